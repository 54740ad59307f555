package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	replicav1 "github.com/cairn-io/cairn/dataplane/api/replica/v1"
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
	reps, args = filesystemEngineArgs(t, dir, "256Mi", frontend...)
	return start(t, args...), reps, args
}

// filesystemEngineArgs starts three replicas of size in dir and returns
// them with the command line of an engine for them with the given
// frontend arguments and the control API.
func filesystemEngineArgs(t *testing.T, dir, size string, frontend ...string) (reps []*proc, args []string) {
	t.Helper()
	args = append([]string{"engine", "--name", "vol"}, frontend...)
	// A replica these tests kill (SIGKILL) closes its connections, which
	// the engine notices at once; the timeout only keeps a live replica
	// from being failed on a loaded machine, in UML (every system call
	// slow) above all, where 3 s failed healthy replicas.
	args = append(args, "--replica-timeout", "30s", "--listen", "127.0.0.1:0")
	for i := range 3 {
		p := start(t, "replica", "--dir", filepath.Join(dir, fmt.Sprint("r", i)), "--size", size,
			"--listen", "127.0.0.1:0", "--control-listen", "127.0.0.1:0")
		reps = append(reps, p)
		args = append(args, "--replica", p.data+","+p.control)
	}
	return reps, args
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
		return fmt.Errorf("sync: %w: %s", err, out)
	}
	return nil
}

// checkFiles reads back the first n files writeFiles wrote.
func checkFiles(t *testing.T, mnt string, n int) {
	t.Helper()
	for i := range n {
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
	t.Cleanup(func() { _ = exec.Command("umount", "-l", mnt).Run() })
	sh(t, "mkfs.ext4", "-q", "-F", dev)
	if err := os.MkdirAll(mnt, 0o755); err != nil {
		t.Fatal(err)
	}
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
	checkFiles(t, mnt, 40)
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

	eng.stopClean(t, "engine")
	if mounted(fuseDir) {
		t.Fatal("the FUSE mount was left behind")
	}
	if loopAttached(dev) {
		t.Fatalf("%s is still attached", dev)
	}
}

// deviceBytes is the size of a block device as the kernel shows it.
func deviceBytes(t *testing.T, dev string) int64 {
	t.Helper()
	n, err := strconv.ParseInt(strings.TrimSpace(sh(t, "blockdev", "--getsize64", dev)), 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// filesystemBytes is the size of the filesystem mounted at mnt.
func filesystemBytes(t *testing.T, mnt string) int64 {
	t.Helper()
	var st syscall.Statfs_t
	if err := syscall.Statfs(mnt, &st); err != nil {
		t.Fatal(err)
	}
	return int64(st.Blocks) * st.Bsize
}

// bigFile is n MiB, each 4 KiB block stamped with its number.
func bigFile(n int) []byte {
	b := make([]byte, n<<20)
	for off := 0; off < len(b); off += 4096 {
		copy(b[off:off+4096], fmt.Sprintf("block %08d", off/4096))
	}
	return b
}

// expandUnderFilesystem takes an engine whose volume is 8 MiB with its
// block device dev: it puts ext4 on dev, mounts it and writes files;
// expands the volume to 24 MiB through the engine's control API and
// requires dev to show 24 MiB when that returns; grows the filesystem
// with resize2fs, mounted (online) or, where the process may not (see
// canResizeOnline), unmounted; writes a 10 MiB file, more than the whole
// old device held; unmounts, requires e2fsck to find the filesystem
// clean, mounts it again and reads every file back. (Small: it also runs
// in User-Mode Linux, where every system call and page fault is slow.)
func expandUnderFilesystem(t *testing.T, dir, dev string, eng *proc) {
	t.Helper()
	needTool(t, "resize2fs")
	mnt := filepath.Join(dir, "mnt")
	t.Cleanup(func() { _ = exec.Command("umount", "-l", mnt).Run() })
	if got := deviceBytes(t, dev); got != 8<<20 {
		t.Fatalf("%s has %d bytes, want 8 MiB", dev, got)
	}
	sh(t, "mkfs.ext4", "-q", "-F", dev)
	if err := os.MkdirAll(mnt, 0o755); err != nil {
		t.Fatal(err)
	}
	sh(t, "mount", dev, mnt)
	if err := writeFiles(mnt, 0, 5); err != nil {
		t.Fatal(err)
	}
	before := filesystemBytes(t, mnt)

	v := &volume{engine: eng}
	v.ctl(t, "expand", "24Mi")
	if got := deviceBytes(t, dev); got != 24<<20 {
		t.Fatalf("after the engine's Expand to 24 MiB, %s has %d bytes\n%s", dev, got, eng.stderr.String())
	}
	if info := v.ctl(t, "info"); !strings.Contains(info, "24.0 MiB") {
		t.Fatalf("info after the expansion: %s", info)
	}
	if why := canResizeOnline(t); why != "" {
		t.Logf("growing the filesystem unmounted: %s", why)
		sh(t, "umount", mnt)
		sh(t, "e2fsck", "-fy", dev) // resize2fs wants a check newer than the last mount; any repair fails the test (exit 1)
		t.Log(sh(t, "resize2fs", dev))
		sh(t, "mount", dev, mnt)
	} else {
		t.Log(sh(t, "resize2fs", dev))
	}
	if after := filesystemBytes(t, mnt); after < before*18/10 {
		t.Fatalf("the mounted filesystem has %d bytes after resize2fs, %d before: it did not grow to the new device", after, before)
	}
	big := bigFile(10)
	if err := os.WriteFile(filepath.Join(mnt, "big"), big, 0o644); err != nil {
		t.Fatalf("writing 10 MiB into the grown filesystem: %v", err)
	}
	if err := writeFiles(mnt, 5, 10); err != nil {
		t.Fatal(err)
	}
	sh(t, "umount", mnt)
	t.Log(sh(t, "e2fsck", "-fn", dev))
	sh(t, "mount", dev, mnt)
	checkFiles(t, mnt, 10)
	if got, err := os.ReadFile(filepath.Join(mnt, "big")); err != nil || !bytes.Equal(got, big) {
		t.Fatalf("the 10 MiB file read back differs (%d bytes, %v)", len(got), err)
	}
	sh(t, "umount", mnt)
}

// canResizeOnline says why resize2fs cannot grow a mounted ext4 here (""
// when it can): the kernel wants CAP_SYS_RESOURCE for that, which
// containers often drop. TestNBDKernelExpand, run inside User-Mode Linux
// (whose init has every capability), always grows it online.
func canResizeOnline(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "CapEff:"); ok {
			caps, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
			if err != nil {
				t.Fatal(err)
			}
			if caps&(1<<unix.CAP_SYS_RESOURCE) == 0 {
				return "this process lacks CAP_SYS_RESOURCE, which the kernel requires to grow a mounted ext4"
			}
			return ""
		}
	}
	t.Fatal("no CapEff in /proc/self/status")
	return ""
}

// TestFUSEFrontendExpand: the engine's Expand reaches the FUSE frontend's
// loop device (the file in the mount grows, then the loop device), and
// ext4 on it grows to the new size with its data intact
// (expandUnderFilesystem).
func TestFUSEFrontendExpand(t *testing.T) {
	needRoot(t)
	needTool(t, "mkfs.ext4")
	dir := t.TempDir()
	fuseDir := filepath.Join(dir, "fuse")
	_, args := filesystemEngineArgs(t, dir, "8Mi", "--frontend", "fuse", "--fuse-dir", fuseDir)
	// If the test fails, the engine is killed: leave no dead FUSE mount
	// (this runs after the kill).
	t.Cleanup(func() { _ = exec.Command("umount", "-l", fuseDir).Run() })
	eng := start(t, args...)
	expandUnderFilesystem(t, dir, eng.endpoint, eng)
	if fi, err := os.Stat(filepath.Join(fuseDir, "vol")); err != nil || fi.Size() != 24<<20 {
		t.Fatalf("the volume file in the FUSE mount: %v, %v", fi, err)
	}
	eng.stopClean(t, "engine")
}

// TestFUSEWritesThroughSharedMemory: with the FUSE frontend, writes to the
// loop device reach a replica on this node's unix socket as offsets into
// the memory the engine shares with it (the engine's metrics count them),
// a replica over TCP gets the bytes, and both hold what was written: each
// replica, read on its own afterwards, returns it.
func TestFUSEWritesThroughSharedMemory(t *testing.T) {
	needRoot(t)
	dir := t.TempDir()
	fuseDir := filepath.Join(dir, "fuse")
	t.Cleanup(func() { _ = exec.Command("umount", "-l", fuseDir).Run() })
	local := start(t, "replica", "--dir", filepath.Join(dir, "r0"), "--size", "16Mi",
		"--listen", "127.0.0.1:0", "--listen-local", "unix:"+filepath.Join(dir, "r0.sock"), "--control-listen", "127.0.0.1:0")
	remote := start(t, "replica", "--dir", filepath.Join(dir, "r1"), "--size", "16Mi",
		"--listen", "127.0.0.1:0", "--control-listen", "127.0.0.1:0")
	eng := start(t, "engine", "--name", "vol", "--frontend", "fuse", "--fuse-dir", fuseDir, "--listen", "127.0.0.1:0",
		"--replica", local.local+","+local.control, "--replica", remote.data+","+remote.control)
	if !strings.HasPrefix(eng.endpoint, "/dev/loop") {
		t.Fatalf("endpoint %q is not a loop device", eng.endpoint)
	}

	// 4 KiB, 64 KiB and 1 MiB writes with O_DIRECT, as a filesystem's
	// come: the loop device passes each to the file in the FUSE mount.
	want := bigFile(2)
	writes := []struct{ off, n int }{{0, 4096}, {64 << 10, 64 << 10}, {1 << 20, 1 << 20}}
	fd, err := unix.Open(eng.endpoint, unix.O_RDWR|unix.O_DIRECT, 0)
	if err != nil {
		t.Fatal(err)
	}
	buf, err := unix.Mmap(-1, 0, 2<<20, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE) // page-aligned, as O_DIRECT needs
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = unix.Munmap(buf) }()
	for _, w := range writes {
		copy(buf, want[w.off:w.off+w.n])
		if _, err := unix.Pwrite(fd, buf[:w.n], int64(w.off)); err != nil {
			t.Fatalf("write %d bytes at %d: %v", w.n, w.off, err)
		}
	}
	if err := unix.Close(fd); err != nil {
		t.Fatal(err)
	}

	v := &volume{engine: eng}
	m := v.ctl(t, "metrics")
	shared := func(addr string) (writes, viaShared int) {
		for _, l := range strings.Split(m, "\n") {
			if strings.HasPrefix(l, "replica "+addr+",") { // the address, then the control address
				if _, err := fmt.Sscanf(l[strings.Index(l, "write ops="):], "write ops=%d (shared memory %d)", &writes, &viaShared); err != nil {
					t.Fatalf("metrics line %q: %v", l, err)
				}
				return writes, viaShared
			}
		}
		t.Fatalf("no metrics for replica %s:\n%s", addr, m)
		return 0, 0
	}
	if n, s := shared(local.local); n < len(writes) || s != n {
		t.Fatalf("the local replica got %d writes, %d of them through shared memory; want at least %d, all shared:\n%s", n, s, len(writes), m)
	}
	if n, s := shared(remote.data); n < len(writes) || s != 0 {
		t.Fatalf("the TCP replica got %d writes, %d of them through shared memory; want at least %d, none shared:\n%s", n, s, len(writes), m)
	}
	eng.stopClean(t, "engine")

	for _, r := range []*proc{local, remote} {
		info, err := dialControl(t, r.control).Info(context.Background(), &replicav1.InfoRequest{})
		if err != nil {
			t.Fatal(err)
		}
		c := dialData(t, r.data, info.GetEpoch())
		got := make([]byte, len(want))
		if err := c.ReadAt(context.Background(), got, 0); err != nil {
			t.Fatalf("reading replica %s: %v", r.data, err)
		}
		for _, w := range writes {
			if !bytes.Equal(got[w.off:w.off+w.n], want[w.off:w.off+w.n]) {
				t.Fatalf("replica %s does not hold the %d bytes written at %d", r.data, w.n, w.off)
			}
		}
	}
}
