package devicekeeper

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"sort"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"golang.org/x/sys/unix"
)

// DefaultSocket is where the keeper listens on a node: under
// /var/lib/cairn, which the CSI node plugin's pod (where the keeper runs)
// and the instance manager's pod share.
const DefaultSocket = "/var/lib/cairn/device-keeper/keeper.sock"

// DefaultHoldFor is how long a keeper holds a session no engine attends.
const DefaultHoldFor = 5 * time.Minute

// Options configure a Keeper.
type Options struct {
	// HoldFor is how long a session is held after its last attendant went
	// (an engine died and none took over): long enough for an instance
	// manager to come back and start the engine again. When it runs out
	// the keeper closes the descriptors, the kernel aborts the connection
	// and the I/O waiting on it fails, as it would have without a keeper.
	// 0 means DefaultHoldFor.
	HoldFor time.Duration
	// SweepEvery is how often held sessions are checked (default 1 s).
	SweepEvery time.Duration
	Logger     logr.Logger
}

// Keeper holds sessions for the engines that connect to it.
type Keeper struct {
	opts Options
	log  logr.Logger

	mu       sync.Mutex
	sessions map[string]*held
	conns    map[*net.UnixConn]struct{}
	closed   bool
}

// held is one session in the table.
type held struct {
	session Session
	files   Files
	// attendant is the connection of the engine serving the session, nil
	// while none does.
	attendant *net.UnixConn
	// alone is when the last attendant went.
	alone time.Time
}

// Status is one held session as seen from outside.
type Status struct {
	Session  Session
	Attended bool
	// Alone is how long it has had no attendant (0 while attended).
	Alone time.Duration
}

// New returns a keeper holding nothing.
func New(opts Options) *Keeper {
	if opts.HoldFor <= 0 {
		opts.HoldFor = DefaultHoldFor
	}
	if opts.SweepEvery <= 0 {
		opts.SweepEvery = time.Second
	}
	return &Keeper{opts: opts, log: opts.Logger, sessions: map[string]*held{}, conns: map[*net.UnixConn]struct{}{}}
}

// Listen makes the keeper's socket at path (SOCK_SEQPACKET, mode 0600, in
// a directory of mode 0700 it creates if missing), replacing a stale
// socket file. The caller makes sure no other keeper uses path (Lock).
func Listen(path string) (*net.UnixListener, error) {
	if err := os.MkdirAll(dirOf(path), 0o700); err != nil {
		return nil, err
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	old := unix.Umask(0o177)
	l, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	unix.Umask(old)
	if err != nil {
		return nil, err
	}
	return l, nil
}

// Lock takes the lock file beside the socket at path, so that two keepers
// never serve one socket (the second would hide the first's sessions). The
// lock goes with the process.
func Lock(path string) (*os.File, error) {
	if err := os.MkdirAll(dirOf(path), 0o700); err != nil {
		return nil, err
	}
	f, err := os.OpenFile(path+".lock", os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, err
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, fmt.Errorf("another device keeper runs on %s", path)
		}
		return nil, err
	}
	return f, nil
}

func dirOf(path string) string {
	for i := len(path) - 1; i > 0; i-- {
		if path[i] == '/' {
			return path[:i]
		}
	}
	return "."
}

// Serve answers connections on l until ctx ends or l fails. It does not
// close the held descriptors (Close does).
func (k *Keeper) Serve(ctx context.Context, l *net.UnixListener) error {
	go func() { <-ctx.Done(); l.Close() }()
	go k.sweepLoop(ctx)
	var wg sync.WaitGroup
	defer wg.Wait()
	for {
		c, err := l.AcceptUnix()
		if err != nil {
			if ctx.Err() != nil {
				k.closeConns()
				return nil
			}
			return err
		}
		if err := k.checkPeer(c); err != nil {
			k.log.Info("refusing a connection", "reason", err.Error())
			c.Close()
			continue
		}
		k.mu.Lock()
		k.conns[c] = struct{}{}
		k.mu.Unlock()
		wg.Add(1)
		go func() {
			defer wg.Done()
			k.serveConn(c)
		}()
	}
}

// checkPeer accepts only processes of the keeper's own user: the socket's
// mode says the same, this holds if the mode is changed.
func (k *Keeper) checkPeer(c *net.UnixConn) error {
	raw, err := c.SyscallConn()
	if err != nil {
		return err
	}
	var cred *unix.Ucred
	var cerr error
	if err := raw.Control(func(fd uintptr) { cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED) }); err != nil {
		return err
	}
	if cerr != nil {
		return cerr
	}
	if int(cred.Uid) != os.Geteuid() {
		return fmt.Errorf("peer pid %d runs as uid %d, not %d", cred.Pid, cred.Uid, os.Geteuid())
	}
	return nil
}

func (k *Keeper) closeConns() {
	k.mu.Lock()
	defer k.mu.Unlock()
	for c := range k.conns {
		c.Close()
	}
}

// serveConn answers one engine's requests until it goes; its sessions are
// then alone (held, unattended).
func (k *Keeper) serveConn(c *net.UnixConn) {
	defer func() {
		c.Close()
		k.forgetConn(c)
	}()
	buf, oob := make([]byte, MaxMessage), make([]byte, oobSpace)
	for {
		b, fds, err := readMessage(c, buf, oob)
		var resp response
		var out []int
		switch {
		case errors.Is(err, ErrInvalid):
			resp = errorResponse(err)
		case err != nil:
			return // closed
		default:
			resp, out = k.handle(c, b, fds)
		}
		if resp.Error != nil {
			k.log.V(1).Info("request refused", "reason", resp.Error.Message)
		}
		msg, err := encode(resp)
		if err == nil {
			err = writeMessage(c, msg, out)
		}
		closeAll(out) // the duplicates made for a claim's answer: the peer has its own now
		if err != nil {
			return
		}
	}
}

// handle decodes and runs one request. fds are the request's descriptors,
// which the keeper keeps (a deposit taken) or closes. The descriptors it
// returns are for the answer; the caller closes them once sent.
func (k *Keeper) handle(c *net.UnixConn, b []byte, fds []int) (response, []int) {
	r, err := decodeRequest(b, len(fds))
	if err != nil {
		closeAll(fds)
		return errorResponse(err), nil
	}
	switch r.Op {
	case OpDeposit:
		f := filesFrom(fds)
		if err := k.deposit(c, *r.Session, f); err != nil {
			f.Close()
			return errorResponse(err), nil
		}
		return response{}, nil
	case OpClaim:
		s, dups, err := k.claim(c, r.Volume)
		if err != nil {
			return errorResponse(err), nil
		}
		return response{Session: &s}, dups
	case OpRelease:
		return errorResponseOrOK(k.release(c, r.Volume)), nil
	default: // OpDrop
		return errorResponseOrOK(k.drop(c, r.Volume)), nil
	}
}

func errorResponseOrOK(err error) response {
	if err != nil {
		return errorResponse(err)
	}
	return response{}
}

// deposit holds s with f for attendant c, replacing a session of the same
// volume no other live connection attends.
func (k *Keeper) deposit(c *net.UnixConn, s Session, f Files) error {
	if err := Check(s, f); err != nil {
		return err
	}
	k.mu.Lock()
	if k.closed {
		k.mu.Unlock()
		return fmt.Errorf("%w: the keeper is closing", ErrInternal)
	}
	old := k.sessions[s.Volume]
	if old != nil && old.attendant != nil && old.attendant != c {
		k.mu.Unlock()
		return fmt.Errorf("%w: volume %s", ErrBusy, s.Volume)
	}
	k.sessions[s.Volume] = &held{session: s, files: f, attendant: c}
	k.mu.Unlock()
	if old != nil {
		// The same kernel objects again (an engine depositing after a
		// reconnect) or a session replaced: either way this copy goes.
		old.files.Close()
	}
	k.log.Info("holding the device of a volume", "volume", s.Volume, "loop", s.LoopPath, "replaced", old != nil)
	return nil
}

// claim makes c the attendant of volume's session and returns it with
// duplicates of its descriptors.
func (k *Keeper) claim(c *net.UnixConn, volume string) (Session, []int, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	h := k.sessions[volume]
	switch {
	case h == nil:
		return Session{}, nil, fmt.Errorf("%w: volume %s", ErrNoSession, volume)
	case h.attendant != nil && h.attendant != c:
		return Session{}, nil, fmt.Errorf("%w: volume %s", ErrBusy, volume)
	}
	var dups []int
	for _, fd := range h.files.list() {
		d, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
		if err != nil {
			closeAll(dups)
			return Session{}, nil, fmt.Errorf("%w: duplicating a descriptor: %w", ErrInternal, err)
		}
		dups = append(dups, d)
	}
	h.attendant = c
	k.log.Info("an engine took over the device of a volume", "volume", volume, "loop", h.session.LoopPath)
	return h.session, dups, nil
}

// release ends c's attendance of volume's session.
func (k *Keeper) release(c *net.UnixConn, volume string) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	h := k.sessions[volume]
	if h == nil {
		return fmt.Errorf("%w: volume %s", ErrNoSession, volume)
	}
	if h.attendant == c {
		h.attendant, h.alone = nil, time.Now()
	}
	return nil
}

// drop closes and forgets volume's session, unless another live
// connection attends it.
func (k *Keeper) drop(c *net.UnixConn, volume string) error {
	k.mu.Lock()
	h := k.sessions[volume]
	switch {
	case h == nil:
		k.mu.Unlock()
		return fmt.Errorf("%w: volume %s", ErrNoSession, volume)
	case h.attendant != nil && h.attendant != c:
		k.mu.Unlock()
		return fmt.Errorf("%w: volume %s", ErrBusy, volume)
	}
	delete(k.sessions, volume)
	k.mu.Unlock()
	h.files.Close()
	k.log.Info("dropped the device of a volume", "volume", volume, "loop", h.session.LoopPath)
	return nil
}

// forgetConn leaves the sessions c attended alone.
func (k *Keeper) forgetConn(c *net.UnixConn) {
	k.mu.Lock()
	defer k.mu.Unlock()
	delete(k.conns, c)
	for v, h := range k.sessions {
		if h.attendant == c {
			h.attendant, h.alone = nil, time.Now()
			k.log.Info("the engine of a volume went; holding its device for a successor", "volume", v, "loop", h.session.LoopPath, "for", k.opts.HoldFor)
		}
	}
}

func (k *Keeper) sweepLoop(ctx context.Context) {
	t := time.NewTicker(k.opts.SweepEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			k.sweep(now)
		}
	}
}

// sweep drops the sessions alone for longer than HoldFor, and those whose
// FUSE connection the kernel ended (unmounted and released, or aborted
// through /sys/fs/fuse/connections): holding those keeps nothing alive.
func (k *Keeper) sweep(now time.Time) {
	k.mu.Lock()
	var gone []*held
	for v, h := range k.sessions {
		expired := h.attendant == nil && now.Sub(h.alone) >= k.opts.HoldFor
		if expired || connectionEnded(h.files.FUSE) {
			delete(k.sessions, v)
			gone = append(gone, h)
			k.log.Info("letting go of the device of a volume", "volume", v, "loop", h.session.LoopPath,
				"reason", map[bool]string{true: "no engine took it over in time", false: "its FUSE connection ended"}[expired])
		}
	}
	k.mu.Unlock()
	for _, h := range gone {
		h.files.Close()
	}
}

// connectionEnded says whether the kernel ended the FUSE connection of
// fd: /dev/fuse then polls as an error.
func connectionEnded(fd int) bool {
	p := []unix.PollFd{{Fd: int32(fd)}}
	n, err := unix.Poll(p, 0)
	return err == nil && n > 0 && p[0].Revents&(unix.POLLERR|unix.POLLNVAL) != 0
}

// Held lists the sessions held, by volume.
func (k *Keeper) Held() []Status {
	k.mu.Lock()
	defer k.mu.Unlock()
	out := make([]Status, 0, len(k.sessions))
	for _, h := range k.sessions {
		st := Status{Session: h.session, Attended: h.attendant != nil}
		if !st.Attended {
			st.Alone = time.Since(h.alone)
		}
		out = append(out, st)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Session.Volume < out[j].Session.Volume })
	return out
}

// Close lets go of every session (the kernel aborts each connection no
// engine holds) and refuses deposits from then on.
func (k *Keeper) Close() {
	k.mu.Lock()
	k.closed = true
	sessions := k.sessions
	k.sessions = map[string]*held{}
	k.mu.Unlock()
	for _, h := range sessions {
		h.files.Close()
	}
}
