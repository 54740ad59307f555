package engine

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/cairn-io/cairn/dataplane/volcrypt"
)

// The I/O paths: reads, writes, unmaps and flushes as the frontends call
// them, fanned out to the replicas.

func (e *Engine) checkRange(off, n int64) error {
	if size := e.size.Load(); off < 0 || n < 0 || off > size || n > size-off {
		return fmt.Errorf("%w: %d bytes at %d, volume size %d", ErrOutOfRange, n, off, size)
	}
	return nil
}

// ReadAt reads from one RW replica (pickRead: the one likely to answer
// first), trying the others if it fails; a replica that fails a read is
// moved to ERR. An encrypted volume's data is decrypted into p.
func (e *Engine) ReadAt(ctx context.Context, p []byte, off int64) error {
	ctx = detach(ctx)
	if err := e.checkRange(off, int64(len(p))); err != nil {
		return err
	}
	if e.crypt != nil && !sectorAligned(off, len(p)) {
		return e.readSectors(ctx, p, off)
	}
	for len(p) > MaxIO {
		if err := e.readAt(ctx, p[:MaxIO], off); err != nil {
			return err
		}
		p, off = p[MaxIO:], off+MaxIO
	}
	return e.readAt(ctx, p, off)
}

// MaxIO is the largest piece a request is split into on its way to the
// replicas (dataconn frames are bounded).
const MaxIO = 1 << 20

// maxUnmap bounds one unmap request (its length is 32 bits on the wire).
const maxUnmap = 1 << 30

func (e *Engine) readAt(ctx context.Context, p []byte, off int64) error {
	began := time.Now()
	e.io.RLock()
	lr := e.ranges.lock(off, int64(len(p)), false)
	rs := e.readable()
	failed := false
	err := fmt.Errorf("%w: no RW replica to read from", ErrNoReplica)
	start := 0
	if len(rs) > 0 {
		start = pickRead(rs, began.UnixNano())
	}
	for i := range rs {
		m := rs[(start+i)%len(rs)]
		t := time.Now()
		m.reading.Add(1)
		rerr := m.data.ReadAt(ctx, p, off)
		m.reading.Add(-1)
		took := time.Since(t)
		m.stats.record(opRead, len(p), took, rerr)
		if rerr == nil {
			m.observeRead(took)
			err = nil
			break
		}
		if ctx.Err() != nil {
			err = ctx.Err()
			break
		}
		failed = e.markFailed(m, fmt.Errorf("read failed: %w", rerr)) || failed
		err = fmt.Errorf("%w: last error: %w", ErrNoReplica, rerr)
	}
	e.ranges.unlock(lr)
	e.io.RUnlock()
	if failed {
		e.afterFailure(ctx)
	}
	if err == nil && e.crypt != nil {
		err = e.crypt.Decrypt(p, off) // whole sectors: ReadAt saw to it
	}
	e.io_.record(opRead, len(p), began, err)
	return err
}

type op uint8

const (
	opRead op = iota
	opWrite
	opFlush
	opUnmap
)

// fanout runs the operation on every member concurrently and returns
// their errors: through start where it gives a wait (nil start, or a nil
// wait, means the member runs fn).
func fanout(ms []*member, o op, n int, fn func(*member) error, start func(*member) func() error) []error {
	errs := make([]error, len(ms))
	times := make([]time.Time, len(ms))
	record := func(i int) { ms[i].stats.record(o, n, time.Since(times[i]), errs[i]) }
	// Replicas that can send now and answer later get their request from
	// this goroutine, all of them before any wait; the others run fn in
	// goroutines, the last one of those on this goroutine. (A started
	// replica's latency is taken when its wait returns, so it includes
	// waiting for the ones before it.)
	waits := make([]func() error, len(ms))
	var inline []int // members without a start: fn runs synchronously
	for i, m := range ms {
		times[i] = time.Now()
		if start != nil {
			if waits[i] = start(m); waits[i] != nil {
				continue
			}
		}
		inline = append(inline, i)
	}
	run := func(i int) {
		times[i] = time.Now()
		errs[i] = fn(ms[i])
		record(i)
	}
	var wg sync.WaitGroup
	for k, i := range inline {
		if k == len(inline)-1 {
			run(i)
			break
		}
		wg.Add(1)
		go func() { defer wg.Done(); run(i) }()
	}
	for i, w := range waits {
		if w != nil {
			errs[i] = w()
			record(i)
		}
	}
	wg.Wait()
	return errs
}

// mutate sends a write-like operation (write, unmap, flush) to every
// writable replica. Replicas that fail are moved to ERR before this
// returns, so an acknowledged operation is on every RW replica; it fails
// only if no RW replica took it.
func (e *Engine) mutate(ctx context.Context, o op, off, n int64, fn func(*member) error) error {
	return e.mutateWith(ctx, o, off, n, nil, fn, nil)
}

// mutateWith is mutate with prepare run once the range is locked, before
// the fan-out (a read-modify-write reads there).
func (e *Engine) mutateWith(ctx context.Context, o op, off, n int64, prepare func() error, fn func(*member) error, start func(*member) func() error) error {
	began := time.Now()
	if o != opFlush {
		e.idle.wrote()
	}
	e.io.RLock()
	var lr *lockedRange
	if o != opFlush {
		lr = e.ranges.lock(off, n, true)
	}
	if prepare != nil {
		if err := prepare(); err != nil {
			e.ranges.unlock(lr)
			e.io.RUnlock()
			e.io_.record(o, int(n), began, err)
			return err
		}
	}
	ms, modes := e.writable()
	// Constant false unless built with -tags cairn_unsafe: then the broken
	// path is not compiled in at all.
	if unsafeAckEarlyBuilt && e.opts.UnsafeAckEarly && o == opWrite && len(ms) > 1 {
		return e.mutateEarly(ctx, lr, ms, modes, fn)
	}
	errs := fanout(ms, o, int(n), fn, start)
	okRW, failed := 0, false
	var last error
	for i, m := range ms {
		if errs[i] == nil {
			if modes[i] == ModeRW {
				okRW++
			}
			continue
		}
		last = errs[i]
		if ctx.Err() == nil {
			failed = e.markFailed(m, fmt.Errorf("%s failed: %w", opName(o), errs[i])) || failed
		}
	}
	if o != opFlush {
		// Before the range is unlocked and I/O can be paused for a
		// rebuild: a returning replica's resync copies what is noted.
		e.away.note(off, n, last != nil)
	}
	if lr != nil {
		e.ranges.unlock(lr)
	}
	e.io.RUnlock()
	marked := last != nil && o != opFlush
	if marked {
		e.markFailedWrite(ctx, off, n)
	}
	if failed || marked || e.needBump.Load() {
		// Acknowledge only once every failed replica is fenced off by the
		// epoch bump (see needBump), and only if a replica that took the
		// write is still RW after it: if the bump found none left, the
		// failed replicas were not fenced, and one of them, without this
		// write, could be taken as current by the next engine.
		e.afterFailure(ctx)
		okRW = e.stillRW(ms, modes, errs)
	}
	var err error
	switch {
	case okRW > 0:
	case ctx.Err() != nil:
		err = ctx.Err()
	case last != nil:
		err = fmt.Errorf("%w: %s: last error: %w", ErrNoReplica, opName(o), last)
	default:
		err = fmt.Errorf("%w: no RW replica", ErrNoReplica)
	}
	e.io_.record(o, int(n), began, err)
	return err
}

// stillRW counts the members that were RW, took the operation (no error)
// and are RW now.
func (e *Engine) stillRW(ms []*member, modes []Mode, errs []error) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	n := 0
	for i, m := range ms {
		if errs[i] == nil && modes[i] == ModeRW && m.mode == ModeRW {
			n++
		}
	}
	return n
}

func opName(o op) string {
	return [...]string{"read", "write", "flush", "unmap"}[o]
}

// WriteAt writes p at off to every writable replica; with fua the data is
// durable on each before it returns. An encrypted volume's replicas get
// the ciphertext; p is left as it is.
func (e *Engine) WriteAt(ctx context.Context, p []byte, off int64, fua bool) error {
	return e.write(ctx, p, off, fua, e.crypt)
}

// write is WriteAt with the cipher p is encrypted with on its way to the
// replicas: nil writes p as it is (a clone's copy of another replica's
// data, already in the replicas' form).
func (e *Engine) write(ctx context.Context, p []byte, off int64, fua bool, c *volcrypt.Cipher) error {
	ctx = detach(ctx)
	if err := e.checkRange(off, int64(len(p))); err != nil {
		return err
	}
	for {
		chunk := p[:min(len(p), MaxIO)]
		last := len(chunk) == len(p)
		// FUA on the last piece makes all durable: its flush covers the others.
		if err := e.writeChunk(ctx, chunk, off, fua && last, c); err != nil {
			return err
		}
		if last {
			return nil
		}
		p, off = p[MaxIO:], off+MaxIO
	}
}

// detach returns ctx without its cancellation and deadline. Every call on
// a replica whose failure fails the replica (data I/O, SetEpoch, the
// flush and snapshot of a pause) uses it: a caller giving up (an NBD
// client gone, an RPC deadline) must never count against a replica.
// Replicas are judged by their own timeouts only (and a dataconn client
// that sees its context end fails as a whole).
func detach(ctx context.Context) context.Context { return context.WithoutCancel(ctx) }

// blockSize is the unit replicas are written in.
const blockSize = 4096

// writeChunk writes p at off, encrypted with c unless c is nil. Replicas
// only ever get whole 4 KiB blocks: a write that starts or ends inside a
// block is merged here with the block's current data, read from an RW
// replica while the range is locked. (A replica being rebuilt cannot merge
// a partial block itself: the older data under it may not have been
// copied in yet.) With c, the merge decrypts the sectors the write
// touches, and the whole blocks are encrypted again; an aligned write is
// encrypted into a pooled buffer before the range is locked. p itself is
// never changed: callers may reuse it (the NBD frontend's write-zeroes
// writes one zero buffer again and again).
func (e *Engine) writeChunk(ctx context.Context, p []byte, off int64, fua bool, c *volcrypt.Cipher) error {
	var prepare func() error
	if off%blockSize != 0 || len(p)%blockSize != 0 {
		start := off - off%blockSize
		end := (off + int64(len(p)) + blockSize - 1) / blockSize * blockSize
		buf := make([]byte, end-start)
		data, at := p, off
		prepare = func() error {
			last := fmt.Errorf("%w: no RW replica to merge a partial block from", ErrNoReplica)
			for _, m := range e.readable() {
				if last = m.data.ReadAt(ctx, buf, start); last == nil {
					return mergeBlocks(c, buf, start, data, at)
				}
			}
			return last
		}
		p, off = buf, start // the whole blocks go to the replicas
	} else if c != nil {
		ct := e.bufs.Get(len(p))
		defer e.bufs.Put(ct) // mutateWith returns once every replica has answered
		if err := c.Encrypt(ct, p, off); err != nil {
			return err
		}
		p = ct
	}
	return e.mutateWith(ctx, opWrite, off, int64(len(p)), prepare,
		func(m *member) error { return m.data.WriteAt(ctx, p, off, fua) }, startWrite(ctx, p, off, fua))
}

// startWrite starts a write on replicas that can send it and wait for the
// answer separately (WriteStarter); nil for the others, which the fan-out
// runs in goroutines.
func startWrite(ctx context.Context, p []byte, off int64, fua bool) func(*member) func() error {
	return func(m *member) func() error {
		ws, ok := m.data.(WriteStarter)
		if !ok {
			return nil
		}
		w := ws.StartWriteAt(p, off, fua)
		return func() error { return w.Wait(ctx) }
	}
}

// Unmap discards [off, off+length) on every writable replica. On an
// encrypted volume too the whole blocks are unmapped as they are: their
// sectors read back as zeros (volcrypt leaves an all-zero sector alone).
func (e *Engine) Unmap(ctx context.Context, off, length int64) error {
	ctx = detach(ctx)
	if err := e.checkRange(off, length); err != nil {
		return err
	}
	// Partial blocks at either end become zero writes (merged here, see
	// writeChunk); whole blocks are unmapped.
	if head := (blockSize - off%blockSize) % blockSize; head > 0 {
		k := min(head, length)
		if err := e.writeChunk(ctx, make([]byte, k), off, false, e.crypt); err != nil {
			return err
		}
		off, length = off+k, length-k
	}
	if tail := length % blockSize; tail > 0 {
		if err := e.writeChunk(ctx, make([]byte, tail), off+length-tail, false, e.crypt); err != nil {
			return err
		}
		length -= tail
	}
	for length > 0 {
		n := min(length, maxUnmap)
		o := off
		if err := e.mutate(ctx, opUnmap, o, n, func(m *member) error { return m.data.Unmap(ctx, o, n) }); err != nil {
			return err
		}
		off, length = off+n, length-n
	}
	return nil
}

// Flush makes every completed write durable on every writable replica.
func (e *Engine) Flush(ctx context.Context) error {
	ctx = detach(ctx)
	return e.mutate(ctx, opFlush, 0, 0, func(m *member) error { return m.data.Flush(ctx) })
}

// readProbeInterval: a RW replica not given a read for this long gets the
// next one, whatever pickRead would choose, so that every replica is read
// regularly (a failing one is noticed by a read, and its latency figure
// stays current) at a cost that does not grow with the I/O rate.
const readProbeInterval = 100 * time.Millisecond

// offNodeSlowdown: replicas on the engine's node take every read (probes
// aside) until their recent read latency is this many times an off-node
// replica's expected wait. A read over TCP costs CPU on both ends (network
// stack, payload checksum, a copy) that a unix socket with shared memory
// does not; on a busy node that CPU is what every other read waits for,
// so a longer queue at the node's replica is no reason to go elsewhere. A
// node replica that is slow for its own sake (a failing disk) is.
const offNodeSlowdown = 16

// pickRead returns the index in rs of the replica a read at now (unix ns)
// goes to: one not read for readProbeInterval (taken by one read only);
// a replica not read yet; else a replica on the engine's node, unless
// offNodeSlowdown says it is too slow; else the one expected to answer
// first, by its recent read latency times one more than its reads in
// flight.
func pickRead(rs []*member, now int64) int {
	for i, m := range rs {
		last := m.lastRead.Load()
		if now-last >= int64(readProbeInterval) && m.lastRead.CompareAndSwap(last, now) {
			return i
		}
	}
	on, off := -1, -1
	var onScore, onLat, offScore float64
	for i, m := range rs {
		lat := m.readNs.Load()
		if lat == 0 {
			return i
		}
		score := float64(lat) * float64(1+m.reading.Load())
		switch {
		case m.onNode() && (on < 0 || score < onScore):
			on, onScore, onLat = i, score, float64(lat)
		case !m.onNode() && (off < 0 || score < offScore):
			off, offScore = i, score
		}
	}
	best := on
	if on < 0 || (off >= 0 && onLat > offNodeSlowdown*offScore) {
		best = off
	}
	if now-rs[best].lastRead.Load() > int64(time.Millisecond) { // not a store per read
		rs[best].lastRead.Store(now)
	}
	return best
}

// observeRead folds a successful read's latency into the member's
// average (weight 1/8: a few slow reads move it, one does not dominate).
func (m *member) observeRead(took time.Duration) {
	ns := max(took.Nanoseconds(), 1)
	for {
		old := m.readNs.Load()
		next := ns
		if old != 0 {
			next = old + (ns-old)/8
		}
		if m.readNs.CompareAndSwap(old, max(next, 1)) {
			return
		}
	}
}
