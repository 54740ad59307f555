package dataconn

import (
	"context"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
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

// Client errors. Every error a failed client returns wraps ErrClientFailed
// and the cause (ErrConnectionLost, ErrTimeout, a decoding error, ...).
var (
	// ErrClientFailed: the client is unusable; dial a new one.
	ErrClientFailed = errors.New("dataconn: client failed")
	// ErrConnectionLost: a connection broke (peer closed, reset, killed).
	ErrConnectionLost = errors.New("dataconn: connection lost")
	// ErrTimeout: a request (or a liveness ping) got no reply in time.
	ErrTimeout = errors.New("dataconn: request timed out")
	// ErrClosed: Close was called.
	ErrClosed = errors.New("dataconn: client closed")
)

// ClientOptions configure a Client. Zero values take the defaults.
type ClientOptions struct {
	// Conns is how many connections to open to the server (Dial only).
	// Requests are spread across them. Default 4.
	Conns int
	// MaxPayload bounds a reply's payload. Default DefaultMaxPayload.
	MaxPayload uint32
	// RequestTimeout bounds each request unless its context has an earlier
	// deadline. Default 10s.
	RequestTimeout time.Duration
	// PingInterval is how often the client pings its server, on one
	// connection at a time in turns (each is pinged every Conns
	// intervals). Default 2s; negative disables liveness pings.
	PingInterval time.Duration
	// PingTimeout bounds a liveness ping. Default 5s.
	PingTimeout time.Duration
	// Pinger, when set, sends this client's liveness pings from its timer,
	// shared with the other clients given it, instead of PingInterval and
	// PingTimeout.
	Pinger *Pinger
	// Logger receives connection-level events. Default: discard.
	Logger logr.Logger
	// Shared, on unix connections (Dial only), is offered to the server
	// on every connection: a write whose data lies in it then sends an
	// offset instead of the bytes (and skips the payload checksum: the
	// bytes cross no wire). A server that refuses it gets plain writes.
	// The region must outlive the client.
	Shared *shm.Region
	// Key, when set, is the volume's key: Dial runs the authentication
	// handshake (auth.go) on every connection before any frame.
	Key []byte
	// HandshakeTimeout bounds each handshake. Default
	// DefaultHandshakeTimeout.
	HandshakeTimeout time.Duration
	// TLS, when set, makes every TCP connection Dial opens a TLS client
	// connection (before the key's handshake): for a server with
	// ServerOptions.TLS. Unix connections stay on the node and are not
	// wrapped (their servers serve them without TLS).
	TLS *tls.Config
}

func (o *ClientOptions) setDefaults() {
	if o.Conns <= 0 {
		o.Conns = 4
	}
	if o.MaxPayload == 0 {
		o.MaxPayload = DefaultMaxPayload
	}
	if o.HandshakeTimeout <= 0 {
		o.HandshakeTimeout = DefaultHandshakeTimeout
	}
	if o.RequestTimeout <= 0 {
		o.RequestTimeout = 10 * time.Second
	}
	if o.PingInterval == 0 {
		o.PingInterval = 2 * time.Second
	}
	if o.PingTimeout <= 0 {
		o.PingTimeout = 5 * time.Second
	}
}

// Client sends requests to one server over one or more connections. It is
// safe for concurrent use; requests are pipelined and complete in any order.
//
// A client fails as a whole: when any connection breaks, a reply is
// malformed, or a request or ping gets no reply before its deadline (or
// its context ends), every connection is closed, every pending request
// fails at once with an error wrapping ErrClientFailed, and later requests
// fail the same way. The engine treats that as the replica failing.
type Client struct {
	opts  ClientOptions
	log   logr.Logger
	conns []*clientConn
	next  atomic.Uint64 // round-robin connection choice
	// pingNext is the connection the next liveness ping goes to, in turns.
	pingNext atomic.Uint64
	seq      atomic.Uint64
	epoch    atomic.Uint64

	frames  atomic.Uint64 // frames sent
	batches atomic.Uint64 // vectored writes that sent them

	repliesByWaiter atomic.Uint64 // replies read by a waiting caller (readUntil)
	repliesByReader atomic.Uint64 // replies read by a connection's readLoop

	shared       *shm.Region   // attached on every connection, or nil
	sharedWrites atomic.Uint64 // writes sent as a reference into shared

	failOnce sync.Once
	done     chan struct{} // closed when the client fails or closes
	err      error         // set before done is closed
	wg       sync.WaitGroup
}

type call struct {
	op      Op
	hdr     [HeaderSize]byte
	payload []byte // sent after the header (writes)
	buf     []byte // read destination
	ref     [SharedRefSize]byte
	err     error
	done    chan struct{}
}

type clientConn struct {
	c  *Client
	nc net.Conn
	w  *batchwrite.Writer[*call] // sends requests

	// Replies are read by whoever holds rmu: a goroutine waiting for its
	// own reply while nobody else reads (readUntil, the queue-depth-1
	// case), or readLoop, woken when calls are pending and their waiters
	// are not reading.
	rmu sync.Mutex
	br  *bufread.Reader
	hb  [HeaderSize]byte
	// wake tells readLoop to read (one token per reader change to
	// readerLoop).
	wake chan struct{}

	mu      sync.Mutex
	closed  bool
	pending map[uint64]*call
	reader  readerState
}

// readerState says who reads a connection's replies.
type readerState uint8

const (
	readerNone   readerState = iota // nobody: replies wait in the socket
	readerInline                    // a waiter, for its own reply (readUntil)
	readerLoop                      // readLoop, until nothing is pending
)

// SplitNetwork maps an address to a network and address for net.Dial and
// net.Listen: "unix:PATH" is the unix socket PATH, anything else is TCP.
func SplitNetwork(addr string) (network, address string) {
	if p, ok := strings.CutPrefix(addr, "unix:"); ok {
		return "unix", p
	}
	return "tcp", addr
}

// Dial opens opts.Conns connections to addr ("tcp" or "unix" network).
func Dial(ctx context.Context, network, addr string, opts ClientOptions) (*Client, error) {
	opts.setDefaults()
	var d net.Dialer
	conns := make([]net.Conn, 0, opts.Conns)
	for range opts.Conns {
		nc, err := d.DialContext(ctx, network, addr)
		timeout := opts.HandshakeTimeout
		if dl, ok := ctx.Deadline(); ok {
			timeout = min(timeout, time.Until(dl))
		}
		if err == nil && opts.TLS != nil && network != "unix" {
			tc := tls.Client(nc, opts.TLS)
			hctx, cancel := context.WithTimeout(ctx, timeout)
			if err = tc.HandshakeContext(hctx); err != nil {
				nc.Close()
				err = fmt.Errorf("TLS: %w", err)
			}
			cancel()
			nc = tc
		}
		if err == nil && opts.Key != nil {
			if err = ClientHandshake(nc, opts.Key, timeout); err != nil {
				nc.Close()
			}
		}
		if err != nil {
			for _, c := range conns {
				c.Close()
			}
			return nil, fmt.Errorf("dataconn: dial %s %s: %w", network, addr, err)
		}
		conns = append(conns, nc)
	}
	shared, err := offerShared(conns, opts)
	if err != nil {
		for _, c := range conns {
			c.Close()
		}
		return nil, fmt.Errorf("dataconn: %s %s: %w", network, addr, err)
	}
	if shared != nil {
		opts.Logger.Info("shared memory attached: writes from it reach the replica without a socket copy", "replica", addr, "bytes", shared.Size())
	}
	c := NewClient(conns, opts)
	c.shared = shared
	return c, nil
}

// offerShared offers opts.Shared on every unix connection, as its first
// frame, and returns it, or nil when there is none to offer or the server
// refused it on any connection (then plain writes are used). A connection
// that breaks while attaching is an error.
func offerShared(conns []net.Conn, opts ClientOptions) (*shm.Region, error) {
	if opts.Shared == nil {
		return nil, nil
	}
	var refused error
	for _, nc := range conns {
		uc, ok := nc.(*net.UnixConn)
		if !ok {
			return nil, nil
		}
		if err := attach(uc, opts.Shared, opts.RequestTimeout); err != nil {
			var re *RemoteError
			if !errors.As(err, &re) {
				return nil, fmt.Errorf("attaching shared memory: %w", err)
			}
			refused = err
		}
	}
	if refused != nil {
		opts.Logger.Info("the replica refused shared memory; writes travel on the socket", "reason", refused.Error())
		return nil, nil
	}
	return opts.Shared, nil
}

// attach sends one connection's first frame, an attach carrying the
// region's descriptor, and reads the server's answer.
func attach(uc *net.UnixConn, r *shm.Region, timeout time.Duration) error {
	var hb [HeaderSize]byte
	PutHeader(hb[:], &Header{Op: OpAttach, Length: uint32(r.Size())})
	if err := uc.SetDeadline(time.Now().Add(timeout)); err != nil {
		return err
	}
	// Clearing the deadline fails only on a closed connection, which the
	// exchange below reports.
	defer func() { _ = uc.SetDeadline(time.Time{}) }()
	if _, _, err := uc.WriteMsgUnix(hb[:], syscall.UnixRights(r.FD()), nil); err != nil {
		return fmt.Errorf("%w: write: %w", ErrConnectionLost, err)
	}
	f, err := Decode(uc, DefaultMaxPayload)
	if err != nil {
		return fmt.Errorf("%w: read: %w", ErrConnectionLost, err)
	}
	if f.Op != OpAttach.Reply() {
		return fmt.Errorf("%w: %s in answer to an attach", ErrMalformed, f.Op)
	}
	if f.Code != CodeOK {
		return &RemoteError{Code: f.Code, Message: string(f.Payload)}
	}
	return nil
}

// NewClient runs a client over already established streams (for example
// both ends of net.Pipe in tests). It takes ownership of them.
func NewClient(streams []net.Conn, opts ClientOptions) *Client {
	opts.setDefaults()
	c := &Client{opts: opts, log: opts.Logger, done: make(chan struct{})}
	for _, nc := range streams {
		cc := &clientConn{c: c, nc: rawio.Wrap(nc), pending: map[uint64]*call{}, wake: make(chan struct{}, 1)}
		cc.br = bufread.NewReader(cc.nc, readBufferSize)
		cc.w = batchwrite.New(cc.nc, batchwrite.Options[*call]{
			Buffers: func(bufs net.Buffers, cl *call) net.Buffers {
				bufs = append(bufs, cl.hdr[:])
				if len(cl.payload) > 0 {
					bufs = append(bufs, cl.payload)
				}
				return bufs
			},
			Done: func(cls []*call, err error) {
				if err == nil {
					c.frames.Add(uint64(len(cls)))
					c.batches.Add(1)
				}
			},
			// Fails every pending call, the ones just written or dropped
			// included: they were registered before they were sent.
			Failed: func(err error) { c.fail(fmt.Errorf("%w: write: %w", ErrConnectionLost, err)) },
			// No bound: a caller must never wait for the connection, or
			// it would not reach Wait, whose deadline is what notices a
			// server that stopped reading (and fails the client, which
			// unblocks the write in progress). The queue holds at most
			// one request per caller.
			Queue:    -1,
			MaxBatch: 128,
		})
		c.conns = append(c.conns, cc)
	}
	// Start only once c.conns is complete: a connection that fails at once
	// makes fail() walk every connection.
	for _, cc := range c.conns {
		c.wg.Add(1)
		go cc.readLoop()
	}
	switch {
	case opts.Pinger != nil:
		opts.Pinger.add(c)
	case opts.PingInterval > 0:
		c.wg.Add(1)
		go c.pingLoop()
	}
	return c
}

// SendStats reports how many frames the client sent and in how many
// vectored writes: frames/batches is the average batch size.
func (c *Client) SendStats() (frames, batches uint64) {
	return c.frames.Load(), c.batches.Load()
}

// ReadStats reports how many replies were read by the caller waiting for
// them (a request alone on its connection, with a context that cannot
// end) and how many by the connections' reader goroutines, which then
// hand them over.
func (c *Client) ReadStats() (byWaiter, byReader uint64) {
	return c.repliesByWaiter.Load(), c.repliesByReader.Load()
}

// SharedWrites reports how many writes were sent as a reference into the
// shared memory (zero when the server did not attach it).
func (c *Client) SharedWrites() uint64 { return c.sharedWrites.Load() }

// SetEpoch sets the epoch carried by every later request.
func (c *Client) SetEpoch(e uint64) { c.epoch.Store(e) }

// Epoch returns the epoch carried by requests.
func (c *Client) Epoch() uint64 { return c.epoch.Load() }

// Done is closed when the client has failed or been closed; Err says why.
func (c *Client) Done() <-chan struct{} { return c.done }

// Err returns why the client stopped, or nil while it works.
func (c *Client) Err() error {
	select {
	case <-c.done:
		return c.err
	default:
		return nil
	}
}

// Close closes the connections; pending requests fail with ErrClosed.
func (c *Client) Close() error {
	c.fail(ErrClosed)
	c.wg.Wait()
	return nil
}

// ReadAt reads len(p) bytes at off.
func (c *Client) ReadAt(ctx context.Context, p []byte, off int64) error {
	return c.do(ctx, &call{op: OpRead, buf: p}, Header{Op: OpRead, Offset: uint64(off), Length: uint32(len(p))})
}

// ReadSnapshotAt reads len(p) bytes at off of the view at snapshot name
// (OpSnapshotRead) into p, holes as zeros. It carries no epoch check: a
// reader beside the engine (a backup) uses it. A server that does not
// serve snapshot reads answers CodeUnsupported; one older than the op
// closes the connection, which fails the client (ErrConnectionLost).
func (c *Client) ReadSnapshotAt(ctx context.Context, p []byte, name string, off int64) error {
	if len(name) == 0 || len(name) > MaxSnapshotNameLen {
		return fmt.Errorf("dataconn: snapshot name of %d bytes: want 1 to %d", len(name), MaxSnapshotNameLen)
	}
	if len(p) == 0 {
		return fmt.Errorf("dataconn: snapshot read of no bytes")
	}
	return c.do(ctx, &call{op: OpSnapshotRead, payload: []byte(name), buf: p},
		Header{Op: OpSnapshotRead, Offset: uint64(off), Length: uint32(len(p))})
}

// WriteAt writes p at off; with fua the data is durable before it returns.
func (c *Client) WriteAt(ctx context.Context, p []byte, off int64, fua bool) error {
	return c.StartWriteAt(p, off, fua).Wait(ctx)
}

// Flush makes every write that completed before it durable on the server.
func (c *Client) Flush(ctx context.Context) error {
	return c.do(ctx, &call{op: OpFlush}, Header{Op: OpFlush})
}

// FlushClean is a clean flush (FlushOffsetClean): only for an engine that
// has no write in flight and every write it completed on every replica of
// a set that is not degraded. A server that cannot clean flushes plainly.
func (c *Client) FlushClean(ctx context.Context) error {
	return c.do(ctx, &call{op: OpFlush}, Header{Op: OpFlush, Offset: FlushOffsetClean})
}

// Unmap discards length bytes at off; they read as zeros afterwards.
func (c *Client) Unmap(ctx context.Context, off, length int64) error {
	return c.do(ctx, &call{op: OpUnmap}, Header{Op: OpUnmap, Offset: uint64(off), Length: uint32(length)})
}

// Ping checks that the server answers.
func (c *Client) Ping(ctx context.Context) error {
	return c.do(ctx, &call{op: OpPing}, Header{Op: OpPing})
}

func (c *Client) do(ctx context.Context, cl *call, h Header) error { return c.start(cl, h).Wait(ctx) }

// start checks a request's size and starts it on the next connection.
func (c *Client) start(cl *call, h Header) *Pending {
	// The payload goes in the request, buf is filled from the reply: each
	// is one frame's payload.
	if n := max(len(cl.payload), len(cl.buf)); n > int(c.opts.MaxPayload) {
		return &Pending{err: fmt.Errorf("dataconn: %s of %d bytes exceeds the %d-byte maximum", h.Op, n, c.opts.MaxPayload)}
	}
	return c.startOn(c.conns[c.next.Add(1)%uint64(len(c.conns))], cl, h, c.opts.RequestTimeout)
}

// Pending is a request that was sent and may still be waiting for its
// reply (see StartWriteAt).
type Pending struct {
	c        *Client
	cc       *clientConn // nil if the request ended before it was sent (err)
	cl       *call
	op       Op
	seq      uint64
	deadline time.Time
	timeout  time.Duration
	err      error
}

// StartWriteAt sends a write and returns without waiting for its reply:
// a caller writing to several servers sends to all of them from one
// goroutine, then waits for each. p must stay untouched until Wait
// returns.
func (c *Client) StartWriteAt(p []byte, off int64, fua bool) *Pending {
	h := Header{Op: OpWrite, Offset: uint64(off), Length: uint32(len(p))}
	if fua {
		h.Flags = FlagFUA
	}
	cl := &call{op: OpWrite, payload: p}
	if c.shared != nil && uint32(len(p)) <= c.opts.MaxPayload {
		if at, ok := c.shared.Offset(p); ok {
			h.Flags |= FlagShared
			binary.BigEndian.PutUint64(cl.ref[:], at)
			cl.payload = cl.ref[:]
			c.sharedWrites.Add(1)
		}
	}
	return c.start(cl, h)
}

// startOn registers cl on cc and sends it, or queues it for the writer.
func (c *Client) startOn(cc *clientConn, cl *call, h Header, timeout time.Duration) *Pending {
	h.Seq = c.seq.Add(1)
	if h.Op != OpPing {
		h.Epoch = c.epoch.Load()
	}
	h.PayloadLen = uint32(len(cl.payload))
	h.PayloadCRC = Checksum(cl.payload)
	PutHeader(cl.hdr[:], &h)
	cl.done = make(chan struct{})
	p := &Pending{c: c, cl: cl, op: h.Op, seq: h.Seq, timeout: timeout}

	// Register before sending, so the reply (or a failure) always finds it.
	cc.mu.Lock()
	if cc.closed {
		cc.mu.Unlock()
		p.err = c.err
		return p
	}
	cc.pending[h.Seq] = cl
	cc.mu.Unlock()

	// Sent from this goroutine when nobody else is writing (queue depth 1:
	// no hand-off), else queued for the goroutine writing, which sends
	// everything queued in one vectored write, so a burst costs one
	// syscall. A send that fails fails the client, which completes cl (it
	// was registered).
	cc.w.Send(cl)
	p.cc, p.deadline = cc, time.Now().Add(timeout)
	return p
}

// Wait waits for the reply of a started request; the request's deadline
// runs from when it was started. A ctx that ends first fails the client,
// as for the synchronous calls.
func (p *Pending) Wait(ctx context.Context) error {
	if p.cc == nil {
		return p.err
	}
	c, cl := p.c, p.cl
	// An answer that is in already wins over a deadline that has passed
	// meanwhile (the caller may have been waiting for other requests):
	// select alone would pick between them at random.
	if cl.completed() {
		return cl.err
	}
	// With a context that cannot end (the engine's), read the reply here
	// if nobody else is reading this connection: no hand-off.
	if ctx.Done() == nil && p.cc.readUntil(p) {
		<-cl.done
		return cl.err
	}
	p.cc.ensureReader()
	// Another goroutine reads for us: it may still have to get to an
	// answer that is in, so a lapsed deadline gets a grace.
	timer := time.NewTimer(max(time.Until(p.deadline), lapsedWaitGrace))
	defer timer.Stop()
	if cl.completed() { // over a context that ended meanwhile, too
		return cl.err
	}
	select {
	case <-cl.done:
		return cl.err
	case <-timer.C:
		c.fail(fmt.Errorf("%w: %s seq %d got no reply within %s", ErrTimeout, p.op, p.seq, p.timeout))
	case <-ctx.Done():
		c.fail(fmt.Errorf("%s seq %d abandoned: %w", p.op, p.seq, ctx.Err()))
	}
	// The call is completed by fail() or, if the reader already claimed it,
	// by the reader once its read fails on the closed connection. Waiting
	// here means p is never written after we return.
	<-cl.done
	return cl.err
}

// fail stops the client once: it records why, closes every connection and
// completes every pending call with the error.
func (c *Client) fail(cause error) {
	c.failOnce.Do(func() {
		if errors.Is(cause, ErrClosed) {
			c.err = cause
		} else {
			c.err = fmt.Errorf("%w: %w", ErrClientFailed, cause)
			c.log.Info("dataconn client failed", "reason", cause.Error())
		}
		close(c.done)
		for _, cc := range c.conns {
			cc.mu.Lock()
			cc.closed = true
			pending := cc.pending
			cc.pending = nil
			cc.mu.Unlock()
			cc.nc.Close()
			for _, cl := range pending {
				cl.complete(c.err)
			}
		}
	})
}

func (cl *call) complete(err error) {
	cl.err = err
	close(cl.done)
}

func (cl *call) completed() bool {
	select {
	case <-cl.done:
		return true
	default:
		return false
	}
}

// An answer that is in wins over a deadline that passed before Wait was
// called (the caller may have been waiting for other requests). Replies
// are read only while someone waits, so such an answer may still be in
// the socket: the waiter gets a grace to read it (lapsedReadGrace), or
// for the reader goroutine to (lapsedWaitGrace); long enough to take an
// answer that is there, short against any request timeout.
const (
	lapsedReadGrace = 5 * time.Millisecond
	lapsedWaitGrace = 100 * time.Millisecond
)

// readUntil reads replies from this goroutine until p's call is complete,
// when it is the only call on cc (or its deadline has passed) and nobody
// else is reading: at queue depth 1 the waiter gets its answer straight from the socket, without
// readLoop handing it over (a goroutine hand-off the scheduler pays a
// thread wake-up for). Replies to calls started meanwhile, read on the
// way, complete those. It returns false, having read nothing, when
// another goroutine reads cc. A read that fails, or p's deadline passing,
// fails the client, as in Wait.
func (cc *clientConn) readUntil(p *Pending) bool {
	lapsed := time.Now().After(p.deadline)
	cc.mu.Lock()
	// Only for a call alone on the connection: with more in flight,
	// readLoop keeps reading (and the waiters are handed their answers),
	// rather than each waiter reading a while and waking it again. Except
	// when the deadline has passed: then read the answer that may be in
	// at once, rather than wait for readLoop to be scheduled.
	if cc.closed || cc.reader != readerNone || (len(cc.pending) != 1 && !lapsed) {
		cc.mu.Unlock()
		return false
	}
	cc.reader = readerInline
	cc.mu.Unlock()

	cc.rmu.Lock()
	deadline := p.deadline
	if now := time.Now(); deadline.Before(now) {
		deadline = now.Add(lapsedReadGrace)
	}
	var err error
	if err = cc.nc.SetReadDeadline(deadline); err == nil {
		for err == nil && !p.cl.completed() {
			err = cc.readReply(&cc.c.repliesByWaiter)
		}
		if derr := cc.nc.SetReadDeadline(time.Time{}); err == nil {
			err = derr
		}
	}
	cc.rmu.Unlock()

	cc.mu.Lock()
	cc.reader = readerNone
	if err == nil && len(cc.pending) > 0 && !cc.closed {
		// Calls started meanwhile whose answers are still to come.
		cc.reader = readerLoop
		cc.wakeLoop()
	}
	cc.mu.Unlock()
	if err != nil {
		if errors.Is(err, os.ErrDeadlineExceeded) {
			err = fmt.Errorf("%w: %s seq %d got no reply within %s", ErrTimeout, p.op, p.seq, p.timeout)
		}
		cc.c.fail(err) // completes p's call
	}
	return true
}

// ensureReader wakes readLoop if nobody reads cc.
func (cc *clientConn) ensureReader() {
	cc.mu.Lock()
	if cc.reader == readerNone && !cc.closed {
		cc.reader = readerLoop
		cc.wakeLoop()
	}
	cc.mu.Unlock()
}

// wakeLoop hands readLoop its token (under mu).
func (cc *clientConn) wakeLoop() {
	select {
	case cc.wake <- struct{}{}:
	default:
	}
}

// claim removes and returns the pending call for seq, or nil.
func (cc *clientConn) claim(seq uint64) *call {
	cc.mu.Lock()
	defer cc.mu.Unlock()
	cl := cc.pending[seq]
	delete(cc.pending, seq)
	return cl
}

// readLoop reads replies when woken (ensureReader, readUntil) until no
// call is pending. While nobody reads, a connection's replies wait in the
// socket for their waiters, and a server that goes away unasked is
// noticed by the next request or liveness ping.
func (cc *clientConn) readLoop() {
	defer cc.c.wg.Done()
	for {
		select {
		case <-cc.wake:
		case <-cc.c.done:
			return
		}
		cc.rmu.Lock()
		for {
			if err := cc.readReply(&cc.c.repliesByReader); err != nil {
				cc.rmu.Unlock()
				cc.c.fail(err)
				return
			}
			cc.mu.Lock()
			idle := len(cc.pending) == 0
			if idle {
				cc.reader = readerNone
			}
			cc.mu.Unlock()
			if idle {
				break
			}
		}
		cc.rmu.Unlock()
	}
}

// readReply reads one reply, completes its call and counts it in n (under
// rmu). An error means the connection is unusable; the caller fails the
// client.
func (cc *clientConn) readReply(n *atomic.Uint64) error {
	if err := cc.br.Header(cc.hb[:]); err != nil {
		return fmt.Errorf("%w: read: %w", ErrConnectionLost, err)
	}
	h, err := ParseHeader(cc.hb[:], cc.c.opts.MaxPayload)
	if err == nil && !h.Op.IsReply() {
		err = fmt.Errorf("%w: the server sent a request (%s)", ErrMalformed, h.Op)
	}
	if err != nil {
		return err
	}
	cl := cc.claim(h.Seq)
	n.Add(1) // before the call completes: its caller may look at once
	if err := cc.complete(cc.br, cl, h); err != nil {
		if cl != nil {
			cl.complete(fmt.Errorf("%w: %w", ErrClientFailed, err))
		}
		return err
	}
	return nil
}

// complete reads the reply's payload and completes cl (nil when the call
// is no longer pending). A returned error means the stream is unusable.
func (cc *clientConn) complete(br *bufread.Reader, cl *call, h Header) error {
	if cl == nil {
		if err := br.Discard(int64(h.PayloadLen)); err != nil {
			return fmt.Errorf("%w: read: %w", ErrConnectionLost, unexpectedEOF(err))
		}
		return nil
	}
	if h.Op.Request() != cl.op {
		return fmt.Errorf("%w: reply %s to a %s request (seq %d)", ErrMalformed, h.Op, cl.op, h.Seq)
	}
	var dst []byte
	switch {
	case h.Code != CodeOK:
		dst = make([]byte, h.PayloadLen)
	case cl.op == OpRead || cl.op == OpSnapshotRead:
		if int(h.PayloadLen) != len(cl.buf) {
			return fmt.Errorf("%w: read reply of %d bytes to a %d-byte read (seq %d)", ErrMalformed, h.PayloadLen, len(cl.buf), h.Seq)
		}
		dst = cl.buf
	}
	if len(dst) > 0 {
		if err := br.Payload(dst); err != nil {
			return fmt.Errorf("%w: read: %w", ErrConnectionLost, unexpectedEOF(err))
		}
	}
	if got := Checksum(dst); got != h.PayloadCRC {
		return fmt.Errorf("%w: %s seq %d", ErrPayloadChecksum, h.Op, h.Seq)
	}
	if h.Code != CodeOK {
		cl.complete(&RemoteError{Code: h.Code, Message: string(dst)})
		return nil
	}
	cl.complete(nil)
	return nil
}
