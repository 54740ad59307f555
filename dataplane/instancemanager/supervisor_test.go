package instancemanager

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/go-logr/logr"

	"github.com/cairn-io/cairn/dataplane/internal/ready"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// These tests drive the Supervisor's state machine through a launcher that
// starts nothing: each test plays the child's part (its ready report, its
// exit, how it takes signals). The instance manager's tests with real
// processes are in cmd/cairn-data.

// within bounds every wait for something the Supervisor does in the
// background: generous, for a loaded machine; nothing waits this long
// when the code is right.
var within = deadline.Scale(30 * time.Second)

// fakeLauncher hands out fakeChildren, in order, on launched.
type fakeLauncher struct {
	launched chan *fakeChild
	mu       sync.Mutex
	fail     error // the next Launch fails with it
	pid      int
	log      *eventLog
}

// eventLog records signals and exits of every child in the order they
// happened.
type eventLog struct {
	mu  sync.Mutex
	out []string
}

func (l *eventLog) add(s string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.out = append(l.out, s)
}

func (l *eventLog) list() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.out)
}

func newFakeLauncher() *fakeLauncher {
	// PIDs far beyond any kernel's pid_max: the pid files the Supervisor
	// writes for them name no process.
	return &fakeLauncher{launched: make(chan *fakeChild, 16), pid: 1 << 30, log: &eventLog{}}
}

func (l *fakeLauncher) Launch(c Launch) (Child, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if err := l.fail; err != nil {
		l.fail = nil
		return nil, err
	}
	r, w, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	l.pid++
	ch := &fakeChild{launch: c, pid: l.pid, readyR: r, readyW: w, done: make(chan struct{}),
		signals: make(chan syscall.Signal, 16), log: l.log, name: fmt.Sprintf("%s%d", c.Kind, l.pid-1<<30)}
	l.launched <- ch
	return ch, nil
}

// fakeChild is a process as the Supervisor sees it. By default SIGTERM
// and SIGKILL end it; holdTERM makes it only record a SIGTERM.
type fakeChild struct {
	launch         Launch
	pid            int
	name           string
	readyR, readyW *os.File
	holdTERM       bool

	once    sync.Once
	code    int
	done    chan struct{}
	signals chan syscall.Signal
	log     *eventLog
}

func (c *fakeChild) PID() int { return c.pid }

func (c *fakeChild) Ready() io.ReadCloser { return c.readyR }

func (c *fakeChild) Wait() (int, error) {
	<-c.done
	if c.code != 0 {
		return c.code, fmt.Errorf("exit status %d", c.code)
	}
	return 0, nil
}

func (c *fakeChild) Signal(sig syscall.Signal) error {
	c.log.add(c.name + " " + sig.String())
	c.signals <- sig
	if sig == syscall.SIGKILL || !c.holdTERM {
		c.exit(map[syscall.Signal]int{syscall.SIGKILL: -1}[sig])
	}
	return nil
}

// report writes the child's ready report.
func (c *fakeChild) report(t *testing.T, r ready.Report) {
	t.Helper()
	b, err := json.Marshal(r)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.readyW.Write(append(b, '\n')); err != nil {
		t.Fatal(err)
	}
	c.readyW.Close()
}

// exit ends the child with code, closing its ready descriptor as an
// exiting process does.
func (c *fakeChild) exit(code int) {
	c.once.Do(func() {
		c.code = code
		c.readyW.Close()
		c.log.add(fmt.Sprintf("%s exit %d", c.name, code))
		close(c.done)
	})
}

func (c *fakeChild) signal(t *testing.T) syscall.Signal {
	t.Helper()
	select {
	case s := <-c.signals:
		return s
	case <-time.After(within):
		t.Fatalf("%s got no signal within %s", c.name, within)
		return 0
	}
}

type rig struct {
	t    *testing.T
	s    *Supervisor
	l    *fakeLauncher
	data string
	ev   <-chan Event
}

// newRig starts a Supervisor over a fake launcher; change adjusts its
// options.
func newRig(t *testing.T, change func(*Options)) *rig {
	t.Helper()
	dir := t.TempDir()
	data := filepath.Join(dir, "data")
	if err := os.MkdirAll(data, 0o750); err != nil {
		t.Fatal(err)
	}
	l := newFakeLauncher()
	base := 24000 + os.Getpid()%4000
	opts := Options{Launcher: l, PortMin: base, PortMax: base + 63, DataDirs: []string{data}, LogDir: filepath.Join(dir, "logs"),
		RunDir: filepath.Join(dir, "run"), StartTimeout: time.Minute, StopGrace: time.Minute, Logger: logr.Discard()}
	if change != nil {
		change(&opts)
	}
	s, err := New(opts)
	if err != nil {
		t.Fatal(err)
	}
	_, _, ev, cancel := s.Watch()
	t.Cleanup(func() {
		cancel()
		// Whatever a test left running ends on its signals.
		s.Close()
	})
	return &rig{t: t, s: s, l: l, data: data, ev: ev}
}

func (r *rig) replica(dir string) ReplicaSpec {
	return ReplicaSpec{DataDir: filepath.Join(r.data, dir), SizeBytes: 1 << 20}
}

// create creates a process and returns its child.
func (r *rig) create(name string, spec Spec) (Process, *fakeChild) {
	r.t.Helper()
	p, err := r.s.Create(name, spec)
	if err != nil {
		r.t.Fatalf("create %s: %v", name, err)
	}
	select {
	case c := <-r.l.launched:
		return p, c
	default:
		r.t.Fatalf("create %s launched nothing", name)
		return p, nil
	}
}

// next is the next event.
func (r *rig) next() Event {
	r.t.Helper()
	select {
	case ev, ok := <-r.ev:
		if !ok {
			r.t.Fatal("the watch ended")
		}
		return ev
	case <-time.After(within):
		r.t.Fatalf("no event within %s", within)
		return Event{}
	}
}

// expect takes the next event and checks its process's name and state
// (and that it is a deletion when deleted).
func (r *rig) expect(name string, st State, deleted bool) Process {
	r.t.Helper()
	ev := r.next()
	if ev.Process.Name != name || ev.Process.State != st || ev.Deleted != deleted {
		r.t.Fatalf("event %s %s (deleted %v), want %s %s (deleted %v)", ev.Process.Name, ev.Process.State, ev.Deleted, name, st, deleted)
	}
	return ev.Process
}

// TestSupervisorLifeCycle: starting (with its pid) → running with what
// the ready report says → stopping on delete (SIGTERM) → stopped →
// forgotten; the launcher gets the spec's arguments, environment and key,
// and the ports come back for the next process.
func TestSupervisorLifeCycle(t *testing.T) {
	r := newRig(t, nil)
	spec := r.replica("r1")
	spec.AuthKey = strings.Repeat("k", AuthKeySize)
	p, c := r.create("ns/r1", spec)
	if p.State != StateStarting || p.PID != c.pid || len(p.Ports) != 2 {
		t.Fatalf("created: %+v", p)
	}
	if c.launch.Kind != KindReplica || c.launch.AuthKey != spec.AuthKey || !slices.Equal(c.launch.Env, DefaultEnv) ||
		!slices.Contains(c.launch.Args, "--ready-fd") || slices.Contains(c.launch.Args, spec.AuthKey) {
		t.Fatalf("launched %+v", c.launch)
	}
	r.expect("ns/r1", StateStarting, false)
	c.report(t, ready.Report{Data: "127.0.0.1:1", LocalData: "unix:/run/r.sock", Control: "127.0.0.1:2", Size: 1 << 20})
	got := r.expect("ns/r1", StateRunning, false)
	if got.DataAddress != "127.0.0.1:1" || got.LocalDataAddress != "unix:/run/r.sock" || got.ControlAddress != "127.0.0.1:2" || got.SizeBytes != 1<<20 {
		t.Fatalf("running: %+v", got)
	}
	if g, err := r.s.Get("ns/r1"); err != nil || g.State != StateRunning {
		t.Fatalf("get: %+v %v", g, err)
	}
	if err := r.s.Delete(context.Background(), "ns/r1"); err != nil {
		t.Fatal(err)
	}
	if s := c.signal(t); s != syscall.SIGTERM {
		t.Fatalf("stopped with %s", s)
	}
	r.expect("ns/r1", StateStopping, false)
	if st := r.expect("ns/r1", StateStopped, false); st.ExitCode != 0 {
		t.Fatalf("stopped: %+v", st)
	}
	r.expect("ns/r1", StateStopped, true)
	if _, err := r.s.Get("ns/r1"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("get after delete: %v", err)
	}
	if err := r.s.Delete(context.Background(), "ns/r1"); err != nil {
		t.Fatalf("deleting a missing process: %v", err)
	}
	again, _ := r.create("ns/r2", r.replica("r2"))
	if !slices.Equal(again.Ports, p.Ports) {
		t.Fatalf("ports %v after %v were released", again.Ports, p.Ports)
	}
}

// TestSupervisorExitsOnItsOwn: a process that exits, before or after it
// was ready, is in error with its exit code and its log's last lines; it
// stays until deleted, and its name can be used again then.
func TestSupervisorExitsOnItsOwn(t *testing.T) {
	r := newRig(t, nil)
	_, c := r.create("early", r.replica("early"))
	r.expect("early", StateStarting, false)
	fmt.Fprintln(c.launch.Output, "replica: open: disk gone")
	c.exit(3)
	p := r.expect("early", StateError, false)
	if p.ExitCode != 3 || !strings.Contains(p.Error, "exited unexpectedly") || !slices.Contains(p.LogTail, "replica: open: disk gone") {
		t.Fatalf("exited before ready: %+v", p)
	}

	_, c2 := r.create("late", r.replica("late"))
	r.expect("late", StateStarting, false)
	c2.report(t, ready.Report{Control: "127.0.0.1:9"})
	r.expect("late", StateRunning, false)
	c2.exit(-1)
	if p := r.expect("late", StateError, false); p.ExitCode != -1 || p.ControlAddress != "127.0.0.1:9" {
		t.Fatalf("exited while running: %+v", p)
	}
	if len(c.signals)+len(c2.signals) != 0 {
		t.Fatal("a process that exited was signalled")
	}

	if err := r.s.Delete(context.Background(), "early"); err != nil {
		t.Fatal(err)
	}
	r.expect("early", StateError, true)
	r.create("early", r.replica("early"))
	r.expect("early", StateStarting, false)
}

// TestSupervisorRemovesSockets: the unix socket a replica was started
// with (beside its TCP port, or its only data listener with UnixSocket),
// or an engine for its NBD frontend, is removed once it exits, whether it
// crashed or was deleted, when it left the socket behind as a killed
// process does.
func TestSupervisorRemovesSockets(t *testing.T) {
	r := newRig(t, nil)
	unixSpec := r.replica("u")
	unixSpec.UnixSocket = true
	nbd := EngineSpec{VolumeName: "v", Frontend: FrontendNBD, NBDKernel: NBDKernelOff, Replicas: []ReplicaAddress{{Data: "127.0.0.1:1", Control: "127.0.0.1:2"}}}
	for _, tc := range []struct {
		name, flag string
		spec       Spec
		stop       func(c *fakeChild) State
	}{
		{"nbd-engine", "--nbd-socket", nbd, func(c *fakeChild) State { c.exit(-1); return StateError }},
		{"tcp", "--listen-local", r.replica("t"), func(c *fakeChild) State { c.exit(-1); return StateError }},
		{"unix", "--listen", unixSpec, func(*fakeChild) State {
			if err := r.s.Delete(context.Background(), "unix"); err != nil {
				t.Fatal(err)
			}
			r.expect("unix", StateStopping, false)
			return StateStopped
		}},
	} {
		_, c := r.create(tc.name, tc.spec)
		r.expect(tc.name, StateStarting, false)
		i := slices.Index(c.launch.Args, tc.flag)
		if i < 0 || i+1 == len(c.launch.Args) {
			t.Fatalf("%s: args %v: no %s", tc.name, c.launch.Args, tc.flag)
		}
		sock := c.launch.Args[i+1]
		if tc.flag != "--nbd-socket" {
			var ok bool
			if sock, ok = strings.CutPrefix(sock, "unix:"); !ok {
				t.Fatalf("%s: args %v: %s is not unix:PATH", tc.name, c.launch.Args, tc.flag)
			}
		}
		if filepath.Dir(sock) != r.s.opts.RunDir {
			t.Fatalf("%s: args %v: %s is not a path in the run directory", tc.name, c.launch.Args, tc.flag)
		}
		l, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
		if err != nil {
			t.Fatal(err)
		}
		l.SetUnlinkOnClose(false) // left behind, as by a killed replica
		l.Close()
		c.report(t, ready.Report{Data: "127.0.0.1:1", Control: "127.0.0.1:2"})
		r.expect(tc.name, StateRunning, false)
		r.expect(tc.name, tc.stop(c), false)
		if _, err := os.Stat(sock); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("%s: the exited process's socket is still there: %v", tc.name, err)
		}
	}
}

// TestSupervisorNotReady: a process that does not report ready in time,
// or reports something unreadable, is killed and in error saying why.
func TestSupervisorNotReady(t *testing.T) {
	r := newRig(t, func(o *Options) { o.StartTimeout = 200 * time.Millisecond })
	_, c := r.create("silent", r.replica("silent"))
	r.expect("silent", StateStarting, false)
	if s := c.signal(t); s != syscall.SIGKILL {
		t.Fatalf("a process that never reported got %s", s)
	}
	if p := r.expect("silent", StateError, false); !strings.Contains(p.Error, "did not report ready within") {
		t.Fatalf("error %q", p.Error)
	}

	r2 := newRig(t, nil)
	_, c2 := r2.create("garbled", r2.replica("garbled"))
	r2.expect("garbled", StateStarting, false)
	if _, err := c2.readyW.WriteString("not a report\n"); err != nil {
		t.Fatal(err)
	}
	if s := c2.signal(t); s != syscall.SIGKILL {
		t.Fatalf("a process with an unreadable report got %s", s)
	}
	if p := r2.expect("garbled", StateError, false); !strings.Contains(p.Error, "unreadable") {
		t.Fatalf("error %q", p.Error)
	}
}

// TestSupervisorLaunchFails: a process that cannot be started is in error
// at once, with the cause, and gives its ports back.
func TestSupervisorLaunchFails(t *testing.T) {
	r := newRig(t, nil)
	r.l.fail = errors.New("exec format error")
	p, err := r.s.Create("broken", r.replica("broken"))
	if err != nil || p.State != StateError || p.ExitCode != -1 || !strings.Contains(p.Error, "start: exec format error") {
		t.Fatalf("create: %+v %v", p, err)
	}
	r.expect("broken", StateError, false)
	next, _ := r.create("next", r.replica("next"))
	if !slices.Equal(next.Ports, p.Ports) {
		t.Fatalf("ports %v, the failed start's %v were not released", next.Ports, p.Ports)
	}
}

// TestSupervisorStopGrace: a process that ignores SIGTERM gets SIGKILL
// after the grace period; a delete whose context ends first says it is
// still stopping, and the stop goes on. An engine's grace covers its
// final flush whatever the configured grace.
func TestSupervisorStopGrace(t *testing.T) {
	r := newRig(t, func(o *Options) { o.StopGrace = 100 * time.Millisecond })
	_, c := r.create("stubborn", r.replica("stubborn"))
	c.holdTERM = true
	r.expect("stubborn", StateStarting, false)
	c.report(t, ready.Report{})
	r.expect("stubborn", StateRunning, false)
	if err := r.s.Delete(context.Background(), "stubborn"); err != nil {
		t.Fatal(err)
	}
	if got := []syscall.Signal{c.signal(t), c.signal(t)}; !slices.Equal(got, []syscall.Signal{syscall.SIGTERM, syscall.SIGKILL}) {
		t.Fatalf("signals %v", got)
	}
	r.expect("stubborn", StateStopping, false)
	if p := r.expect("stubborn", StateStopped, false); p.ExitCode != -1 {
		t.Fatalf("stopped: %+v", p)
	}
	if g := r.s.grace(KindEngine); g < EngineFinalFlush {
		t.Fatalf("engine grace %s, shorter than its final flush", g)
	}

	r2 := newRig(t, nil)
	_, c2 := r2.create("slow", r2.replica("slow"))
	c2.holdTERM = true
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	if err := r2.s.Delete(ctx, "slow"); !errors.Is(err, ErrStillStopping) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("delete with an ended context: %v", err)
	}
	if s := c2.signal(t); s != syscall.SIGTERM {
		t.Fatalf("got %s", s)
	}
	if p, _ := r2.s.Get("slow"); p.State != StateStopping {
		t.Fatalf("state %s, want stopping", p.State)
	}
	c2.exit(0)
	if err := r2.s.Delete(context.Background(), "slow"); err != nil {
		t.Fatalf("delete again: %v", err)
	}
	if _, err := r2.s.Get("slow"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("get: %v", err)
	}
}

// TestSupervisorRefuses: bad requests change nothing and say why.
func TestSupervisorRefuses(t *testing.T) {
	r := newRig(t, func(o *Options) { o.RequireAuthKey = true })
	key := strings.Repeat("k", AuthKeySize)
	spec := r.replica("a")
	spec.AuthKey = key
	r.create("a", spec)
	r.expect("a", StateStarting, false)
	other := spec
	other.SizeBytes *= 2
	sameDir := spec
	for _, c := range []struct {
		name string
		spec Spec
		want error
	}{
		{"a", spec, ErrExists},
		{"a", other, ErrConflict},
		{"b", sameDir, ErrConflict}, // another process uses the data directory
		{"B", spec, ErrInvalid},
		{"c", nil, ErrInvalid},
		{"d", r.replica("d"), ErrInvalid}, // no key
		{"e", ReplicaSpec{DataDir: "/elsewhere", SizeBytes: 4096, AuthKey: key}, ErrInvalid},
	} {
		if _, err := r.s.Create(c.name, c.spec); !errors.Is(err, c.want) {
			t.Errorf("create %s: %v, want %v", c.name, err, c.want)
		}
	}
	if n := len(r.l.launched); n != 0 {
		t.Fatalf("%d refused creates launched a process", n)
	}
	if err := r.s.DeleteData(spec.DataDir); !errors.Is(err, ErrInUse) {
		t.Fatalf("deleting a running replica's data: %v", err)
	}
	if got := r.s.List(); len(got) != 1 || got[0].Name != "a" {
		t.Fatalf("processes %+v", got)
	}
}

// TestSupervisorCloseStopsEnginesFirst: Close stops the engines with
// HandOverSignal (the instance manager goes away, the volumes stay
// attached), waits for them to exit (an engine flushes to its replicas on
// the way down), then stops the replicas with SIGTERM, and ends the
// watches; later creates are refused.
func TestSupervisorCloseStopsEnginesFirst(t *testing.T) {
	r := newRig(t, nil)
	_, rc := r.create("rep", r.replica("rep"))
	_, ec := r.create("eng", EngineSpec{VolumeName: "v", Replicas: []ReplicaAddress{{Data: "127.0.0.1:1", Control: "127.0.0.1:2"}}})
	ec.holdTERM = true
	for _, c := range []*fakeChild{rc, ec} {
		c.report(t, ready.Report{})
	}
	closed := make(chan error, 1)
	go func() { closed <- r.s.Close() }()
	if s := ec.signal(t); s != HandOverSignal {
		t.Fatalf("engine got %s, want %s", s, HandOverSignal)
	}
	if len(rc.signals) != 0 {
		t.Fatal("a replica was stopped before its engine exited")
	}
	ec.exit(0)
	if s := rc.signal(t); s != syscall.SIGTERM {
		t.Fatalf("replica got %s", s)
	}
	select {
	case err := <-closed:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(within):
		t.Fatal("Close did not return")
	}
	log := r.l.log.list()
	if i, j := slices.Index(log, ec.name+" exit 0"), slices.Index(log, rc.name+" terminated"); i < 0 || j < i {
		t.Fatalf("order %v: the replica's SIGTERM must follow the engine's exit", log)
	}
	for ok := true; ok; {
		select {
		case _, ok = <-r.ev:
		case <-time.After(within):
			t.Fatal("the watch did not end")
		}
	}
	if _, err := r.s.Create("late", r.replica("late")); !errors.Is(err, ErrShuttingDown) {
		t.Fatalf("create after close: %v", err)
	}
}

// TestSupervisorDeleteStopsEngineWithSIGTERM: a Delete (the volume is
// detached from the node) stops an engine with SIGTERM, on which it
// detaches its device, never with HandOverSignal.
func TestSupervisorDeleteStopsEngineWithSIGTERM(t *testing.T) {
	r := newRig(t, nil)
	_, ec := r.create("eng", EngineSpec{VolumeName: "v", Replicas: []ReplicaAddress{{Data: "127.0.0.1:1", Control: "127.0.0.1:2"}}})
	ec.report(t, ready.Report{})
	if err := r.s.Delete(context.Background(), "eng"); err != nil {
		t.Fatal(err)
	}
	if s := ec.signal(t); s != syscall.SIGTERM {
		t.Fatalf("engine deleted with %s, want SIGTERM", s)
	}
}
