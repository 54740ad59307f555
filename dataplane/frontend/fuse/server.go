package fuse

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"github.com/go-logr/logr"
	gofuse "github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/cairn-io/cairn/dataplane/devicekeeper"
	"github.com/cairn-io/cairn/dataplane/internal/shm"
)

// The FUSE server: the protocol for a mount that holds one file, the
// volume, spoken on /dev/fuse directly (go-fuse provides the message
// layouts only). It exists for speed. go-fuse reads /dev/fuse with
// blocking read(2) calls, so every request wakes a thread parked in the
// kernel, and the Go runtime hands its processor to another thread while
// it waits (sysmon polling, futex wake-ups): the loop device's 4 KiB
// requests cost the engine three times the thread switches of the same
// requests on the NBD socket. Here /dev/fuse is non-blocking and waits in
// Go's network poller, like a socket: one goroutine reads requests back to
// back while there are any and starts a goroutine for each, which
// answers it with one writev. docs/performance.md has the figures.
//
// Requests are read into buffers of the engine's arena (Options.Buffers):
// with replicas on this node, that is memory they share with the engine,
// so a WRITE's payload reaches them as an offset instead of through the
// socket, as the NBD frontend's writes do. A request starts at reqAt in
// its buffer, so that a WRITE's payload, after its headers, starts on a
// 4 KiB boundary, as a replica writing with O_DIRECT needs it.

const (
	// maxWrite is the largest READ or WRITE the kernel sends (max_read,
	// max_write, max_pages): a block request up to 1 MiB goes as one.
	maxWrite = 1 << 20
	// bigBuffer holds any request: the kernel wants room for max_write
	// and the headers before it hands one over.
	bigBuffer = maxWrite + 4096
	// smallBuffer holds the requests copied out of the reading buffer
	// (all but large writes), so that the reader keeps its big one, and
	// the data of small READ answers.
	smallBuffer = 64<<10 + 4096

	// writeHead is a WRITE's headers before its payload (fuse_in_header
	// and fuse_write_in, 80 bytes).
	writeHead = int(unsafe.Sizeof(gofuse.WriteIn{}))
	// reqAt is where a request starts in its buffer: a WRITE's payload
	// then starts at 4096 (arena buffers start on a page).
	reqAt = 4096 - writeHead

	// maxBackground is how many asynchronous requests (the loop device's
	// direct I/O) the kernel keeps in flight to the server, above the
	// queue depths worth serving, so that the kernel does not queue them
	// itself.
	maxBackground = 128

	// ourMinor is the protocol minor version spoken (7.28: max_pages).
	ourMinor = 28

	// uniqueResend marks the unique of a request the kernel sends again
	// after FUSE_NOTIFY_RESEND (FUSE_UNIQUE_RESEND); the answer carries
	// the unique as read.
	uniqueResend = 1 << 63

	rootID = 1 // the mount's directory
	fileID = 2 // the volume file

	ttl = time.Second // how long the kernel may cache entries and attributes
)

// initFlags are the capabilities the server asks for, where the kernel
// offers them. Asynchronous direct I/O is what lets the loop device keep
// many requests in flight: the loop driver submits each block request as
// an asynchronous kiocb, which FUSE turns into requests sent without
// waiting for their answers only with FUSE_ASYNC_DIO; without it the loop
// worker blocks on each request and the engine sees them one at a time.
// Those requests count as background requests, capped at max_background.
const initFlags = gofuse.CAP_ASYNC_READ | gofuse.CAP_BIG_WRITES | gofuse.CAP_ASYNC_DIO | gofuse.CAP_MAX_PAGES

// FUSE opcodes (include/uapi/linux/fuse.h).
const (
	opLookup      = 1
	opForget      = 2
	opGetattr     = 3
	opSetattr     = 4
	opOpen        = 14
	opRead        = 15
	opWrite       = 16
	opStatfs      = 17
	opRelease     = 18
	opFsync       = 20
	opFlush       = 25
	opInit        = 26
	opOpendir     = 27
	opReaddir     = 28
	opReleasedir  = 29
	opAccess      = 34
	opInterrupt   = 36
	opDestroy     = 38
	opBatchForget = 42
	opFallocate   = 43

	// Notification codes, in the header's error field.
	notifyInvalInode = 2 // FUSE_NOTIFY_INVAL_INODE
	notifyResend     = 7 // FUSE_NOTIFY_RESEND (7.40)
)

// server answers one FUSE connection for a file backed by dev.
type server struct {
	dev  Device
	name string // the file's name in the mount
	log  logr.Logger
	uid  uint32 // owner of the mount's nodes: the engine's user
	gid  uint32

	file   *os.File // /dev/fuse, non-blocking, in Go's poller
	fd     int      // file's descriptor number (never file.Fd(), which would make it blocking)
	conn   syscall.RawConn
	params devicekeeper.FUSEParams // what FUSE_INIT agreed

	done     chan struct{}  // closed when serve returns: the connection ended
	handlers sync.WaitGroup // requests being answered

	bufs       *shm.Arena // requests' buffers (see reqAt)
	big, small sync.Pool  // *[]byte of bigBuffer and smallBuffer bytes: INIT, READ answers

	resent atomic.Bool // a request the kernel sent again was seen (and logged)
}

// newServer makes a server for the FUSE connection fd (non-blocking),
// which it owns from then on, reading requests into bufs (nil: the heap).
// It does not serve yet.
func newServer(dev Device, name string, fd int, bufs *shm.Arena, log logr.Logger) (*server, error) {
	if bufs == nil {
		bufs = shm.NewArena(nil)
	}
	s := &server{dev: dev, name: name, log: log, uid: uint32(os.Getuid()), gid: uint32(os.Getgid()), done: make(chan struct{}), fd: fd, bufs: bufs}
	s.big.New = func() any { b := make([]byte, bigBuffer); return &b }
	s.small.New = func() any { b := make([]byte, smallBuffer); return &b }
	s.file = os.NewFile(uintptr(fd), "/dev/fuse") // non-blocking: reads wait in the poller
	var err error
	if s.conn, err = s.file.SyscallConn(); err != nil {
		s.file.Close()
		return nil, err
	}
	return s, nil
}

// mountServer mounts a FUSE filesystem holding dev as the file name at
// dir, answers the kernel's INIT and starts serving.
func mountServer(dev Device, name, dir string, bufs *shm.Arena, log logr.Logger) (*server, error) {
	fd, err := unix.Open("/dev/fuse", unix.O_RDWR|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	if err != nil {
		return nil, fmt.Errorf("open /dev/fuse: %w", err)
	}
	data := fmt.Sprintf("fd=%d,rootmode=%o,user_id=%d,group_id=%d,max_read=%d", fd, unix.S_IFDIR, os.Getuid(), os.Getgid(), maxWrite)
	if err := unix.Mount("cairn:"+name, dir, "fuse.cairn", unix.MS_NOSUID|unix.MS_NODEV, data); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("mount %s: %w", dir, err)
	}
	s, err := newServer(dev, name, fd, bufs, log)
	if err == nil {
		if err = s.init(); err != nil {
			s.file.Close()
		}
	}
	if err != nil {
		return nil, errors.Join(err, unix.Unmount(dir, unix.MNT_DETACH))
	}
	go s.serve()
	if err := s.disarmPoll(filepath.Join(dir, name)); err != nil {
		return nil, errors.Join(err, s.stop(dir, true))
	}
	return s, nil
}

// resumeServer serves a FUSE connection another server initialised and
// left (its process died): fd is the connection's /dev/fuse, params what
// its INIT agreed. The kernel queued the requests that came meanwhile; the
// ones the dead server had read and not answered it sends again once
// asked (FUSE_NOTIFY_RESEND), which needs params.Resend. It owns fd from
// then on, also when it fails.
func resumeServer(dev Device, name string, fd int, params devicekeeper.FUSEParams, bufs *shm.Arena, log logr.Logger) (*server, error) {
	if params.MaxWrite > maxWrite {
		unix.Close(fd)
		return nil, fmt.Errorf("the FUSE connection was set up for requests of %d bytes, more than this server's %d", params.MaxWrite, maxWrite)
	}
	if !params.Resend {
		unix.Close(fd)
		return nil, errors.New("the kernel cannot resend the requests the previous server had read (FUSE_NOTIFY_RESEND, Linux 6.9)")
	}
	s, err := newServer(dev, name, fd, bufs, log)
	if err != nil {
		return nil, err
	}
	s.params = params
	go s.serve()
	if err := s.notify(notifyResend, nil); err != nil {
		s.file.Close()
		<-s.done
		return nil, fmt.Errorf("asking the kernel to resend the requests in flight (FUSE_NOTIFY_RESEND): %w", err)
	}
	return s, nil
}

// disarmPoll has the kernel stop sending FUSE_POLL for the file. The
// kernel asks the server when someone polls a FUSE file, and Go's
// os.OpenFile adds every file it opens to the runtime's epoll set: in this
// process that would deadlock, the epoll_ctl holding the epoll set's lock
// while it waits for the answer, and the server waiting in that same set
// to read the request. So the server answers one poll(2) now, from a
// plain descriptor, with ENOSYS (as to any request it does not serve), and
// the kernel never asks again on this mount.
func (s *server) disarmPoll(file string) error {
	fd, err := unix.Open(file, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open %s: %w", file, err)
	}
	defer unix.Close(fd)
	if _, err := unix.Poll([]unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}, 0); err != nil {
		return fmt.Errorf("poll %s: %w", file, err)
	}
	return nil
}

// read reads one request into buf, waiting in the poller for one.
func (s *server) read(buf []byte) (int, error) {
	var n int
	var err error
	cerr := s.conn.Read(func(fd uintptr) bool {
		n, err = unix.Read(int(fd), buf)
		return err != unix.EAGAIN
	})
	if cerr != nil {
		return 0, cerr
	}
	return n, err
}

// write sends one message (an answer or a notification) to the kernel.
func (s *server) write(iov [][]byte) error {
	var err error
	cerr := s.conn.Write(func(fd uintptr) bool {
		_, err = unix.Writev(int(fd), iov)
		return err != unix.EAGAIN
	})
	if cerr != nil {
		return cerr
	}
	return err
}

// init answers the INIT the kernel sends when the filesystem is mounted.
func (s *server) init() error {
	bp := s.big.Get().(*[]byte)
	defer s.big.Put(bp)
	var n int
	var err error
	for n, err = s.read(*bp); errors.Is(err, unix.EINTR); n, err = s.read(*bp) {
	}
	if err != nil {
		return fmt.Errorf("reading INIT: %w", err)
	}
	req := (*bp)[:n]
	h, ok := header(req)
	if !ok || h.Opcode != opInit || n < int(unsafe.Sizeof(gofuse.InHeader{}))+16 {
		return fmt.Errorf("the kernel's first message is not INIT (%d bytes)", n)
	}
	var in gofuse.InitIn // kernels before 7.36 send only major, minor, max_readahead and flags
	copy(unsafe.Slice((*byte)(unsafe.Pointer(&in)), unsafe.Sizeof(in)), req)
	if in.Major != 7 || in.Minor < 12 {
		s.reply(h, unix.EPROTO, nil, nil)
		return fmt.Errorf("FUSE protocol %d.%d: want 7.12 or later", in.Major, in.Minor)
	}
	out := gofuse.InitOut{Major: 7, Minor: min(in.Minor, ourMinor), MaxReadAhead: in.MaxReadAhead,
		Flags: in.Flags & initFlags, MaxBackground: maxBackground, CongestionThreshold: maxBackground * 3 / 4,
		MaxWrite: maxWrite, TimeGran: 1, MaxPages: maxWrite / 4096}
	b := bytesOf(&out)
	if out.Minor <= 22 {
		b = b[:24] // the layout before 7.23
	}
	if err := s.write([][]byte{outHeader(h.Unique, 0, len(b)), b}); err != nil {
		return fmt.Errorf("answering INIT: %w", err)
	}
	s.params = devicekeeper.FUSEParams{Major: out.Major, Minor: out.Minor, Flags: uint64(out.Flags), MaxWrite: out.MaxWrite, Resend: kernelResends(&in)}
	return nil
}

// kernelResends says whether the kernel that sent INIT in can resend the
// requests a server read and never answered (FUSE_NOTIFY_RESEND): it says
// so with FUSE_HAS_RESEND in the extended flags, and protocol 7.40 (Linux
// 6.9) brought both.
func kernelResends(in *gofuse.InitIn) bool {
	ext := in.Flags&uint32(gofuse.CAP_INIT_EXT) != 0
	return in.Minor >= 40 || (ext && in.Flags64()&gofuse.CAP_HAS_RESEND != 0)
}

// serve reads requests until the connection ends (the mount is gone) and
// answers each in a goroutine of its own.
func (s *server) serve() {
	defer close(s.done)
	hold := s.bufs.Get(reqAt + bigBuffer) // the reader's buffer; requests start at reqAt
	defer func() { s.bufs.Put(hold) }()
	for {
		buf := hold[reqAt:]
		n, err := s.read(buf)
		switch {
		case errors.Is(err, unix.EINTR), errors.Is(err, unix.ENOENT): // ENOENT: the request was interrupted before we read it
			continue
		case errors.Is(err, unix.ENODEV), errors.Is(err, os.ErrClosed), errors.Is(err, os.ErrDeadlineExceeded): // unmounted, or paused
			return
		case err != nil:
			s.log.Error(err, "reading /dev/fuse; the FUSE mount stops answering")
			return
		}
		if n < int(unsafe.Sizeof(gofuse.InHeader{})) {
			s.log.Error(nil, "a FUSE request shorter than its header; the FUSE mount stops answering", "bytes", n)
			return
		}
		h, ok := header(buf[:n])
		if !ok {
			s.reply(h, unix.EIO, nil, nil) // the kernel's length and the read's differ: cannot be parsed
			continue
		}
		switch h.Opcode {
		case opForget, opBatchForget, opInterrupt:
			continue // no answer: one inode that never goes; requests are not cancelled
		}
		if h.Unique&uniqueResend != 0 && !s.resent.Swap(true) {
			s.log.Info("the kernel sent again a request the engine before this one had read and not answered; it is answered now", "opcode", h.Opcode)
		}
		// Large writes keep the buffer they were read into; anything else
		// is copied out so that the reader keeps it: a WRITE into the
		// arena (its payload goes to the replicas), the rest to the heap.
		var req, own []byte // own: from the arena
		var small *[]byte   // or from the small pool
		switch {
		case n > smallBuffer:
			own, req = hold, buf[:n]
			hold = s.bufs.Get(reqAt + bigBuffer)
		case h.Opcode == opWrite:
			own = s.bufs.Get(reqAt + n)
			req = own[reqAt : reqAt+n]
			copy(req, buf[:n])
		default:
			small = s.small.Get().(*[]byte)
			req = (*small)[:n]
			copy(req, buf[:n])
		}
		s.handlers.Add(1)
		go func() {
			defer s.handlers.Done()
			s.handle(req)
			if small != nil {
				s.small.Put(small)
			} else {
				s.bufs.Put(own)
			}
		}()
	}
}

// header is the request's header (nil if req is shorter than one), and
// whether req has the length the header says.
func header(req []byte) (*gofuse.InHeader, bool) {
	if len(req) < int(unsafe.Sizeof(gofuse.InHeader{})) {
		return nil, false
	}
	h := (*gofuse.InHeader)(unsafe.Pointer(&req[0]))
	return h, int(h.Length) == len(req)
}

// in is req's request struct T (which starts with the header), or false if
// req is too short for one.
func in[T any](req []byte) (*T, bool) {
	var t T
	if len(req) < int(unsafe.Sizeof(t)) {
		return nil, false
	}
	return (*T)(unsafe.Pointer(&req[0])), true
}

// bytesOf is the memory of *v, for an answer.
func bytesOf[T any](v *T) []byte {
	return unsafe.Slice((*byte)(unsafe.Pointer(v)), unsafe.Sizeof(*v))
}

func outHeader(unique uint64, status int32, payload int) []byte {
	h := gofuse.OutHeader{Length: uint32(int(unsafe.Sizeof(gofuse.OutHeader{})) + payload), Status: status, Unique: unique}
	return bytesOf(&h)
}

// reply answers request h: errno, or success with out and data.
func (s *server) reply(h *gofuse.InHeader, errno syscall.Errno, out, data []byte) {
	var iov [][]byte
	if errno != 0 {
		iov = [][]byte{outHeader(h.Unique, -int32(errno), 0)}
	} else {
		iov = [][]byte{outHeader(h.Unique, 0, len(out)+len(data)), out, data}
	}
	err := s.write(iov)
	// ENOENT: the kernel no longer waits for this answer (interrupted);
	// ENODEV, closed: the connection ended meanwhile.
	if err != nil && !errors.Is(err, unix.ENOENT) && !errors.Is(err, unix.ENODEV) && !errors.Is(err, os.ErrClosed) {
		s.log.Error(err, "answering a FUSE request", "opcode", h.Opcode)
	}
}

// notifyAttributes has the kernel drop what it cached of the file's
// attributes (FUSE_NOTIFY_INVAL_INODE, offset -1: not its pages).
func (s *server) notifyAttributes() error {
	out := gofuse.NotifyInvalInodeOut{Ino: fileID, Off: -1}
	err := s.notify(notifyInvalInode, bytesOf(&out))
	if errors.Is(err, unix.ENOENT) {
		return nil // the kernel holds nothing of the file
	}
	return err
}

// notify sends the kernel an unsolicited message: unique 0, the code in
// the header's error field.
func (s *server) notify(code int32, payload []byte) error {
	return s.write([][]byte{outHeader(0, code, len(payload)), payload})
}

// pause stops reading requests and waits for the ones being answered; the
// kernel queues what comes next for the server that takes the connection
// over. The descriptor stays open.
func (s *server) pause() {
	// Fails only on a closed file, whose reader has stopped already.
	_ = s.file.SetReadDeadline(time.Now())
	<-s.done
	s.handlers.Wait()
}

// close closes this process's descriptor of the connection, after the
// requests being answered (the connection ends if it was the last one).
func (s *server) close() error {
	err := s.file.Close()
	<-s.done
	s.handlers.Wait()
	return err
}

// stop unmounts dir and, once the kernel ended the connection, waits for
// the requests being answered and closes /dev/fuse. If the mount is busy
// (the loop device still holds the file, as long as a filesystem on it is
// mounted) it is detached lazily and the server goes on answering until
// the kernel lets go of it. Without a mount of this connection at dir
// (mounted, false: it was made in the mount namespace of a process that is
// gone) the descriptor is closed once the kernel ended the connection or
// after a short wait.
func (s *server) stop(dir string, mounted bool) error {
	if !mounted {
		select {
		case <-s.done:
		case <-time.After(5 * time.Second):
		}
		return s.close()
	}
	if err := unix.Unmount(dir, 0); err != nil {
		if derr := unix.Unmount(dir, unix.MNT_DETACH); derr != nil {
			return fmt.Errorf("unmount %s: %w", dir, errors.Join(err, derr))
		}
		return nil
	}
	select {
	case <-s.done:
	case <-time.After(30 * time.Second):
		return fmt.Errorf("the FUSE connection of %s did not end 30 s after the unmount", dir)
	}
	s.handlers.Wait()
	return s.file.Close()
}

// handle answers one request.
func (s *server) handle(req []byte) {
	h := (*gofuse.InHeader)(unsafe.Pointer(&req[0]))
	switch h.Opcode {
	case opLookup:
		name := req[unsafe.Sizeof(gofuse.InHeader{}):]
		if len(name) > 0 && name[len(name)-1] == 0 {
			name = name[:len(name)-1]
		}
		if h.NodeId != rootID || string(name) != s.name {
			s.reply(h, unix.ENOENT, nil, nil)
			return
		}
		out := gofuse.EntryOut{NodeId: fileID, Generation: 1}
		out.SetEntryTimeout(ttl)
		out.SetAttrTimeout(ttl)
		out.Attr = s.attr(fileID)
		s.reply(h, 0, bytesOf(&out), nil)
	case opGetattr:
		s.replyAttr(h)
	case opSetattr:
		r, ok := in[gofuse.SetAttrIn](req)
		if !ok {
			s.reply(h, unix.EINVAL, nil, nil)
			return
		}
		if sz, ok := r.GetSize(); ok && h.NodeId == fileID && int64(sz) != s.dev.Size() {
			s.reply(h, unix.EPERM, nil, nil) // the volume's size changes only through the engine
			return
		}
		s.replyAttr(h) // modes, owners and times stay as they are
	case opOpen:
		if h.NodeId != fileID {
			s.reply(h, unix.EISDIR, nil, nil)
			return
		}
		// Direct I/O: no page cache in between, so every write reaches
		// the engine and a flush from the loop device covers it. Parallel
		// direct writes: the kernel takes the file's lock shared, not
		// exclusive, for a write inside the file, so writes are submitted
		// side by side (the engine orders overlapping ones itself, as for
		// NBD).
		out := gofuse.OpenOut{OpenFlags: gofuse.FOPEN_DIRECT_IO | gofuse.FOPEN_PARALLEL_DIRECT_WRITES}
		s.reply(h, 0, bytesOf(&out), nil)
	case opOpendir:
		if h.NodeId != rootID {
			s.reply(h, unix.ENOTDIR, nil, nil)
			return
		}
		var out gofuse.OpenOut
		s.reply(h, 0, bytesOf(&out), nil)
	case opRead:
		s.handleRead(h, req)
	case opWrite:
		s.handleWrite(h, req)
	case opReaddir:
		s.handleReaddir(h, req)
	case opStatfs:
		out := gofuse.StatfsOut{Blocks: uint64(s.dev.Size()) / 4096, Bsize: 4096, Frsize: 4096, NameLen: 255, Files: 1}
		s.reply(h, 0, bytesOf(&out), nil)
	case opFsync:
		s.reply(h, s.errno("fsync", s.dev.Flush(context.Background())), nil, nil)
	case opFallocate:
		r, ok := in[gofuse.FallocateIn](req)
		if !ok {
			s.reply(h, unix.EINVAL, nil, nil)
			return
		}
		s.reply(h, s.allocate(h, r), nil, nil)
	case opRelease, opReleasedir, opFlush, opAccess, opDestroy:
		s.reply(h, 0, nil, nil)
	default:
		s.reply(h, unix.ENOSYS, nil, nil) // xattrs, creating files, locks...: the kernel stops asking for most
	}
}

func (s *server) attr(node uint64) gofuse.Attr {
	a := gofuse.Attr{Ino: node, Owner: gofuse.Owner{Uid: s.uid, Gid: s.gid}, Blksize: 4096}
	if node == rootID {
		a.Mode, a.Nlink = syscall.S_IFDIR|0o755, 2
		return a
	}
	a.Mode, a.Nlink = syscall.S_IFREG|0o600, 1
	a.Size = uint64(s.dev.Size())
	a.Blocks = a.Size / 512
	return a
}

func (s *server) replyAttr(h *gofuse.InHeader) {
	if h.NodeId != rootID && h.NodeId != fileID {
		s.reply(h, unix.ENOENT, nil, nil)
		return
	}
	out := gofuse.AttrOut{Attr: s.attr(h.NodeId)}
	out.SetTimeout(ttl)
	s.reply(h, 0, bytesOf(&out), nil)
}

func (s *server) handleRead(h *gofuse.InHeader, req []byte) {
	r, ok := in[gofuse.ReadIn](req)
	if !ok || r.Size > maxWrite || h.NodeId != fileID {
		s.reply(h, unix.EINVAL, nil, nil)
		return
	}
	size := s.dev.Size()
	off := int64(r.Offset)
	if off >= size {
		s.reply(h, 0, nil, nil) // end of file
		return
	}
	n := min(int64(r.Size), size-off)
	pool := &s.small
	if n > smallBuffer {
		pool = &s.big
	}
	bp := pool.Get().(*[]byte)
	defer pool.Put(bp)
	p := (*bp)[:n]
	if err := s.dev.ReadAt(context.Background(), p, off); err != nil {
		s.reply(h, s.errno("read", err), nil, nil)
		return
	}
	s.reply(h, 0, nil, p)
}

func (s *server) handleWrite(h *gofuse.InHeader, req []byte) {
	r, ok := in[gofuse.WriteIn](req)
	data := req[min(len(req), int(unsafe.Sizeof(gofuse.WriteIn{}))):]
	if !ok || int(r.Size) != len(data) || h.NodeId != fileID {
		s.reply(h, unix.EINVAL, nil, nil)
		return
	}
	if int64(r.Offset)+int64(len(data)) > s.dev.Size() {
		s.reply(h, unix.ENOSPC, nil, nil)
		return
	}
	if err := s.dev.WriteAt(context.Background(), data, int64(r.Offset), false); err != nil {
		s.reply(h, s.errno("write", err), nil, nil)
		return
	}
	out := gofuse.WriteOut{Size: r.Size}
	s.reply(h, 0, bytesOf(&out), nil)
}

func (s *server) allocate(h *gofuse.InHeader, r *gofuse.FallocateIn) syscall.Errno {
	const punchHole, zeroRange = 0x02, 0x10 // FALLOC_FL_PUNCH_HOLE, FALLOC_FL_ZERO_RANGE
	if h.NodeId != fileID {
		return unix.EINVAL
	}
	if int64(r.Offset+r.Length) > s.dev.Size() {
		return unix.ENOSPC
	}
	if r.Mode&(punchHole|zeroRange) != 0 {
		return s.errno("discard", s.dev.Unmap(context.Background(), int64(r.Offset), int64(r.Length))) // unmapped ranges read as zeros
	}
	return 0 // plain allocation: replicas allocate on write
}

// handleReaddir lists ".", ".." and the file, from the entry at the
// request's offset, as many as fit.
func (s *server) handleReaddir(h *gofuse.InHeader, req []byte) {
	r, ok := in[gofuse.ReadIn](req)
	if !ok || h.NodeId != rootID {
		s.reply(h, unix.EINVAL, nil, nil)
		return
	}
	entries := []struct {
		ino  uint64
		name string
		typ  uint32
	}{{rootID, ".", unix.DT_DIR}, {rootID, "..", unix.DT_DIR}, {fileID, s.name, unix.DT_REG}}
	var out []byte
	for i := int(min(r.Offset, uint64(len(entries)))); i < len(entries); i++ {
		e := entries[i]
		// struct fuse_dirent: ino, off (of the next entry), namelen, type,
		// name, padded to 8 bytes.
		size := (24 + len(e.name) + 7) &^ 7
		if len(out)+size > int(r.Size) {
			break
		}
		d := make([]byte, size)
		*(*uint64)(unsafe.Pointer(&d[0])) = e.ino
		*(*uint64)(unsafe.Pointer(&d[8])) = uint64(i + 1)
		*(*uint32)(unsafe.Pointer(&d[16])) = uint32(len(e.name))
		*(*uint32)(unsafe.Pointer(&d[20])) = e.typ
		copy(d[24:], e.name)
		out = append(out, d...)
	}
	s.reply(h, 0, nil, out)
}

func (s *server) errno(what string, err error) syscall.Errno {
	if err == nil {
		return 0
	}
	if errors.Is(err, syscall.ENOSPC) {
		return syscall.ENOSPC
	}
	s.log.Info("fuse request failed", "op", what, "error", err.Error())
	return syscall.EIO
}
