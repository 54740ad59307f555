// Package fuse exposes a volume as a block device on any Linux node with
// FUSE and loop devices: the volume is one file in a FUSE mount, and that
// file is attached to a loop device (/dev/loopN), which is what the node
// formats and mounts. It needs root (mount(2) and loop ioctls).
package fuse

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"

	"github.com/go-logr/logr"

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
	server   *server
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
	s, err := mountServer(dev, opts.Name, opts.Dir, opts.Logger)
	if err != nil {
		return nil, fmt.Errorf("fuse frontend: %w", err)
	}
	f := &Frontend{server: s, dir: opts.Dir, file: filepath.Join(opts.Dir, opts.Name), log: opts.Logger}
	if f.loop, err = attachLoop(f.file); err != nil {
		s.stop(opts.Dir)
		return nil, fmt.Errorf("fuse frontend: %w", err)
	}
	if !f.loop.directIO {
		// Still correct, but the loop driver then hands the file one
		// request at a time: a fraction of the IOPS (docs/performance.md).
		opts.Logger.Info("the loop device does buffered I/O on the volume file: the kernel refused direct I/O; requests reach the engine one at a time", "device", f.loop.path)
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
	if err := f.server.notifyAttributes(); err != nil {
		return fmt.Errorf("fuse frontend: invalidating the cached size of %s: %w", f.file, err)
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
		f.stopErr = errors.Join(f.loop.detach(), f.server.stop(f.dir))
	})
	return f.stopErr
}
