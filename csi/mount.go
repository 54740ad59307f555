package csi

import (
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"unsafe"

	"golang.org/x/sys/unix"
	mountutils "k8s.io/mount-utils"
	utilexec "k8s.io/utils/exec"
)

// Mounter is everything the node service does to the node's devices and
// filesystems: the system's mount, mkfs, resize2fs and xfs_growfs in
// production and in the root-only tests, which mount for real; an
// in-memory double in the tests that run without root.
type Mounter interface {
	// FormatAndMount mounts device at target as fsType, first creating the
	// filesystem if, and only if, the device holds none (blkid finds no
	// signature). A device with another filesystem is never reformatted:
	// the mount fails.
	FormatAndMount(device, target, fsType string, options []string) error
	// Mount mounts source at target; options "bind" for a bind mount.
	Mount(source, target, fsType string, options []string) error
	// Unmount unmounts target.
	Unmount(target string) error
	// IsMountPoint reports whether something is mounted at path; a
	// missing path is not a mount point.
	IsMountPoint(path string) (bool, error)
	// DeviceOf returns the device mounted at path.
	DeviceOf(path string) (string, error)
	// DeviceSize returns the size in bytes of the block device at path (a
	// device node, or a file a device is bind-mounted on); an error
	// wrapping ErrNotBlockDevice when path is none.
	DeviceSize(path string) (int64, error)
	// Flush writes the device's cached pages to it and has it flush them
	// to stable storage (fsync of the block device). A missing device has
	// nothing to flush.
	Flush(device string) error
	// Filesystem reads what filesystem device holds and how much of the
	// device it spans, mounted or not; Type is "" on a blank device.
	Filesystem(device string) (Filesystem, error)
	// Grow grows the filesystem on device to fill the device. mountPath
	// is where it is mounted, "" when it is not: an ext4 grows in either
	// state, an xfs only mounted. Growing a mounted ext4 fails with
	// ErrNeedCapSysResource where the process lacks that capability.
	Grow(device, mountPath string, fs Filesystem) error
	// FilesystemMounts lists where device is mounted as a filesystem
	// (the staging path and the bind mounts of its directories); none
	// for a device only bind-mounted on a file (a raw block volume).
	FilesystemMounts(device string) ([]string, error)
	// Trim discards the free blocks of the filesystem mounted at path
	// (the FITRIM ioctl, what fstrim runs) and returns how many bytes the
	// filesystem reports discarding. A device that cannot discard fails
	// with an error wrapping ErrDiscardNotSupported.
	Trim(path string) (int64, error)
}

// Filesystem is what a device holds.
type Filesystem struct {
	// Type is blkid's name for it (ext4, xfs, ...), "" for none.
	Type string
	// Size is the bytes the filesystem spans (its block count times its
	// block size).
	Size int64
	// GrowsTo is the bytes it would span grown to fill its device, as its
	// grow tool sizes it (a last block group or allocation group too
	// small to hold its own metadata is left out, as mkfs leaves it out):
	// more than Size once the device has grown; Size for a type the
	// driver does not create.
	GrowsTo int64
}

// CanGrow reports whether growing the filesystem would make it larger.
func (fs Filesystem) CanGrow() bool { return fs.GrowsTo > fs.Size }

var (
	// ErrNotBlockDevice is returned by DeviceSize for a path that is not a
	// block device.
	ErrNotBlockDevice = errors.New("not a block device")
	// ErrNeedCapSysResource is returned by Grow for a mounted ext4 that
	// did not grow where the node plugin lacks CAP_SYS_RESOURCE, without
	// which the kernel refuses to grow a mounted ext4 (resize2fs:
	// Permission denied).
	ErrNeedCapSysResource = errors.New("growing a mounted ext4 needs CAP_SYS_RESOURCE, which the node plugin lacks")
	// ErrCannotGrow is returned by Grow for a filesystem it cannot grow in
	// the state asked: an unmounted xfs, or a type the driver does not
	// create.
	ErrCannotGrow = errors.New("cannot grow this filesystem")
	// ErrDiscardNotSupported is returned by Trim for a filesystem whose
	// device does not support discard.
	ErrDiscardNotSupported = errors.New("the device does not support discard")
)

// SystemMounter runs the node's own mount tools (through k8s.io/mount-utils).
type SystemMounter struct {
	m *mountutils.SafeFormatAndMount
}

// NewSystemMounter returns a Mounter over the node's tools.
func NewSystemMounter() *SystemMounter {
	return &SystemMounter{m: mountutils.NewSafeFormatAndMount(mountutils.New(""), utilexec.New())}
}

// FormatAndMount implements Mounter.
func (s *SystemMounter) FormatAndMount(device, target, fsType string, options []string) error {
	return s.m.FormatAndMount(device, target, fsType, options)
}

// Mount implements Mounter.
func (s *SystemMounter) Mount(source, target, fsType string, options []string) error {
	return s.m.Mount(source, target, fsType, options)
}

// Unmount implements Mounter.
func (s *SystemMounter) Unmount(target string) error { return s.m.Unmount(target) }

// IsMountPoint implements Mounter.
func (s *SystemMounter) IsMountPoint(path string) (bool, error) {
	ok, err := s.m.IsMountPoint(path)
	if errors.Is(err, os.ErrNotExist) {
		return false, nil
	}
	return ok, err
}

// DeviceOf implements Mounter.
func (s *SystemMounter) DeviceOf(path string) (string, error) {
	dev, refs, err := mountutils.GetDeviceNameFromMount(s.m, path)
	if err != nil {
		return "", err
	}
	if refs == 0 || dev == "" {
		return "", fmt.Errorf("nothing is mounted at %s", path)
	}
	return dev, nil
}

// DeviceSize implements Mounter.
func (s *SystemMounter) DeviceSize(path string) (int64, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return 0, err
	}
	if fi.Mode()&os.ModeDevice == 0 || fi.Mode()&os.ModeCharDevice != 0 {
		return 0, fmt.Errorf("%s: %w", path, ErrNotBlockDevice)
	}
	f, err := os.Open(path)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	return f.Seek(0, io.SeekEnd)
}

// Flush implements Mounter.
func (s *SystemMounter) Flush(device string) error {
	f, err := os.OpenFile(device, os.O_RDWR, 0)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	defer f.Close()
	return f.Sync()
}

// Filesystem implements Mounter: blkid names the filesystem, its
// superblock gives its geometry.
func (s *SystemMounter) Filesystem(device string) (Filesystem, error) {
	typ, err := s.m.GetDiskFormat(device)
	if err != nil || typ == "" {
		return Filesystem{}, err
	}
	f, err := os.Open(device)
	if err != nil {
		return Filesystem{}, err
	}
	defer f.Close()
	size, err := f.Seek(0, io.SeekEnd)
	if err != nil {
		return Filesystem{}, err
	}
	fs, err := readFilesystem(f, typ, size)
	if err != nil {
		return Filesystem{}, fmt.Errorf("read the %s superblock of %s: %w", typ, device, err)
	}
	return fs, nil
}

// Grow implements Mounter. A mounted ext4 is grown by the kernel, which
// wants CAP_SYS_RESOURCE for it; resize2fs is run regardless (it changes
// nothing and succeeds when there is no room to grow into), and its
// failure is put down to the capability where the process lacks it.
func (s *SystemMounter) Grow(device, mountPath string, fs Filesystem) error {
	switch {
	case isExt(fs.Type) && mountPath == "":
		return growExtUnmounted(device)
	case isExt(fs.Type):
		err := run("resize2fs", device)
		if err != nil && !hasCapSysResource() {
			return fmt.Errorf("%w (%w)", ErrNeedCapSysResource, err)
		}
		return err
	case fs.Type == fsXFS && mountPath != "":
		return run("xfs_growfs", "-d", mountPath)
	}
	state := "mounted"
	if mountPath == "" {
		state = "unmounted"
	}
	return fmt.Errorf("%w: %s %s", ErrCannotGrow, state, orUnknown(fs.Type))
}

// growExtUnmounted checks an unmounted ext filesystem (resize2fs refuses
// to grow one not checked since it was last mounted; the check also
// replays the journal of one that was not unmounted cleanly, as a
// snapshot of a mounted volume is) and grows it. Neither needs a
// capability beyond writing the device.
func growExtUnmounted(device string) error {
	out, err := exec.Command("e2fsck", "-f", "-p", device).CombinedOutput()
	var exit *exec.ExitError
	// Exit status 1 and 2: errors were found and corrected.
	if errors.As(err, &exit) && exit.ExitCode() <= 2 {
		err = nil
	}
	if err != nil {
		return fmt.Errorf("e2fsck -f -p %s: %w: %s", device, err, out)
	}
	return run("resize2fs", device)
}

func run(name string, args ...string) error {
	if out, err := exec.Command(name, args...).CombinedOutput(); err != nil {
		return fmt.Errorf("%s %v: %w: %s", name, args, err, out)
	}
	return nil
}

func isExt(fsType string) bool {
	return fsType == "ext2" || fsType == "ext3" || fsType == fsExt4
}

// hasCapSysResource reports whether this process has CAP_SYS_RESOURCE in
// its effective set (CapEff in /proc/self/status), which resize2fs needs
// to grow a mounted ext4.
func hasCapSysResource() bool {
	const c = unix.CAP_SYS_RESOURCE
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return false
	}
	return data[c/32].Effective&(1<<(uint(c)%32)) != 0
}

// FilesystemMounts implements Mounter: the mount table's entries whose
// source is device, by its path or by the path a symbolic link to it
// resolves to.
func (s *SystemMounter) FilesystemMounts(device string) ([]string, error) {
	mps, err := s.m.List()
	if err != nil {
		return nil, err
	}
	want := device
	if p, err := filepath.EvalSymlinks(device); err == nil {
		want = p
	}
	var out []string
	for _, mp := range mps {
		if mp.Device == device || mp.Device == want {
			out = append(out, mp.Path)
		}
	}
	return out, nil
}

// fitrim is the FITRIM ioctl, _IOWR('X', 121, struct fstrim_range) in
// linux/fs.h (golang.org/x/sys/unix does not define it). Its encoding is
// the same on every architecture Linux runs Go on: read and write make
// 0xC0000000 under both the 2-bit and the 3-bit direction layouts.
const fitrim = 0xC0000000 | 24<<16 | 'X'<<8 | 121

// fstrimRange is linux/fs.h's struct fstrim_range: the byte range to
// trim and the smallest free extent worth discarding; on return Len is
// the bytes discarded.
type fstrimRange struct {
	Start, Len, MinLen uint64
}

// Trim implements Mounter with the FITRIM ioctl on the mount's root
// directory, over the whole filesystem, as fstrim does.
func (s *SystemMounter) Trim(path string) (int64, error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	r := fstrimRange{Len: math.MaxUint64}
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), fitrim, uintptr(unsafe.Pointer(&r))); e != 0 {
		if e == unix.EOPNOTSUPP {
			return 0, fmt.Errorf("FITRIM on %s: %w (%w)", path, ErrDiscardNotSupported, e)
		}
		return 0, fmt.Errorf("FITRIM on %s: %w", path, e)
	}
	return int64(min(r.Len, math.MaxInt64)), nil
}
