// Package engine turns N replicas into one reliable block device: every
// write goes to all writable replicas, reads come from RW replicas, failed
// replicas are dropped (ERR), and new ones are rebuilt while I/O goes on.
// It is a library: replicas come through the Replica interface and the
// frontends (NBD, FUSE) call the I/O methods.
package engine

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"

	"github.com/cairn-io/cairn/dataplane/internal/shm"
	"github.com/cairn-io/cairn/dataplane/volcrypt"
)

// Errors.
var (
	// ErrNoReplica: no RW replica took the request; the volume is faulted.
	ErrNoReplica = errors.New("no healthy replica")
	// ErrOutOfRange: the request goes past the end of the volume.
	ErrOutOfRange = errors.New("out of range")
	// ErrClosed: the engine was closed.
	ErrClosed = errors.New("engine closed")
	// ErrInvalid: a control request that cannot be carried out as asked.
	ErrInvalid = errors.New("invalid request")
	// ErrNoPull: a rebuild target cannot pull its data from the source
	// itself (LayerPuller); the engine copies it instead.
	ErrNoPull = errors.New("the replica cannot pull from the source")
	// ErrUnsafeNotBuilt: Open was asked for Options.UnsafeAckEarly by a
	// build without it (see unsafe_ackearly.go).
	ErrUnsafeNotBuilt = errors.New("the unsafe early-acknowledgement engine (CAIRN_UNSAFE_ACK_EARLY, Options.UnsafeAckEarly) needs a cairn-data built with -tags cairn_unsafe (tests only)")
)

// Options configure Open.
type Options struct {
	// Name is the volume name, for logs and reports.
	Name string
	// Size is the volume size; 0 takes the replicas' size.
	Size int64
	// Replicas are the replicas' addresses.
	Replicas []string
	// Wanted is how many RW replicas make the set complete (healthy).
	// Default: len(Replicas).
	Wanted int
	// Dial connects to a replica.
	Dial Dialer
	// Logger receives events. Default: discard.
	Logger logr.Logger
	// ConnectTimeout bounds each attempt to reach a replica at open
	// (connect, handshake, Info); the replicas are tried all at once.
	// Default: DefaultConnectTimeout.
	ConnectTimeout time.Duration
	// WaitInterval is how often Open, while it waits for replicas, says
	// which (in the log and to OnWait) and, while the volume cannot be
	// served safely without them, tries them again. Open waits until it
	// can serve safely or ctx ends. Default: DefaultWaitInterval.
	WaitInterval time.Duration
	// OnWait, if set, is told what Open waits for, every WaitInterval
	// while it waits (cairn-data passes it on to the instance manager).
	OnWait func(Waiting)
	// AcceptLostMembers lets Open serve the volume although replicas
	// recorded as RW at the newest epoch are not among those it was given,
	// once every replica it was given has answered: the caller declares
	// those others lost for good (the control plane sets it only when
	// every replica of the volume left out sits on a node an operator
	// declared shut down), so waiting for them could only keep the volume
	// down. Writes that only they held, if any, are lost; Open logs which
	// replicas it went on without. A given replica that does not answer
	// is still waited for.
	AcceptLostMembers bool
	// ControlTimeout bounds every control and rebuild call the engine
	// makes to a replica (info, epoch, snapshot, revert, expand, a
	// rebuild's reads, writes and checksums): a replica that has not
	// answered by then is failed, or skipped where its answer was only
	// informative, instead of blocking the engine. A snapshot deletion,
	// which merges the snapshot's data, gets one second more per 16 MiB of
	// it. Default: DefaultControlTimeout.
	ControlTimeout time.Duration
	// UnsafeAckEarly breaks the engine on purpose, for testing the chaos
	// harness: a write is acknowledged as soon as the first RW replica has
	// it, while the others get it later (see mutateEarly). Only a build
	// with -tags cairn_unsafe has it; any other refuses it at Open
	// (ErrUnsafeNotBuilt), before contacting a replica. Never set it
	// outside tests.
	UnsafeAckEarly bool
	// Cipher encrypts the volume at rest: every write is encrypted before
	// it fans out and every read decrypted after it comes back, so the
	// replicas, and everything copied from them (rebuilds, snapshots,
	// clones), hold ciphertext only. Nil: data is stored as written.
	Cipher *volcrypt.Cipher
	// IdleFlush is how long after the last write, with no flush from the
	// client, the engine flushes the replicas itself (a few times, that
	// far apart), so that their write-intent bits clear on an idle volume
	// and a replica returning from an outage copies only what was written
	// while it was away. Default DefaultIdleFlush; negative: never.
	IdleFlush time.Duration
	// Buffers hands out the I/O path's scratch buffers (an encrypted
	// write's ciphertext). cairn-data passes the arena over the memory it
	// shares with the replicas on its node, so ciphertext reaches them as
	// plaintext would. Default: an arena on the Go heap.
	Buffers *shm.Arena
}

// cand is a replica being considered at open, with what it reported.
type cand struct {
	m    *member
	info ReplicaInfo
}

type member struct {
	addr string
	id   string // the replica's ID (from Info)
	// The replica's connection by role (all nil if it could not be
	// dialed): data for the I/O path, ctl for control and rebuild calls,
	// conn to close it.
	data      DataPath
	ctl       bounded
	conn      interface{ Close() error }
	closeOnce sync.Once
	mode      Mode // written only by Engine.setMode, under Engine.mu
	since     time.Time
	err       error
	stats     stats
	// reading counts the member's reads in flight, readNs is its recent
	// read latency (an exponentially weighted average, ns; 0 before the
	// first read), lastRead when it was last given a read (unix ns):
	// pickRead chooses by them.
	reading  atomic.Int64
	readNs   atomic.Int64
	lastRead atomic.Int64
}

// onNode reports whether the member is reached over a unix socket: a
// replica on the engine's node, whose reads cost no network stack (and,
// with shared memory, no copy through the socket).
func (m *member) onNode() bool { return strings.HasPrefix(m.addr, "unix:") }

// replica is m's connection as the Replica it was given (nil if it could
// not be dialed), for a rebuild target that reads from it itself.
func (m *member) replica() Replica {
	r, _ := m.conn.(Replica)
	return r
}

// controller is what the engine calls on a member outside the I/O path.
type controller interface {
	Control
	RebuildSource
	RebuildTarget
}

// attach gives m its connection r, its control calls bounded by timeout.
func (m *member) attach(r Replica, timeout time.Duration) {
	m.data, m.ctl, m.conn = r, bounded{r, timeout}, r
}

// close closes the connection to the replica, once however often it is
// called (a failure and the engine's Close both close it).
func (m *member) close() {
	m.closeOnce.Do(func() {
		if m.conn != nil {
			m.conn.Close()
		}
	})
}

// Engine serves one volume from a set of replicas.
type Engine struct {
	opts Options
	log  logr.Logger
	// crypt is Options.Cipher (nil: not encrypted); bufs Options.Buffers.
	crypt *volcrypt.Cipher
	bufs  *shm.Arena

	// io is held shared by every data operation and exclusively to pause
	// I/O (snapshots, epoch changes, mode changes that need a quiet set).
	// Held exclusively it also serialises the epoch's publication and the
	// changes to the set that go with one (a replica added or made RW):
	// replicas never see epochs out of order.
	io     sync.RWMutex
	ranges rangeLock

	// chain serialises the operations that change the replicas' snapshot
	// chains (snapshot, delete, revert, expand, a rebuild's start): a
	// snapshot deletion runs without pausing I/O, and one of the others
	// arriving meanwhile waits for it here rather than with I/O paused.
	chain sync.Mutex

	// mu guards the fields below (members, modes, epoch, rebuilds,
	// failed). It is never held across a call to a replica: operations
	// copy what they need under it, call the replicas without it, and take
	// it again to apply the results, so a slow replica stalls neither
	// status nor the failing of another replica.
	mu       sync.Mutex
	members  []*member
	epoch    uint64
	wanted   int
	closed   bool
	rebuilds map[string]*rebuild
	// idle decides when the engine flushes by itself (flushWhenIdle).
	idle idleFlusher
	// failed records, by replica ID, the address of replicas that failed
	// during this engine's life while the set stayed degraded since: their
	// write-intent bits were kept on the survivors, so if the same replica
	// (same ID, at any address) comes back it resyncs only dirty regions.
	failed map[string]string
	// away records the regions written while a replica in failed is away
	// (see awayMap); reset whenever failed is cleared.
	away awayMap
	// marks are the failed writes waiting to be marked on the others
	// (markFailedWrite).
	marks pendingMarks
	// forgot records, by replica ID, why a replica this engine saw fail
	// was dropped from failed, for the status of its full rebuild.
	forgot map[string]string
	// doneSnaps are the snapshots of completed rebuilds not deleted yet
	// (another rebuild was reading them): see removeDoneSnapshots.
	doneSnaps map[string]bool
	// clone is the last CloneFrom's copy (nil if none was asked).
	clone *clone
	// changes wakes the watchers of Changed.
	changes changes

	// stop is the context of the engine's background work (rebuilds and
	// their clean-up), cancelled by Close; bg counts the goroutines doing
	// it, which Close waits for. bg.Add is called under mu with closed
	// false.
	stop       context.Context
	cancelStop context.CancelFunc
	bg         sync.WaitGroup

	size atomic.Int64
	io_  ioStats
	// needBump is set when a replica is failed and cleared once the
	// survivors' epoch has been bumped. No write is acknowledged while it
	// is set: otherwise a write acknowledged by the survivors alone could
	// be lost if the engine died before the bump, since the failed
	// replica would still carry the same epoch and be trusted again.
	needBump atomic.Bool
}

// Open connects to the replicas (all at once, each attempt bounded by
// Options.ConnectTimeout; see connect for when it goes on without one
// that does not answer, and when it waits for it until ctx ends instead),
// keeps those whose size and epoch agree, bumps the epoch on them, and
// makes their contents agree where a previous engine may have left writes
// half done (the union of their write-intent bitmaps). At least one replica must be usable. Every replica's mode is
// set through setMode; a replica that is not usable is ERR, with its
// reason, and its connection closed.
func Open(ctx context.Context, opts Options) (*Engine, error) {
	if opts.Dial == nil || len(opts.Replicas) == 0 {
		return nil, fmt.Errorf("%w: need at least one replica and a dialer", ErrInvalid)
	}
	if opts.UnsafeAckEarly && !unsafeAckEarlyBuilt {
		// Before any replica is dialed: a binary refusing to start must
		// not fence out the engine that serves the volume.
		return nil, ErrUnsafeNotBuilt
	}
	if opts.UnsafeAckEarly && opts.Cipher != nil {
		// mutateEarly lets writes run on after they return: the
		// ciphertext's pooled buffer would be reused under them.
		return nil, fmt.Errorf("%w: the unsafe early-acknowledgement engine does not encrypt", ErrInvalid)
	}
	if opts.Buffers == nil {
		opts.Buffers = shm.NewArena(nil)
	}
	if opts.Wanted <= 0 {
		opts.Wanted = len(opts.Replicas)
	}
	if opts.ControlTimeout <= 0 {
		opts.ControlTimeout = DefaultControlTimeout
	}
	if opts.ConnectTimeout <= 0 {
		opts.ConnectTimeout = DefaultConnectTimeout
	}
	if opts.WaitInterval <= 0 {
		opts.WaitInterval = DefaultWaitInterval
	}
	if opts.IdleFlush == 0 {
		opts.IdleFlush = DefaultIdleFlush
	}
	e := &Engine{opts: opts, log: opts.Logger.WithValues("volume", opts.Name), wanted: opts.Wanted, crypt: opts.Cipher, bufs: opts.Buffers,
		rebuilds: map[string]*rebuild{}, failed: map[string]string{}, forgot: map[string]string{}, doneSnaps: map[string]bool{}}
	e.stop, e.cancelStop = context.WithCancel(context.Background())
	cands, err := e.connect(ctx)
	if err != nil {
		e.closeAll()
		return nil, err
	}
	size := opts.Size
	if size == 0 {
		size = newestSize(cands)
	}
	usable, maxEpoch := e.sortOut(cands, size)
	if len(usable) == 0 {
		e.closeAll()
		return nil, fmt.Errorf("%w: none of %d replicas is usable: %w", ErrNoReplica, len(opts.Replicas), e.memberErrors())
	}
	e.size.Store(size)
	e.epoch = maxEpoch + 1
	e.fenceAtOpen(ctx, usable)
	if err := e.reconcile(ctx, usable[0].m, usable); err != nil {
		e.closeAll()
		return nil, err
	}
	if e.rwCount() == 0 {
		e.closeAll()
		return nil, fmt.Errorf("%w: every replica failed while opening: %w", ErrNoReplica, e.memberErrors())
	}
	// A replica failed while fencing or reconciling may have the new
	// epoch already: bump again so it cannot be trusted by a later engine.
	if err := e.publishEpoch(ctx, e.needBump.Load()); err != nil {
		e.closeAll()
		return nil, err
	}
	epoch, rw := e.startWatching()
	if opts.IdleFlush > 0 {
		e.idle.kick = make(chan struct{}, 1)
		e.bg.Add(1) // not closed yet: nobody else has the engine
		go e.flushWhenIdle(opts.IdleFlush)
	}
	e.log.Info("engine opened", "size", size, "epoch", epoch, "rw", rw, "wanted", e.wanted, "encrypted", e.crypt != nil)
	return e, nil
}

// startWatching starts watching every member not in ERR, and returns the
// epoch and the RW count as they were before the first watcher ran: a
// watcher may fail its replica and bump the epoch at once, so from here
// on both are read under e.mu.
func (e *Engine) startWatching() (epoch uint64, rw int) {
	e.mu.Lock()
	epoch, rw = e.epoch, e.rwCountLocked()
	var watched []*member
	for _, m := range e.members {
		if m.mode != ModeERR {
			watched = append(watched, m)
		}
	}
	e.mu.Unlock()
	for _, m := range watched {
		go e.watch(m)
	}
	return epoch, rw
}

// newestSize is the size of a replica with the newest epoch (one whose
// rebuild finished): the volume's size as the last engine served it. A
// replica left behind by an expansion while it was away is older and
// smaller; taking its size would refuse every current replica.
func newestSize(cands []cand) int64 {
	var size int64
	var epoch uint64
	found := false
	for _, c := range cands {
		if c.info.Rebuilding {
			continue
		}
		if !found || c.info.Epoch > epoch {
			size, epoch, found = c.info.Size, c.info.Epoch, true
		}
	}
	return size
}

// sortOut makes RW the candidates a volume of size can be served from and
// ERR the others, with the reason: a replica whose rebuild did not finish,
// one of another size, one whose epoch is older than the newest (it
// missed changes). It returns the usable ones and the newest epoch seen.
func (e *Engine) sortOut(cands []cand, size int64) (usable []cand, maxEpoch uint64) {
	for _, c := range cands {
		maxEpoch = max(maxEpoch, c.info.Epoch)
	}
	for _, c := range cands {
		c.m.id = c.info.ID
		var why string
		switch {
		case c.info.Rebuilding:
			why = "a rebuild of it started and did not finish: its data is incomplete"
		case c.info.Size != size:
			why = fmt.Sprintf("its size is %d bytes, the volume's %d", c.info.Size, size)
		case c.info.Epoch < maxEpoch:
			why = fmt.Sprintf("its epoch %d is older than %d: it missed changes and needs a rebuild", c.info.Epoch, maxEpoch)
		}
		if why != "" {
			_ = e.become(c.m, ModeERR, errors.New(why))
			continue
		}
		_ = e.become(c.m, ModeRW, nil)
		usable = append(usable, c)
	}
	return usable, maxEpoch
}

// fenceAtOpen gives the usable replicas the engine's epoch, with the set
// marked degraded so that they keep the write-intent bits reconcile reads
// until it is done; one that refuses is failed.
func (e *Engine) fenceAtOpen(ctx context.Context, usable []cand) {
	ms := make([]*member, len(usable))
	ids := make([]string, len(usable))
	for i, c := range usable {
		ms[i], ids[i] = c.m, c.m.id
	}
	errs := each(ms, func(_ int, m *member) error {
		if err := m.ctl.SetEpoch(ctx, EpochState{Epoch: e.epoch, Degraded: true, Members: ids}); err != nil {
			return err
		}
		m.data.SetRequestEpoch(e.epoch)
		return nil
	})
	for i, m := range ms {
		if errs[i] != nil {
			_ = e.become(m, ModeERR, fmt.Errorf("set epoch: %w", errs[i]))
		}
	}
}

// setMode is the only writer of member modes. Callers hold e.mu (become
// takes it). A replica failed from RW or WO may hold the current epoch:
// no write is acknowledged until the survivors' epoch moves past it (see
// needBump), and it is recorded in failed for a dirty-only resync. One
// that never served (new: unusable at open, or failed while joining) needs
// neither. Either way its connection is closed. A change the state
// machine forbids (a member failed already, say) is refused and changes
// nothing; callers for which that is the outcome they wanted discard the
// error.
func (e *Engine) setMode(m *member, to Mode, cause error) error {
	from := m.mode
	if err := transition(from, to); err != nil {
		return err
	}
	e.log.Info("replica mode", "replica", m.addr, "from", from.String(), "to", to.String(), "cause", fmt.Sprint(cause))
	m.mode, m.since, m.err = to, time.Now(), cause
	e.changed()
	if from == ModeWO && to == ModeRW && len(e.failed) > 0 {
		// A rebuilt member has no write-intent bits for the writes made
		// before its rebuild snapshot; a failed replica coming back could
		// take it as its source and miss them. From now on every returning
		// replica is rebuilt in full.
		e.forgetFailedLocked(fmt.Sprintf("replica %s was rebuilt after it left, and holds no record of the writes made before its rebuild", m.addr))
	}
	if to == ModeERR {
		if from != modeNew {
			e.needBump.Store(true) // until the survivors' epoch moves past it
			if m.id != "" {
				e.failed[m.id] = m.addr // a replica failed mid-rebuild is refused dirty-only resync by its persisted rebuilding flag
				e.away.start()
			}
		}
		go m.close() // stop its traffic; pending requests fail at once
	}
	return nil
}

// forgetFailedLocked clears the record of failed replicas and of what
// was written while they were away: from now on none of them may resync
// dirty regions only. why is kept for the status of their full rebuild.
// Callers hold e.mu.
func (e *Engine) forgetFailedLocked(why string) {
	for id := range e.failed {
		e.forgot[id] = why
	}
	clear(e.failed)
	e.away.reset()
}

// become takes e.mu and calls setMode.
func (e *Engine) become(m *member, to Mode, cause error) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.setMode(m, to, cause)
}

// watch fails a replica whose connection dies on its own.
func (e *Engine) watch(m *member) {
	<-m.data.Failed()
	if e.markFailed(m, errors.New("connection to the replica failed")) {
		e.afterFailure(context.Background())
	}
}

// markFailed moves m to ERR, reporting whether it changed.
func (e *Engine) markFailed(m *member, cause error) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	if m.mode == ModeERR || e.closed {
		return false
	}
	return e.setMode(m, ModeERR, cause) == nil
}

// afterFailure bumps the epoch on the surviving replicas, with I/O paused,
// marking the set degraded so their write-intent bits are kept. The failed
// replica keeps its old epoch: if it comes back it is recognised as stale.
func (e *Engine) afterFailure(ctx context.Context) {
	e.pause()
	defer e.resume()
	e.mu.Lock()
	skip := e.closed || !e.needBump.Swap(false) // someone else bumped it already
	e.mu.Unlock()
	if skip {
		return
	}
	if err := e.publishEpoch(ctx, true); err != nil {
		e.log.Error(err, "after a replica failure")
	}
}

// publishEpoch (optionally bumps and) sets the epoch and the degraded flag
// on every writable replica, all at once; one that refuses is failed, and
// the others are told again if that changed whether the set is degraded.
// Returns ErrNoReplica if no RW replica remains. Callers hold e.io
// exclusively (I/O paused), or are Open before the engine is shared: that
// serialises epoch changes. e.mu is taken only around reading and
// applying, not across the calls.
func (e *Engine) publishEpoch(ctx context.Context, bump bool) error {
	return e.publishEpochMarking(ctx, bump, nil)
}

// publishEpochMarking is publishEpoch that also has every writable
// replica mark the write-intent bits of marks durably, if the set is
// degraded (see markFailedWrite).
func (e *Engine) publishEpochMarking(ctx context.Context, bump bool, marks []ByteRange) error {
	ctx = detach(ctx) // a refusal fails the replica: never let a caller's cancellation cause one
	e.mu.Lock()
	if bump {
		e.epoch++
		e.needBump.Store(false)
		e.changed()
	}
	epoch := e.epoch
	e.mu.Unlock()
	for {
		e.mu.Lock()
		degraded := e.degradedLocked()
		ms, modes := e.selectLocked(ModeRW, ModeWO)
		ids := e.rwIDsLocked()
		e.mu.Unlock()
		errs := each(ms, func(i int, m *member) error {
			st := EpochState{Epoch: epoch, Degraded: degraded, Rebuilding: modes[i] == ModeWO, Members: ids}
			if degraded {
				st.Mark = marks
			}
			if err := m.ctl.SetEpoch(ctx, st); err != nil {
				return err
			}
			m.data.SetRequestEpoch(epoch)
			return nil
		})
		e.mu.Lock()
		for i, m := range ms {
			if errs[i] != nil {
				_ = e.setMode(m, ModeERR, fmt.Errorf("set epoch %d: %w", epoch, errs[i]))
			}
		}
		// A failure, here or elsewhere meanwhile, may have made the set
		// degraded: the survivors must know, to keep their bits.
		told := e.degradedLocked() == degraded
		if told && !degraded && len(e.failed) > 0 {
			// Bits may be cleared from now on.
			e.forgetFailedLocked("the volume was healthy again after it left, so the write-intent bits of what it missed were cleared")
		}
		var err error
		if e.rwCountLocked() == 0 {
			err = fmt.Errorf("%w: %w", ErrNoReplica, e.memberErrorsLocked())
		}
		e.mu.Unlock()
		if told {
			return err
		}
	}
}

// each runs fn on every member at once and returns their errors, by
// index: a slow replica delays the others' calls by nothing.
func each(ms []*member, fn func(i int, m *member) error) []error {
	errs := make([]error, len(ms))
	var wg sync.WaitGroup
	for i, m := range ms {
		wg.Go(func() { errs[i] = fn(i, m) })
	}
	wg.Wait()
	return errs
}

func (e *Engine) degradedLocked() bool {
	rw := 0
	for _, m := range e.members {
		switch m.mode {
		case ModeRW:
			rw++
		case ModeWO:
			return true
		}
	}
	return rw < e.wanted
}

func (e *Engine) rwCount() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.rwCountLocked()
}

func (e *Engine) rwCountLocked() int {
	n := 0
	for _, m := range e.members {
		if m.mode == ModeRW {
			n++
		}
	}
	return n
}

func (e *Engine) memberErrors() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.memberErrorsLocked()
}

// memberErrorsLocked returns the members' errors, each prefixed with its
// replica's address.
func (e *Engine) memberErrorsLocked() error {
	var errs memberErrors
	for _, m := range e.members {
		if m.err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", m.addr, m.err))
		}
	}
	return errs
}

// memberErrors are several replicas' errors in one: errors.Is, errors.As
// and status.Code see each replica's cause (a refused connection, a
// deadline, a gRPC status), and the message lists them all.
type memberErrors []error

func (m memberErrors) Error() string {
	if len(m) == 0 {
		return "no replica reported an error"
	}
	s := make([]string, len(m))
	for i, err := range m {
		s[i] = err.Error()
	}
	return strings.Join(s, "; ")
}

func (m memberErrors) Unwrap() []error { return m }

// writable returns the RW and WO members with their modes at the time;
// readable the RW ones.
func (e *Engine) writable() ([]*member, []Mode) { return e.select_(ModeRW, ModeWO) }
func (e *Engine) readable() []*member {
	ms, _ := e.select_(ModeRW, ModeRW)
	return ms
}

func (e *Engine) select_(a, b Mode) ([]*member, []Mode) {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.selectLocked(a, b)
}

func (e *Engine) selectLocked(a, b Mode) ([]*member, []Mode) {
	out := make([]*member, 0, len(e.members))
	modes := make([]Mode, 0, len(e.members))
	for _, m := range e.members {
		if m.mode == a || m.mode == b {
			out = append(out, m)
			modes = append(modes, m.mode)
		}
	}
	return out, modes
}

// Size is the volume size in bytes.
func (e *Engine) Size() int64 { return e.size.Load() }

// Encrypted reports whether the volume is encrypted at rest (Options.Cipher).
func (e *Engine) Encrypted() bool { return e.crypt != nil }

// Epoch is the current epoch.
func (e *Engine) Epoch() uint64 {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.epoch
}

// pause stops new I/O and waits for I/O in flight; resume undoes it.
func (e *Engine) pause()  { e.io.Lock() }
func (e *Engine) resume() { e.io.Unlock() }

// Close stops rebuilds, waits for them and for a control operation in
// progress with I/O paused (an epoch bump, a snapshot), and closes every
// replica connection: once it returns, the engine makes no more calls to
// the replicas. Control operations called later fail with ErrClosed.
// Callers stop the frontend first.
func (e *Engine) Close() error {
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return nil
	}
	e.closed = true
	e.cancelStop() // the rebuilds' contexts derive from it
	e.mu.Unlock()
	e.bg.Wait()
	e.pause()
	defer e.resume()
	e.closeAll()
	return nil
}

// closeAll closes every member's connection (also on a failed Open).
func (e *Engine) closeAll() {
	e.mu.Lock()
	ms := append([]*member(nil), e.members...)
	e.mu.Unlock()
	for _, m := range ms {
		m.close()
	}
	e.cancelStop()
}
