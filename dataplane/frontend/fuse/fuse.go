// Package fuse exposes a volume as a block device on any Linux node with
// FUSE and loop devices: the volume is one file in a FUSE mount, and that
// file is attached to a loop device (/dev/loopN), which is what the node
// formats and mounts. It needs root (mount(2) and loop ioctls).
//
// With a device keeper (Options.Keeper, package devicekeeper) the kernel
// side outlives the engine: the frontend deposits its descriptors with the
// keeper, and the frontend of the next engine of the volume on the node
// takes them over instead of mounting anew, so the loop device and what is
// mounted on it stay, and I/O waits instead of failing.
package fuse

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"golang.org/x/sys/unix"

	"github.com/cairn-io/cairn/dataplane/devicekeeper"
	"github.com/cairn-io/cairn/dataplane/frontend"
	"github.com/cairn-io/cairn/dataplane/internal/shm"
)

// Device is the block device served (see frontend.Device).
type Device = frontend.Device

// Keeper holds a volume's session outside the engine process
// (devicekeeper.Client).
type Keeper interface {
	// Claim returns the session held for volume and descriptors the
	// caller owns; devicekeeper.ErrNoSession if none is held,
	// devicekeeper.ErrBusy while another engine serves it.
	Claim(ctx context.Context, volume string) (devicekeeper.Session, devicekeeper.Files, error)
	// Deposit has the keeper hold a session this process serves (the
	// caller keeps its descriptors open until Release or Drop).
	Deposit(ctx context.Context, s devicekeeper.Session, f devicekeeper.Files) error
	// Release: this process stops serving; the keeper goes on holding.
	Release(ctx context.Context, volume string) error
	// Drop: the keeper lets go of the session.
	Drop(ctx context.Context, volume string) error
}

// Options configure Start.
type Options struct {
	// Name is the volume name: the file in the mount is called this.
	Name string
	// Dir is the mount point (created if missing).
	Dir    string
	Logger logr.Logger
	// Keeper, if set, holds the session while no engine does (nil: an
	// engine that dies takes the device's I/O in flight down with it).
	Keeper Keeper
	// Buffers hands out the buffers requests are read into. The engine
	// passes an arena over the memory it shares with the replicas on this
	// node, whose writes then carry an offset into it instead of the data
	// (nil: buffers from the heap).
	Buffers *shm.Arena
}

// keeperWait bounds each exchange with the keeper.
const keeperWait = 10 * time.Second

// Frontend is a mounted volume file attached to a loop device.
type Frontend struct {
	opts   Options
	server *server
	loop   *loopDevice
	dir    string // where the FUSE filesystem was mounted
	file   string
	log    logr.Logger
	// fileFD is the volume file opened O_PATH (-1 before Start); fileDev
	// is its filesystem's device number, which tells whether dir is still
	// this connection's mount.
	fileFD  int
	fileDev uint64

	claimed *claimed // taken from the keeper, to be served by Start
	resumed bool     // serving a session an earlier engine set up
	kept    bool     // the keeper holds (or will hold) the session

	stopOnce sync.Once
	stopErr  error
}

// claimed is a session taken from the keeper.
type claimed struct {
	session devicekeeper.Session
	files   devicekeeper.Files
}

// Start mounts the volume file under opts.Dir and attaches a loop device,
// or takes over the ones the keeper holds for the volume (Claim, then
// Start).
func Start(dev Device, opts Options) (*Frontend, error) {
	f, err := Claim(opts)
	if err != nil {
		return nil, err
	}
	if err := f.Start(dev); err != nil {
		return nil, err
	}
	return f, nil
}

// Claim prepares the frontend without serving anything yet: with a keeper
// that holds a session of the volume (its engine died), it takes the
// session, to be served by Start. It fails if another engine of the
// volume serves that session (devicekeeper.ErrBusy): call it before
// opening the replicas, which would fence that engine out.
func Claim(opts Options) (*Frontend, error) {
	if opts.Dir == "" || opts.Name == "" {
		return nil, errors.New("fuse frontend: a mount directory and a volume name are required")
	}
	if os.Geteuid() != 0 {
		return nil, errors.New("fuse frontend: needs root (mount and loop devices)")
	}
	// Nothing here touches opts.Dir: it may still be the mount of a dead
	// engine's connection, where any lookup waits for a server.
	f := &Frontend{opts: opts, dir: opts.Dir, file: filepath.Join(opts.Dir, opts.Name), log: opts.Logger, fileFD: -1}
	if opts.Keeper == nil {
		return f, nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), keeperWait)
	defer cancel()
	s, files, err := opts.Keeper.Claim(ctx, opts.Name)
	switch {
	case err == nil:
		if why := resumable(s, files); why != nil {
			f.log.Info("the device keeper holds a session of this volume that this engine cannot serve; letting it go (the I/O waiting on it fails) and mounting anew", "device", s.LoopPath, "reason", why.Error())
			files.Close()
			if err := opts.Keeper.Drop(ctx, opts.Name); err != nil {
				return nil, fmt.Errorf("fuse frontend: dropping the session the keeper holds: %w", err)
			}
			return f, nil
		}
		f.claimed = &claimed{session: s, files: files}
		f.log.Info("the device keeper holds the device of this volume, left by the engine before this one: taking it over", "device", s.LoopPath)
	case errors.Is(err, devicekeeper.ErrNoSession):
	case errors.Is(err, devicekeeper.ErrBusy):
		return nil, fmt.Errorf("fuse frontend: another engine of volume %s on this node serves its device; stop it first: %w", opts.Name, err)
	default:
		f.log.Info("the device keeper does not answer: mounting anew", "reason", err.Error())
	}
	return f, nil
}

// resumable says why a session taken from the keeper cannot be served
// here (nil if it can). It asks the kernel only about the descriptors, not
// the FUSE server, which is gone.
func resumable(s devicekeeper.Session, files devicekeeper.Files) error {
	if err := s.Validate(); err != nil {
		return err
	}
	switch {
	case !s.FUSE.Resend:
		return errors.New("the kernel cannot resend the requests the dead engine had read")
	case s.FUSE.MaxWrite > maxWrite:
		return fmt.Errorf("the connection was set up for requests of %d bytes, more than this engine's %d", s.FUSE.MaxWrite, maxWrite)
	}
	p := []unix.PollFd{{Fd: int32(files.FUSE)}}
	if n, err := unix.Poll(p, 0); err == nil && n > 0 && p[0].Revents&(unix.POLLERR|unix.POLLNVAL) != 0 {
		return errors.New("the kernel ended its FUSE connection")
	}
	return nil
}

// Start serves dev: on the session Claim took over, or on a new mount and
// loop device.
func (f *Frontend) Start(dev Device) error {
	if f.claimed != nil {
		return f.resume(dev)
	}
	return f.mount(dev)
}

// Release gives back a session Claim took and Start never served: the
// keeper goes on holding it for the next engine.
func (f *Frontend) Release() {
	if f.claimed == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), keeperWait)
	defer cancel()
	if err := f.opts.Keeper.Release(ctx, f.opts.Name); err != nil {
		f.log.Info("could not tell the device keeper this engine gives its session back", "reason", err.Error())
	}
	f.claimed.files.Close()
	f.claimed = nil
}

// mount mounts the volume file, attaches a loop device and deposits both
// with the keeper.
func (f *Frontend) mount(dev Device) error {
	if err := f.makeDir(); err != nil {
		return fmt.Errorf("fuse frontend: %w", err)
	}
	s, err := mountServer(dev, f.opts.Name, f.dir, f.opts.Buffers, f.log)
	if err != nil {
		return fmt.Errorf("fuse frontend: %w", err)
	}
	f.server = s
	if f.loop, err = attachLoop(f.file); err != nil {
		return errors.Join(fmt.Errorf("fuse frontend: %w", err), s.stop(f.dir, true))
	}
	if !f.loop.directIO {
		// Still correct, but the loop driver then hands the file one
		// request at a time: a fraction of the IOPS (docs/performance.md).
		f.log.Info("the loop device does buffered I/O on the volume file: the kernel refused direct I/O; requests reach the engine one at a time", "device", f.loop.path)
	}
	if f.fileFD, err = unix.Open(f.file, unix.O_PATH|unix.O_CLOEXEC, 0); err == nil {
		f.fileDev, err = fileDevice(f.fileFD)
	}
	if err != nil {
		return errors.Join(fmt.Errorf("fuse frontend: opening %s: %w", f.file, err), f.stopLocal())
	}
	f.deposit()
	return nil
}

// makeDir makes the mount directory, detaching first a FUSE mount an
// earlier engine of the volume left there that this one did not take over
// (it died with nobody holding its connection, or the keeper could not be
// asked): its connection answers nothing, or fails everything, so even a
// stat of the directory could wait for good. The detach asks the server
// nothing; what the old mount still serves (a loop device over it) keeps
// it as long as it is used, and its I/O fails once nothing holds its
// connection.
func (f *Frontend) makeDir() error {
	if mountedAt(f.dir) {
		f.log.Info("detaching the FUSE mount an earlier engine of the volume left, which this one did not take over", "dir", f.dir)
		if err := unix.Unmount(f.dir, unix.MNT_DETACH); err != nil {
			return fmt.Errorf("detaching the FUSE mount left at %s: %w", f.dir, err)
		}
	}
	return os.MkdirAll(f.dir, 0o700)
}

// mountedAt says whether something is mounted at dir in this mount
// namespace, from /proc/self/mountinfo (which, unlike a stat, never waits
// for a FUSE server).
func mountedAt(dir string) bool {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return false
	}
	for _, line := range strings.Split(string(b), "\n") {
		// Field 5 is the mount point, with space, tab, newline and
		// backslash escaped in octal.
		if fields := strings.Fields(line); len(fields) > 4 && unescapeMount(fields[4]) == dir {
			return true
		}
	}
	return false
}

func unescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// fileDevice is the device number of fd's filesystem, from what the
// kernel cached (no request to the FUSE server).
func fileDevice(fd int) (uint64, error) {
	var sx unix.Statx_t
	if err := unix.Statx(fd, "", unix.AT_EMPTY_PATH|unix.AT_STATX_DONT_SYNC, unix.STATX_INO, &sx); err != nil {
		return 0, err
	}
	return unix.Mkdev(sx.Dev_major, sx.Dev_minor), nil
}

// session is what the keeper holds for a successor.
func (f *Frontend) session() (devicekeeper.Session, devicekeeper.Files) {
	return devicekeeper.Session{Volume: f.opts.Name, MountDir: f.dir, FileName: filepath.Base(f.file), LoopPath: f.loop.path, FUSE: f.server.params},
		devicekeeper.Files{FUSE: f.server.fd, Loop: int(f.loop.f.Fd()), File: f.fileFD}
}

// deposit hands the session to the keeper, if there is one and the kernel
// lets a successor finish what this engine leaves unanswered.
func (f *Frontend) deposit() {
	switch {
	case f.opts.Keeper == nil:
		f.log.Info("no device keeper: if this engine dies or is restarted, the I/O in flight on its device fails (a filesystem on it goes read-only)", "device", f.loop.path)
		return
	case !f.server.params.Resend:
		f.log.Info("this kernel cannot resend FUSE requests to a new server (FUSE_NOTIFY_RESEND, Linux 6.9): the device is not handed to the device keeper, and if this engine dies the I/O in flight on it fails", "device", f.loop.path)
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), keeperWait)
	defer cancel()
	s, files := f.session()
	err := f.opts.Keeper.Deposit(ctx, s, files)
	switch {
	case err == nil:
		f.kept = true
		f.log.Info("the device keeper holds the device: if this engine dies, the next engine of the volume takes it over", "device", f.loop.path)
	case errors.Is(err, devicekeeper.ErrUnavailable):
		f.kept = true // deposited once the keeper answers
		f.log.Info("the device keeper does not answer; the device is handed to it once it does", "device", f.loop.path, "reason", err.Error())
	default:
		f.log.Error(err, "the device keeper refused the device: if this engine dies, the I/O in flight on it fails", "device", f.loop.path)
	}
}

// resume serves the claimed session: the same connection, loop device and
// file, with the requests the dead engine had read sent again.
func (f *Frontend) resume(dev Device) error {
	c := f.claimed
	f.claimed = nil
	s, err := resumeServer(dev, c.session.FileName, c.files.FUSE, c.session.FUSE, f.opts.Buffers, f.log)
	if err != nil {
		// Nobody can resume it if this engine cannot: let it go, so that
		// the next start mounts anew.
		unix.Close(c.files.Loop)
		unix.Close(c.files.File)
		ctx, cancel := context.WithTimeout(context.Background(), keeperWait)
		defer cancel()
		return fmt.Errorf("fuse frontend: taking over the device of volume %s: %w", f.opts.Name, errors.Join(err, f.opts.Keeper.Drop(ctx, f.opts.Name)))
	}
	f.server = s
	f.dir, f.file, f.fileFD = c.session.MountDir, filepath.Join(c.session.MountDir, c.session.FileName), c.files.File
	// The loop device's status is asked for after the server serves: the
	// kernel may ask the server for the file's attributes to answer.
	if f.loop, err = adoptLoop(c.session.LoopPath, c.files.Loop); err == nil {
		f.fileDev, err = fileDevice(f.fileFD)
		if err != nil {
			f.loop.f.Close()
		}
	}
	if err != nil {
		// A session whose loop device or file is gone cannot be served by
		// anyone: let it go, so that the next start mounts anew.
		ctx, cancel := context.WithTimeout(context.Background(), keeperWait)
		defer cancel()
		err = errors.Join(err, f.opts.Keeper.Drop(ctx, f.opts.Name), unixClose(f.fileFD), s.close())
		return fmt.Errorf("fuse frontend: taking over the device of volume %s: %w", f.opts.Name, err)
	}
	f.resumed, f.kept = true, true
	f.log.Info("took over the device of the volume from the engine before this one: same loop device, the I/O it held goes on, the requests it had not answered are sent again", "device", f.loop.path)
	return nil
}

// Resumed says whether Start took over a device an earlier engine set up.
func (f *Frontend) Resumed() bool { return f.resumed }

// Endpoint is the loop device path, e.g. /dev/loop3.
func (f *Frontend) Endpoint() string { return f.loop.path }

// File is the volume file inside the FUSE mount.
func (f *Frontend) File() string { return f.file }

// Resize makes the file in the mount and the loop device show the
// volume's new size, after the device behind them grew to size: the
// kernel caches the file's attributes, so the server invalidates them
// (FUSE_NOTIFY_INVAL_INODE) and stats the file, which has the kernel ask
// for its size again; then LOOP_SET_CAPACITY has the loop device take the
// file's new size and announce it, so a filesystem on it can be grown
// online. Calling it again with the same size changes nothing.
func (f *Frontend) Resize(size int64) error {
	if err := f.server.notifyAttributes(); err != nil {
		return fmt.Errorf("fuse frontend: invalidating the cached size of %s: %w", f.file, err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(f.fileFD, &st); err != nil {
		return fmt.Errorf("fuse frontend: stat %s: %w", f.file, err)
	}
	if st.Size != size {
		return fmt.Errorf("fuse frontend: %s has %d bytes after the volume grew to %d", f.file, st.Size, size)
	}
	if err := f.loop.setCapacity(size); err != nil {
		return fmt.Errorf("fuse frontend: %w", err)
	}
	return nil
}

// Stop detaches the loop device and unmounts, and has the keeper let go of
// them. If the device is in use (a filesystem on it is mounted, or an
// application has it open: the engine is stopped under a running workload,
// as when its instance manager is shut down) and the keeper holds the
// session, the device is left to the keeper instead: the server stops
// reading requests, answers those it has, and the next engine of the
// volume takes the device over; the I/O waits until then. Without a
// keeper, the kernel keeps an in-use loop device until its user goes (it
// is set to clear itself then) and the FUSE mount is detached lazily.
func (f *Frontend) Stop() error {
	f.stopOnce.Do(func() { f.stopErr = f.stop() })
	return f.stopErr
}

func (f *Frontend) stop() error {
	if f.kept {
		// Before the loop device is cleared: the keeper's descriptor of it
		// would otherwise count as a user.
		ctx, cancel := context.WithTimeout(context.Background(), keeperWait)
		err := f.opts.Keeper.Drop(ctx, f.opts.Name)
		cancel()
		if err != nil {
			f.log.Error(err, "the device keeper did not let go of the device; it does when its hold runs out", "device", f.loop.path)
		}
	}
	inUse, err := f.loop.clear()
	if inUse && f.kept && f.handOver() {
		return errors.Join(err, f.loop.f.Close(), unixClose(f.fileFD), f.server.close())
	}
	return errors.Join(err, f.stopLocal())
}

// handOver deposits the session with the keeper again and stops reading
// requests; false if the keeper does not take it.
func (f *Frontend) handOver() bool {
	ctx, cancel := context.WithTimeout(context.Background(), keeperWait)
	defer cancel()
	s, files := f.session()
	if err := f.opts.Keeper.Deposit(ctx, s, files); err != nil {
		f.log.Error(err, "the device is in use and the device keeper does not take it: stopping anyway; the I/O on it fails", "device", f.loop.path)
		return false
	}
	f.server.pause()
	// Unattended from now on: the next engine may take it over while this
	// one still flushes.
	if err := f.opts.Keeper.Release(ctx, f.opts.Name); err != nil {
		f.log.Info("could not tell the device keeper this engine no longer serves the device; it knows once this process exits", "reason", err.Error())
	}
	f.log.Info("the device is in use (a mounted filesystem or an application): left to the device keeper; its I/O waits for the next engine of the volume", "device", f.loop.path)
	return true
}

// stopLocal closes the loop device (cleared once its last user goes) and
// unmounts, if the mount at dir is this connection's.
func (f *Frontend) stopLocal() error {
	mounted := true
	if f.fileFD >= 0 {
		var st unix.Stat_t
		mounted = unix.Stat(f.dir, &st) == nil && st.Dev == f.fileDev
	}
	return errors.Join(f.loop.f.Close(), unixClose(f.fileFD), f.server.stop(f.dir, mounted))
}

func unixClose(fd int) error {
	if fd < 0 {
		return nil
	}
	return unix.Close(fd)
}
