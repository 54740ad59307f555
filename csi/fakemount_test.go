package csi

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// fakeMounter is a Mounter that mounts nothing: it keeps its mount table
// and the filesystems it "made" in memory, so the node service runs
// without root. Its devices are real: a volume's endpoint is the NBD
// socket of its engine (the nbd frontend without the kernel module), whose
// size it asks the engine with the NBD handshake and which it flushes with
// an NBD FLUSH, or a real block device. It keeps the contract of the
// system's mounter where a caller could tell: a device with another
// filesystem is never reformatted, an xfs grows only mounted, a mounted
// ext4 does not grow without CAP_SYS_RESOURCE (noCapSysResource), and
// unmounting what is not mounted fails.
type fakeMounter struct {
	noCapSysResource bool

	mu     sync.Mutex
	mounts map[string]fakeMount
	fs     map[string]Filesystem // by device
}

type fakeMount struct {
	device string // the device the mount shows (for a bind mount, its source's)
	block  bool   // a block device bind-mounted on a file
	opts   []string
}

func newFakeMounter() *fakeMounter {
	return &fakeMounter{mounts: map[string]fakeMount{}, fs: map[string]Filesystem{}}
}

func (f *fakeMounter) FormatAndMount(device, target, fsType string, options []string) error {
	size, err := f.DeviceSize(device)
	if err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.checkTarget(target, true); err != nil {
		return err
	}
	have, ok := f.fs[device]
	if !ok {
		have = Filesystem{Type: fsType, Size: size}
		f.fs[device] = have
	}
	if have.Type != fsType {
		return fmt.Errorf("mount %s at %s: wrong fs type: %s holds %s", device, target, device, have.Type)
	}
	f.mounts[target] = fakeMount{device: device, opts: slices.Clone(options)}
	return nil
}

func (f *fakeMounter) Mount(source, target, _ string, options []string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if !slices.Contains(options, "bind") {
		return fmt.Errorf("the fake mounter bind-mounts only (options %v)", options)
	}
	fi, err := os.Stat(target)
	if err != nil {
		return err
	}
	if m, ok := f.mounts[source]; ok { // a staged filesystem
		if err := f.checkTarget(target, true); err != nil {
			return err
		}
		f.mounts[target] = fakeMount{device: m.device, opts: slices.Clone(options)}
		return nil
	}
	if fi.IsDir() {
		return fmt.Errorf("bind-mount device %s on directory %s: not a file", source, target)
	}
	f.mounts[target] = fakeMount{device: source, block: true, opts: slices.Clone(options)}
	return nil
}

// checkTarget fails where the kernel would: a missing target, or a
// directory target for a filesystem that is not a directory.
func (f *fakeMounter) checkTarget(target string, wantDir bool) error {
	fi, err := os.Stat(target)
	if err != nil {
		return err
	}
	if wantDir && !fi.IsDir() {
		return fmt.Errorf("mount a filesystem at %s: not a directory", target)
	}
	return nil
}

func (f *fakeMounter) Unmount(target string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.mounts[target]; !ok {
		return fmt.Errorf("umount %s: not mounted", target)
	}
	delete(f.mounts, target)
	return nil
}

func (f *fakeMounter) IsMountPoint(path string) (bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	_, ok := f.mounts[path]
	return ok, nil
}

func (f *fakeMounter) DeviceOf(path string) (string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	m, ok := f.mounts[path]
	if !ok {
		return "", fmt.Errorf("nothing is mounted at %s", path)
	}
	return m.device, nil
}

func (f *fakeMounter) DeviceSize(path string) (int64, error) {
	f.mu.Lock()
	m, ok := f.mounts[path]
	f.mu.Unlock()
	switch {
	case ok && m.block:
		path = m.device
	case ok:
		return 0, fmt.Errorf("%s: a filesystem is mounted there: %w", path, ErrNotBlockDevice)
	}
	fi, err := os.Stat(path)
	if err != nil {
		return 0, err
	}
	if fi.Mode()&os.ModeSocket != 0 {
		var size int64
		err := nbdDo(path, func(c *nbdConn) error { size = c.size; return nil })
		return size, err
	}
	return NewSystemMounter().DeviceSize(path)
}

func (f *fakeMounter) Flush(device string) error {
	fi, err := os.Stat(device)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	if fi.Mode()&os.ModeSocket != 0 {
		return nbdDo(device, (*nbdConn).flush)
	}
	return NewSystemMounter().Flush(device)
}

func (f *fakeMounter) Filesystem(device string) (Filesystem, error) {
	size, err := f.DeviceSize(device)
	if err != nil {
		return Filesystem{}, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	fs := f.fs[device]
	fs.GrowsTo = max(fs.Size, size)
	if fs.Type == "" {
		fs.GrowsTo = 0
	}
	return fs, nil
}

func (f *fakeMounter) FilesystemMounts(device string) ([]string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []string
	for p, m := range f.mounts {
		if m.device == device && !m.block {
			out = append(out, p)
		}
	}
	slices.Sort(out)
	return out, nil
}

// Trim discards nothing: the fake's filesystems hold no data.
func (f *fakeMounter) Trim(path string) (int64, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if m, ok := f.mounts[path]; !ok || m.block {
		return 0, fmt.Errorf("no filesystem is mounted at %s", path)
	}
	return 0, nil
}

func (f *fakeMounter) Grow(device, mountPath string, fs Filesystem) error {
	size, err := f.DeviceSize(device)
	if err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	have, ok := f.fs[device]
	if !ok {
		return fmt.Errorf("%w: %s holds no filesystem", ErrCannotGrow, device)
	}
	if mountPath != "" {
		if m, ok := f.mounts[mountPath]; !ok || m.device != device {
			return fmt.Errorf("%s is not mounted at %s", device, mountPath)
		}
	}
	switch {
	case isExt(have.Type) && mountPath != "" && f.noCapSysResource:
		return ErrNeedCapSysResource
	case have.Type == fsXFS && mountPath == "":
		return fmt.Errorf("%w: unmounted xfs", ErrCannotGrow)
	}
	have.Size = max(have.Size, size)
	f.fs[device] = have
	return nil
}

// nbdConn is a connection to an NBD server past the handshake.
type nbdConn struct {
	net.Conn
	size int64
}

// nbdDo connects to the NBD server on a unix socket, negotiates its
// default export (fixed newstyle, NBD_OPT_EXPORT_NAME ""), runs fn and
// disconnects.
func nbdDo(socket string, fn func(*nbdConn) error) error {
	conn, err := net.DialTimeout("unix", socket, deadline.Scale(10*time.Second))
	if err != nil {
		return err
	}
	defer conn.Close()
	if err := conn.SetDeadline(deadline.After(time.Minute)); err != nil {
		return err
	}
	c := &nbdConn{Conn: conn}
	if err := c.handshake(); err != nil {
		return fmt.Errorf("NBD handshake with %s: %w", socket, err)
	}
	if err := fn(c); err != nil {
		return err
	}
	return c.request(nbdCmdDisc)
}

const (
	nbdMagic         = 0x4e42444d41474943 // "NBDMAGIC"
	nbdOptMagic      = 0x49484156454f5054 // "IHAVEOPT"
	nbdRequestMagic  = 0x25609513
	nbdReplyMagic    = 0x67446698
	nbdFixedNewstyle = 1
	nbdNoZeroes      = 2
	nbdOptExportName = 1
	nbdCmdDisc       = 2
	nbdCmdFlush      = 3
)

func (c *nbdConn) handshake() error {
	var hello struct {
		Magic, OptMagic uint64
		Flags           uint16
	}
	if err := binary.Read(c, binary.BigEndian, &hello); err != nil {
		return err
	}
	if hello.Magic != nbdMagic || hello.OptMagic != nbdOptMagic || hello.Flags&nbdFixedNewstyle == 0 {
		return fmt.Errorf("not a fixed-newstyle NBD server (%x %x %x)", hello.Magic, hello.OptMagic, hello.Flags)
	}
	clientFlags := uint32(nbdFixedNewstyle) | uint32(hello.Flags&nbdNoZeroes)
	opt := struct {
		ClientFlags uint32
		Magic       uint64
		Option, Len uint32
	}{clientFlags, nbdOptMagic, nbdOptExportName, 0}
	if err := binary.Write(c, binary.BigEndian, opt); err != nil {
		return err
	}
	var export struct {
		Size  uint64
		Flags uint16
	}
	if err := binary.Read(c, binary.BigEndian, &export); err != nil {
		return err
	}
	if hello.Flags&nbdNoZeroes == 0 {
		if _, err := io.CopyN(io.Discard, c, 124); err != nil {
			return err
		}
	}
	c.size = int64(export.Size)
	return nil
}

func (c *nbdConn) request(cmd uint16) error {
	req := struct {
		Magic       uint32
		Flags, Type uint16
		Handle      uint64
		Offset      uint64
		Length      uint32
	}{Magic: nbdRequestMagic, Type: cmd, Handle: 1}
	return binary.Write(c, binary.BigEndian, req)
}

// flush asks the server to make every write it acknowledged durable.
func (c *nbdConn) flush() error {
	if err := c.request(nbdCmdFlush); err != nil {
		return err
	}
	var rep struct {
		Magic, Error uint32
		Handle       uint64
	}
	if err := binary.Read(c, binary.BigEndian, &rep); err != nil {
		return err
	}
	if rep.Magic != nbdReplyMagic || rep.Error != 0 {
		return fmt.Errorf("NBD flush: reply magic %x, error %d", rep.Magic, rep.Error)
	}
	return nil
}
