// Package rawio makes the data path's socket and file-write system calls
// raw, for queue-depth-1 latency.
//
// A Go program that goes idle parks its monitor thread (sysmon); the next
// system call made through the syscall package wakes it again, and the
// monitor then polls every 20 µs until the program is idle once more. At
// queue depth 1 every request finds the process idle, so each one paid for
// the monitor's wake-up and a few timer sleeps on top of its own work: on
// a two-vCPU virtual machine with an engine and three replicas, a replica
// went from 2.7 to 1 context switch per 4 KiB write, and from about 40 to
// 20 µs of CPU, once its calls were raw.
//
// A raw call (syscall.RawSyscall) is invisible to the scheduler: the
// goroutine keeps its P while in it. That is harmless for a call that
// cannot block. A socket's descriptor is non-blocking (the netpoller
// waits for it), so Conn's reads and writes return at once; they run
// inside the descriptor's syscall.RawConn, which still parks the goroutine
// in the netpoller when the socket is not ready and still honours
// deadlines and Close. A buffered file write usually returns at once too,
// but can wait (dirty-page throttling, journal locks): File makes it raw
// only while fewer than GOMAXPROCS-1 raw writes are in progress in the
// process, so at least one P is always free for everything else.
package rawio

import (
	"io"
	"net"
	"sync"
	"syscall"
	"unsafe"
)

// maxIovecs is the most buffers one writev takes (the kernel's IOV_MAX).
const maxIovecs = 1024

// Conn is a net.Conn whose Read, Write and WriteBuffers use raw system
// calls. Everything else is the wrapped connection's. Reads may run
// alongside writes; reads among themselves and writes among themselves
// are serialised.
type Conn struct {
	net.Conn
	rc syscall.RawConn

	rmu   sync.Mutex
	rbuf  []byte // the read in progress
	rn    int
	rerr  syscall.Errno
	rfunc func(fd uintptr) bool

	wmu   sync.Mutex
	iovs  []syscall.Iovec // the writev in progress
	wn    int
	werr  syscall.Errno
	wfunc func(fd uintptr) bool
}

// Wrap returns nc as a *Conn when it has a descriptor (TCP and unix
// sockets), and nc itself otherwise (net.Pipe, TLS).
func Wrap(nc net.Conn) net.Conn {
	sc, ok := nc.(syscall.Conn)
	if !ok {
		return nc
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return nc
	}
	c := &Conn{Conn: nc, rc: rc, iovs: make([]syscall.Iovec, 0, 8)}
	// Built once: a closure made per call would be allocated per call.
	c.rfunc = func(fd uintptr) bool {
		n, e := rawCall(syscall.SYS_READ, fd, unsafe.Pointer(&c.rbuf[0]), uintptr(len(c.rbuf)), 0)
		if e == syscall.EAGAIN {
			return false // wait in the netpoller
		}
		c.rn, c.rerr = n, e
		return true
	}
	c.wfunc = func(fd uintptr) bool {
		n, e := rawCall(syscall.SYS_WRITEV, fd, unsafe.Pointer(&c.iovs[0]), uintptr(len(c.iovs)), 0)
		if e == syscall.EAGAIN {
			return false
		}
		c.wn, c.werr = n, e
		return true
	}
	return c
}

// Read reads up to len(p) bytes, waiting in the netpoller while none are
// there. It returns io.EOF at the end of the stream.
func (c *Conn) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	c.rmu.Lock()
	defer c.rmu.Unlock()
	c.rbuf, c.rn, c.rerr = p, 0, 0
	err := c.rc.Read(c.rfunc)
	c.rbuf = nil
	switch {
	case err != nil:
		return 0, err
	case c.rerr != 0:
		return 0, c.opError("read", c.rerr)
	case c.rn == 0:
		return 0, io.EOF
	}
	return c.rn, nil
}

// Write writes all of p.
func (c *Conn) Write(p []byte) (int, error) {
	bufs := net.Buffers{p}
	n, err := c.WriteBuffers(&bufs)
	return int(n), err
}

// WriteBuffers writes every buffer in *bufs with as few writev calls as
// the socket allows, consuming *bufs like net.Buffers.WriteTo.
func (c *Conn) WriteBuffers(bufs *net.Buffers) (int64, error) {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	defer func() { clear(c.iovs[:cap(c.iovs)]) }() // keep no buffer alive
	var total int64
	for len(*bufs) > 0 {
		c.iovs = c.iovs[:0]
		for _, b := range *bufs {
			if len(c.iovs) == maxIovecs {
				break
			}
			if len(b) > 0 {
				v := syscall.Iovec{Base: &b[0]}
				v.SetLen(len(b))
				c.iovs = append(c.iovs, v)
			}
		}
		if len(c.iovs) == 0 {
			*bufs = (*bufs)[:0]
			break
		}
		c.wn, c.werr = 0, 0
		err := c.rc.Write(c.wfunc)
		if err == nil && c.werr != 0 {
			err = c.opError("write", c.werr)
		}
		if err != nil {
			return total, err
		}
		total += int64(c.wn)
		consume(bufs, int64(c.wn))
	}
	return total, nil
}

// rawCall makes the raw system call trap(fd, p, n, a4), again while it
// is interrupted (EINTR). p stays an unsafe.Pointer up to the call
// expression, where its conversion keeps the memory alive.
func rawCall(trap, fd uintptr, p unsafe.Pointer, n, a4 uintptr) (int, syscall.Errno) {
	for {
		r, _, e := syscall.RawSyscall6(trap, fd, uintptr(p), n, a4, 0, 0)
		if e != syscall.EINTR {
			return int(r), e
		}
	}
}

// consume drops n written bytes from the front of *bufs.
func consume(bufs *net.Buffers, n int64) {
	for len(*bufs) > 0 {
		b := (*bufs)[0]
		if int64(len(b)) > n {
			(*bufs)[0] = b[n:]
			return
		}
		n -= int64(len(b))
		(*bufs)[0] = nil
		*bufs = (*bufs)[1:]
	}
}

func (c *Conn) opError(op string, errno syscall.Errno) error {
	return &net.OpError{Op: op, Net: c.LocalAddr().Network(), Source: c.LocalAddr(), Addr: c.RemoteAddr(), Err: errno}
}

// WriteBuffers writes bufs to w with writev: through w's WriteBuffers when
// it is a *Conn, else net.Buffers.WriteTo (which uses writev for the net
// package's own connections). It consumes *bufs either way.
func WriteBuffers(w io.Writer, bufs *net.Buffers) (int64, error) {
	if c, ok := w.(*Conn); ok {
		return c.WriteBuffers(bufs)
	}
	return bufs.WriteTo(w)
}
