package main

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/cairn-io/cairn/dataplane/internal/uml"
)

// TestNBDKernelFilesystem: the engine with --nbd-kernel on attaches
// /dev/nbdN through the kernel's nbd driver and reports it as its
// endpoint; ext4 on it survives a replica killed while files are written
// (e2fsck clean); a revert is refused while the kernel holds the device;
// SIGTERM detaches it. It needs the nbd driver:
// TestNBDKernelFilesystemInUML runs it inside User-Mode Linux with one.
func TestNBDKernelFilesystem(t *testing.T) {
	needRoot(t)
	needTool(t, "mkfs.ext4")
	if _, err := os.Stat("/sys/module/nbd"); err != nil {
		t.Skip("no nbd driver in this kernel: TestNBDKernelFilesystemInUML runs this test inside User-Mode Linux")
	}
	dir := t.TempDir()
	eng, reps := startFilesystemVolume(t, dir, "--frontend", "nbd", "--nbd-socket", filepath.Join(dir, "vol.sock"), "--nbd-kernel", "on")
	dev := eng.endpoint
	if !strings.HasPrefix(dev, "/dev/nbd") {
		t.Fatalf("endpoint %q is not an nbd device", dev)
	}
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

	eng.cmd.Process.Signal(syscall.SIGTERM)
	if code := eng.waitExit(t); code != 0 {
		t.Fatalf("engine exit %d\n%s", code, eng.stderr.String())
	}
	// A connected nbd device has a pid file naming its owner and a size.
	if _, err := os.Stat(filepath.Join(sys, "pid")); err == nil {
		t.Fatalf("%s is still connected after the engine's SIGTERM", dev)
	}
	if b, _ := os.ReadFile(filepath.Join(sys, "size")); strings.TrimSpace(string(b)) != "0" {
		t.Fatalf("%s still has size %q after the engine's SIGTERM", dev, b)
	}
}

// TestNBDKernelFilesystemInUML runs TestNBDKernelFilesystem inside
// User-Mode Linux with the nbd module loaded: the real kernel driver under
// a real filesystem, on hosts whose kernel has no nbd driver (CI's).
func TestNBDKernelFilesystemInUML(t *testing.T) {
	if uml.Inside() {
		t.Skip("already inside UML")
	}
	uml.Run(t, uml.Options{Tests: "^TestNBDKernelFilesystem$", Want: []string{"TestNBDKernelFilesystem"}, Modules: []string{"nbd"}})
}
