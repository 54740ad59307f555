// Package instancemanager supervises a node's engine and replica
// processes: it starts them on request, allocates their ports, watches
// them through their life (starting → running → stopping → stopped, or
// error), keeps their logs, and reports every change to watchers. The gRPC
// service in server.go puts it on the network.
package instancemanager

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/go-logr/logr"
)

// Kind is the kind of process.
type Kind string

// Kinds. The kind is also the cairn-data subcommand that runs it.
const (
	KindEngine  Kind = "engine"
	KindReplica Kind = "replica"
)

// State is a process's state.
type State string

// States.
const (
	StateStarting State = "starting"
	StateRunning  State = "running"
	StateStopping State = "stopping"
	StateStopped  State = "stopped"
	StateError    State = "error"
)

// Errors, tested with errors.Is.
var (
	ErrExists       = errors.New("process already exists")
	ErrNotFound     = errors.New("process not found")
	ErrNoPorts      = errors.New("no free ports")
	ErrInvalid      = errors.New("invalid request")
	ErrShuttingDown = errors.New("instance manager shutting down")
)

// Options configure a Supervisor.
type Options struct {
	// Binary is run as "Binary <kind> <args...>". Default: this executable.
	Binary string
	// PortMin and PortMax bound the ports handed to processes.
	PortMin, PortMax int
	// LogDir holds one log file per process (required).
	LogDir string
	// StateDir records running children so a restarted instance manager
	// can kill those it no longer supervises. Default: LogDir.
	StateDir string
	// ProbeHost is where readiness probes dial the allocated ports.
	// Default 127.0.0.1.
	ProbeHost string
	// StartTimeout: a process whose ports do not all answer by then is
	// killed and put in error. Default 60s.
	StartTimeout time.Duration
	// StopGrace is how long a process has to exit after SIGTERM before it
	// gets SIGKILL. Default 10s.
	StopGrace time.Duration
	// LogMaxBytes rotates a process log past this size. Default 10 MiB.
	LogMaxBytes int64
	Logger      logr.Logger
}

// Process is a snapshot of one supervised process.
type Process struct {
	Name     string
	Kind     Kind
	State    State
	Ports    []int
	Args     []string
	PID      int
	ExitCode int
	Error    string
	LogTail  []string
}

// Event is one change, as watchers see it.
type Event struct {
	Seq     uint64
	Deleted bool
	Process Process
}

type proc struct {
	Process
	cmd     *exec.Cmd
	log     *processLog
	started chan struct{} // closed once the start attempt is over (PID set or failed)
	exited  chan struct{}
	deleted bool // ProcessDelete was asked: remove once stopped
}

// Supervisor runs and watches processes.
type Supervisor struct {
	opts  Options
	log   logr.Logger
	spawn chan spawnReq

	mu       sync.Mutex
	procs    map[string]*proc
	ports    *portRange
	seq      uint64
	watchers map[chan Event]struct{}
	closing  bool
	wg       sync.WaitGroup
}

type spawnReq struct {
	cmd  *exec.Cmd
	done chan error
}

var nameRE = regexp.MustCompile(`^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$`)

// New returns a Supervisor, first killing any child a previous instance
// manager left running (see docs/instance-manager.md, "Restarts").
func New(opts Options) (*Supervisor, error) {
	if opts.LogDir == "" {
		return nil, fmt.Errorf("%w: a log directory is required", ErrInvalid)
	}
	if opts.Binary == "" {
		exe, err := os.Executable()
		if err != nil {
			return nil, err
		}
		opts.Binary = exe
	}
	if opts.StateDir == "" {
		opts.StateDir = opts.LogDir
	}
	if opts.ProbeHost == "" {
		opts.ProbeHost = "127.0.0.1"
	}
	if opts.StartTimeout <= 0 {
		opts.StartTimeout = 60 * time.Second
	}
	if opts.StopGrace <= 0 {
		opts.StopGrace = 10 * time.Second
	}
	if opts.LogMaxBytes <= 0 {
		opts.LogMaxBytes = 10 << 20
	}
	ports, err := newPortRange(opts.PortMin, opts.PortMax)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrInvalid, err)
	}
	for _, d := range []string{opts.LogDir, opts.StateDir} {
		if err := os.MkdirAll(d, 0o750); err != nil {
			return nil, err
		}
	}
	s := &Supervisor{opts: opts, log: opts.Logger, spawn: make(chan spawnReq), procs: map[string]*proc{},
		ports: ports, watchers: map[chan Event]struct{}{}}
	if n := killOrphans(opts.StateDir, s.log); n > 0 {
		s.log.Info("killed processes left by a previous instance manager", "count", n)
	}
	go s.spawner()
	return s, nil
}

// spawner starts every child from one OS thread that never exits: a
// child's parent-death signal (SIGKILL) fires when the thread that started
// it ends, and Go may otherwise retire threads at any time.
func (s *Supervisor) spawner() {
	runtime.LockOSThread()
	for r := range s.spawn {
		r.done <- r.cmd.Start()
	}
}

// Create starts a process. If the name exists, it returns the existing
// process and an error wrapping ErrExists.
func (s *Supervisor) Create(name string, kind Kind, args []string, portCount int) (Process, error) {
	if !nameRE.MatchString(name) {
		return Process{}, fmt.Errorf("%w: name %q: use lowercase letters, digits, '-' and '.'", ErrInvalid, name)
	}
	if kind != KindEngine && kind != KindReplica {
		return Process{}, fmt.Errorf("%w: kind %q: use engine or replica", ErrInvalid, kind)
	}
	if portCount < 0 || portCount > 16 {
		return Process{}, fmt.Errorf("%w: port count %d: use 0 to 16", ErrInvalid, portCount)
	}
	s.mu.Lock()
	if s.closing {
		s.mu.Unlock()
		return Process{}, ErrShuttingDown
	}
	if p, ok := s.procs[name]; ok {
		snap := p.snapshot()
		s.mu.Unlock()
		return snap, fmt.Errorf("%w: %s", ErrExists, name)
	}
	ports, ok := s.ports.alloc(portCount)
	if !ok {
		s.mu.Unlock()
		return Process{}, fmt.Errorf("%w: %d contiguous ports wanted in %d-%d", ErrNoPorts, portCount, s.opts.PortMin, s.opts.PortMax)
	}
	p := &proc{Process: Process{Name: name, Kind: kind, State: StateStarting, Ports: ports, Args: substitute(args, ports)},
		started: make(chan struct{}), exited: make(chan struct{})}
	defer close(p.started)
	s.procs[name] = p // reserve the name: concurrent creates see it
	s.mu.Unlock()

	lg, err := openLog(filepath.Join(s.opts.LogDir, name+".log"), s.opts.LogMaxBytes)
	if err == nil {
		p.log = lg
		p.cmd = exec.Command(s.opts.Binary, append([]string{string(kind)}, p.Args...)...)
		p.cmd.Stdout, p.cmd.Stderr = lg, lg
		p.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
		done := make(chan error, 1)
		s.spawn <- spawnReq{cmd: p.cmd, done: done}
		err = <-done
	}
	s.mu.Lock()
	if err != nil {
		s.setState(p, StateError, func(p *proc) { p.Error = "start: " + err.Error(); p.ExitCode = -1 })
		s.ports.release(p.Ports)
		close(p.exited)
		snap := p.snapshot()
		s.mu.Unlock()
		if lg != nil {
			lg.Close()
		}
		return snap, nil
	}
	p.PID = p.cmd.Process.Pid
	writePIDFile(s.opts.StateDir, name, p.PID)
	// The name was reserved at "starting"; announce it now that it has a pid.
	s.emit(p, false)
	snap := p.snapshot()
	s.wg.Add(2)
	s.mu.Unlock()
	go s.wait(p)
	go s.probe(p)
	return snap, nil
}

func substitute(args []string, ports []int) []string {
	out := make([]string, len(args))
	for i, a := range args {
		for k := len(ports) - 1; k >= 0; k-- { // PORT10 before PORT1
			a = strings.ReplaceAll(a, "${PORT"+strconv.Itoa(k)+"}", strconv.Itoa(ports[k]))
		}
		out[i] = a
	}
	return out
}

// setState is the only writer of a process's state; it emits the change.
// Callers hold s.mu.
func (s *Supervisor) setState(p *proc, st State, mutate func(*proc)) {
	p.State = st
	if mutate != nil {
		mutate(p)
	}
	s.emit(p, false)
}

func (s *Supervisor) emit(p *proc, deleted bool) {
	s.seq++
	ev := Event{Seq: s.seq, Deleted: deleted, Process: p.snapshot()}
	for ch := range s.watchers {
		select {
		case ch <- ev:
		default:
			// A watcher that fell behind loses its place; it must re-watch
			// (it gets a fresh snapshot). Closing tells it so.
			delete(s.watchers, ch)
			close(ch)
		}
	}
}

func (p *proc) snapshot() Process {
	out := p.Process
	out.Ports = append([]int(nil), p.Ports...)
	out.Args = append([]string(nil), p.Args...)
	out.LogTail = append([]string(nil), p.LogTail...)
	return out
}

// probe moves a starting process to running once every port answers.
func (s *Supervisor) probe(p *proc) {
	defer s.wg.Done()
	deadline := time.Now().Add(s.opts.StartTimeout)
	t := time.NewTicker(50 * time.Millisecond)
	defer t.Stop()
	for {
		if s.portsAnswer(p.Ports) {
			s.mu.Lock()
			if p.State == StateStarting {
				s.setState(p, StateRunning, nil)
			}
			s.mu.Unlock()
			return
		}
		select {
		case <-p.exited:
			return
		case <-t.C:
		}
		if time.Now().After(deadline) {
			s.log.Info("process did not open its ports in time; killing it", "name", p.Name, "ports", p.Ports)
			s.mu.Lock()
			if p.State == StateStarting {
				p.Error = fmt.Sprintf("its ports %v did not answer within %s", p.Ports, s.opts.StartTimeout)
			}
			s.mu.Unlock()
			syscall.Kill(-p.PID, syscall.SIGKILL)
			return
		}
	}
}

func (s *Supervisor) portsAnswer(ports []int) bool {
	for _, port := range ports {
		c, err := net.DialTimeout("tcp", net.JoinHostPort(s.opts.ProbeHost, strconv.Itoa(port)), time.Second)
		if err != nil {
			return false
		}
		c.Close()
	}
	return true
}

// wait records a process's exit: stopped if it was asked to stop, error
// (with exit code and log tail) otherwise.
func (s *Supervisor) wait(p *proc) {
	defer s.wg.Done()
	err := p.cmd.Wait()
	code := p.cmd.ProcessState.ExitCode()
	p.log.Close()
	removePIDFile(s.opts.StateDir, p.Name)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.ports.release(p.Ports)
	if p.State == StateStopping {
		s.setState(p, StateStopped, func(p *proc) { p.ExitCode = code })
	} else {
		tail := p.log.Tail()
		s.setState(p, StateError, func(p *proc) {
			p.ExitCode = code
			if p.Error == "" {
				p.Error = fmt.Sprintf("exited unexpectedly: %v", err)
			}
			p.LogTail = tail
		})
	}
	close(p.exited)
	if p.deleted {
		delete(s.procs, p.Name)
		s.emit(p, true)
	}
}

// Delete stops a process (SIGTERM, SIGKILL after the grace period) and
// forgets it; it returns once it is gone. A missing name is not an error.
func (s *Supervisor) Delete(ctx context.Context, name string) error {
	s.mu.Lock()
	p, ok := s.procs[name]
	s.mu.Unlock()
	if !ok {
		return nil
	}
	<-p.started // never signal a process group before the child exists
	s.mu.Lock()
	p.deleted = true
	select {
	case <-p.exited: // already exited (stopped or error): just forget it
		delete(s.procs, name)
		s.emit(p, true)
		s.mu.Unlock()
		return nil
	default:
	}
	if p.State != StateStopping {
		s.setState(p, StateStopping, nil)
	}
	s.mu.Unlock()
	return s.stop(ctx, p)
}

// stop signals the process group and waits for the exit.
func (s *Supervisor) stop(ctx context.Context, p *proc) error {
	syscall.Kill(-p.PID, syscall.SIGTERM)
	t := time.NewTimer(s.opts.StopGrace)
	defer t.Stop()
	select {
	case <-p.exited:
		return nil
	case <-t.C:
	case <-ctx.Done():
	}
	s.log.Info("process did not stop in time; killing it", "name", p.Name)
	syscall.Kill(-p.PID, syscall.SIGKILL)
	<-p.exited
	return nil
}

// Get returns one process.
func (s *Supervisor) Get(name string) (Process, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	p, ok := s.procs[name]
	if !ok {
		return Process{}, fmt.Errorf("%w: %s", ErrNotFound, name)
	}
	return p.snapshot(), nil
}

// List returns every process, by name.
func (s *Supervisor) List() []Process {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.listLocked()
}

func (s *Supervisor) listLocked() []Process {
	out := make([]Process, 0, len(s.procs))
	for _, p := range s.procs {
		out = append(out, p.snapshot())
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// Watch returns the current processes and the sequence number they are
// current at, and a channel of every later event in order. The channel is
// closed if the watcher falls too far behind (re-watch) or on Close; call
// cancel when done.
func (s *Supervisor) Watch() (snapshot []Process, seq uint64, events <-chan Event, cancel func()) {
	s.mu.Lock()
	defer s.mu.Unlock()
	ch := make(chan Event, 1024)
	s.watchers[ch] = struct{}{}
	return s.listLocked(), s.seq, ch, func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		if _, ok := s.watchers[ch]; ok {
			delete(s.watchers, ch)
			close(ch)
		}
	}
}

// Logs returns a process's log lines and, with follow, later ones.
func (s *Supervisor) Logs(name string, follow bool) ([]string, <-chan string, func(), error) {
	s.mu.Lock()
	p, ok := s.procs[name]
	s.mu.Unlock()
	if !ok || p.log == nil {
		return nil, nil, nil, fmt.Errorf("%w: %s", ErrNotFound, name)
	}
	lines, later, stop := p.log.Lines(follow)
	return lines, later, stop, nil
}

// Close stops every process, engines before replicas (an engine flushes to
// its replicas on the way down), each within the grace period, and ends
// the watchers.
func (s *Supervisor) Close() error {
	s.mu.Lock()
	s.closing = true
	var engines, replicas []*proc
	for _, p := range s.procs {
		if p.Kind == KindEngine {
			engines = append(engines, p)
		} else {
			replicas = append(replicas, p)
		}
		p.deleted = true
	}
	s.mu.Unlock()
	for _, group := range [][]*proc{engines, replicas} {
		var wg sync.WaitGroup
		for _, p := range group {
			<-p.started
			s.mu.Lock()
			running := false
			select {
			case <-p.exited:
			default:
				running = true
				if p.State != StateStopping {
					s.setState(p, StateStopping, nil)
				}
			}
			s.mu.Unlock()
			if running {
				wg.Add(1)
				go func() { defer wg.Done(); s.stop(context.Background(), p) }()
			}
		}
		wg.Wait()
	}
	s.wg.Wait()
	s.mu.Lock()
	for ch := range s.watchers {
		close(ch)
	}
	s.watchers = map[chan Event]struct{}{}
	s.mu.Unlock()
	return nil
}
