// Package fuse exposes a volume as a block device on any Linux node with
// FUSE and loop devices: the volume is one file in a FUSE mount, and that
// file is attached to a loop device (/dev/loopN), which is what the node
// formats and mounts. It needs root (mount(2) and loop ioctls).
package fuse

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"github.com/go-logr/logr"
	"github.com/hanwen/go-fuse/v2/fs"
	gofuse "github.com/hanwen/go-fuse/v2/fuse"

	"github.com/cairn-io/cairn/dataplane/frontend"
)

// Device is the block device served (see frontend.Device).
type Device = frontend.Device

// Options configure Start.
type Options struct {
	// Name is the volume name: the file in the mount is called this.
	Name string
	// Dir is the mount point (created if missing).
	Dir    string
	Logger logr.Logger
}

// Frontend is a mounted volume file attached to a loop device.
type Frontend struct {
	server   *gofuse.Server
	node     *fileNode // the volume file's node
	loop     *loopDevice
	dir      string
	file     string
	log      logr.Logger
	stopOnce sync.Once
	stopErr  error
}

// Start mounts the volume file under opts.Dir and attaches a loop device.
func Start(dev Device, opts Options) (*Frontend, error) {
	if opts.Dir == "" || opts.Name == "" {
		return nil, errors.New("fuse frontend: a mount directory and a volume name are required")
	}
	if os.Geteuid() != 0 {
		return nil, errors.New("fuse frontend: needs root (mount and loop devices)")
	}
	if err := os.MkdirAll(opts.Dir, 0o700); err != nil {
		return nil, fmt.Errorf("fuse frontend: %w", err)
	}
	root := &dirNode{name: opts.Name, file: &fileNode{dev: dev, log: opts.Logger}}
	timeout := time.Second
	server, err := fs.Mount(opts.Dir, root, &fs.Options{
		AttrTimeout:  &timeout,
		EntryTimeout: &timeout,
		MountOptions: gofuse.MountOptions{
			FsName:       "cairn:" + opts.Name,
			Name:         "cairn",
			DirectMount:  true, // mount(2) as root; no fusermount needed
			MaxWrite:     1 << 20,
			MaxReadAhead: 1 << 20,
		},
	})
	if err != nil {
		return nil, fmt.Errorf("fuse frontend: mount %s: %w", opts.Dir, err)
	}
	f := &Frontend{server: server, node: root.file, dir: opts.Dir, file: filepath.Join(opts.Dir, opts.Name), log: opts.Logger}
	if f.loop, err = attachLoop(f.file); err != nil {
		server.Unmount()
		return nil, fmt.Errorf("fuse frontend: %w", err)
	}
	return f, nil
}

// Endpoint is the loop device path, e.g. /dev/loop3.
func (f *Frontend) Endpoint() string { return f.loop.path }

// File is the volume file inside the FUSE mount.
func (f *Frontend) File() string { return f.file }

// Resize makes the file in the mount and the loop device show the
// volume's new size, after the device behind them grew to size: the
// kernel caches the file's attributes, so the server invalidates them
// (FUSE_NOTIFY_INVAL_INODE) and stats the file, which has the kernel ask
// for its size again; then LOOP_SET_CAPACITY has the loop device take the
// file's new size and announce it, so a filesystem on it can be grown
// online. Calling it again with the same size changes nothing.
func (f *Frontend) Resize(size int64) error {
	if errno := f.node.NotifyContent(-1, 0); errno != 0 { // offset -1: attributes only, no page cache
		return fmt.Errorf("fuse frontend: invalidating the cached size of %s: %w", f.file, errno)
	}
	fi, err := os.Stat(f.file)
	if err != nil {
		return fmt.Errorf("fuse frontend: %w", err)
	}
	if fi.Size() != size {
		return fmt.Errorf("fuse frontend: %s has %d bytes after the volume grew to %d", f.file, fi.Size(), size)
	}
	if err := f.loop.setCapacity(size); err != nil {
		return fmt.Errorf("fuse frontend: %w", err)
	}
	return nil
}

// Stop detaches the loop device and unmounts. If a filesystem on the loop
// device is still mounted, the kernel keeps the device until it is
// unmounted (the loop is set to clear itself then), and the FUSE mount is
// detached lazily.
func (f *Frontend) Stop() error {
	f.stopOnce.Do(func() {
		err := f.loop.detach()
		uerr := f.server.Unmount()
		if uerr != nil {
			// Busy (the loop device still holds the file): detach lazily so
			// no mount is left behind for the next engine.
			uerr = syscall.Unmount(f.dir, syscall.MNT_DETACH)
		}
		f.stopErr = errors.Join(err, uerr)
	})
	return f.stopErr
}

// dirNode is the mount's root directory, holding the volume file.
type dirNode struct {
	fs.Inode
	name string
	file *fileNode
}

var _ fs.NodeOnAdder = (*dirNode)(nil)

func (d *dirNode) OnAdd(ctx context.Context) {
	ch := d.NewPersistentInode(ctx, d.file, fs.StableAttr{Mode: syscall.S_IFREG, Ino: 2})
	d.AddChild(d.name, ch, false)
}

// fileNode is the volume as a regular file.
type fileNode struct {
	fs.Inode
	dev Device
	log logr.Logger
}

var (
	_ fs.NodeGetattrer = (*fileNode)(nil)
	_ fs.NodeSetattrer = (*fileNode)(nil)
	_ fs.NodeOpener    = (*fileNode)(nil)
	_ fs.NodeReader    = (*fileNode)(nil)
	_ fs.NodeWriter    = (*fileNode)(nil)
	_ fs.NodeFsyncer   = (*fileNode)(nil)
	_ fs.NodeFlusher   = (*fileNode)(nil)
	_ fs.NodeAllocater = (*fileNode)(nil)
)

func (n *fileNode) errno(what string, err error) syscall.Errno {
	if err == nil {
		return 0
	}
	if errors.Is(err, syscall.ENOSPC) {
		return syscall.ENOSPC
	}
	n.log.Info("fuse request failed", "op", what, "error", err.Error())
	return syscall.EIO
}

func (n *fileNode) Getattr(ctx context.Context, fh fs.FileHandle, out *gofuse.AttrOut) syscall.Errno {
	out.Mode = syscall.S_IFREG | 0o600
	out.Size = uint64(n.dev.Size())
	out.Blocks = out.Size / 512
	out.Blksize = 4096
	return 0
}

func (n *fileNode) Setattr(ctx context.Context, fh fs.FileHandle, in *gofuse.SetAttrIn, out *gofuse.AttrOut) syscall.Errno {
	if sz, ok := in.GetSize(); ok && int64(sz) != n.dev.Size() {
		return syscall.EPERM // the volume's size changes only through the engine
	}
	return n.Getattr(ctx, fh, out)
}

func (n *fileNode) Open(ctx context.Context, flags uint32) (fs.FileHandle, uint32, syscall.Errno) {
	// Direct I/O: no page cache in between, so every write reaches the
	// engine and a flush from the loop device covers it.
	return nil, gofuse.FOPEN_DIRECT_IO, 0
}

func (n *fileNode) Read(ctx context.Context, fh fs.FileHandle, dest []byte, off int64) (gofuse.ReadResult, syscall.Errno) {
	size := n.dev.Size()
	if off >= size {
		return gofuse.ReadResultData(nil), 0
	}
	p := dest[:min(int64(len(dest)), size-off)]
	if err := n.dev.ReadAt(ctx, p, off); err != nil {
		return nil, n.errno("read", err)
	}
	return gofuse.ReadResultData(p), 0
}

func (n *fileNode) Write(ctx context.Context, fh fs.FileHandle, data []byte, off int64) (uint32, syscall.Errno) {
	if off+int64(len(data)) > n.dev.Size() {
		return 0, syscall.ENOSPC
	}
	if err := n.dev.WriteAt(ctx, data, off, false); err != nil {
		return 0, n.errno("write", err)
	}
	return uint32(len(data)), 0
}

func (n *fileNode) Fsync(ctx context.Context, fh fs.FileHandle, flags uint32) syscall.Errno {
	return n.errno("fsync", n.dev.Flush(ctx))
}

func (n *fileNode) Flush(ctx context.Context, fh fs.FileHandle) syscall.Errno { return 0 }

func (n *fileNode) Allocate(ctx context.Context, fh fs.FileHandle, off, size uint64, mode uint32) syscall.Errno {
	const punchHole, zeroRange = 0x02, 0x10 // FALLOC_FL_PUNCH_HOLE, FALLOC_FL_ZERO_RANGE
	if int64(off+size) > n.dev.Size() {
		return syscall.ENOSPC
	}
	if mode&(punchHole|zeroRange) != 0 {
		return n.errno("discard", n.dev.Unmap(ctx, int64(off), int64(size))) // unmapped ranges read as zeros
	}
	return 0 // plain allocation: replicas allocate on write
}
