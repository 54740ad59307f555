package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

func needRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: FUSE mount, loop devices, mkfs and mount (CI runs as root)")
	}
}

func sh(t *testing.T, name string, args ...string) string {
	t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return string(out)
}

func mounted(path string) bool {
	b, _ := os.ReadFile("/proc/self/mountinfo")
	return strings.Contains(string(b), " "+path+" ")
}

func loopAttached(dev string) bool {
	out, _ := exec.Command("losetup", "--list", "--noheadings", "--output", "NAME").Output()
	for _, l := range strings.Fields(string(out)) {
		if l == dev {
			return true
		}
	}
	return false
}

// startFilesystemVolume starts three 256 MiB replicas and an engine with
// the given frontend arguments; args start the same engine again.
func startFilesystemVolume(t *testing.T, dir string, frontend ...string) (eng *proc, reps []*proc, args []string) {
	t.Helper()
	args = append([]string{"engine", "--name", "vol"}, frontend...)
	args = append(args, "--replica-timeout", "3s", "--listen", "127.0.0.1:0")
	for i := range 3 {
		p := start(t, "replica", "--dir", filepath.Join(dir, fmt.Sprint("r", i)), "--size", "256Mi",
			"--listen", "127.0.0.1:0", "--control-listen", "127.0.0.1:0")
		reps = append(reps, p)
		args = append(args, "--replica", p.data+","+p.control)
	}
	return start(t, args...), reps, args
}

// writeFiles writes files f<from>..f<to-1> of 160 KB each into mnt and
// syncs the filesystem.
func writeFiles(mnt string, from, to int) error {
	for i := from; i < to; i++ {
		data := []byte(strings.Repeat(fmt.Sprintf("file %d ", i), 20000))
		if err := os.WriteFile(filepath.Join(mnt, fmt.Sprintf("f%03d", i)), data, 0o644); err != nil {
			return err
		}
	}
	if out, err := exec.Command("sync", "-f", mnt).CombinedOutput(); err != nil {
		return fmt.Errorf("sync: %v: %s", err, out)
	}
	return nil
}

// checkFiles reads back what writeFiles wrote.
func checkFiles(t *testing.T, mnt string, from, to int) {
	t.Helper()
	for i := from; i < to; i++ {
		b, err := os.ReadFile(filepath.Join(mnt, fmt.Sprintf("f%03d", i)))
		if err != nil || !strings.HasPrefix(string(b), fmt.Sprintf("file %d ", i)) || len(b) != len(fmt.Sprintf("file %d ", i))*20000 {
			t.Fatalf("file %d: %v (%d bytes)", i, err, len(b))
		}
	}
}

// filesystemThroughFailure puts ext4 on the engine's block device dev,
// mounts it and writes files; SIGKILLs a replica while more files are
// written; reads every file back, checks the replica is ERR, unmounts and
// requires e2fsck to find the filesystem clean.
func filesystemThroughFailure(t *testing.T, dir, dev string, eng *proc, reps []*proc) {
	t.Helper()
	mnt := filepath.Join(dir, "mnt")
	t.Cleanup(func() { exec.Command("umount", "-l", mnt).Run() })
	sh(t, "mkfs.ext4", "-q", "-F", dev)
	os.MkdirAll(mnt, 0o755)
	sh(t, "mount", dev, mnt)
	write := func(from, to int) {
		if err := writeFiles(mnt, from, to); err != nil {
			t.Fatal(err)
		}
	}
	write(0, 20)
	t.Logf("20 files written and synced through %s", dev)
	reps[2].cmd.Process.Kill() // a replica dies under the filesystem
	reps[2].waitExit(t)
	write(20, 40)
	checkFiles(t, mnt, 0, 40)
	v := &volume{engine: eng}
	if r := v.ctl(t, "replicas"); strings.Count(r, "ERR") != 1 {
		t.Fatalf("the killed replica is not ERR:\n%s", r)
	}
	sh(t, "umount", mnt)
	t.Log(sh(t, "e2fsck", "-fn", dev))
}

// TestFUSEFrontendFilesystem: the engine with the FUSE frontend gives a
// loop device that takes mkfs.ext4, a mount and files; a replica is
// SIGKILLed while files are written; after unmount e2fsck finds the
// filesystem clean; SIGTERM leaves no mount and no loop device behind.
func TestFUSEFrontendFilesystem(t *testing.T) {
	needRoot(t)
	needTool(t, "mkfs.ext4")
	dir := t.TempDir()
	fuseDir := filepath.Join(dir, "fuse")
	eng, reps, _ := startFilesystemVolume(t, dir, "--frontend", "fuse", "--fuse-dir", fuseDir)
	dev := eng.endpoint
	if !strings.HasPrefix(dev, "/dev/loop") {
		t.Fatalf("endpoint %q is not a loop device", dev)
	}
	// The loop device is backed by the volume file in the FUSE mount.
	if out := sh(t, "losetup", "--list", "--noheadings", "--output", "BACK-FILE", dev); strings.TrimSpace(out) != filepath.Join(fuseDir, "vol") {
		t.Fatalf("%s is backed by %q", dev, out)
	}
	filesystemThroughFailure(t, dir, dev, eng, reps)

	eng.cmd.Process.Signal(syscall.SIGTERM)
	if code := eng.waitExit(t); code != 0 {
		t.Fatalf("engine exit %d\n%s", code, eng.stderr.String())
	}
	if mounted(fuseDir) {
		t.Fatal("the FUSE mount was left behind")
	}
	if loopAttached(dev) {
		t.Fatalf("%s is still attached", dev)
	}
}
