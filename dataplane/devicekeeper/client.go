package devicekeeper

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/go-logr/logr"
)

// Client is an engine's link to the keeper. It keeps one connection open
// (the keeper counts it as the engine being alive) and, whenever it
// connects anew (the keeper restarted and lost its table), deposits again
// every session this process serves.
type Client struct {
	path string
	log  logr.Logger

	mu        sync.Mutex         // serialises requests; guards the fields below
	conn      *link              // nil while disconnected
	connected chan struct{}      // closed once conn is set; replaced when it breaks
	tried     chan struct{}      // closed after the first attempt to connect
	serving   map[string]deposit // sessions this process serves, by volume
	closed    bool

	done chan struct{} // closed by Close
	wg   sync.WaitGroup
}

// deposit is a session this process serves and the descriptors it owns.
type deposit struct {
	session Session
	files   Files
}

// link is one connection and the answers read from it.
type link struct {
	c       *net.UnixConn
	answers chan answer
	dead    chan struct{} // closed when the connection failed
}

type answer struct {
	resp response
	fds  []int
}

// reconnectMax is the longest wait between attempts to reach the keeper.
const reconnectMax = 2 * time.Second

// NewClient starts a client of the keeper at path; it connects in the
// background, again whenever the connection breaks, until Close.
func NewClient(path string, log logr.Logger) *Client {
	c := &Client{path: path, log: log, connected: make(chan struct{}), tried: make(chan struct{}), serving: map[string]deposit{}, done: make(chan struct{})}
	c.wg.Add(1)
	go c.maintain()
	return c
}

// maintain connects, deposits what this process serves, waits for the
// connection to break, and starts again.
func (c *Client) maintain() {
	defer c.wg.Done()
	wait := 50 * time.Millisecond
	logged := false
	var once sync.Once
	defer once.Do(func() { close(c.tried) })
	for {
		l, err := c.dial()
		if err != nil {
			once.Do(func() { close(c.tried) })
			if !logged {
				c.log.Info("cannot reach the device keeper; retrying in the background: until it answers, a restart of this engine fails the I/O in flight on its device", "socket", c.path, "reason", err.Error())
				logged = true
			}
			select {
			case <-c.done:
				return
			case <-time.After(wait):
			}
			wait = min(2*wait, reconnectMax)
			continue
		}
		wait, logged = 50*time.Millisecond, false
		if !c.adopt(l) {
			l.c.Close()
			return
		}
		once.Do(func() { close(c.tried) })
		select {
		case <-l.dead:
			c.log.Info("lost the device keeper; reconnecting", "socket", c.path)
		case <-c.done:
		}
		c.mu.Lock()
		c.conn = nil
		c.connected = make(chan struct{})
		c.mu.Unlock()
		l.c.Close()
	}
}

func (c *Client) dial() (*link, error) {
	conn, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: c.path, Net: "unixpacket"})
	if err != nil {
		return nil, err
	}
	l := &link{c: conn, answers: make(chan answer, 1), dead: make(chan struct{})}
	go l.read()
	return l, nil
}

// read hands each message to the waiting request, until the connection
// fails.
func (l *link) read() {
	defer close(l.dead)
	buf, oob := make([]byte, MaxMessage), make([]byte, oobSpace)
	for {
		b, fds, err := readMessage(l.c, buf, oob)
		if err != nil {
			return
		}
		var a answer
		a.fds = fds
		if err := decodeResponse(b, &a.resp); err != nil {
			closeAll(fds)
			return // a keeper that sends garbage: reconnect
		}
		select {
		case l.answers <- a:
		default:
			closeAll(fds) // nobody asked: never happens with a keeper that answers once per request
			return
		}
	}
}

// adopt makes l the connection and deposits again every session this
// process serves. False if the client is closed.
func (c *Client) adopt(l *link) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return false
	}
	c.conn = l
	for v, d := range c.serving {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		_, _, err := c.requestLocked(ctx, request{Op: OpDeposit, Session: &d.session}, d.files.list())
		cancel()
		if err != nil {
			c.log.Error(err, "depositing the device of a volume again at the device keeper", "volume", v)
			continue
		}
		c.log.Info("deposited the device of a volume again at the device keeper (it restarted)", "volume", v)
	}
	close(c.connected)
	return true
}

// requestLocked sends r with fds on the current connection and waits for
// the answer. A request that gets no answer before ctx ends breaks the
// connection (a late answer must not be taken for the next request's).
func (c *Client) requestLocked(ctx context.Context, r request, fds []int) (response, []int, error) {
	l := c.conn
	if l == nil {
		return response{}, nil, ErrUnavailable
	}
	b, err := encode(r)
	if err != nil {
		return response{}, nil, err
	}
	if err := writeMessage(l.c, b, fds); err != nil {
		l.c.Close()
		return response{}, nil, fmt.Errorf("%w: %w", ErrUnavailable, err)
	}
	select {
	case a := <-l.answers:
		return a.resp, a.fds, a.resp.err()
	case <-l.dead:
		return response{}, nil, fmt.Errorf("%w: the connection closed", ErrUnavailable)
	case <-ctx.Done():
		l.c.Close()
		return response{}, nil, fmt.Errorf("%w: no answer: %w", ErrUnavailable, ctx.Err())
	}
}

// disconnectedWait is how long a request waits for a broken connection
// to come back before it gives up with ErrUnavailable: a keeper that is
// not there holds nothing, so waiting longer gains nothing.
const disconnectedWait = time.Second

// request sends r once connected: it waits for the first attempt to
// connect, then at most disconnectedWait (and never past ctx).
func (c *Client) request(ctx context.Context, r request, fds []int) (response, []int, error) {
	select {
	case <-c.tried:
	case <-ctx.Done():
		return response{}, nil, fmt.Errorf("%w: %s: %w", ErrUnavailable, c.path, ctx.Err())
	}
	timeout := time.NewTimer(disconnectedWait)
	defer timeout.Stop()
	for {
		c.mu.Lock()
		if c.closed {
			c.mu.Unlock()
			return response{}, nil, fmt.Errorf("%w: the client is closed", ErrUnavailable)
		}
		if c.conn != nil {
			defer c.mu.Unlock()
			return c.requestLocked(ctx, r, fds)
		}
		connected := c.connected
		c.mu.Unlock()
		select {
		case <-connected:
		case <-c.done:
		case <-timeout.C:
			return response{}, nil, fmt.Errorf("%w: not connected to %s", ErrUnavailable, c.path)
		case <-ctx.Done():
			return response{}, nil, fmt.Errorf("%w: %s: %w", ErrUnavailable, c.path, ctx.Err())
		}
	}
}

// Claim takes over the session the keeper holds for volume: it returns the
// session and new descriptors the caller owns, and from then on this
// client deposits them again if the keeper restarts (until Release or
// Drop). ErrNoSession if none is held; while another engine attends it
// the claim is retried until ctx ends (an engine that just died may not
// have been noticed yet), then ErrBusy.
func (c *Client) Claim(ctx context.Context, volume string) (Session, Files, error) {
	for {
		resp, fds, err := c.request(ctx, request{Op: OpClaim, Volume: volume}, nil)
		switch {
		case err == nil && (resp.Session == nil || len(fds) != 3 || resp.Session.Volume != volume):
			closeAll(fds)
			return Session{}, Files{}, fmt.Errorf("%w: the keeper's answer to a claim of %s carries no session", ErrInternal, volume)
		case err == nil:
			f := filesFrom(fds)
			c.mu.Lock()
			c.serving[volume] = deposit{session: *resp.Session, files: f}
			c.mu.Unlock()
			return *resp.Session, f, nil
		case errors.Is(err, ErrBusy):
			closeAll(fds)
			select {
			case <-ctx.Done():
				return Session{}, Files{}, err
			case <-time.After(100 * time.Millisecond):
			}
		default:
			closeAll(fds)
			return Session{}, Files{}, err
		}
	}
}

// Deposit hands the keeper a session this process serves, with its
// descriptors (the caller keeps its own and must not close them before
// Release or Drop). If no keeper answers now, it is deposited when one
// does; the error then wraps ErrUnavailable. A session the keeper refuses
// is not deposited again.
func (c *Client) Deposit(ctx context.Context, s Session, f Files) error {
	if err := s.Validate(); err != nil {
		return err
	}
	c.mu.Lock()
	c.serving[s.Volume] = deposit{session: s, files: f}
	c.mu.Unlock()
	_, fds, err := c.request(ctx, request{Op: OpDeposit, Session: &s}, f.list())
	closeAll(fds)
	if err != nil && !errors.Is(err, ErrUnavailable) {
		c.forget(s.Volume) // refused: not deposited again either
	}
	return err
}

// Release stops depositing volume's session and tells the keeper this
// process no longer serves it; the keeper goes on holding it for the next
// engine. The caller may close its descriptors afterwards.
func (c *Client) Release(ctx context.Context, volume string) error {
	c.forget(volume)
	_, fds, err := c.request(ctx, request{Op: OpRelease, Volume: volume}, nil)
	closeAll(fds)
	if errors.Is(err, ErrNoSession) {
		return nil
	}
	return err
}

// Drop has the keeper let go of volume's session (a detach): the keeper
// closes its descriptors. A keeper that holds none is not an error.
func (c *Client) Drop(ctx context.Context, volume string) error {
	c.forget(volume)
	_, fds, err := c.request(ctx, request{Op: OpDrop, Volume: volume}, nil)
	closeAll(fds)
	if errors.Is(err, ErrNoSession) {
		return nil
	}
	return err
}

func (c *Client) forget(volume string) {
	c.mu.Lock()
	delete(c.serving, volume)
	c.mu.Unlock()
}

// Close ends the connection; the keeper goes on holding what was deposited.
func (c *Client) Close() {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return
	}
	c.closed = true
	if c.conn != nil {
		c.conn.c.Close()
	}
	c.mu.Unlock()
	close(c.done)
	c.wg.Wait()
}

func decodeResponse(b []byte, r *response) error { return unmarshalStrict(b, r) }
