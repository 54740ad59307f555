package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	imv1 "github.com/cairn-io/cairn/dataplane/api/instancemanager/v1"
	"github.com/cairn-io/cairn/dataplane/internal/uml"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// nbdEngineOnIM starts three 64 MiB replicas as plain processes (the
// volume's replicas on other nodes) and returns an engine spec for them
// with the nbd frontend on /dev/nbdN. It skips without root or the nbd
// driver (TestNBDKernelHandOverInUML runs its tests inside User-Mode
// Linux, which has one).
func nbdEngineOnIM(t *testing.T) *imv1.ProcessCreateRequest {
	t.Helper()
	needRoot(t)
	if _, err := os.Stat("/sys/module/nbd"); err != nil {
		t.Skip("no nbd driver in this kernel: TestNBDKernelHandOverInUML runs this test inside User-Mode Linux")
	}
	reps, _ := filesystemEngineArgs(t, t.TempDir(), "64Mi")
	var addrs []*imv1.ReplicaAddress
	for _, r := range reps {
		addrs = append(addrs, &imv1.ReplicaAddress{Data: r.data, Control: r.control})
	}
	return &imv1.ProcessCreateRequest{Name: "ns/vol-e", Spec: &imv1.ProcessCreateRequest_Engine{Engine: &imv1.EngineSpec{
		VolumeName: "vol", Replicas: addrs, Frontend: imv1.Frontend_FRONTEND_NBD, NbdKernel: imv1.NBDKernel_NBD_KERNEL_ON,
		// Every system call is slow in UML: a live replica must not be
		// failed for it (see filesystemEngineArgs).
		ReplicaTimeoutMs: 30000}}}
}

// startShortIM starts an instance manager whose run directory (the
// engine's NBD socket) has a path short enough for a unix socket inside
// UML, whose TMPDIR is deep.
func startShortIM(t *testing.T) *imHandle {
	t.Helper()
	run, err := os.MkdirTemp("/run", "im")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(run) })
	return startIM(t, freePortRange(t, 8), "--run-dir", run)
}

// createNBDEngine creates the engine on im and returns its running
// process, whose endpoint is /dev/nbdN.
func createNBDEngine(t *testing.T, im *imHandle, req *imv1.ProcessCreateRequest) *imv1.Process {
	t.Helper()
	if _, err := im.c.ProcessCreate(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	p := waitState(t, im.c, req.Name, imv1.ProcessState_PROCESS_STATE_RUNNING)
	if !strings.HasPrefix(p.GetEndpoint().GetPath(), "/dev/nbd") {
		t.Fatalf("endpoint %+v is not an nbd device", p.GetEndpoint())
	}
	return p
}

// nbdConnected says whether /dev/nbdN (dev) is configured: the kernel
// gives a configured device a pid file.
func nbdConnected(dev string) bool {
	_, err := os.Stat(filepath.Join("/sys/block", filepath.Base(dev), "pid"))
	return err == nil
}

// recordSize is the size of one record recordWriter writes.
const recordSize = 4096

// nbdRecord is record i's content: its number, then a pattern made from it.
func nbdRecord(i int) []byte {
	b := alignedBuf(recordSize)
	copy(b, bytes.Repeat([]byte(fmt.Sprintf("record %08d|", i)), recordSize/16))
	return b
}

// alignedBuf is a 4 KiB-aligned buffer of n bytes, for O_DIRECT.
func alignedBuf(n int) []byte {
	b := make([]byte, n+4096)
	off := 4096 - int(uintptr(unsafe.Pointer(&b[0]))%4096)
	return b[off%4096 : off%4096+n]
}

// recordWriter is an application writing numbered records to a block
// device, each with O_DIRECT and then fdatasync (a flush the device must
// acknowledge only once the record is durable), one after the other.
type recordWriter struct {
	f     *os.File
	acked atomic.Int64 // records 0..acked-1 were acknowledged
	err   atomic.Pointer[error]
	stop  chan struct{}
	done  chan struct{}
}

func startRecordWriter(t *testing.T, dev string) *recordWriter {
	t.Helper()
	f, err := os.OpenFile(dev, os.O_RDWR|unix.O_DIRECT, 0)
	if err != nil {
		t.Fatal(err)
	}
	w := &recordWriter{f: f, stop: make(chan struct{}), done: make(chan struct{})}
	go w.run()
	t.Cleanup(func() { w.halt(); f.Close() })
	return w
}

func (w *recordWriter) run() {
	defer close(w.done)
	for i := 0; ; i++ {
		select {
		case <-w.stop:
			return
		default:
		}
		_, err := w.f.WriteAt(nbdRecord(i), int64(i)*recordSize)
		if err == nil {
			err = unix.Fdatasync(int(w.f.Fd()))
		}
		if err != nil {
			err = fmt.Errorf("record %d: %w", i, err)
			w.err.Store(&err)
			return
		}
		w.acked.Store(int64(i + 1))
	}
}

// failed is the writer's error, or nil.
func (w *recordWriter) failed() error {
	if e := w.err.Load(); e != nil {
		return *e
	}
	return nil
}

func (w *recordWriter) halt() {
	select {
	case <-w.stop:
	default:
		close(w.stop)
	}
	<-w.done
}

// waitAcked waits until n records are acknowledged; it fails on the
// writer's first error.
func (w *recordWriter) waitAcked(t *testing.T, n int64, within time.Duration, why func() string) {
	t.Helper()
	until := deadline.After(within)
	for w.acked.Load() < n {
		if err := w.failed(); err != nil {
			t.Fatalf("the application saw an I/O error after %d acknowledged records: %v\n%s", w.acked.Load(), err, why())
		}
		if time.Now().After(until) {
			t.Fatalf("%d records acknowledged, want %d, within %s\n%s", w.acked.Load(), n, deadline.Scale(within), why())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// checkRecords reads every acknowledged record back from dev (O_DIRECT,
// from the replicas through the engine serving dev).
func checkRecords(t *testing.T, dev string, n int64) {
	t.Helper()
	f, err := os.OpenFile(dev, os.O_RDONLY|unix.O_DIRECT, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	got := alignedBuf(recordSize)
	for i := range int(n) {
		if _, err := f.ReadAt(got, int64(i)*recordSize); err != nil {
			t.Fatalf("reading record %d: %v", i, err)
		}
		if !bytes.Equal(got, nbdRecord(i)) {
			t.Fatalf("acknowledged record %d of %d is not there: it reads %q...", i, n, got[:16])
		}
	}
}

// TestNBDKernelInstanceManagerRestart: an application appends records
// with O_DIRECT and fdatasync to /dev/nbdN of an engine run by an
// instance manager; the instance manager is stopped the way a pod
// termination stops it (SIGTERM to it; it stops its children), and the
// engine leaves the device attached with its I/O held; a new instance
// manager starts the volume's engine again, which reattaches the same
// device. The application never sees an error, carries on, and every
// record acknowledged before, during and after reads back.
func TestNBDKernelInstanceManagerRestart(t *testing.T) {
	req := nbdEngineOnIM(t)
	im1 := startShortIM(t)
	dev := createNBDEngine(t, im1, req).GetEndpoint().GetPath()
	w := startRecordWriter(t, dev)
	kernelLog := func() string { return uml.KernelLog(25) }
	w.waitAcked(t, 20, 60*time.Second, kernelLog)

	im1.p.stopClean(t, "instance manager")
	engineLog, _ := os.ReadFile(filepath.Join(im1.logDir, "ns_vol-e.log"))
	if !nbdConnected(dev) {
		t.Fatalf("%s was detached when the instance manager stopped\nengine:\n%s\nkernel:\n%s", dev, engineLog, kernelLog())
	}
	if err := w.failed(); err != nil {
		t.Fatalf("the application saw an I/O error when the instance manager stopped: %v\nengine:\n%s\nkernel:\n%s", err, engineLog, kernelLog())
	}
	if !bytes.Contains(engineLog, []byte("left "+dev+" attached for the next engine")) {
		t.Fatalf("the engine did not say it left %s attached:\n%s", dev, engineLog)
	}
	atStop := w.acked.Load()
	t.Logf("%d records acknowledged when the instance manager stopped", atStop)

	im2 := startShortIM(t)
	p := createNBDEngine(t, im2, req)
	if p.GetEndpoint().GetPath() != dev || !p.GetEndpoint().GetResumed() {
		t.Fatalf("the new engine serves %+v, want the device the old one left, %s, resumed", p.GetEndpoint(), dev)
	}
	// The records held while no engine ran complete, and more follow. A
	// request the kernel had sent the old engine and it never read is sent
	// again when the kernel's 30 s request timeout fires for it.
	w.waitAcked(t, atStop+20, 3*time.Minute, kernelLog)
	w.halt()
	if err := w.failed(); err != nil {
		t.Fatalf("the application saw an I/O error: %v\n%s", err, kernelLog())
	}
	checkRecords(t, dev, w.acked.Load())
	t.Logf("%d records acknowledged and read back", w.acked.Load())
	w.f.Close()

	// The volume detached here (the application gone): its engine deleted
	// the way the control plane does it detaches the device.
	deleteEngineDetaches(t, im2, req.Name, dev)
}

// deleteEngineDetaches deletes the engine (ProcessDelete, what the control
// plane does once the volume is detached from the node) and requires its
// device to be disconnected.
func deleteEngineDetaches(t *testing.T, im *imHandle, name, dev string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), deadline.Scale(2*time.Minute))
	defer cancel()
	if _, err := im.c.ProcessDelete(ctx, &imv1.ProcessDeleteRequest{Name: name}); err != nil {
		t.Fatal(err)
	}
	if nbdConnected(dev) {
		t.Fatalf("%s is still connected after its engine was deleted\nkernel:\n%s", dev, uml.KernelLog(25))
	}
	if b, _ := os.ReadFile(filepath.Join("/sys/block", filepath.Base(dev), "size")); strings.TrimSpace(string(b)) != "0" {
		t.Fatalf("%s still has size %q after its engine was deleted", dev, b)
	}
}

// TestNBDKernelProcessDeleteDetaches: an engine deleted through its
// instance manager (ProcessDelete: the volume is detached from the node,
// after the CSI node service unmounted it) disconnects its /dev/nbdN: it
// leaves nothing attached for a successor.
func TestNBDKernelProcessDeleteDetaches(t *testing.T) {
	req := nbdEngineOnIM(t)
	im := startShortIM(t)
	dev := createNBDEngine(t, im, req).GetEndpoint().GetPath()
	f, err := os.OpenFile(dev, os.O_RDWR|unix.O_DIRECT, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt(nbdRecord(0), 0); err != nil {
		t.Fatal(err)
	}
	if err := unix.Fdatasync(int(f.Fd())); err != nil {
		t.Fatal(err)
	}
	f.Close() // the CSI node service unmounts before the volume is detached
	deleteEngineDetaches(t, im, req.Name, dev)
}

// TestNBDKernelHandOverInUML runs TestNBDKernelInstanceManagerRestart and
// TestNBDKernelProcessDeleteDetaches inside User-Mode Linux with the nbd
// module: the kernel's real nbd driver, on hosts whose kernel has none.
func TestNBDKernelHandOverInUML(t *testing.T) {
	if uml.Inside() {
		t.Skip("already inside UML")
	}
	uml.Run(t, uml.Options{Tests: []string{"TestNBDKernelInstanceManagerRestart", "TestNBDKernelProcessDeleteDetaches"},
		Modules: []string{"nbd"}, Timeout: deadline.Scale(10 * time.Minute)})
}
