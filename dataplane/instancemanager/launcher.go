package instancemanager

import (
	"io"
	"os"
	"os/exec"
	"runtime"
	"syscall"

	"golang.org/x/sys/unix"
)

// Launcher starts the processes a Supervisor supervises. The Supervisor
// owns their life cycle (states, ports, logs, stops); a Launcher only
// starts one and gives back the handle it is watched through. The default
// runs Options.Binary (execLauncher); a test of the state machine gives
// one that starts nothing.
type Launcher interface {
	Launch(l Launch) (Child, error)
}

// Launch is one process to start.
type Launch struct {
	// Kind is the cairn-data subcommand; Args follow it.
	Kind Kind
	Args []string
	// Env is the whole environment.
	Env []string
	// Output receives the process's stdout and stderr (its log).
	Output io.Writer
	// AuthKey and EncryptionKey reach the process through pipes of their
	// own ("" none): descriptors keyFD and encKeyFD, which its arguments
	// name.
	AuthKey, EncryptionKey string
}

// Child is a started process.
type Child interface {
	// PID is its process id, also the id of its process group.
	PID() int
	// Ready is the read end of its ready descriptor (readyFD), where it
	// writes one ready.Report; the Supervisor reads and closes it.
	Ready() io.ReadCloser
	// Wait waits until it exits and returns its exit code (-1 if a signal
	// ended it) and how it ended (nil for exit code 0).
	Wait() (code int, err error)
	// Signal sends sig to its process group.
	Signal(sig syscall.Signal) error
}

// execLauncher runs "binary <kind> <args...>", each child from one OS
// thread that never exits: a child's parent-death signal (SIGKILL) fires
// when the thread that started it ends, and Go may otherwise retire
// threads at any time.
type execLauncher struct {
	binary string
	spawn  chan spawnReq
}

type spawnReq struct {
	cmd  *exec.Cmd
	done chan error
}

func newExecLauncher(binary string) *execLauncher {
	l := &execLauncher{binary: binary, spawn: make(chan spawnReq)}
	go l.spawner()
	return l
}

func (l *execLauncher) spawner() {
	runtime.LockOSThread()
	for r := range l.spawn {
		r.done <- r.cmd.Start()
	}
}

// Launch starts the child with the write end of a ready pipe as
// descriptor readyFD and its keys' pipes as keyFD and encKeyFD.
func (l *execLauncher) Launch(c Launch) (Child, error) {
	readyR, readyW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	defer readyW.Close() // the child has its copy
	cmd := exec.Command(l.binary, append([]string{string(c.Kind)}, c.Args...)...)
	cmd.Stdout, cmd.Stderr = c.Output, c.Output
	cmd.Env = c.Env
	// Descriptors 3, 4 and 5 of the child: the ready pipe, then the key
	// pipes (nil: closed in the child).
	cmd.ExtraFiles = []*os.File{readyW, nil, nil}
	for i, key := range []string{c.AuthKey, c.EncryptionKey} {
		if key == "" {
			continue
		}
		r, err := keyPipe(key)
		if err != nil {
			readyR.Close()
			return nil, err
		}
		defer r.Close() // the child has its copy
		cmd.ExtraFiles[1+i] = r
	}
	for len(cmd.ExtraFiles) > 1 && cmd.ExtraFiles[len(cmd.ExtraFiles)-1] == nil {
		cmd.ExtraFiles = cmd.ExtraFiles[:len(cmd.ExtraFiles)-1]
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	done := make(chan error, 1)
	l.spawn <- spawnReq{cmd: cmd, done: done}
	if err := <-done; err != nil {
		readyR.Close()
		return nil, err
	}
	return &execChild{cmd: cmd, ready: readyR}, nil
}

// keyPipe returns the read end of a pipe holding key, its write end
// closed. A key goes to a child through such a pipe, which the child reads
// once: not in its arguments or environment, which other users of the
// node can read in /proc. A key (32 or 64 bytes) fits in any pipe's
// buffer, so the write does not wait for the child.
func keyPipe(key string) (*os.File, error) {
	r, w, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	_, err = w.WriteString(key)
	w.Close()
	if err != nil {
		r.Close()
		return nil, err
	}
	return r, nil
}

type execChild struct {
	cmd   *exec.Cmd
	ready *os.File
}

func (c *execChild) PID() int             { return c.cmd.Process.Pid }
func (c *execChild) Ready() io.ReadCloser { return c.ready }

func (c *execChild) Wait() (int, error) {
	awaitExit(c.cmd.Process.Pid)
	err := c.cmd.Wait() // reaps it: at once after awaitExit
	return c.cmd.ProcessState.ExitCode(), err
}

// awaitExit returns once the child pid has exited (before it is reaped),
// waiting for its pidfd to become readable through Go's poller: a child
// being waited for then holds no OS thread. exec.Cmd.Wait alone blocks one
// thread in waitid for as long as the child lives: one thread per child,
// 800 for 200 volumes, and Go ends a program that reaches 10,000 threads.
// Where no pidfd can be had (Linux before 5.3, or no descriptor left) it
// returns at once and Wait blocks a thread as before. The pid cannot be
// reused meanwhile: only Wait reaps the child.
func awaitExit(pid int) {
	fd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return
	}
	// Non-blocking before os.NewFile, which registers only such
	// descriptors with the poller (PIDFD_NONBLOCK would need Linux 5.10).
	if err := unix.SetNonblock(fd, true); err != nil {
		unix.Close(fd)
		return
	}
	f := os.NewFile(uintptr(fd), "pidfd")
	defer f.Close()
	rc, err := f.SyscallConn()
	if err != nil {
		return
	}
	_ = rc.Read(func(fd uintptr) bool { // an error: not pollable, Wait blocks instead
		n, err := unix.Poll([]unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}, 0)
		return n > 0 || (err != nil && err != unix.EINTR)
	})
}

func (c *execChild) Signal(sig syscall.Signal) error { return syscall.Kill(-c.cmd.Process.Pid, sig) }
