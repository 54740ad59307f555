package main

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	imv1 "github.com/cairn-io/cairn/dataplane/api/instancemanager/v1"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// The engine restart tests: a volume with the fuse frontend and a device
// keeper, ext4 on the first half of its loop device with a file appended
// to and fsynced in a loop, and O_DIRECT writes to the second half, while
// engines are killed, stopped and started again. The application (these
// writers) must see no error, only a pause, and every write acknowledged
// before a restart must be there after it.

const (
	restartVolume = "256Mi"
	fsSize        = "128M" // ext4 on the first 128 MiB
	rawBase       = 160 << 20
	rawBlocks     = 4096 // 16 MiB of 4 KiB blocks from rawBase
)

var (
	// pauseBound is what the test tolerates as one I/O's wait; the
	// target is under 10 s (the pause is printed, not asserted against
	// the target: the machine may be loaded).
	pauseBound = deadline.Scale(60 * time.Second)
	// keeperHold is the test keepers' --hold-for: above any pause here,
	// and short enough that a failed test's writers, waiting on a device
	// no engine serves, get their error and let the test end.
	keeperHold = deadline.Scale(90 * time.Second).String()
)

// ioLoad is the application: the two writers and what they saw.
type ioLoad struct {
	stop chan struct{}
	wg   sync.WaitGroup

	rawOps, records atomic.Int64 // acknowledged O_DIRECT writes; fsynced records

	mu       sync.Mutex
	errs     []error
	maxPause time.Duration
	acked    map[int64]uint64 // block offset -> sequence number of its last acknowledged write
}

func (l *ioLoad) fail(err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.errs = append(l.errs, err)
}

func (l *ioLoad) took(d time.Duration) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.maxPause = max(l.maxPause, d)
}

// startLoad starts the writers on dev (raw, second half) and mnt/log.
func startLoad(t *testing.T, dev, mnt string) *ioLoad {
	t.Helper()
	l := &ioLoad{stop: make(chan struct{}), acked: map[int64]uint64{}}
	raw, err := os.OpenFile(dev, os.O_RDWR|unix.O_DIRECT, 0)
	if err != nil {
		t.Fatal(err)
	}
	logf, err := os.OpenFile(filepath.Join(mnt, "log"), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	if err := syncDir(mnt); err != nil {
		t.Fatal(err)
	}
	l.wg.Add(2)
	go func() { defer l.wg.Done(); defer raw.Close(); l.writeRaw(raw) }()
	go func() { defer l.wg.Done(); defer logf.Close(); l.appendRecords(logf) }()
	t.Cleanup(l.halt)
	return l
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

func (l *ioLoad) halt() {
	select {
	case <-l.stop:
	default:
		close(l.stop)
	}
	l.wg.Wait()
}

// alignedBlock is a 4 KiB buffer O_DIRECT accepts.
func alignedBlock() []byte {
	b, err := unix.Mmap(-1, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		panic(err)
	}
	return b
}

// stamp fills a block with its offset and sequence number.
func stamp(b []byte, off int64, seq uint64) {
	binary.LittleEndian.PutUint64(b[0:], uint64(off))
	binary.LittleEndian.PutUint64(b[8:], seq)
	for i := 16; i < len(b); i++ {
		b[i] = byte(seq) ^ byte(i)
	}
}

// writeRaw writes blocks in a scattered order, one at a time, and records
// each acknowledged one.
func (l *ioLoad) writeRaw(f *os.File) {
	b := alignedBlock()
	defer func() { _ = unix.Munmap(b) }()
	for seq := uint64(1); ; seq++ {
		select {
		case <-l.stop:
			return
		default:
		}
		off := rawBase + int64((seq*7919)%rawBlocks)*4096
		stamp(b, off, seq)
		begin := time.Now()
		if _, err := f.WriteAt(b, off); err != nil {
			l.fail(fmt.Errorf("O_DIRECT write %d at %d: %w", seq, off, err))
			return
		}
		l.took(time.Since(begin))
		l.mu.Lock()
		l.acked[off] = seq
		l.mu.Unlock()
		l.rawOps.Add(1)
	}
}

func record(n int64) []byte {
	return []byte(fmt.Sprintf("record %012d %s\n", n, strings.Repeat("x", 40)))
}

// appendRecords appends numbered records to the file, each fsynced.
func (l *ioLoad) appendRecords(f *os.File) {
	for n := int64(0); ; n++ {
		select {
		case <-l.stop:
			return
		default:
		}
		begin := time.Now()
		if _, err := f.Write(record(n)); err != nil {
			l.fail(fmt.Errorf("appending record %d: %w", n, err))
			return
		}
		if err := f.Sync(); err != nil {
			l.fail(fmt.Errorf("fsync after record %d: %w", n, err))
			return
		}
		l.took(time.Since(begin))
		l.records.Store(n + 1)
	}
}

// waitProgress waits until both writers acknowledged n more operations.
func (l *ioLoad) waitProgress(t *testing.T, n int64, what string) {
	t.Helper()
	raw, recs := l.rawOps.Load(), l.records.Load()
	until := deadline.After(2 * pauseBound)
	for l.rawOps.Load() < raw+n || l.records.Load() < recs+n {
		if errs := l.errors(); len(errs) > 0 {
			t.Fatalf("%s: the application saw I/O errors: %v", what, errs)
		}
		if time.Now().After(until) {
			t.Fatalf("%s: the writers made no progress in %v (raw %d -> %d, records %d -> %d)", what, 2*pauseBound, raw, l.rawOps.Load(), recs, l.records.Load())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// waitStuck waits until the raw writer has made no progress for a while:
// its write is held somewhere below.
func (l *ioLoad) waitStuck(t *testing.T) {
	t.Helper()
	until := deadline.After(pauseBound)
	last, since := l.rawOps.Load(), time.Now()
	for time.Since(since) < 300*time.Millisecond {
		if time.Now().After(until) {
			t.Fatal("the writer never waited on the stopped replica")
		}
		time.Sleep(20 * time.Millisecond)
		if n := l.rawOps.Load(); n != last {
			last, since = n, time.Now()
		}
	}
}

func (l *ioLoad) errors() []error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]error(nil), l.errs...)
}

// check stops the writers and requires no error, every acknowledged raw
// write on dev, and every fsynced record in mnt/log.
func (l *ioLoad) check(t *testing.T, dev, mnt string) {
	t.Helper()
	l.halt()
	if errs := l.errors(); len(errs) > 0 {
		t.Fatalf("the application saw I/O errors: %v", errs)
	}
	t.Logf("longest wait of one I/O (the pause the application saw): %v; %d O_DIRECT writes, %d fsynced records", l.maxPause, l.rawOps.Load(), l.records.Load())
	if l.maxPause > pauseBound {
		t.Fatalf("an I/O waited %v, more than %v", l.maxPause, pauseBound)
	}
	f, err := os.OpenFile(dev, os.O_RDONLY|unix.O_DIRECT, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b, want := alignedBlock(), alignedBlock()
	defer func() { _ = unix.Munmap(b) }()
	defer func() { _ = unix.Munmap(want) }()
	for off, seq := range l.acked {
		if _, err := f.ReadAt(b, off); err != nil {
			t.Fatalf("reading back %d: %v", off, err)
		}
		stamp(want, off, seq)
		if !bytes.Equal(b, want) {
			t.Fatalf("block at %d: want write %d, found write %d of offset %d", off, seq,
				binary.LittleEndian.Uint64(b[8:]), binary.LittleEndian.Uint64(b[0:]))
		}
	}
	got, err := os.ReadFile(filepath.Join(mnt, "log"))
	if err != nil {
		t.Fatal(err)
	}
	n := l.records.Load()
	for i := int64(0); i < n; i++ {
		r := record(i)
		if !bytes.HasPrefix(got, r) {
			t.Fatalf("fsynced record %d of %d missing or damaged", i, n)
		}
		got = got[len(r):]
	}
}

// restartVolume is a volume of three replica processes served by an
// engine with the fuse frontend and a device keeper, with ext4 mounted.
type restartSetup struct {
	dir, fuseDir, mnt, keeperSock string
	keeper                        *proc
	reps                          []*proc
	args                          []string // the engine's command line
	eng                           *proc
	dev                           string
	load                          *ioLoad
}

func newRestartSetup(t *testing.T) *restartSetup {
	t.Helper()
	needRoot(t)
	needTool(t, "mkfs.ext4")
	dir := t.TempDir()
	s := &restartSetup{dir: dir, fuseDir: filepath.Join(dir, "fuse"), mnt: filepath.Join(dir, "mnt"), keeperSock: filepath.Join(dir, "keeper", "k.sock")}
	// Runs after the processes are killed (cleanups run last first): no
	// mount left behind, whatever failed.
	t.Cleanup(func() {
		_ = exec.Command("umount", "-l", s.mnt).Run()
		_ = exec.Command("umount", "-l", s.fuseDir).Run()
	})
	s.keeper = start(t, "device-keeper", "--socket", s.keeperSock, "--hold-for", keeperHold)
	s.reps, s.args = filesystemEngineArgs(t, dir, restartVolume, "--frontend", "fuse", "--fuse-dir", s.fuseDir, "--device-keeper", s.keeperSock)
	s.eng = start(t, s.args...)
	s.dev = s.eng.endpoint
	waitLog(t, s.eng, "the device keeper holds the device")
	sh(t, "mkfs.ext4", "-q", "-F", s.dev, fsSize)
	if err := os.MkdirAll(s.mnt, 0o755); err != nil {
		t.Fatal(err)
	}
	sh(t, "mount", s.dev, s.mnt)
	return s
}

// waitLog waits until p's log says what.
func waitLog(t *testing.T, p *proc, what string) {
	t.Helper()
	until := deadline.After(pauseBound)
	for !strings.Contains(p.stderr.String(), what) {
		if time.Now().After(until) {
			t.Fatalf("the log never said %q:\n%s", what, p.stderr.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// restart starts the next engine and requires it to have taken over the
// same loop device.
func (s *restartSetup) restart(t *testing.T) {
	t.Helper()
	begin := time.Now()
	s.eng = start(t, s.args...)
	s.haltFirst(t)
	t.Logf("the next engine was ready %v after it was started", time.Since(begin))
	if s.eng.endpoint != s.dev {
		t.Fatalf("the engine started again serves %s, not %s\n%s\nkeeper:\n%s", s.eng.endpoint, s.dev, s.eng.stderr.String(), s.keeper.stderr.String())
	}
	// Its log is copied from a pipe: it may lag behind the ready line.
	waitLog(t, s.eng, "took over the device")
}

// haltFirst has a failed test stop the writers before it kills the engine
// just started (cleanups run last registered first): killed first, the
// writers would wait for the keeper to let go.
func (s *restartSetup) haltFirst(t *testing.T) {
	t.Cleanup(func() {
		if s.load != nil {
			s.load.halt()
		}
	})
}

// finish unmounts, requires e2fsck to find ext4 clean, stops the engine
// and requires it to leave no mount and no loop device.
func (s *restartSetup) finish(t *testing.T) {
	t.Helper()
	sh(t, "umount", s.mnt)
	t.Log(sh(t, "e2fsck", "-fn", s.dev))
	s.eng.stopClean(t, "engine")
	if mounted(s.fuseDir) {
		t.Fatal("the FUSE mount was left behind")
	}
	until := deadline.After(pauseBound)
	for loopAttached(s.dev) {
		if time.Now().After(until) {
			t.Fatalf("%s is still attached after the engine stopped", s.dev)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if strings.Contains(s.keeper.stderr.String(), "letting go of the device") {
		t.Fatalf("the keeper let a device go on its own:\n%s", s.keeper.stderr.String())
	}
}

// TestFUSEEngineKilledIsAPause: the engine is SIGKILLed while a write is
// held inside it (one replica stopped, so the engine cannot answer it),
// and a new engine started: the writers see no error, the new engine
// serves the same loop device under the mounted ext4, the kernel sent the
// held write again to it, every acknowledged write and fsynced record is
// there, e2fsck finds ext4 clean.
func TestFUSEEngineKilledIsAPause(t *testing.T) {
	s := newRestartSetup(t)
	load := startLoad(t, s.dev, s.mnt)
	s.load = load
	load.waitProgress(t, 50, "before the kill")

	// A write in flight in the engine: replica r0 stopped, the engine
	// waits for it (its timeout is 30 s).
	r0 := s.reps[0].cmd.Process
	r0.Signal(syscall.SIGSTOP)
	load.waitStuck(t)
	killed := time.Now()
	s.eng.cmd.Process.Kill()
	s.eng.waitExit(t)
	t.Logf("the killed engine exited %v after the kill", time.Since(killed))
	r0.Signal(syscall.SIGCONT)
	s.restart(t)
	t.Logf("engine started again %v after the kill", time.Since(killed))
	load.waitProgress(t, 50, "after the restart")
	if !strings.Contains(s.eng.stderr.String(), "the kernel sent again a request") {
		t.Fatalf("the new engine was not sent the request the killed one held:\n%s", s.eng.stderr.String())
	}
	load.check(t, s.dev, s.mnt)
	s.finish(t)
}

// TestFUSEKeeperRestartThenEngineRestarts: the keeper is SIGKILLed and
// started again while the engine runs (the engine deposits its device with
// the new keeper); then the engine is stopped with SIGTERM under the
// mounted ext4 (as when its instance manager shuts down: it leaves the
// in-use device to the keeper), a new engine takes over, is SIGKILLed, and
// another takes over. The writers see no error throughout.
func TestFUSEKeeperRestartThenEngineRestarts(t *testing.T) {
	s := newRestartSetup(t)
	load := startLoad(t, s.dev, s.mnt)
	s.load = load
	load.waitProgress(t, 20, "before the keeper restart")

	s.keeper.cmd.Process.Kill()
	s.keeper.waitExit(t)
	s.keeper = start(t, "device-keeper", "--socket", s.keeperSock, "--hold-for", keeperHold)
	waitLog(t, s.eng, "deposited the device of a volume again")
	load.waitProgress(t, 20, "after the keeper restart")

	s.eng.stopClean(t, "engine")
	if !strings.Contains(s.eng.stderr.String(), "left to the device keeper") {
		t.Fatalf("the engine stopped under a mounted filesystem did not leave the device to the keeper:\n%s", s.eng.stderr.String())
	}
	s.restart(t)
	load.waitProgress(t, 20, "after the engine's SIGTERM and restart")

	s.eng.cmd.Process.Kill()
	s.eng.waitExit(t)
	s.restart(t)
	load.waitProgress(t, 20, "after the engine's SIGKILL and restart")
	load.check(t, s.dev, s.mnt)
	s.finish(t)
}

// TestFUSESecondEngineRefused: while an engine serves the device the
// keeper holds, a second engine of the volume fails before it opens the
// replicas, and the first goes on serving.
func TestFUSESecondEngineRefused(t *testing.T) {
	s := newRestartSetup(t)
	code, stderr := runExit(t, s.args...)
	if code == 0 || !strings.Contains(stderr, "another engine of volume vol on this node serves its device") {
		t.Fatalf("a second engine: exit %d\n%s", code, stderr)
	}
	if strings.Contains(stderr, "engine opened") {
		t.Fatalf("the second engine opened the replicas before it was refused:\n%s", stderr)
	}
	if err := writeFiles(s.mnt, 0, 3); err != nil {
		t.Fatalf("the first engine stopped serving: %v", err)
	}
	checkFiles(t, s.mnt, 3)
	s.finish(t)
}

// TestFUSEEngineRestartWithoutKeeper: without a keeper, an engine killed
// takes its FUSE connection down (the mount it leaves answers ENOTCONN);
// the engine started again detaches that mount without touching it and
// serves the volume anew, with the data written before.
func TestFUSEEngineRestartWithoutKeeper(t *testing.T) {
	needRoot(t)
	dir := t.TempDir()
	fuseDir := filepath.Join(dir, "fuse")
	t.Cleanup(func() { _ = exec.Command("umount", "-l", fuseDir).Run() })
	_, args := filesystemEngineArgs(t, dir, "16Mi", "--frontend", "fuse", "--fuse-dir", fuseDir)
	eng := start(t, args...)
	waitLog(t, eng, "no device keeper: if this engine dies or is restarted, the I/O in flight on its device fails")
	block := bytes.Repeat([]byte{0x5a}, 4096)
	if err := os.WriteFile(eng.endpoint, block, 0); err != nil {
		t.Fatal(err)
	}
	sh(t, "sync")
	eng.cmd.Process.Kill()
	eng.waitExit(t)
	eng = start(t, args...)
	waitLog(t, eng, "detaching the FUSE mount an earlier engine of the volume left")
	got := make([]byte, 4096)
	f, err := os.Open(eng.endpoint)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.ReadAt(got, 0); err != nil || !bytes.Equal(got, block) {
		t.Fatalf("the block written before the kill: %v", err)
	}
}

// TestFUSEInstanceManagerRestartIsAPause: the scenario at the
// process level. The engine runs under an instance manager whose children
// know the keeper (--child-env CAIRN_DEVICE_KEEPER); ext4 on its loop
// device takes fsynced appends and O_DIRECT writes. The instance manager
// is stopped with SIGTERM (a pod deleted: it stops its engine, which leaves
// the in-use device to the keeper), a new one started on the same state
// directory and asked for the engine again; then that one is SIGKILLed
// (its engine dies with it), and a third one asked again. Each new engine
// takes the same loop device over; the writers see no error; every
// acknowledged write and fsynced record is there; deleting the engine at
// the end (a detach) leaves no loop device.
func TestFUSEInstanceManagerRestartIsAPause(t *testing.T) {
	needRoot(t)
	needTool(t, "mkfs.ext4")
	ctx := context.Background()
	dir := t.TempDir()
	sock := filepath.Join(dir, "keeper", "k.sock")
	keeper := start(t, "device-keeper", "--socket", sock, "--hold-for", keeperHold)
	reps, _ := filesystemEngineArgs(t, dir, restartVolume)
	var addrs []*imv1.ReplicaAddress
	for _, r := range reps {
		addrs = append(addrs, &imv1.ReplicaAddress{Data: r.data, Control: r.control})
	}
	logDir, ports, mnt := filepath.Join(dir, "im"), freePortRange(t, 8), filepath.Join(dir, "mnt")
	t.Cleanup(func() {
		_ = exec.Command("umount", "-l", mnt).Run()
		unmountUnder(logDir)
	})
	var load *ioLoad
	startEngine := func(resumed bool) (*imHandle, string) {
		t.Helper()
		im := startIM(t, ports, "--log-dir", logDir, "--child-env", "CAIRN_DEVICE_KEEPER="+sock)
		t.Cleanup(func() { // before the instance manager is killed (see haltFirst)
			if load != nil {
				load.halt()
			}
		})
		if _, err := im.c.ProcessCreate(ctx, &imv1.ProcessCreateRequest{Name: "vol-e", Spec: &imv1.ProcessCreateRequest_Engine{Engine: &imv1.EngineSpec{
			VolumeName: "vol", Replicas: addrs, Frontend: imv1.Frontend_FRONTEND_FUSE}}}); err != nil {
			t.Fatal(err)
		}
		ep := waitState(t, im.c, "vol-e", imv1.ProcessState_PROCESS_STATE_RUNNING).GetEndpoint()
		if ep.GetResumed() != resumed {
			t.Fatalf("the instance manager reports the engine's device %s resumed=%v, want %v", ep.GetPath(), ep.GetResumed(), resumed)
		}
		return im, ep.GetPath()
	}
	im, dev := startEngine(false)
	sh(t, "mkfs.ext4", "-q", "-F", dev, fsSize)
	if err := os.MkdirAll(mnt, 0o755); err != nil {
		t.Fatal(err)
	}
	sh(t, "mount", dev, mnt)
	load = startLoad(t, dev, mnt)
	load.waitProgress(t, 20, "before the instance manager's SIGTERM")

	for i, stop := range []func(*os.Process) error{
		func(p *os.Process) error { return p.Signal(syscall.SIGTERM) },
		func(p *os.Process) error { return p.Kill() },
	} {
		if err := stop(im.p.cmd.Process); err != nil {
			t.Fatalf("stop %d: %v", i, err)
		}
		im.p.waitExit(t)
		var again string
		im, again = startEngine(true)
		if again != dev {
			t.Fatalf("restart %d: the engine serves %s, not %s", i, again, dev)
		}
		load.waitProgress(t, 20, fmt.Sprintf("after instance manager restart %d", i))
	}
	if n := strings.Count(keeper.stderr.String(), "an engine took over the device of a volume"); n != 2 {
		t.Fatalf("the keeper handed the device over %d times, want 2:\n%s", n, keeper.stderr.String())
	}
	load.check(t, dev, mnt)
	sh(t, "umount", mnt)
	t.Log(sh(t, "e2fsck", "-fn", dev))
	if _, err := im.c.ProcessDelete(ctx, &imv1.ProcessDeleteRequest{Name: "vol-e"}); err != nil {
		t.Fatal(err)
	}
	until := deadline.After(pauseBound)
	for loopAttached(dev) {
		if time.Now().After(until) {
			t.Fatalf("%s is still attached after the engine was deleted", dev)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// unmountUnder lazily unmounts every mount below dir (a failed test's
// FUSE mounts).
func unmountUnder(dir string) {
	b, _ := os.ReadFile("/proc/self/mountinfo")
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) > 4 && strings.HasPrefix(f[4], dir+"/") {
			_ = exec.Command("umount", "-l", f[4]).Run()
		}
	}
}
