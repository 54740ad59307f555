package nbd

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"

	"github.com/go-logr/logr"

	"github.com/cairn-io/cairn/dataplane/dataconn"
	"github.com/cairn-io/cairn/dataplane/frontend"
	"github.com/cairn-io/cairn/dataplane/internal/batchwrite"
	"github.com/cairn-io/cairn/dataplane/internal/bufread"
	"github.com/cairn-io/cairn/dataplane/internal/rawio"
	"github.com/cairn-io/cairn/dataplane/internal/shm"
)

// Device is the block device served (see frontend.Device).
type Device = frontend.Device

// Options configure a Server.
type Options struct {
	// ExportName is the export's name; clients asking for "" get it too.
	ExportName string
	// MaxInFlight bounds concurrent requests per connection. Default 128.
	MaxInFlight int
	Logger      logr.Logger
	// Buffers hands out request buffers. The engine passes an arena over
	// the memory it shares with replicas on its node, so a write's payload
	// is read from the client straight into memory the replica writes
	// from. Default: an arena on the Go heap.
	Buffers *shm.Arena
}

// Server serves one Device to any number of NBD clients.
type Server struct {
	dev  Device
	opts Options
	log  logr.Logger

	mu     sync.Mutex
	conns  map[net.Conn]struct{}
	closed bool
	done   chan struct{} // closed when closed is set: ends an accept back-off
	wg     sync.WaitGroup
}

// NewServer returns a Server for dev.
func NewServer(dev Device, opts Options) *Server {
	if opts.MaxInFlight <= 0 {
		opts.MaxInFlight = 128
	}
	if opts.Buffers == nil {
		opts.Buffers = shm.NewArena(nil)
	}
	return &Server{dev: dev, opts: opts, log: opts.Logger, conns: map[net.Conn]struct{}{}, done: make(chan struct{})}
}

// Serve accepts clients on l until Close, then returns nil. Transient
// accept failures (a process out of descriptors and the like, see
// dataconn.TransientAcceptError) are retried with a back-off and logged:
// the volume's clients must be able to reconnect once they pass. It
// returns the listener's error when accepting fails for good (the
// listener was closed under it, say).
func (s *Server) Serve(l net.Listener) error {
	a := dataconn.NewAcceptor(l, dataconn.AcceptOptions{Logger: s.log, Done: s.done})
	for {
		c, err := a.Accept()
		if err != nil {
			s.mu.Lock()
			closed := s.closed
			s.mu.Unlock()
			if closed {
				return nil
			}
			return err
		}
		if !s.track(c) {
			return nil
		}
		go s.run(c, s.serveConn)
	}
}

// ServeTransmission serves c, a connection already in the transmission
// phase with the transmission flags of TransmissionFlags: the kernel's nbd
// driver, connected through netlink, sends requests on it without a
// handshake. It returns when the peer disconnects or the server closes.
func (s *Server) ServeTransmission(c net.Conn) {
	if !s.track(c) {
		return
	}
	s.run(c, s.transmit)
}

// Clients is how many connections the server is serving now.
func (s *Server) Clients() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.conns)
}

// TransmissionFlags are the flags the server announces for its export.
func (s *Server) TransmissionFlags() uint16 { return transmissionFlagsBase }

// track registers c so that Close disconnects it; false if already closed.
func (s *Server) track(c net.Conn) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		c.Close()
		return false
	}
	s.conns[c] = struct{}{}
	s.wg.Add(1)
	return true
}

// run serves a tracked connection with serve, then closes and forgets it.
func (s *Server) run(c net.Conn, serve func(net.Conn) error) {
	defer s.wg.Done()
	// A deadline ends a connection only when KernelDevice.Leave stops it.
	if err := serve(c); err != nil && !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) && !errors.Is(err, os.ErrDeadlineExceeded) {
		s.log.Info("nbd client closed", "reason", err.Error())
	}
	c.Close()
	s.mu.Lock()
	delete(s.conns, c)
	s.mu.Unlock()
}

// Close disconnects every client and waits for their requests to end.
func (s *Server) Close() error {
	s.mu.Lock()
	if !s.closed {
		s.closed = true
		close(s.done)
	}
	for c := range s.conns {
		c.Close()
	}
	s.mu.Unlock()
	s.wg.Wait()
	return nil
}

func (s *Server) serveConn(c net.Conn) error {
	if err := s.handshake(c); err != nil {
		return err
	}
	return s.transmit(c)
}

// handshake runs the fixed-newstyle negotiation until the client picks the
// export (EXPORT_NAME or GO). It returns an error to close the connection.
func (s *Server) handshake(c net.Conn) error {
	noZeroes, err := greet(c)
	if err != nil {
		return err
	}
	for {
		opt, data, err := readOption(c)
		if err != nil {
			return err
		}
		if done, err := s.option(c, opt, data, noZeroes); done || err != nil {
			return err
		}
	}
}

// greet sends the server's hello and checks the client's flags; noZeroes:
// the client wants no 124 zero bytes after EXPORT_NAME's reply.
func greet(c net.Conn) (noZeroes bool, err error) {
	var hello [18]byte
	binary.BigEndian.PutUint64(hello[0:], magicNBD)
	binary.BigEndian.PutUint64(hello[8:], magicOpt)
	binary.BigEndian.PutUint16(hello[16:], flagFixedNewstyle|flagNoZeroes)
	if _, err := c.Write(hello[:]); err != nil {
		return false, err
	}
	var cf [4]byte
	if _, err := io.ReadFull(c, cf[:]); err != nil {
		return false, err
	}
	clientFlags := binary.BigEndian.Uint32(cf[:])
	if clientFlags&clientFixed == 0 {
		return false, errors.New("client does not speak fixed newstyle")
	}
	if clientFlags&^(clientFixed|clientNoZeroes) != 0 {
		return false, fmt.Errorf("unknown client flags 0x%x", clientFlags)
	}
	return clientFlags&clientNoZeroes != 0, nil
}

// readOption reads one option request: its number and its data (at most
// maxOptionLength bytes).
func readOption(c net.Conn) (opt uint32, data []byte, err error) {
	var oh [16]byte
	if _, err := io.ReadFull(c, oh[:]); err != nil {
		return 0, nil, err
	}
	if binary.BigEndian.Uint64(oh[0:]) != magicOpt {
		return 0, nil, errors.New("bad option magic")
	}
	opt = binary.BigEndian.Uint32(oh[8:])
	n := binary.BigEndian.Uint32(oh[12:])
	if n > maxOptionLength {
		return 0, nil, fmt.Errorf("option %d: %d bytes of data is too long", opt, n)
	}
	data = make([]byte, n)
	if _, err := io.ReadFull(c, data); err != nil {
		return 0, nil, err
	}
	return opt, data, nil
}

// option answers one option; done: the negotiation is over (the client
// picked the export, or aborted with io.EOF).
func (s *Server) option(c net.Conn, opt uint32, data []byte, noZeroes bool) (done bool, err error) {
	switch opt {
	case optExportName:
		return true, s.exportName(c, data, noZeroes)
	case optAbort:
		_ = s.optReply(c, opt, repAck, nil) // the client leaves whether or not the ack reaches it
		return true, io.EOF
	case optList:
		return false, s.list(c, opt, data)
	case optInfo, optGo:
		return s.infoGo(c, opt, data)
	default: // STARTTLS, STRUCTURED_REPLY, META_CONTEXT, ...: not supported
		return false, s.optReply(c, opt, repErrUnsup, nil)
	}
}

// exportName answers EXPORT_NAME, which ends the negotiation: the size and
// transmission flags, or an error (closing the connection) for an unknown
// export.
func (s *Server) exportName(c net.Conn, data []byte, noZeroes bool) error {
	if !s.nameOK(string(data)) {
		return fmt.Errorf("unknown export %q", data)
	}
	reply := make([]byte, 10, 10+124)
	binary.BigEndian.PutUint64(reply[0:], uint64(s.dev.Size()))
	binary.BigEndian.PutUint16(reply[8:], s.TransmissionFlags())
	if !noZeroes {
		reply = append(reply, make([]byte, 124)...)
	}
	_, err := c.Write(reply)
	return err
}

// list answers LIST with the one export's name.
func (s *Server) list(c net.Conn, opt uint32, data []byte) error {
	if len(data) != 0 {
		return s.optReply(c, opt, repErrInvalid, []byte("LIST takes no data"))
	}
	name := []byte(s.opts.ExportName)
	d := binary.BigEndian.AppendUint32(nil, uint32(len(name)))
	if err := s.optReply(c, opt, repServer, append(d, name...)); err != nil {
		return err
	}
	return s.optReply(c, opt, repAck, nil)
}

// infoGo answers INFO and GO: the export's size, flags and block sizes;
// done after a GO answered so.
func (s *Server) infoGo(c net.Conn, opt uint32, data []byte) (done bool, err error) {
	name, ok := parseInfoRequest(data)
	switch {
	case !ok:
		return false, s.optReply(c, opt, repErrInvalid, []byte("malformed INFO/GO request"))
	case !s.nameOK(name):
		return false, s.optReply(c, opt, repErrUnknown, []byte("no such export: "+name))
	}
	ex := binary.BigEndian.AppendUint16(nil, infoExport)
	ex = binary.BigEndian.AppendUint64(ex, uint64(s.dev.Size()))
	ex = binary.BigEndian.AppendUint16(ex, s.TransmissionFlags())
	bs := binary.BigEndian.AppendUint16(nil, infoBlockSize)
	bs = binary.BigEndian.AppendUint32(bs, 512)        // minimum
	bs = binary.BigEndian.AppendUint32(bs, 4096)       // preferred
	bs = binary.BigEndian.AppendUint32(bs, MaxRequest) // maximum
	for _, r := range []struct {
		rep  uint32
		data []byte
	}{{repInfo, ex}, {repInfo, bs}, {repAck, nil}} {
		if err := s.optReply(c, opt, r.rep, r.data); err != nil {
			return false, err
		}
	}
	return opt == optGo, nil
}

func (s *Server) nameOK(name string) bool { return name == "" || name == s.opts.ExportName }

// parseInfoRequest reads the export name out of an INFO/GO request.
func parseInfoRequest(d []byte) (string, bool) {
	if len(d) < 4 {
		return "", false
	}
	n := binary.BigEndian.Uint32(d)
	if uint64(n)+6 > uint64(len(d)) {
		return "", false
	}
	name := string(d[4 : 4+n])
	k := binary.BigEndian.Uint16(d[4+n:])
	if int(4+n+2+2*uint32(k)) != len(d) {
		return "", false
	}
	return name, true
}

func (s *Server) optReply(c net.Conn, opt, typ uint32, data []byte) error {
	b := make([]byte, 20, 20+len(data))
	binary.BigEndian.PutUint64(b[0:], magicOptReply)
	binary.BigEndian.PutUint32(b[8:], opt)
	binary.BigEndian.PutUint32(b[12:], typ)
	binary.BigEndian.PutUint32(b[16:], uint32(len(data)))
	_, err := c.Write(append(b, data...))
	return err
}

// transmit serves requests until DISC or a broken connection. Requests run
// concurrently; replies go out as they complete, matched by handle.
func (s *Server) transmit(c net.Conn) error {
	c = rawio.Wrap(c)
	rw := s.replyWriter(c)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	sem := make(chan struct{}, s.opts.MaxInFlight)
	var inflight sync.WaitGroup
	defer inflight.Wait() // every request read is answered and its reply written
	var hdr [28]byte
	br := bufread.NewReader(c, 256<<10) // many requests per read syscall
	var active atomic.Int32             // requests running in goroutines
	for {
		if err := br.Header(hdr[:]); err != nil {
			return err
		}
		if binary.BigEndian.Uint32(hdr[0:]) != magicRequest {
			return errors.New("bad request magic")
		}
		flags := binary.BigEndian.Uint16(hdr[4:])
		typ := binary.BigEndian.Uint16(hdr[6:])
		handle := binary.BigEndian.Uint64(hdr[8:])
		off := binary.BigEndian.Uint64(hdr[16:])
		length := binary.BigEndian.Uint32(hdr[24:])

		var payload []byte
		if typ == cmdWrite {
			if length > MaxRequest {
				// We cannot trust the stream to carry that much; drop the client.
				return fmt.Errorf("write of %d bytes exceeds the %d-byte maximum", length, MaxRequest)
			}
			payload = s.opts.Buffers.Get(int(length))
			if err := br.Payload(payload); err != nil {
				s.opts.Buffers.Put(payload)
				return err
			}
		}
		if typ == cmdDisc {
			return nil // inflight requests finish (deferred Wait), then close
		}
		serve := func() {
			data, errno := s.do(ctx, typ, flags, int64(off), int64(length), payload)
			s.opts.Buffers.Put(payload)
			rw.Send(simpleReply(handle, errno, data, s.opts.Buffers)) // a failed write closes c: the reader sees it and ends the loop
		}
		if br.Idle() && active.Load() == 0 && (typ == cmdRead || typ == cmdWrite) {
			serve() // queue depth 1: no hand-off to another goroutine
			continue
		}
		sem <- struct{}{}
		inflight.Add(1)
		active.Add(1)
		go func() {
			defer func() { active.Add(-1); <-sem; inflight.Done() }()
			serve()
		}()
	}
}

// pendingReply is a simple reply on its way out.
type pendingReply struct {
	hdr  [16]byte
	data []byte // from the buffer arena; goes back once written
}

// simpleReply builds the reply to handle. Read data goes with a success;
// with an error it goes back to arena at once.
func simpleReply(handle uint64, errno uint32, data []byte, arena *shm.Arena) pendingReply {
	var r pendingReply
	binary.BigEndian.PutUint32(r.hdr[0:], magicSimpleRep)
	binary.BigEndian.PutUint32(r.hdr[4:], errno)
	binary.BigEndian.PutUint64(r.hdr[8:], handle)
	if errno == 0 {
		r.data = data
	} else {
		arena.Put(data)
	}
	return r
}

// replyWriter sends the replies of one connection: a lone reply (queue
// depth 1) straight from the goroutine that has it, replies finishing
// together in one vectored write. A write that fails closes c; the
// request reader sees that and stops.
func (s *Server) replyWriter(c net.Conn) *batchwrite.Writer[pendingReply] {
	return batchwrite.New(c, batchwrite.Options[pendingReply]{
		Buffers: func(bufs net.Buffers, r pendingReply) net.Buffers {
			bufs = append(bufs, r.hdr[:])
			if len(r.data) > 0 {
				bufs = append(bufs, r.data)
			}
			return bufs
		},
		Done: func(rs []pendingReply, _ error) {
			for i := range rs {
				s.opts.Buffers.Put(rs[i].data)
			}
		},
		Failed: func(error) { c.Close() },
		// Never full: a request is answered by the reader goroutine itself
		// or by one of at most MaxInFlight others.
		Queue: s.opts.MaxInFlight + 1,
		// Replies of all that finish together leave in one write.
		MaxBatch: s.opts.MaxInFlight + 1,
	})
}

// do runs one command and returns read data and an NBD error number.
func (s *Server) do(ctx context.Context, typ, flags uint16, off, length int64, payload []byte) ([]byte, uint32) {
	size := s.dev.Size()
	inRange := off >= 0 && length >= 0 && off <= size && length <= size-off
	fua := flags&cmdFlagFUA != 0
	switch typ {
	case cmdRead:
		if length > MaxRequest {
			return nil, errOverflow
		}
		if !inRange {
			return nil, errInval
		}
		p := s.opts.Buffers.Get(int(length))
		if err := s.dev.ReadAt(ctx, p, off); err != nil {
			s.opts.Buffers.Put(p)
			return nil, s.errno("read", err)
		}
		return p, 0
	case cmdWrite:
		if !inRange {
			return nil, errNoSpc
		}
		return nil, s.errno("write", s.dev.WriteAt(ctx, payload, off, fua))
	case cmdFlush:
		return nil, s.errno("flush", s.dev.Flush(ctx))
	case cmdTrim:
		if !inRange {
			return nil, errNoSpc
		}
		err := s.dev.Unmap(ctx, off, length)
		if err == nil && fua {
			err = s.dev.Flush(ctx)
		}
		return nil, s.errno("trim", err)
	case cmdWriteZeroes:
		if !inRange {
			return nil, errNoSpc
		}
		var err error
		if flags&cmdFlagNoHole != 0 {
			// The client wants the space allocated: write real zeros.
			zero := make([]byte, min(length, 1<<20))
			for done := int64(0); done < length && err == nil; done += int64(len(zero)) {
				n := min(int64(len(zero)), length-done)
				err = s.dev.WriteAt(ctx, zero[:n], off+done, false)
			}
		} else {
			err = s.dev.Unmap(ctx, off, length) // unmapped ranges read as zeros
		}
		if err == nil && fua {
			err = s.dev.Flush(ctx)
		}
		return nil, s.errno("write zeroes", err)
	}
	return nil, errInval
}

func (s *Server) errno(what string, err error) uint32 {
	switch {
	case err == nil:
		return 0
	case errors.Is(err, syscall.ENOSPC):
		return errNoSpc
	case errors.Is(err, context.Canceled):
		return errShutdown
	}
	s.log.Info("nbd request failed", "op", what, "error", err.Error())
	return errIO
}
