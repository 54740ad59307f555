package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cairn-io/cairn/dataplane/internal/ready"
	"github.com/cairn-io/cairn/dataplane/internal/uml"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// startNBDKernelVolume skips without root, mkfs.ext4 or the nbd driver
// (TestNBDKernelFilesystemInUML runs the tests that use it inside
// User-Mode Linux, which has one), then starts three replicas and an
// engine with --nbd-kernel kernel, and checks its endpoint is /dev/nbdN.
// args start the same engine again.
func startNBDKernelVolume(t *testing.T, kernel string) (dir string, eng *proc, reps []*proc, args []string) {
	t.Helper()
	needRoot(t)
	needTool(t, "mkfs.ext4")
	if _, err := os.Stat("/sys/module/nbd"); err != nil {
		t.Skip("no nbd driver in this kernel: TestNBDKernelFilesystemInUML runs this test inside User-Mode Linux")
	}
	dir = t.TempDir()
	eng, reps, args = startFilesystemVolume(t, dir, "--frontend", "nbd", "--nbd-socket", filepath.Join(dir, "vol.sock"), "--nbd-kernel", kernel)
	if !strings.HasPrefix(eng.endpoint, "/dev/nbd") {
		t.Fatalf("endpoint %q is not an nbd device", eng.endpoint)
	}
	return dir, eng, reps, args
}

// TestNBDKernelFilesystem: the engine with --nbd-kernel on attaches
// /dev/nbdN through the kernel's nbd driver and reports it as its
// endpoint; ext4 on it survives a replica killed while files are written
// (e2fsck clean); a revert is refused while the kernel holds the device;
// SIGTERM detaches it. It needs the nbd driver:
// TestNBDKernelFilesystemInUML runs it inside User-Mode Linux with one.
func TestNBDKernelFilesystem(t *testing.T) {
	dir, eng, reps, _ := startNBDKernelVolume(t, "on")
	dev := eng.endpoint
	sys := filepath.Join("/sys/block", filepath.Base(dev))
	if b, err := os.ReadFile(filepath.Join(sys, "size")); err != nil || strings.TrimSpace(string(b)) != "524288" {
		t.Fatalf("%s size %q (%v), want 524288 sectors (256 MiB)", dev, b, err)
	}
	if b, err := os.ReadFile(filepath.Join(sys, "backend")); err == nil && strings.TrimSpace(string(b)) != "vol" {
		t.Fatalf("%s backend %q, want the volume name", dev, b)
	}
	v := &volume{engine: eng}
	if info := v.ctl(t, "info"); !strings.Contains(info, dev) {
		t.Fatalf("info does not report %s:\n%s", dev, info)
	}
	filesystemThroughFailure(t, dir, dev, eng, reps)
	// The kernel holds the volume while attached: a revert would change
	// the data under its page cache, so the engine refuses it.
	v.ctl(t, "snapshot", "create", "after-fsck")
	out, err := command("ctl", "--engine", eng.control, "snapshot", "revert", "after-fsck").CombinedOutput()
	if err == nil || !strings.Contains(string(out), "attached as "+dev) || !strings.Contains(string(out), "FailedPrecondition") {
		t.Fatalf("revert while attached as %s: %v\n%s", dev, err, out)
	}

	eng.stopClean(t, "engine")
	// A connected nbd device has a pid file naming its owner and a size.
	if _, err := os.Stat(filepath.Join(sys, "pid")); err == nil {
		t.Fatalf("%s is still connected after the engine's SIGTERM", dev)
	}
	if b, _ := os.ReadFile(filepath.Join(sys, "size")); strings.TrimSpace(string(b)) != "0" {
		t.Fatalf("%s still has size %q after the engine's SIGTERM", dev, b)
	}
}

// TestNBDKernelEngineRestart: an engine SIGKILLed under a mounted
// filesystem leaves /dev/nbdN configured, and the kernel holds the I/O
// issued meanwhile; an engine started again for the volume reattaches the
// same device, the held writes complete, and the filesystem is whole
// (every file reads back, e2fsck clean). A second engine for the volume
// while one owns the device is refused.
func TestNBDKernelEngineRestart(t *testing.T) {
	dir, eng, _, args := startNBDKernelVolume(t, "auto")
	dev := eng.endpoint
	sys := filepath.Join("/sys/block", filepath.Base(dev))
	mnt := filepath.Join(dir, "mnt")
	detachOnCleanup(t, eng, mnt)
	sh(t, "mkfs.ext4", "-q", "-F", dev)
	if err := os.MkdirAll(mnt, 0o755); err != nil {
		t.Fatal(err)
	}
	sh(t, "mount", dev, mnt)
	if err := writeFiles(mnt, 0, 10); err != nil {
		t.Fatal(err)
	}

	// Another engine for the same volume (on another socket) must not take
	// the device, even with --nbd-kernel auto.
	dup := slices.Clone(args)
	dup[slices.Index(dup, "--nbd-socket")+1] = filepath.Join(dir, "dup.sock")
	if code, stderr := runExit(t, dup...); code == 0 || !strings.Contains(stderr, "another engine on this node owns its /dev/nbdN") {
		t.Fatalf("a second engine for the volume: exit %d\n%s", code, stderr)
	}
	// It failed before opening the replicas, which would have fenced the
	// running engine out: writes still go through.
	if err := writeFiles(mnt, 10, 12); err != nil {
		t.Fatalf("writing after a second engine was refused: %v\n%s", err, uml.KernelLog(25))
	}

	eng.cmd.Process.Kill()
	eng.waitExit(t)
	if _, err := os.Stat(filepath.Join(sys, "pid")); err != nil {
		t.Fatalf("%s was detached when its engine died: %v", dev, err)
	}
	// Files written now wait in the kernel for an engine.
	held := make(chan error, 1)
	go func() { held <- writeFiles(mnt, 12, 20) }()

	eng2 := start(t, args...)
	detachOnCleanup(t, eng2, mnt)
	if eng2.endpoint != dev {
		t.Fatalf("the restarted engine's endpoint is %q, want the device it left, %s", eng2.endpoint, dev)
	}
	if !eng2.logged("reattached " + dev) {
		t.Fatalf("the restarted engine did not say it reattached %s:\n%s", dev, eng2.stderr.String())
	}
	select {
	case err := <-held:
		if err != nil {
			t.Fatalf("writing while the engine restarted: %v\nengine:\n%s\nkernel:\n%s", err, eng2.stderr.String(), uml.KernelLog(25))
		}
	case <-time.After(deadline.Scale(90 * time.Second)):
		t.Fatalf("the writes held while the engine was gone did not complete after it came back\nkernel:\n%s", uml.KernelLog(25))
	}
	checkFiles(t, mnt, 20)
	sh(t, "umount", mnt)
	t.Log(sh(t, "e2fsck", "-fn", dev))

	eng2.stopClean(t, "engine")
	if _, err := os.Stat(filepath.Join(sys, "pid")); err == nil {
		t.Fatalf("%s is still connected after the engine's SIGTERM", dev)
	}
}

// detachOnCleanup makes a failed test leave no /dev/nbdN behind for the
// next: it unmounts mnt and stops eng with SIGTERM, on which the engine
// detaches its device (a SIGKILL, the default cleanup, leaves it attached
// for a successor to reattach). It runs before start's own cleanup.
func detachOnCleanup(t *testing.T, eng *proc, mnt string) {
	t.Cleanup(func() {
		_ = exec.Command("umount", "-l", mnt).Run()
		eng.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-eng.exited:
		case <-time.After(30 * time.Second):
		}
	})
}

// TestNBDKernelExpand: an engine with --nbd-kernel auto on a host with
// the nbd driver reports /dev/nbdN as a block-device endpoint on its
// --ready-fd, with no fallback; the engine's Expand reaches /dev/nbdN and
// ext4 on it grows online (expandUnderFilesystem; inside UML the test has
// the capability that takes). It needs the nbd driver:
// TestNBDKernelFilesystemInUML runs it inside User-Mode Linux.
func TestNBDKernelExpand(t *testing.T) {
	needRoot(t)
	needTool(t, "mkfs.ext4")
	if _, err := os.Stat("/sys/module/nbd"); err != nil {
		t.Skip("no nbd driver in this kernel: TestNBDKernelFilesystemInUML runs this test inside User-Mode Linux")
	}
	dir := t.TempDir()
	sock := filepath.Join(dir, "vol.sock")
	_, args := filesystemEngineArgs(t, dir, "8Mi", "--frontend", "nbd", "--nbd-socket", sock, "--nbd-kernel", "auto")
	eng, r := startReady(t, args...)
	if r.EndpointKind != ready.EndpointBlockDevice || !strings.HasPrefix(r.Endpoint, "/dev/nbd") || r.Endpoint != eng.endpoint ||
		r.Socket != sock || r.Fallback != "" || r.Control != eng.control || r.Size != 8<<20 {
		t.Fatalf("ready report %+v (ready line endpoint=%s control=%s)", r, eng.endpoint, eng.control)
	}
	expandUnderFilesystem(t, dir, r.Endpoint, eng)
	eng.stopClean(t, "engine")
}

// TestNBDKernelFilesystemInUML runs TestNBDKernelFilesystem,
// TestNBDKernelEngineRestart and TestNBDKernelExpand inside User-Mode
// Linux with the nbd module loaded: the real kernel driver under a real
// filesystem, on hosts whose kernel has no nbd driver (CI's).
func TestNBDKernelFilesystemInUML(t *testing.T) {
	if uml.Inside() {
		t.Skip("already inside UML")
	}
	uml.Run(t, uml.Options{Tests: []string{"TestNBDKernelFilesystem", "TestNBDKernelEngineRestart", "TestNBDKernelExpand"}, Modules: []string{"nbd"}})
}
