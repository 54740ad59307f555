// Package uring reads and writes files through one io_uring per process,
// for files opened with O_DIRECT.
//
// A direct pread or pwrite waits for the device inside the system call.
// Go's runtime sees a goroutine stuck in a system call, hands its P to
// another thread, and on return the goroutine queues for a P again: two
// thread wake-ups per I/O, which on a replica doing tens of thousands of
// direct I/Os a second cost more CPU than the I/O itself (docs/
// performance.md). Here a request is queued in the ring and submitted
// with io_uring_enter, which returns as soon as the device has the
// request; the completion is posted to an eventfd that Go's network
// poller watches, and one goroutine hands every completion that arrived
// to its waiter. Completions that finish together cost one wake-up. A
// request alone in flight is a plain blocking call instead: at queue
// depth 1 the blocking call is the quicker of the two.
//
// Only what the replica needs: read and write at an offset, one buffer
// each. The ring's layout is the kernel's (linux/io_uring.h); nothing is
// used that a 5.6 kernel lacks.
package uring

import (
	"errors"
	"fmt"
	"io"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Entries is the ring's size, and so the most requests in flight at once;
// callers beyond it wait for a free slot.
const Entries = 256

const (
	opRead  = 22 // IORING_OP_READ
	opWrite = 23 // IORING_OP_WRITE

	registerEventFD  = 4      // IORING_REGISTER_EVENTFD
	featSingleMmap   = 1      // IORING_FEAT_SINGLE_MMAP
	featRWCurPos     = 1 << 3 // IORING_FEAT_RW_CUR_POS: Linux 5.6, with IORING_OP_READ and IORING_OP_WRITE
	offSQRing        = 0
	offCQRing        = 0x8000000
	offSQEs          = 0x10000000
	sqeSize          = 64
	cqeSize          = 16
	maxRequestLength = 1 << 30 // one request's length fits the SQE's 32 bits
)

type sqringOffsets struct {
	head, tail, ringMask, ringEntries, flags, dropped, array, resv1 uint32
	userAddr                                                        uint64
}

type cqringOffsets struct {
	head, tail, ringMask, ringEntries, overflow, cqes, flags, resv1 uint32
	userAddr                                                        uint64
}

type params struct {
	sqEntries, cqEntries, flags, sqThreadCPU, sqThreadIdle, features, wqFD uint32
	resv                                                                   [3]uint32
	sqOff                                                                  sqringOffsets
	cqOff                                                                  cqringOffsets
}

// sqe is a submission queue entry as the kernel reads it.
type sqe struct {
	opcode, flags uint8
	ioprio        uint16
	fd            int32
	off, addr     uint64
	len, rwFlags  uint32
	userData      uint64
	_             [3]uint64
}

// cqe is a completion queue entry as the kernel writes it.
type cqe struct {
	userData uint64
	res      int32
	flags    uint32
}

// Ring is one io_uring and the goroutine that reaps its completions.
type Ring struct {
	fd      int
	rings   []byte // the SQ and CQ rings, mapped
	cqMap   []byte // the CQ ring when not in rings (no single mmap)
	sqeMap  []byte
	efd     *os.File // eventfd the kernel signals on each completion
	sqHead  *uint32
	sqTail  *uint32
	sqMask  uint32
	sqArray unsafe.Pointer
	sqes    unsafe.Pointer
	cqHead  *uint32
	cqTail  *uint32
	cqMask  uint32
	cqes    unsafe.Pointer

	mu         sync.Mutex // the SQ tail, submitting
	submitting bool       // a goroutine is in io_uring_enter for the queue
	taken1     sync.Cond  // broadcast after each io_uring_enter
	oneByOne   bool       // every request enters itself (the benchmark's comparison)
	requests   atomic.Uint64
	inflight   atomic.Int32  // requests of Files in progress, through the ring or not
	ringOnly   bool          // no blocking call for a request alone (tests of the ring's own paths)
	enters     atomic.Uint64 // io_uring_enter calls, against requests: the batching
	slots      chan uint32
	done       [Entries]chan int32 // a request's result, by slot
}

var (
	shared    *Ring
	sharedErr error
	once      sync.Once
)

// Shared returns the process's ring, set up on first use; the error says
// why there is none (an old kernel, io_uring disabled by sysctl or a
// seccomp profile), and callers then use plain system calls.
func Shared() (*Ring, error) {
	once.Do(func() { shared, sharedErr = New() })
	return shared, sharedErr
}

// New sets up a ring of Entries entries.
func New() (*Ring, error) {
	var p params
	fd, _, errno := unix.Syscall(unix.SYS_IO_URING_SETUP, Entries, uintptr(unsafe.Pointer(&p)), 0)
	if errno != 0 {
		return nil, fmt.Errorf("io_uring_setup: %w", errno)
	}
	r := &Ring{fd: int(fd), slots: make(chan uint32, Entries)}
	r.taken1.L = &r.mu
	fail := func(what string, err error) (*Ring, error) {
		r.unmap()
		unix.Close(r.fd)
		return nil, fmt.Errorf("io_uring %s: %w", what, err)
	}
	sqLen := int(p.sqOff.array + p.sqEntries*4)
	cqLen := int(p.cqOff.cqes + p.cqEntries*cqeSize)
	if p.features&featRWCurPos == 0 {
		// Before 5.6 the ring sets up but has no plain READ and WRITE:
		// every request would fail with EINVAL.
		unix.Close(r.fd)
		return nil, errors.New("io_uring: this kernel lacks IORING_OP_READ and IORING_OP_WRITE (Linux 5.6)")
	}
	single := p.features&featSingleMmap != 0
	if single {
		sqLen = max(sqLen, cqLen)
	}
	var err error
	if r.rings, err = unix.Mmap(r.fd, offSQRing, sqLen, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE); err != nil {
		return fail("mmap of the rings", err)
	}
	cq := r.rings
	if !single {
		if r.cqMap, err = unix.Mmap(r.fd, offCQRing, cqLen, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE); err != nil {
			return fail("mmap of the completion ring", err)
		}
		cq = r.cqMap
	}
	if r.sqeMap, err = unix.Mmap(r.fd, offSQEs, int(p.sqEntries)*sqeSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE); err != nil {
		return fail("mmap of the entries", err)
	}
	at := func(b []byte, off uint32) unsafe.Pointer { return unsafe.Pointer(&b[off]) }
	r.sqHead, r.sqTail = (*uint32)(at(r.rings, p.sqOff.head)), (*uint32)(at(r.rings, p.sqOff.tail))
	r.sqMask = *(*uint32)(at(r.rings, p.sqOff.ringMask))
	r.sqArray = at(r.rings, p.sqOff.array)
	r.sqes = unsafe.Pointer(&r.sqeMap[0])
	r.cqHead, r.cqTail = (*uint32)(at(cq, p.cqOff.head)), (*uint32)(at(cq, p.cqOff.tail))
	r.cqMask = *(*uint32)(at(cq, p.cqOff.ringMask))
	r.cqes = at(cq, p.cqOff.cqes)

	efd, err := unix.Eventfd(0, unix.EFD_NONBLOCK|unix.EFD_CLOEXEC)
	if err != nil {
		return fail("eventfd", err)
	}
	efd32 := int32(efd) // the kernel reads an __s32
	if _, _, errno := unix.Syscall6(unix.SYS_IO_URING_REGISTER, uintptr(r.fd), registerEventFD, uintptr(unsafe.Pointer(&efd32)), 1, 0, 0); errno != 0 {
		unix.Close(efd)
		return fail("register of the eventfd", errno)
	}
	r.efd = os.NewFile(uintptr(efd), "io_uring-eventfd") // non-blocking: read through the poller
	for i := range uint32(Entries) {
		r.done[i] = make(chan int32, 1)
		r.slots <- i
	}
	go r.reap()
	return r, nil
}

func (r *Ring) unmap() {
	for _, m := range [][]byte{r.rings, r.cqMap, r.sqeMap} {
		if m != nil {
			_ = unix.Munmap(m) // fails only for a range not mapped: nothing to undo
		}
	}
}

// reap waits on the eventfd and delivers every completion in the ring;
// the process's ring lives as long as the process.
func (r *Ring) reap() {
	var b [8]byte
	for {
		if _, err := r.efd.Read(b[:]); err != nil && !errors.Is(err, syscall.EINTR) {
			panic("uring: reading the completion eventfd: " + err.Error())
		}
		head := atomic.LoadUint32(r.cqHead)
		for tail := atomic.LoadUint32(r.cqTail); head != tail; tail = atomic.LoadUint32(r.cqTail) {
			for ; head != tail; head++ {
				c := (*cqe)(unsafe.Add(r.cqes, uintptr(head&r.cqMask)*cqeSize))
				r.done[c.userData] <- c.res
			}
			atomic.StoreUint32(r.cqHead, head)
		}
	}
}

// do runs one request on rc's descriptor and returns the kernel's
// result: bytes moved, or -errno.
//
// Submission is combined: the goroutine that finds nobody submitting
// calls io_uring_enter once for everything queued; the others only queue,
// and wait until the kernel has taken their request (one of them enters
// next if it had not). So a burst of requests costs one system call, and
// the kernel starts their device I/O together (one doorbell for the
// device instead of one each).
func (r *Ring) do(rc syscall.RawConn, op uint8, p []byte, off int64) (int32, error) {
	slot := <-r.slots // bounds the requests in flight: the rings never overflow
	r.requests.Add(1)
	defer func() { r.slots <- slot }()
	// Control keeps the descriptor open until the kernel has taken the
	// request (and with it a reference on the file): a descriptor closed
	// and reused before would have the request read or write another file.
	cerr := rc.Control(func(fd uintptr) {
		r.mu.Lock()
		tail := *r.sqTail
		i := tail & r.sqMask
		s := (*sqe)(unsafe.Add(r.sqes, uintptr(i)*sqeSize))
		*s = sqe{opcode: op, fd: int32(fd), off: uint64(off), addr: uint64(uintptr(unsafe.Pointer(unsafe.SliceData(p)))),
			len: uint32(len(p)), userData: uint64(slot)}
		*(*uint32)(unsafe.Add(r.sqArray, uintptr(i)*4)) = i
		atomic.StoreUint32(r.sqTail, tail+1)
		// Until the kernel has taken this request: wait while another
		// goroutine is in io_uring_enter, else enter once for everything
		// queued and let the next waiter take over. One enter each, so no
		// submitter is kept from its own answer by a stream of others.
		for mine := tail + 1; !r.taken(mine); {
			if r.submitting && !r.oneByOne {
				r.taken1.Wait()
				continue
			}
			r.submitting = true
			r.mu.Unlock()
			r.enter()
			r.mu.Lock()
			r.submitting = false
			r.taken1.Broadcast()
		}
		r.mu.Unlock()
	})
	if cerr != nil {
		// Nothing was queued: Control did not call us. The one error it
		// has for a regular file is that the file is closed.
		return 0, fmt.Errorf("%w (%w)", os.ErrClosed, cerr)
	}
	res := <-r.done[slot]
	runtime.KeepAlive(p)
	return res, nil
}

// taken reports whether the kernel has taken the queued requests up to
// (not including) position end.
func (r *Ring) taken(end uint32) bool {
	return int32(atomic.LoadUint32(r.sqHead)-end) >= 0
}

// enter has the kernel take the queued requests (all of them, normally;
// the caller checks).
func (r *Ring) enter() {
	r.enters.Add(1)
	_, _, errno := unix.Syscall6(unix.SYS_IO_URING_ENTER, uintptr(r.fd), Entries, 0, 0, 0, 0)
	switch errno {
	case 0:
	case syscall.EINTR, syscall.EAGAIN, syscall.EBUSY:
		// Interrupted, or short of memory for the moment: the requests
		// are still queued; the caller enters again.
		runtime.Gosched()
	default:
		// The ring itself is broken (a descriptor or memory the kernel
		// refuses): a queued request would never complete.
		panic("uring: io_uring_enter: " + errno.Error())
	}
}

// File does a file's positional reads and writes through a ring.
type File struct {
	r  *Ring
	rc syscall.RawConn
}

// NewFile returns a File for f (opened with O_DIRECT, by the caller, who
// closes it) on ring r.
func (r *Ring) NewFile(f *os.File) (*File, error) {
	rc, err := f.SyscallConn()
	if err != nil {
		return nil, err
	}
	return &File{r: r, rc: rc}, nil
}

// run does one request: through the ring, or, when no other request of
// the ring is in flight, with a plain blocking pread or pwrite. Alone, a
// request gains nothing from the ring, and the ring's completion costs a
// round trip through the poller and a goroutine hand-off that a blocking
// call does not (4 KiB writes at queue depth 1, three replicas: 258 µs
// through the ring, 197 µs blocking).
func (f *File) run(op uint8, p []byte, off int64) (int32, error) {
	if f.r.inflight.Add(1) != 1 || f.r.ringOnly {
		defer f.r.inflight.Add(-1)
		return f.r.do(f.rc, op, p, off)
	}
	defer f.r.inflight.Add(-1)
	var n int
	var err error
	cerr := f.rc.Control(func(fd uintptr) {
		for {
			if op == opRead {
				n, err = unix.Pread(int(fd), p, off)
			} else {
				n, err = unix.Pwrite(int(fd), p, off)
			}
			if !errors.Is(err, syscall.EINTR) {
				return
			}
		}
	})
	switch {
	case cerr != nil:
		return 0, fmt.Errorf("%w (%w)", os.ErrClosed, cerr)
	case err != nil:
		var errno syscall.Errno
		if !errors.As(err, &errno) {
			return 0, err
		}
		return -int32(errno), nil
	}
	return int32(n), nil
}

// ReadAt reads len(p) bytes at off, as os.File.ReadAt: fewer only at the
// end of the file, with io.EOF.
func (f *File) ReadAt(p []byte, off int64) (int, error) {
	return f.all(opRead, "read", io.EOF, p, off)
}

// WriteAt writes all of p at off, as os.File.WriteAt.
func (f *File) WriteAt(p []byte, off int64) (int, error) {
	return f.all(opWrite, "write", io.ErrShortWrite, p, off)
}

// all moves all of p at off in requests of at most maxRequestLength,
// retrying transient results; a request that moves nothing ends it with
// short (io.EOF for reads, io.ErrShortWrite for writes).
func (f *File) all(op uint8, name string, short error, p []byte, off int64) (int, error) {
	if off < 0 { // -1 would mean the file position to io_uring
		return 0, &os.PathError{Op: name, Path: "io_uring", Err: errors.New("negative offset")}
	}
	done := 0
	for done < len(p) {
		n := min(len(p)-done, maxRequestLength)
		res, err := f.run(op, p[done:done+n], off+int64(done))
		switch {
		case err != nil:
			return done, err
		case res == -int32(syscall.EAGAIN) || res == -int32(syscall.EINTR):
			runtime.Gosched() // transient (a device out of request tags, a signal): again
			continue
		case res < 0:
			return done, &os.PathError{Op: name, Path: "io_uring", Err: syscall.Errno(-res)}
		case res == 0:
			return done, short
		}
		done += int(res)
	}
	return done, nil
}
