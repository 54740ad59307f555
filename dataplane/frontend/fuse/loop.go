package fuse

import (
	"errors"
	"fmt"
	"os"
	"unsafe"

	"golang.org/x/sys/unix"
)

// loopDevice is a loop device attached to a file.
type loopDevice struct {
	path     string
	f        *os.File
	directIO bool // the loop driver reads and writes the file with direct I/O
}

// attachLoop attaches a free loop device to file with a 4 KiB logical block
// size, set to clear itself when its last user goes (so a crash of this
// process cannot leak it once nothing has it mounted), with direct I/O
// if the kernel allows it.
//
// Direct I/O (LO_FLAGS_DIRECT_IO, losetup --direct-io=on) is what lets
// the loop device keep many requests in flight to the engine: without it
// the loop driver's worker reads and writes the file with one blocking
// call per block request, so the FUSE server sees one request at a time
// whatever the queue depth above; with it the worker submits each block
// request as an asynchronous kiocb and goes on to the next (FUSE then
// needs asynchronous direct I/O, see initFlags). It also keeps the
// loop device from caching the file's pages a second time (the file is
// FOPEN_DIRECT_IO anyway). A kernel that refuses it (EINVAL) gets the
// device without it.
func attachLoop(file string) (*loopDevice, error) {
	ctl, err := os.OpenFile("/dev/loop-control", os.O_RDWR, 0)
	if err != nil {
		return nil, fmt.Errorf("loop devices unavailable: %w", err)
	}
	defer ctl.Close()
	// A plain descriptor, not an *os.File, which Go would add to its
	// epoll set: see disarmPoll.
	backing, err := unix.Open(file, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open volume file: %w", err)
	}
	defer unix.Close(backing) // the loop device keeps its own reference
	for attempt := 0; attempt < 16; attempt++ {
		n, err := unix.IoctlRetInt(int(ctl.Fd()), unix.LOOP_CTL_GET_FREE)
		if err != nil {
			return nil, fmt.Errorf("find a free loop device: %w", err)
		}
		path := fmt.Sprintf("/dev/loop%d", n)
		if _, err := os.Stat(path); errors.Is(err, os.ErrNotExist) {
			// Containers often have only a few /dev/loopN nodes.
			if err := unix.Mknod(path, unix.S_IFBLK|0o660, int(unix.Mkdev(7, uint32(n)))); err != nil && !errors.Is(err, os.ErrExist) {
				return nil, fmt.Errorf("create %s: %w", path, err)
			}
		}
		lf, err := os.OpenFile(path, os.O_RDWR, 0)
		if err != nil {
			return nil, fmt.Errorf("open %s: %w", path, err)
		}
		cfg := unix.LoopConfig{Fd: uint32(backing), Size: 4096}
		cfg.Info.Flags = unix.LO_FLAGS_AUTOCLEAR | unix.LO_FLAGS_DIRECT_IO
		copy(cfg.Info.File_name[:], file)
		err = unix.IoctlLoopConfigure(int(lf.Fd()), &cfg)
		if errors.Is(err, unix.EINVAL) {
			cfg.Info.Flags &^= unix.LO_FLAGS_DIRECT_IO // a kernel that cannot do direct I/O on this file
			err = unix.IoctlLoopConfigure(int(lf.Fd()), &cfg)
		}
		if errors.Is(err, unix.EBUSY) {
			lf.Close() // another process took it between GET_FREE and CONFIGURE
			continue
		}
		if err != nil {
			lf.Close()
			return nil, fmt.Errorf("attach %s to %s: %w", path, file, err)
		}
		// Older kernels drop the flag silently when they cannot honour
		// it: ask what the device does.
		info, err := unix.IoctlLoopGetStatus64(int(lf.Fd()))
		if err != nil {
			err = errors.Join(fmt.Errorf("LOOP_GET_STATUS64 on %s: %w", path, err),
				unix.IoctlSetInt(int(lf.Fd()), unix.LOOP_CLR_FD, 0))
			lf.Close()
			return nil, err
		}
		return &loopDevice{path: path, f: lf, directIO: info.Flags&unix.LO_FLAGS_DIRECT_IO != 0}, nil
	}
	return nil, errors.New("no free loop device after 16 attempts")
}

// setCapacity has the loop device take its file's current size
// (LOOP_SET_CAPACITY) and checks it shows size.
func (l *loopDevice) setCapacity(size int64) error {
	if err := unix.IoctlSetInt(int(l.f.Fd()), unix.LOOP_SET_CAPACITY, 0); err != nil {
		return fmt.Errorf("LOOP_SET_CAPACITY on %s: %w", l.path, err)
	}
	var got uint64
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, l.f.Fd(), unix.BLKGETSIZE64, uintptr(unsafe.Pointer(&got))); errno != 0 {
		return fmt.Errorf("BLKGETSIZE64 on %s: %w", l.path, errno)
	}
	if int64(got) != size {
		return fmt.Errorf("%s has %d bytes after LOOP_SET_CAPACITY, want %d", l.path, got, size)
	}
	return nil
}

// adoptLoop is the loop device path as an engine before this one attached
// it, from a descriptor of it (which it owns from then on).
func adoptLoop(path string, fd int) (*loopDevice, error) {
	info, err := unix.IoctlLoopGetStatus64(fd)
	if err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("LOOP_GET_STATUS64 on %s: %w", path, err)
	}
	return &loopDevice{path: path, f: os.NewFile(uintptr(fd), path), directIO: info.Flags&unix.LO_FLAGS_DIRECT_IO != 0}, nil
}

// clear has the loop device let go of its file once its last user closes
// it (LOOP_CLR_FD), and says whether someone other than this descriptor
// has it open (a mounted filesystem, an application): the kernel then
// keeps the device bound; with this descriptor alone it stops taking new
// openers at once (and older kernels clear it at once).
func (l *loopDevice) clear() (inUse bool, err error) {
	err = unix.IoctlSetInt(int(l.f.Fd()), unix.LOOP_CLR_FD, 0)
	if errors.Is(err, unix.ENXIO) {
		return false, nil // already cleared
	}
	if errors.Is(err, unix.EBUSY) {
		return true, nil // kernels that refuse while others have it open
	}
	if err != nil {
		return false, fmt.Errorf("LOOP_CLR_FD on %s: %w", l.path, err)
	}
	_, err = unix.IoctlLoopGetStatus64(int(l.f.Fd()))
	return err == nil, nil
}
