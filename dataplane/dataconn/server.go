package dataconn

import (
	"context"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/go-logr/logr"

	"github.com/cairn-io/cairn/dataplane/internal/batchwrite"
	"github.com/cairn-io/cairn/dataplane/internal/bufread"
	"github.com/cairn-io/cairn/dataplane/internal/rawio"
	"github.com/cairn-io/cairn/dataplane/internal/shm"
)

// Backend is the storage a Server serves. Offsets and lengths are in bytes;
// the server checks them against Size before calling it. Implementations
// must be safe for concurrent use.
type Backend interface {
	ReadAt(p []byte, off int64) (int, error)
	WriteAt(p []byte, off int64) (int, error)
	// Flush makes every completed write durable.
	Flush() error
	// Unmap discards [off, off+length); the range reads as zeros after.
	Unmap(off, length int64) error
	Size() int64
}

// EpochBackend is a Backend that refuses requests from a stale replica set
// (see docs/dataconn.md): each operation is given the request's epoch and
// fails with an error wrapping CodeStaleEpoch when it is not the backend's
// current epoch. The check and the operation must be atomic with respect
// to a change of epoch, or a request that passed the check could still
// land after the change.
type EpochBackend interface {
	Backend
	ReadAtEpoch(p []byte, off int64, epoch uint64) (int, error)
	WriteAtEpoch(p []byte, off int64, epoch uint64) (int, error)
	FlushEpoch(epoch uint64) error
	UnmapEpoch(off, length int64, epoch uint64) error
}

// SnapshotBackend is a Backend that serves snapshot reads
// (OpSnapshotRead): ReadSnapshotAt fills p with the bytes at off of the
// view at snapshot name, holes as zeros. The server has checked that p
// lies in the volume and is at most the payload bound; the backend checks
// the name and any alignment it needs. A server whose backend is not one
// answers snapshot reads with CodeUnsupported.
type SnapshotBackend interface {
	ReadSnapshotAt(p []byte, name string, off int64) error
}

// CleanFlusher is a Backend that keeps a write-intent record it can clear
// on a clean flush (FlushOffsetClean).
type CleanFlusher interface {
	FlushClean() error
}

// EpochCleanFlusher is CleanFlusher for an EpochBackend.
type EpochCleanFlusher interface {
	FlushCleanEpoch(epoch uint64) error
}

// flush runs a flush request on b: a clean one (FlushOffsetClean) if b
// keeps a record to clear, else a plain one.
func flush(b Backend, kind uint64) error {
	if c, ok := b.(CleanFlusher); ok && kind == FlushOffsetClean {
		return c.FlushClean()
	}
	return b.Flush()
}

// ServerOptions configure a Server. Zero values take the defaults.
type ServerOptions struct {
	// Workers bounds how many requests run against the backend at once,
	// across all connections. Default 4 × GOMAXPROCS.
	Workers int
	// MaxPayload bounds a frame's payload. Default DefaultMaxPayload.
	MaxPayload uint32
	// Logger receives connection-level events. Default: discard.
	Logger logr.Logger
	// Key, when set (KeySize bytes), is the volume's key: every
	// connection Serve accepts must pass the authentication handshake
	// (auth.go) before a frame is read; one that does not is closed.
	Key []byte
	// HandshakeTimeout bounds each handshake. Default
	// DefaultHandshakeTimeout.
	HandshakeTimeout time.Duration
	// MaxHandshakes bounds the handshakes in progress at once; a
	// connection beyond it is closed at once (a flood of idle connections
	// cannot hold the server's memory). Default 64.
	MaxHandshakes int
	// TLS, when set, makes every connection Serve accepts from a listener
	// that is not a unix socket (TCP) a TLS server connection: its
	// handshake (within HandshakeTimeout, counted in MaxHandshakes) comes
	// before the key's, and frames travel encrypted. For data ports on
	// networks the volume's traffic must not be read on; give it
	// ClientAuth to require the engines' certificates too. Connections
	// from a unix listener stay on the node and are served without TLS
	// (clients do not wrap them, see ClientOptions.TLS); the key's
	// handshake still applies to them.
	TLS *tls.Config
}

// ErrServerClosed is returned by Serve after Shutdown or Close.
var ErrServerClosed = errors.New("dataconn: server closed")

// Server serves a Backend over dataconn streams.
type Server struct {
	backend Backend
	opts    ServerOptions
	log     logr.Logger
	pool    *shm.Arena // request and reply buffers (heap)
	jobs    chan job

	mu        sync.Mutex
	closing   bool
	done      chan struct{} // closed when closing is set
	listeners map[net.Listener]struct{}
	conns     map[*serverConn]struct{}
	pending   map[net.Conn]struct{} // connections in their handshake
	connsWG   sync.WaitGroup
	workersWG sync.WaitGroup
	stopOnce  sync.Once
}

type job struct {
	sc     *serverConn
	h      Header
	buf    []byte // write data: from the pool, or the shared memory
	pooled bool   // buf goes back to the pool
	err    error  // the request was refused before it ran
}

type reply struct {
	hdr     [HeaderSize]byte
	payload []byte
	pooled  bool // payload goes back to the pool once written
}

// NewServer returns a Server for b. Its workers start at once; Close or
// Shutdown stop them.
func NewServer(b Backend, opts ServerOptions) *Server {
	if opts.Workers <= 0 {
		opts.Workers = 4 * runtime.GOMAXPROCS(0)
	}
	if opts.MaxPayload == 0 {
		opts.MaxPayload = DefaultMaxPayload
	}
	if opts.HandshakeTimeout <= 0 {
		opts.HandshakeTimeout = DefaultHandshakeTimeout
	}
	if opts.MaxHandshakes <= 0 {
		opts.MaxHandshakes = 64
	}
	s := &Server{
		backend:   b,
		opts:      opts,
		log:       opts.Logger,
		pool:      shm.NewArena(nil),
		jobs:      make(chan job, opts.Workers),
		done:      make(chan struct{}),
		listeners: map[net.Listener]struct{}{},
		conns:     map[*serverConn]struct{}{},
		pending:   map[net.Conn]struct{}{},
	}
	s.workersWG.Add(opts.Workers)
	for range opts.Workers {
		go s.worker()
	}
	return s
}

// Serve accepts connections on l and serves each until the server shuts
// down. It returns ErrServerClosed after Shutdown or Close, which close l
// (a Serve called after them closes it at once), and the listener's error
// when accepting fails for good; transient failures (see
// TransientAcceptError) are retried with a back-off and logged. Serve may
// run for several listeners at once: they share the workers, the key and
// the backend, and TLS applies to each that is not a unix socket
// (ServerOptions.TLS).
func (s *Server) Serve(l net.Listener) error {
	s.mu.Lock()
	if s.closing {
		s.mu.Unlock()
		// A Serve started in the background may come after Shutdown:
		// the listener is closed as if it had been tracked.
		l.Close()
		return ErrServerClosed
	}
	s.listeners[l] = struct{}{}
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.listeners, l)
		s.mu.Unlock()
	}()
	// Transient accept failures (EMFILE and the like) are waited out: a
	// replica whose Serve returned would stop taking its engine's
	// connections, and its process would exit.
	a := NewAcceptor(l, AcceptOptions{Logger: s.log, Done: s.done})
	tlsConf := s.opts.TLS
	if l.Addr().Network() == "unix" {
		tlsConf = nil
	}
	for {
		nc, err := a.Accept()
		if err != nil {
			s.mu.Lock()
			closing := s.closing
			s.mu.Unlock()
			if closing {
				return ErrServerClosed
			}
			return err
		}
		if s.opts.Key == nil && tlsConf == nil {
			s.ServeConn(nc)
			continue
		}
		s.mu.Lock()
		full := len(s.pending) >= s.opts.MaxHandshakes || s.closing
		if !full {
			s.pending[nc] = struct{}{}
		}
		s.mu.Unlock()
		if full {
			s.log.Info("connection closed: too many handshakes in progress", "peer", nc.RemoteAddr().String(), "max", s.opts.MaxHandshakes)
			nc.Close()
			continue
		}
		go s.authenticate(nc, tlsConf)
	}
}

// authenticate runs the handshakes on an accepted connection (TLS's with
// tlsConf when it is not nil, then the key's) and serves it if the client
// passes them.
func (s *Server) authenticate(nc net.Conn, tlsConf *tls.Config) {
	var err error
	if tlsConf != nil {
		tc := tls.Server(nc, tlsConf)
		ctx, cancel := context.WithTimeout(context.Background(), s.opts.HandshakeTimeout)
		err = tc.HandshakeContext(ctx)
		cancel()
		s.mu.Lock()
		delete(s.pending, nc)
		if err == nil {
			s.pending[tc] = struct{}{}
		}
		s.mu.Unlock()
		if err != nil {
			s.log.Info("connection refused: TLS handshake failed", "peer", nc.RemoteAddr().String(), "error", err.Error())
			nc.Close()
			return
		}
		nc = tc
	}
	if s.opts.Key != nil {
		err = ServerHandshake(nc, s.opts.Key, s.opts.HandshakeTimeout)
	}
	s.mu.Lock()
	delete(s.pending, nc)
	s.mu.Unlock()
	if err != nil {
		s.log.Info("connection refused: authentication failed", "peer", nc.RemoteAddr().String(), "error", err.Error())
		nc.Close()
		return
	}
	s.ServeConn(nc)
}

// ServeConn serves one established stream in the background until it fails,
// the peer closes it, or the server shuts down.
func (s *Server) ServeConn(nc net.Conn) {
	sc := &serverConn{s: s, nc: nc, raw: rawio.Wrap(nc), log: s.log.WithValues("peer", nc.RemoteAddr().String())}
	sc.w = batchwrite.New(sc.raw, batchwrite.Options[reply]{
		Buffers: func(bufs net.Buffers, r reply) net.Buffers {
			bufs = append(bufs, r.hdr[:])
			if len(r.payload) > 0 {
				bufs = append(bufs, r.payload)
			}
			return bufs
		},
		Done: func(rs []reply, _ error) {
			for i := range rs {
				if rs[i].pooled {
					s.pool.Put(rs[i].payload)
				}
			}
		},
		// The reader sees the close and stops; later replies are dropped
		// (and their buffers released), so workers never block.
		Failed:   func(error) { nc.Close() },
		Queue:    256,
		MaxBatch: 64,
	})
	s.mu.Lock()
	if s.closing {
		s.mu.Unlock()
		nc.Close()
		return
	}
	s.conns[sc] = struct{}{}
	s.connsWG.Add(1)
	s.mu.Unlock()
	go sc.run()
}

// Shutdown stops accepting connections and reading requests, lets every
// request already read finish and its reply be written, then closes the
// connections. If ctx ends first, it closes everything at once.
func (s *Server) Shutdown(ctx context.Context) error {
	s.beginClose()
	s.mu.Lock()
	for sc := range s.conns {
		// Unblock the reader; it stops reading and drains what it started.
		_ = sc.nc.SetReadDeadline(time.Now())
	}
	s.mu.Unlock()
	done := make(chan struct{})
	go func() { s.connsWG.Wait(); close(done) }()
	select {
	case <-done:
	case <-ctx.Done():
		s.closeConns()
		<-done
	}
	s.stopWorkers()
	return ctx.Err()
}

// Close closes every listener and connection at once. Requests in flight
// get no reply.
func (s *Server) Close() error {
	s.beginClose()
	s.closeConns()
	s.connsWG.Wait()
	s.stopWorkers()
	return nil
}

func (s *Server) beginClose() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.closing {
		s.closing = true
		close(s.done)
	}
	for l := range s.listeners {
		l.Close()
	}
}

func (s *Server) closeConns() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for sc := range s.conns {
		sc.nc.Close()
	}
	for nc := range s.pending {
		nc.Close()
	}
}

func (s *Server) stopWorkers() {
	s.stopOnce.Do(func() { close(s.jobs) })
	s.workersWG.Wait()
}

func (s *Server) worker() {
	defer s.workersWG.Done()
	for j := range s.jobs {
		s.handle(j)
		j.sc.active.Add(-1)
		j.sc.inflight.Done()
	}
}

// handle runs one request against the backend and queues its reply.
func (s *Server) handle(j job) {
	h := j.h
	rh := Header{Op: h.Op.Reply(), Seq: h.Seq, Offset: h.Offset, Epoch: h.Epoch, Length: h.Length}
	var payload []byte
	pooled := false
	err := j.err
	if err == nil {
		err = s.check(h)
	}
	if err == nil {
		b := s.epochBackend(h.Epoch)
		switch h.Op {
		case OpRead:
			payload = s.pool.Get(int(h.Length))
			pooled = true
			_, err = b.ReadAt(payload, int64(h.Offset))
		case OpWrite:
			_, err = b.WriteAt(j.buf, int64(h.Offset))
			if err == nil && h.Flags&FlagFUA != 0 {
				err = b.Flush()
			}
		case OpFlush:
			err = flush(b, h.Offset)
		case OpUnmap:
			err = b.Unmap(int64(h.Offset), int64(h.Length))
		case OpSnapshotRead:
			payload, pooled, err = s.readSnapshot(h, j.buf)
		case OpPing:
		default:
			err = fmt.Errorf("%w: %s", CodeUnsupported, h.Op)
		}
	}
	if j.pooled {
		s.pool.Put(j.buf)
	}
	if err != nil {
		if pooled {
			s.pool.Put(payload)
		}
		j.sc.replyError(rh, err)
		return
	}
	j.sc.reply(rh, payload, pooled)
}

// readSnapshot serves a snapshot read: name is the request's payload.
// The reply's buffer comes from the pool and, on success, goes back to it
// once written (pooled).
func (s *Server) readSnapshot(h Header, name []byte) (payload []byte, pooled bool, err error) {
	sb, ok := s.backend.(SnapshotBackend)
	if !ok {
		return nil, false, fmt.Errorf("%w: this replica serves no snapshot reads", CodeUnsupported)
	}
	payload = s.pool.Get(int(h.Length))
	if err := sb.ReadSnapshotAt(payload, string(name), int64(h.Offset)); err != nil {
		s.pool.Put(payload)
		return nil, false, err
	}
	return payload, true, nil
}

// replyError answers with err's code and its message as the payload.
func (sc *serverConn) replyError(rh Header, err error) {
	rh.Code = codeOf(err)
	rh.Length = 0
	msg := []byte(err.Error())
	if len(msg) > int(sc.s.opts.MaxPayload) {
		msg = msg[:sc.s.opts.MaxPayload]
	}
	sc.reply(rh, msg, false)
}

// reply sends a reply at once, or queues it for the goroutine writing to
// the connection (see batchwrite).
func (sc *serverConn) reply(rh Header, payload []byte, pooled bool) {
	r := reply{payload: payload, pooled: pooled}
	rh.PayloadLen = uint32(len(payload))
	rh.PayloadCRC = Checksum(payload)
	PutHeader(r.hdr[:], &rh)
	sc.w.Send(r)
}

// check validates a request's length and range before anything is
// allocated or run for it. A read's length is the size of its reply, which
// the server allocates: it is bounded by MaxPayload like any payload, or
// one header could make the server allocate up to 4 GiB. A write's length
// is bounded by the decoder (it equals the payload length) or, with the
// shared flag, by sharedData. An unmap allocates nothing, so any length
// within the volume is fine.
func (s *Server) check(h Header) error {
	switch h.Op {
	case OpRead, OpWrite, OpSnapshotRead:
		if h.Length > s.opts.MaxPayload {
			return fmt.Errorf("%w: %s of %d bytes exceeds the %d-byte maximum", CodeInvalid, h.Op, h.Length, s.opts.MaxPayload)
		}
	}
	switch h.Op {
	case OpRead, OpWrite, OpUnmap, OpSnapshotRead:
		size := uint64(s.backend.Size())
		if h.Offset > size || uint64(h.Length) > size-h.Offset {
			return fmt.Errorf("%w: %s of %d bytes at offset %d, volume size %d", CodeOutOfRange, h.Op, h.Length, h.Offset, size)
		}
	}
	return nil
}

// epochBackend returns the backend's operations bound to a request's
// epoch when the backend checks epochs, or the plain backend.
func (s *Server) epochBackend(epoch uint64) Backend {
	if eb, ok := s.backend.(EpochBackend); ok {
		return withEpoch{eb, epoch}
	}
	return s.backend
}

// withEpoch runs a Backend's operations with the request's epoch.
type withEpoch struct {
	b     EpochBackend
	epoch uint64
}

func (w withEpoch) ReadAt(p []byte, off int64) (int, error) { return w.b.ReadAtEpoch(p, off, w.epoch) }
func (w withEpoch) WriteAt(p []byte, off int64) (int, error) {
	return w.b.WriteAtEpoch(p, off, w.epoch)
}
func (w withEpoch) Flush() error                  { return w.b.FlushEpoch(w.epoch) }
func (w withEpoch) Unmap(off, length int64) error { return w.b.UnmapEpoch(off, length, w.epoch) }
func (w withEpoch) Size() int64                   { return w.b.Size() }

func (w withEpoch) FlushClean() error {
	if c, ok := w.b.(EpochCleanFlusher); ok {
		return c.FlushCleanEpoch(w.epoch)
	}
	return w.Flush()
}

// codeOf maps a backend error to a wire code.
func codeOf(err error) Code {
	var c Code
	switch {
	case errors.As(err, &c):
		return c
	case errors.Is(err, syscall.ENOSPC), errors.Is(err, syscall.EDQUOT):
		return CodeNoSpace
	}
	return CodeIO
}

// readBufferSize is the buffer each connection reads through, so that a
// burst of pipelined frames costs one read syscall, not two per frame.
const readBufferSize = 256 << 10

type serverConn struct {
	s        *Server
	nc       net.Conn
	raw      net.Conn // nc with raw-syscall reads and writes (rawio)
	log      logr.Logger
	w        *batchwrite.Writer[reply]
	inflight sync.WaitGroup
	active   atomic.Int32 // requests handed to workers and not yet answered
	shared   *shm.Mapping // the client's shared memory, once attached
}

func (sc *serverConn) run() {
	defer sc.s.connsWG.Done()
	err := sc.readLoop()
	if err != nil && !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) && !errors.Is(err, syscall.ECONNRESET) {
		var ne net.Error
		if !errors.As(err, &ne) || !ne.Timeout() { // the read deadline Shutdown sets
			sc.log.Info("closing connection", "reason", err.Error())
		}
	}
	// Every request read is answered, and its reply written: each was
	// sent before its request counted as done, and a reply queued behind
	// another sender's write is written by that sender before its Send
	// returns.
	sc.inflight.Wait()
	sc.nc.Close()
	if sc.shared != nil {
		sc.shared.Close() // no request is left to read from it
	}
	sc.s.mu.Lock()
	delete(sc.s.conns, sc)
	sc.s.mu.Unlock()
}

func (sc *serverConn) readLoop() error {
	var hb [HeaderSize]byte
	br := bufread.NewReader(sc.raw, readBufferSize) // many frames per read syscall
	uc, _ := sc.nc.(*net.UnixConn)
	for first := true; ; first = false {
		var fds []int
		if first && uc != nil {
			// Read the first header with recvmsg: an attach carries a
			// descriptor, which a plain read would drop.
			var err error
			if fds, err = readFirstHeader(uc, hb[:]); err != nil {
				return err
			}
		} else if err := br.Header(hb[:]); err != nil {
			return err
		}
		h, err := ParseHeader(hb[:], sc.s.opts.MaxPayload)
		if err == nil && h.Op.IsReply() {
			err = fmt.Errorf("%w: the client sent a reply (%s)", ErrMalformed, h.Op)
		}
		if err != nil {
			closeFDs(fds)
			return err
		}
		if h.Op == OpAttach {
			sc.attach(h, fds, first)
			continue
		}
		closeFDs(fds)
		var buf []byte
		if h.PayloadLen > 0 {
			buf = sc.s.pool.Get(int(h.PayloadLen))
			if err := br.Payload(buf); err != nil {
				sc.s.pool.Put(buf)
				return unexpectedEOF(err)
			}
			if got := Checksum(buf); got != h.PayloadCRC {
				sc.s.pool.Put(buf)
				return fmt.Errorf("%w: %s seq %d", ErrPayloadChecksum, h.Op, h.Seq)
			}
		}
		sc.inflight.Add(1)
		j := job{sc: sc, h: h, buf: buf, pooled: buf != nil}
		if h.Flags&FlagShared != 0 {
			j.buf, j.err = sc.sharedData(h, buf)
			j.pooled = false
			sc.s.pool.Put(buf)
		}
		if br.Idle() && sc.active.Load() == 0 && sc.w.Idle() && (h.Op == OpRead || h.Op == OpWrite) {
			// Nothing else has arrived: run it here and reply directly,
			// sparing two hand-offs (the common case at queue depth 1).
			sc.s.handle(j)
			sc.inflight.Done()
			continue
		}
		sc.active.Add(1)
		sc.s.jobs <- j
	}
}

// attach maps the shared memory a client offers (its descriptors are fds)
// and answers. It must be the first frame on a unix connection, carry one
// descriptor, and come once.
func (sc *serverConn) attach(h Header, fds []int, first bool) {
	defer closeFDs(fds) // the mapping keeps the memory; the descriptor is not needed
	rh := Header{Op: h.Op.Reply(), Seq: h.Seq, Length: h.Length}
	_, isUnix := sc.nc.(*net.UnixConn)
	var err error
	switch {
	case !isUnix:
		err = fmt.Errorf("%w: shared memory needs a unix socket", CodeUnsupported)
	case first && len(fds) == 1:
		var m *shm.Mapping
		if m, err = shm.Map(fds[0], uint64(h.Length)); err == nil {
			sc.shared = m
			sc.log.V(1).Info("shared memory attached", "bytes", h.Length)
		} else {
			err = fmt.Errorf("%w: %w", CodeInvalid, err)
		}
	default:
		err = fmt.Errorf("%w: attach must be a connection's first frame and carry exactly one memfd (got %d descriptors)", CodeInvalid, len(fds))
	}
	if err != nil {
		sc.replyError(rh, err)
		return
	}
	sc.reply(rh, nil, false)
}

// sharedData returns the data of a write with FlagShared: the request's
// length of bytes at the offset its payload names, in the shared memory.
func (sc *serverConn) sharedData(h Header, ref []byte) ([]byte, error) {
	if sc.shared == nil {
		return nil, fmt.Errorf("%w: a shared-memory write on a connection that attached none", CodeInvalid)
	}
	if h.Length > sc.s.opts.MaxPayload {
		return nil, fmt.Errorf("%w: write of %d bytes exceeds the %d-byte maximum", CodeInvalid, h.Length, sc.s.opts.MaxPayload)
	}
	at := binary.BigEndian.Uint64(ref)
	data, ok := sc.shared.Slice(at, h.Length)
	if !ok {
		return nil, fmt.Errorf("%w: shared-memory write of %d bytes at region offset %d lies outside the region", CodeInvalid, h.Length, at)
	}
	return data, nil
}

// readFirstHeader fills hb from a unix connection with recvmsg and returns
// the descriptors that came with it.
func readFirstHeader(uc *net.UnixConn, hb []byte) ([]int, error) {
	var fds []int
	oob := make([]byte, syscall.CmsgSpace(4*4))
	for n := 0; n < len(hb); {
		k, oobn, _, _, err := uc.ReadMsgUnix(hb[n:], oob)
		if oobn > 0 {
			if msgs, perr := syscall.ParseSocketControlMessage(oob[:oobn]); perr == nil {
				for i := range msgs {
					if rights, rerr := syscall.ParseUnixRights(&msgs[i]); rerr == nil {
						fds = append(fds, rights...)
					}
				}
			}
		}
		n += k
		if err == nil && k == 0 && oobn == 0 {
			err = io.EOF
		}
		if err != nil {
			closeFDs(fds)
			if n > 0 {
				err = unexpectedEOF(err)
			}
			return nil, err
		}
	}
	return fds, nil
}

func closeFDs(fds []int) {
	for _, fd := range fds {
		syscall.Close(fd)
	}
}
