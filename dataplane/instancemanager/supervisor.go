// Package instancemanager supervises a node's engine and replica
// processes: it starts them on request, allocates their ports, watches
// them through their life (starting → running → stopping → stopped, or
// error), keeps their logs, and reports every change to watchers. The gRPC
// service in package imserver puts it on the network.
package instancemanager

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"syscall"
	"time"

	"github.com/go-logr/logr"

	"github.com/cairn-io/cairn/dataplane/internal/ready"
)

// Kind is the kind of process.
type Kind string

// Kinds. The kind is also the cairn-data subcommand that runs it.
const (
	KindEngine  Kind = "engine"
	KindReplica Kind = "replica"
)

// Errors, tested with errors.Is.
var (
	ErrExists       = errors.New("process already exists")
	ErrNotFound     = errors.New("process not found")
	ErrNoPorts      = errors.New("no free ports")
	ErrInvalid      = errors.New("invalid request")
	ErrShuttingDown = errors.New("instance manager shutting down")
	// ErrConflict: a process of that name exists with another spec, or
	// another process uses the data directory.
	ErrConflict = errors.New("conflict")
	// ErrInUse: the data directory to delete is used by a process.
	ErrInUse = errors.New("in use")
	// ErrStillStopping: a delete's deadline ended before the process
	// exited; the stop goes on.
	ErrStillStopping = errors.New("still stopping")
)

// EngineFinalFlush is how long an engine may take, after SIGTERM, to
// detach its frontend and flush every replica (cairn-data engine's final
// flush timeout). An engine always gets at least this plus engineStopSlack
// before SIGKILL, whatever the configured grace.
const (
	EngineFinalFlush = 30 * time.Second
	engineStopSlack  = 15 * time.Second
)

// HandOverSignal is what Close stops engines with, where Delete sends
// SIGTERM. A Delete means the volume is detached from this node (the
// control plane deletes an engine once the node no longer uses the
// volume), so the engine detaches its frontend's device; Close means the
// instance manager itself is going away (its pod deleted, rolled or
// drained) and the volume stays attached, so the engine leaves what its
// successor under the next instance manager takes over: an nbd frontend
// leaves /dev/nbdN attached with its I/O held, as after a crash (see
// cairn-data engine). Replicas get SIGTERM either way.
const HandOverSignal = syscall.SIGUSR1

// DefaultEnv is the whole environment of a child unless Options.Env says
// otherwise: nothing of the instance manager's own environment leaks in.
var DefaultEnv = []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}

// Options configure a Supervisor.
type Options struct {
	// Binary is run as "Binary <kind> <args...>". Default: this executable.
	Binary string
	// Launcher starts the processes. Default: one that runs Binary.
	Launcher Launcher
	// PortMin and PortMax bound the ports handed to processes.
	PortMin, PortMax int
	// Host is the address children listen on and report (the node's
	// address as other nodes reach it). Default 127.0.0.1.
	Host string
	// DataDirs are the directories replica data may live in; a replica's
	// DataDir must be strictly inside one of them.
	DataDirs []string
	// RunDir holds the children's unix sockets and FUSE mounts; its path
	// must leave room for a socket name within the 107 bytes a unix socket
	// path may have. Default: StateDir/run.
	RunDir string
	// LogDir holds one log file per process (required).
	LogDir string
	// StateDir records running children so a restarted instance manager
	// can kill those it no longer supervises. Default: LogDir.
	StateDir string
	// Env is the children's whole environment. Default: only PATH.
	Env []string
	// RequireAuthKey refuses specs without a volume key: set when the
	// children serve a network address, where anyone could otherwise
	// reach their data ports.
	RequireAuthKey bool
	// ChildArgs are added to every child's command line (the mutual-TLS
	// files its control port serves with).
	ChildArgs []string
	// StartTimeout: a process that has not reported ready by then is
	// killed and put in error. Default 60s.
	StartTimeout time.Duration
	// StopGrace is how long a process has to exit after SIGTERM before it
	// gets SIGKILL. Default 60s; an engine gets at least EngineFinalFlush
	// plus 15s.
	StopGrace time.Duration
	// LogMaxBytes rotates a process log past this size. Default 10 MiB.
	LogMaxBytes int64
	Logger      logr.Logger
}

// Endpoint is where a running engine serves its volume.
type Endpoint struct {
	Path     string
	Kind     ready.EndpointKind
	Socket   string
	Fallback string
	// Resumed: the device is the one a dead engine of the volume served,
	// taken over (ready.Report.Resumed).
	Resumed bool
}

// Process is a snapshot of one supervised process.
type Process struct {
	Name     string
	Kind     Kind
	Spec     Spec
	State    State
	Ports    []int
	Args     []string
	PID      int
	ExitCode int
	Error    string
	LogTail  []string
	// Waiting is what a starting process last reported it waits for (an
	// engine waiting for a replica); kept if it goes to error (a start
	// timeout's Error ends with it), cleared once it is running.
	Waiting string
	// What the process reported when it became ready.
	DataAddress string
	// LocalDataAddress is a replica's second data address (unix:PATH),
	// beside a TCP DataAddress, for an engine of this instance manager;
	// empty for a replica with only one (ReplicaSpec.UnixSocket).
	LocalDataAddress string
	ControlAddress   string
	SizeBytes        int64
	Endpoint         Endpoint
}

// Event is one change, as watchers see it.
type Event struct {
	Seq     uint64
	Deleted bool
	Process Process
}

type proc struct {
	Process
	child    Child
	log      *processLog
	started  chan struct{} // closed once the start attempt is over (PID set or failed)
	exited   chan struct{}
	deleted  bool // ProcessDelete was asked: remove once stopped
	stopOnce sync.Once
}

// Supervisor runs and watches processes.
type Supervisor struct {
	opts Options
	log  logr.Logger

	mu       sync.Mutex
	procs    map[string]*proc
	ports    *portRange
	seq      uint64
	watchers map[chan Event]struct{}
	deleting map[string]struct{} // data directories being removed
	closing  bool
	wg       sync.WaitGroup
}

// readyFD is the descriptor number of the ready pipe in a child (the
// first of exec.Cmd.ExtraFiles), keyFD that of the key pipe (the second),
// encKeyFD that of an engine's encryption key pipe (the third; the second
// is then closed in a child without a key).
const (
	readyFD  = 3
	keyFD    = 4
	encKeyFD = 5
)

// New returns a Supervisor, first killing any child a previous instance
// manager left running (see docs/instance-manager.md, "Restarts").
func New(opts Options) (*Supervisor, error) {
	if opts.LogDir == "" {
		return nil, fmt.Errorf("%w: a log directory is required", ErrInvalid)
	}
	if opts.Binary == "" && opts.Launcher == nil {
		exe, err := os.Executable()
		if err != nil {
			return nil, err
		}
		opts.Binary = exe
	}
	if opts.Launcher == nil {
		opts.Launcher = newExecLauncher(opts.Binary)
	}
	if opts.StateDir == "" {
		opts.StateDir = opts.LogDir
	}
	if opts.RunDir == "" {
		opts.RunDir = filepath.Join(opts.StateDir, "run")
	}
	if !filepath.IsAbs(opts.RunDir) {
		abs, err := filepath.Abs(opts.RunDir)
		if err != nil {
			return nil, err
		}
		opts.RunDir = abs
	}
	if n := len(opts.RunDir) + len("/r-.sock") + shortNameLen; n > 107 {
		return nil, fmt.Errorf("%w: run directory %s is too long for unix socket paths in it (%d bytes of 107); choose a shorter one", ErrInvalid, opts.RunDir, n)
	}
	if opts.Host == "" {
		opts.Host = "127.0.0.1"
	}
	if len(opts.Env) == 0 {
		opts.Env = DefaultEnv
	}
	for i, d := range opts.DataDirs {
		opts.DataDirs[i] = filepath.Clean(d)
	}
	if opts.StartTimeout <= 0 {
		opts.StartTimeout = 60 * time.Second
	}
	if opts.StopGrace <= 0 {
		opts.StopGrace = 60 * time.Second
	}
	if opts.LogMaxBytes <= 0 {
		opts.LogMaxBytes = 10 << 20
	}
	ports, err := newPortRange(opts.PortMin, opts.PortMax)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	for _, d := range []string{opts.LogDir, opts.StateDir, opts.RunDir} {
		if err := os.MkdirAll(d, 0o750); err != nil {
			return nil, err
		}
	}
	s := &Supervisor{opts: opts, log: opts.Logger, procs: map[string]*proc{},
		ports: ports, watchers: map[chan Event]struct{}{}, deleting: map[string]struct{}{}}
	if n := killOrphans(opts.StateDir, s.log); n > 0 {
		s.log.Info("killed processes left by a previous instance manager", "count", n)
	}
	return s, nil
}

// grace is how long a process gets between SIGTERM and SIGKILL.
func (s *Supervisor) grace(k Kind) time.Duration {
	if k == KindEngine {
		return max(s.opts.StopGrace, EngineFinalFlush+engineStopSlack)
	}
	return s.opts.StopGrace
}

// Create starts the process spec describes, under name. If the name
// exists with the same spec, it returns the existing process and an error
// wrapping ErrExists; with another spec, an error wrapping ErrConflict.
func (s *Supervisor) Create(name string, spec Spec) (Process, error) {
	if !nameRE.MatchString(name) {
		return Process{}, fmt.Errorf("%w: name %q: use lowercase letters, digits, '-' and '.', optionally after NAMESPACE/", ErrInvalid, name)
	}
	if spec == nil {
		return Process{}, fmt.Errorf("%w: give an engine or a replica spec", ErrInvalid)
	}
	spec = withDefaults(spec)
	if s.opts.RequireAuthKey && authKeyOf(spec) == "" {
		return Process{}, fmt.Errorf("%w: no auth key: this instance manager's processes serve %s, a network address, so each needs its volume's key (the manager sends it; a test setup on loopback needs none)", ErrInvalid, s.opts.Host)
	}
	if err := spec.validate(s.opts.DataDirs); err != nil {
		return Process{}, err
	}
	s.mu.Lock()
	if s.closing {
		s.mu.Unlock()
		return Process{}, ErrShuttingDown
	}
	if p, ok := s.procs[name]; ok {
		snap := p.snapshot()
		s.mu.Unlock()
		if !sameSpec(p.Spec, spec) {
			return snap, fmt.Errorf("%w: process %s exists with another spec (%+v); delete it first", ErrConflict, name, redacted(p.Spec))
		}
		return snap, fmt.Errorf("%w: %s", ErrExists, name)
	}
	if err := s.dataDirFreeLocked(dataDirOf(spec)); err != nil {
		s.mu.Unlock()
		return Process{}, fmt.Errorf("%w: %w", ErrConflict, err)
	}
	n := portsFor(spec)
	ports, ok := s.ports.alloc(n, func(port int) bool { return bindable(s.opts.Host, port) })
	if !ok {
		s.mu.Unlock()
		return Process{}, fmt.Errorf("%w: %d contiguous ports wanted in %d-%d", ErrNoPorts, n, s.opts.PortMin, s.opts.PortMax)
	}
	p := &proc{Process: Process{Name: name, Kind: spec.Kind(), Spec: spec, State: StateStarting, Ports: ports,
		Args: append(args(spec, placement{host: s.opts.Host, runDir: s.opts.RunDir, ports: ports, name: name, readyF: readyFD, keyF: keyFD, encF: encKeyFD}), s.opts.ChildArgs...)},
		started: make(chan struct{}), exited: make(chan struct{})}
	defer close(p.started)
	s.procs[name] = p // reserve the name: concurrent creates see it
	s.mu.Unlock()

	// If we crash from here on, the child dies with us (its parent-death
	// signal) and a restarted instance manager kills it by its pid file;
	// the caller's next reconcile creates it again.
	readyR, err := s.launch(p)
	s.mu.Lock()
	if err != nil {
		_ = s.setState(p, StateError, func(p *proc) { p.Error = "start: " + err.Error(); p.ExitCode = -1 })
		s.ports.release(p.Ports)
		close(p.exited)
		snap := p.snapshot()
		s.mu.Unlock()
		if p.log != nil {
			p.log.Close()
		}
		return snap, nil
	}
	p.PID = p.child.PID()
	writePIDFile(s.opts.StateDir, fileName(name), p.PID)
	// The name was reserved at "starting"; announce it now that it has a pid.
	s.emit(p, false)
	snap := p.snapshot()
	s.wg.Add(2)
	s.mu.Unlock()
	go s.wait(p)
	go s.awaitReady(p, readyR)
	return snap, nil
}

// launch opens the process's log and starts it (Options.Launcher); it
// returns the read end of its ready descriptor.
func (s *Supervisor) launch(p *proc) (io.ReadCloser, error) {
	lg, err := openLog(filepath.Join(s.opts.LogDir, fileName(p.Name)+".log"), s.opts.LogMaxBytes)
	if err != nil {
		return nil, err
	}
	p.log = lg
	child, err := s.opts.Launcher.Launch(Launch{Kind: p.Kind, Args: p.Args, Env: s.opts.Env, Output: lg,
		AuthKey: authKeyOf(p.Spec), EncryptionKey: encryptionKeyOf(p.Spec)})
	if err != nil {
		return nil, err
	}
	p.child = child
	return child.Ready(), nil
}

// dataDirFreeLocked refuses a data directory that a process which has not
// exited uses, or that is being deleted ("" is free). Callers hold s.mu.
func (s *Supervisor) dataDirFreeLocked(dir string) error {
	if dir == "" {
		return nil
	}
	for d := range s.deleting {
		if overlaps(d, dir) {
			return fmt.Errorf("data directory %s is being deleted", d)
		}
	}
	for _, p := range s.procs {
		if d := dataDirOf(p.Spec); d != "" && overlaps(d, dir) && !p.hasExited() {
			return fmt.Errorf("data directory %s is used by process %s (%s)", d, p.Name, p.State)
		}
	}
	return nil
}

func (p *proc) hasExited() bool {
	select {
	case <-p.exited:
		return true
	default:
		return false
	}
}

// DeleteData removes a replica's data directory (see ReplicaSpec.DataDir
// for where one may be). It refuses, with ErrInUse, while a process that
// has not exited uses the directory. A missing directory is not an error.
func (s *Supervisor) DeleteData(dir string) error {
	if err := confine(s.opts.DataDirs, dir); err != nil {
		return err
	}
	s.mu.Lock()
	if err := s.dataDirFreeLocked(dir); err != nil {
		s.mu.Unlock()
		return fmt.Errorf("%w: %w; delete the process first", ErrInUse, err)
	}
	s.deleting[dir] = struct{}{} // creates for it wait until we are done
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.deleting, dir)
		s.mu.Unlock()
	}()
	// If we crash midway, part of the directory is left; the caller
	// deletes again and RemoveAll finishes the job.
	if err := os.RemoveAll(dir); err != nil {
		return fmt.Errorf("delete replica data %s: %w", dir, err)
	}
	s.log.Info("deleted replica data", "dir", dir)
	return nil
}

// awaitReady reads the process's ready report and moves it to running
// with the addresses it reports; a process that gives none within the
// start timeout is killed (wait then records the error).
func (s *Supervisor) awaitReady(p *proc, r io.ReadCloser) {
	defer s.wg.Done()
	defer r.Close()
	type result struct {
		rep ready.Report
		err error
	}
	got := make(chan result, 1)
	go func() {
		rep, err := ready.ReadProgress(r, func(msg string) { s.setWaiting(p, msg) })
		got <- result{rep, err}
	}()
	t := time.NewTimer(s.opts.StartTimeout)
	defer t.Stop()
	var reason string
	select {
	case res := <-got:
		switch {
		case res.err == nil:
			s.mu.Lock()
			if p.State == StateStarting {
				_ = s.setState(p, StateRunning, func(p *proc) {
					p.Waiting = ""
					p.DataAddress, p.LocalDataAddress, p.ControlAddress, p.SizeBytes = res.rep.Data, res.rep.LocalData, res.rep.Control, res.rep.Size
					p.Endpoint = Endpoint{Path: res.rep.Endpoint, Kind: res.rep.EndpointKind, Socket: res.rep.Socket, Fallback: res.rep.Fallback, Resumed: res.rep.Resumed}
				})
			}
			s.mu.Unlock()
			return
		case errors.Is(res.err, ready.ErrNoReport):
			return // it exited before it was ready: wait records why
		default:
			reason = "its ready report was unreadable: " + res.err.Error()
		}
	case <-p.exited:
		return
	case <-t.C:
		reason = fmt.Sprintf("it did not report ready within %s", s.opts.StartTimeout)
	}
	s.mu.Lock()
	if p.Waiting != "" {
		reason += "; its last report: " + p.Waiting
	}
	if p.State == StateStarting {
		p.Error = reason
	}
	s.mu.Unlock()
	s.log.Info("killing a process that did not start", "name", p.Name, "reason", reason)
	_ = p.child.Signal(syscall.SIGKILL)
}

// setWaiting records what starting process p reports it waits for, and
// tells the watchers.
func (s *Supervisor) setWaiting(p *proc, msg string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if p.State == StateStarting && p.Waiting != msg {
		p.Waiting = msg
		s.emit(p, false)
	}
}

// setState is the only writer of a process's state; it refuses an
// illegal change (see transitions) and emits every legal one. Callers hold
// s.mu.
// A refusal is logged here: callers with nothing else to do about it
// discard the error. (Signals to a child are discarded the same way: the
// only error is that it has exited, which its wait reports.)
func (s *Supervisor) setState(p *proc, st State, mutate func(*proc)) error {
	if !canTransition(p.State, st) {
		err := errTransition(p.Name, p.State, st)
		s.log.Error(err, "state change refused")
		return err
	}
	p.State = st
	if mutate != nil {
		mutate(p)
	}
	s.emit(p, false)
	return nil
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

// wait records a process's exit: stopped if it was asked to stop, error
// (with exit code and log tail) otherwise.
func (s *Supervisor) wait(p *proc) {
	defer s.wg.Done()
	code, err := p.child.Wait()
	p.log.Close()
	removePIDFile(s.opts.StateDir, fileName(p.Name))
	s.removeSocket(p)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.ports.release(p.Ports)
	if p.State == StateStopping {
		_ = s.setState(p, StateStopped, func(p *proc) { p.ExitCode = code })
	} else {
		tail := p.log.Tail()
		_ = s.setState(p, StateError, func(p *proc) {
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

// removeSocket removes the unix socket an exited replica served its data
// on, or an exited engine its NBD frontend. A process that stops cleanly
// removes it itself; one that was killed or crashed leaves it, and the
// sockets of deleted processes would pile up in the run directory. The
// name is still taken (the process is forgotten only after this), so no
// new process of that name can be serving there yet.
func (s *Supervisor) removeSocket(p *proc) {
	var path string
	switch p.Kind {
	case KindReplica:
		path = replicaSocket(s.opts.RunDir, p.Name)
	case KindEngine:
		path = engineSocket(s.opts.RunDir, p.Name) // absent for a FUSE engine
	default:
		return
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		s.log.Error(err, "could not remove an exited process's socket", "name", p.Name, "kind", p.Kind, "path", path)
	}
}

// Delete stops a process (SIGTERM, SIGKILL after the grace period) and
// forgets it; it returns once it is gone. If ctx ends first it returns an
// error wrapping ErrStillStopping and ctx's error, and the stop goes on:
// a caller's deadline never cuts an engine's final flush short. A missing
// name is not an error.
func (s *Supervisor) Delete(ctx context.Context, name string) error {
	s.mu.Lock()
	p, ok := s.procs[name]
	s.mu.Unlock()
	if !ok {
		return nil
	}
	select {
	case <-p.started: // never signal a process group before the child exists
	case <-ctx.Done():
		return fmt.Errorf("%w: %s is still starting: %w", ErrStillStopping, name, ctx.Err())
	}
	s.mu.Lock()
	p.deleted = true
	if p.hasExited() { // already exited (stopped or error): just forget it
		if _, ok := s.procs[name]; ok {
			delete(s.procs, name)
			s.emit(p, true)
		}
		s.mu.Unlock()
		return nil
	}
	if p.State != StateStopping {
		_ = s.setState(p, StateStopping, nil)
	}
	s.mu.Unlock()
	s.startStop(p, syscall.SIGTERM)
	select {
	case <-p.exited:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("%w: %s has not exited yet (SIGKILL %s after SIGTERM if it does not); delete it again to wait: %w",
			ErrStillStopping, name, s.grace(p.Kind), ctx.Err())
	}
}

// startStop stops a process in the background, once however many callers
// ask: sig (SIGTERM, or HandOverSignal) to its group, SIGKILL after the
// grace period.
func (s *Supervisor) startStop(p *proc, sig syscall.Signal) {
	p.stopOnce.Do(func() {
		_ = p.child.Signal(sig)
		go func() {
			t := time.NewTimer(s.grace(p.Kind))
			defer t.Stop()
			select {
			case <-p.exited:
			case <-t.C:
				s.log.Info("process did not stop in time; killing it", "name", p.Name, "grace", s.grace(p.Kind))
				_ = p.child.Signal(syscall.SIGKILL)
			}
		}()
	})
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
// the watchers. Engines get HandOverSignal: the instance manager is going
// away, not the volumes.
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
		for _, p := range group {
			<-p.started
			s.mu.Lock()
			running := !p.hasExited()
			if running && p.State != StateStopping {
				_ = s.setState(p, StateStopping, nil)
			}
			s.mu.Unlock()
			if running {
				s.startStop(p, closeSignal(p.Kind))
			}
		}
		for _, p := range group {
			<-p.exited
		}
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

// closeSignal is what Close stops a process of kind k with.
func closeSignal(k Kind) syscall.Signal {
	if k == KindEngine {
		return HandOverSignal
	}
	return syscall.SIGTERM
}
