package csi

import (
	"errors"
	"fmt"
	"os"

	mountutils "k8s.io/mount-utils"
	utilexec "k8s.io/utils/exec"
)

// Mounter is what the node service does to the node's filesystems: the
// system's mount, mkfs, blkid, resize2fs and xfs_growfs in production and
// in the root-only tests, which mount for real.
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
	// IsMountPoint reports whether something is mounted at path.
	IsMountPoint(path string) (bool, error)
	// DeviceOf returns the device mounted at path.
	DeviceOf(path string) (string, error)
	// Resize grows the filesystem of device, mounted at path, to fill it.
	Resize(device, path string) error
}

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

// IsMountPoint implements Mounter; a missing path is not one.
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

// Resize implements Mounter: resize2fs for ext4, xfs_growfs for xfs.
func (s *SystemMounter) Resize(device, path string) error {
	_, err := mountutils.NewResizeFs(s.m.Exec).Resize(device, path)
	return err
}
