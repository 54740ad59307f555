package engine

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
)

// RebuildState is the phase of a rebuild.
type RebuildState string

// Rebuild states.
const (
	RebuildInProgress RebuildState = "in-progress"
	RebuildComplete   RebuildState = "complete"
	RebuildFailed     RebuildState = "failed"
	RebuildCancelled  RebuildState = "cancelled"
)

// RebuildStatus reports one rebuild.
type RebuildStatus struct {
	Replica  string
	Source   string
	Snapshot string
	State    RebuildState
	// DirtyOnly is true when only regions marked in the write-intent bitmaps
	// are copied (a returning replica); false for a full copy.
	DirtyOnly bool
	// FullReason says, for a full rebuild of a replica that held data of
	// a volume (one returning after an outage), why its changed regions
	// alone could not be copied; empty otherwise.
	FullReason string
	// Layers are the snapshots the rebuild reads, oldest first, the
	// rebuild snapshot last. A full rebuild copies each one's own data
	// into the same snapshot on the target, so the target keeps the
	// volume's snapshot history; they cannot be deleted meanwhile.
	Layers []string
	// BytesDone and BytesTotal measure progress: through the dirty regions
	// (dirty-only), or through the data the source's layers hold (full).
	BytesDone, BytesTotal int64
	// BytesCopied is the data actually sent (holes are skipped).
	BytesCopied int64
	// RelayReason says why the rebuild's data passes through the engine
	// (read from the source, written to the target) instead of going
	// from replica to replica (LayerPuller); empty while it does not.
	RelayReason string
	Started     time.Time
	Finished    time.Time
	Error       string
}

type rebuild struct {
	// dirtyLayers: for a dirty-only rebuild, the snapshots the dirty
	// regions are copied into, oldest first (those the replica missed,
	// then the rebuild snapshot).
	dirtyLayers []string
	// ctx is the context of the rebuild's calls; cancel ends it.
	ctx    context.Context
	cancel context.CancelFunc
	mu     sync.Mutex
	st     RebuildStatus
	done   atomic.Int64
	copied atomic.Int64
	// relay: the chunks go through the engine (copyChunk), since the
	// target could not pull one itself; set once, never cleared.
	relay atomic.Bool
	fin   chan struct{}
	// copyTime (copy and verify) and syncTime are how long each phase of
	// copyAndVerify took, logged when the rebuild completes; written by
	// the rebuild's goroutine only.
	copyTime, syncTime time.Duration
}

func (rb *rebuild) status() RebuildStatus {
	rb.mu.Lock()
	defer rb.mu.Unlock()
	s := rb.st
	s.Layers = append([]string(nil), s.Layers...)
	s.BytesDone, s.BytesCopied = rb.done.Load(), rb.copied.Load()
	return s
}

// RebuildChunk is how much a rebuild copies per request.
const RebuildChunk = 4 << 20

// deletedFrom returns the snapshots of have that want lacks: want is have
// less the snapshots deleted since, plus the ones taken since (newer than
// all of have's, so at its end).
func deletedFrom(have, want []SnapshotInfo) []string {
	var gone []string
	j := 0
	for _, s := range have {
		if j < len(want) && sameSnapshot(want[j], s) {
			j++
		} else {
			gone = append(gone, s.Name)
		}
	}
	return gone
}

func names(s []SnapshotInfo) []string {
	out := make([]string, len(s))
	for i, x := range s {
		out[i] = x.Name
	}
	return out
}

// sameSnapshot: a snapshot is known by its name and creation time (the
// engine gives every replica the same), so one deleted and taken again
// under the same name is another snapshot.
func sameSnapshot(a, b SnapshotInfo) bool { return a.Name == b.Name && a.Created.Equal(b.Created) }

// sameChain reports whether two chains hold the same snapshots in order.
func sameChain(a, b []SnapshotInfo) bool { return len(a) == len(b) && isPrefix(a, b) }

// isPrefix reports whether chain a is the start of chain b.
func isPrefix(a, b []SnapshotInfo) bool {
	if len(a) > len(b) {
		return false
	}
	for i := range a {
		if !sameSnapshot(a[i], b[i]) {
			return false
		}
	}
	return true
}

type span struct{ off, n int64 }

// eachChunk calls fn for every piece of at most RebuildChunk bytes of the
// regions, in order, until fn fails.
func eachChunk(regions []span, fn func(off, n int64) error) error {
	for _, s := range regions {
		for off := s.off; off < s.off+s.n; off += RebuildChunk {
			if err := fn(off, min(RebuildChunk, s.off+s.n-off)); err != nil {
				return err
			}
		}
	}
	return nil
}

// dirtySpans is the union of two write-intent bitmaps and the engine's
// record of the writes made while a replica was away, as byte ranges of
// the bitmaps' regions.
func dirtySpans(size int64, a, b ReplicaInfo, away *awayMap) []span {
	rs := a.DirtyRegionSize
	if rs <= 0 || rs != b.DirtyRegionSize {
		return []span{{0, size}} // bitmaps not comparable: copy everything
	}
	var out []span
	for r := int64(0); r*rs < size; r++ {
		if bit(a.Dirty, a.DirtyCount, r) || bit(b.Dirty, b.DirtyCount, r) || away.overlaps(r*rs, min(rs, size-r*rs)) {
			off := r * rs
			n := min(rs, size-off)
			if k := len(out) - 1; k >= 0 && out[k].off+out[k].n == off {
				out[k].n += n
			} else {
				out = append(out, span{off, n})
			}
		}
	}
	return out
}

func bit(w []uint64, count, r int64) bool {
	return r < count && int(r/64) < len(w) && w[r/64]&(1<<(r%64)) != 0
}

func (e *Engine) runRebuild(ctx context.Context, rb *rebuild, src, dst *member, regions []span) {
	defer close(rb.fin)
	err := e.copyAndVerify(ctx, rb, src, dst, regions)
	if err == nil {
		err = e.promote(ctx, dst)
	}
	rb.mu.Lock()
	rb.st.Finished = time.Now()
	switch {
	case err == nil:
		rb.st.State = RebuildComplete
	case errors.Is(err, context.Canceled) || ctx.Err() != nil:
		// A cancelled call to a replica over gRPC returns its own
		// Canceled status, which does not wrap context.Canceled.
		rb.st.State, rb.st.Error = RebuildCancelled, "cancelled"
	default:
		rb.st.State, rb.st.Error = RebuildFailed, err.Error()
	}
	st := rb.st.State
	rb.mu.Unlock()
	e.layersChanged() // the target holds the data now, or the rebuild's snapshot may be gone
	if err != nil {
		if e.markFailed(dst, fmt.Errorf("rebuild %s: %w", st, err)) {
			e.afterFailure(context.Background())
		}
		e.log.Info("rebuild ended", "replica", dst.addr, "state", string(st), "error", err.Error())
	} else {
		e.log.Info("rebuild complete", "replica", dst.addr, "copied", rb.copied.Load(),
			"copyAndVerify", rb.copyTime.String(), "sync", rb.syncTime.String())
	}
	if rb.st.Snapshot == "" {
		return
	}
	// The rebuild snapshot has served its purpose, or the rebuild failed
	// or was cancelled and the members keep it for nothing: merge it away
	// on every replica, or each rebuild would leave a layer behind for
	// good. Not once the engine is closed: the next engine rebuilds the
	// replica anew (its rebuild never finished), and the members keep the
	// snapshot, as after a crash.
	e.mu.Lock()
	e.doneSnaps[rb.st.Snapshot] = true
	closed := e.closed
	e.mu.Unlock()
	if !closed {
		e.removeDoneSnapshots()
	}
}

// promote makes dst RW once its copy is verified, with I/O paused so no
// write finds it half promoted, and publishes the new epoch. A rebuild
// cancelled meanwhile (CancelRebuild, Close) is not promoted.
func (e *Engine) promote(ctx context.Context, dst *member) error {
	e.pause()
	defer e.resume()
	e.mu.Lock()
	err := ctx.Err()
	if err == nil && dst.mode != ModeWO {
		err = fmt.Errorf("the replica left write-only mode during the rebuild: %w", dst.err)
	}
	if err == nil {
		err = e.setMode(dst, ModeRW, nil)
	}
	e.mu.Unlock()
	if err != nil {
		return err
	}
	return e.publishEpoch(detach(ctx), true)
}

// removeDoneSnapshots deletes the snapshots of completed rebuilds. One
// that another rebuild in progress still reads (it started meanwhile and
// copies it as a layer) is kept until that rebuild ends and calls this
// again. Close cancels the deletions (they run in a rebuild's goroutine,
// which Close waits for).
func (e *Engine) removeDoneSnapshots() {
	e.mu.Lock()
	var todo []string
	for name := range e.doneSnaps {
		todo = append(todo, name)
	}
	e.mu.Unlock()
	for _, name := range todo {
		err := e.deleteSnapshot(e.stop, name)
		switch {
		case e.stop.Err() != nil:
			return
		case errors.Is(err, ErrInvalid):
			continue // in use by a rebuild: it removes it when it ends
		case err != nil && !errors.Is(err, ErrSnapshotNotFound):
			e.log.Error(err, "removing a rebuild snapshot; the next rebuild to complete tries again", "snapshot", name)
			continue
		}
		e.mu.Lock()
		delete(e.doneSnaps, name)
		e.mu.Unlock()
	}
}

// copyAndVerify copies into dst what it lacks below the rebuild
// snapshot and compares checksums of every chunk on both sides: for a
// dirty-only rebuild, the dirty regions of the view at each snapshot it
// missed and at the rebuild snapshot, written whole (zeros included, so
// none of the target's stale data shows through the source's holes) into
// that snapshot's layer; for a full one, every layer's own data into the
// same layer of the target (emptied before it joined). Then it makes the
// target's layers durable.
//
// A chunk is verified as soon as it is written, not after the whole copy:
// the layers a rebuild reads cannot change while it runs (they cannot be
// deleted, and only the rebuild writes the target's), and a chunk of a
// layer is written by that chunk's copy alone, so the checksums compare
// what they would at the end. Layers are copied one after the other, so
// the view at a layer (dirty-only) is complete below it when verified.
// Making the data durable does not change it: the sync comes last, before
// the target is promoted.
func (e *Engine) copyAndVerify(ctx context.Context, rb *rebuild, src, dst *member, regions []span) error {
	layers := rb.st.Layers
	if rb.st.DirtyOnly {
		layers = rb.dirtyLayers
	}
	t := time.Now()
	for _, l := range layers {
		if err := e.copyLayer(ctx, rb, src, dst, l, regions); err != nil {
			return err
		}
	}
	rb.copyTime, t = time.Since(t), time.Now()
	if err := dst.ctl.SyncLayers(ctx); err != nil {
		return fmt.Errorf("sync %s: %w", dst.addr, err)
	}
	rb.syncTime = time.Since(t)
	return nil
}

// RebuildInFlight is how many chunks a rebuild copies at once. Each
// chunk's calls (read from the source, write to the target, checksum on
// both) run one after the other; several chunks in flight keep both
// replicas, their disks and the network busy while any one call waits.
const RebuildInFlight = 4

// copyLayer copies the regions of snapshot layer l from src to dst, and
// verifies them, RebuildInFlight chunks at a time (copyChunk). The first
// error stops the others and is returned.
func (e *Engine) copyLayer(ctx context.Context, rb *rebuild, src, dst *member, l string, regions []span) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var (
		once  sync.Once
		first error
		wg    sync.WaitGroup
	)
	fail := func(err error) {
		once.Do(func() { first = err })
		cancel()
	}
	chunks := make(chan span)
	for range RebuildInFlight {
		wg.Go(func() {
			for c := range chunks {
				if err := e.copyChunk(ctx, rb, src, dst, l, c.off, c.n); err != nil {
					fail(err)
					return
				}
			}
		})
	}
	err := eachChunk(regions, func(off, n int64) error {
		select {
		case chunks <- span{off, n}:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	})
	close(chunks)
	wg.Wait()
	if first != nil {
		return first
	}
	return err
}

// copyChunk copies [off, off+n) of layer l from src to dst, the view,
// filled (dirty-only), or the layer's own extents (full), then compares
// the checksums of that range on both sides. The target pulls the chunk
// from the source itself when it can (LayerPuller); the first chunk it
// cannot pull (ErrNoPull) makes the rebuild relay that chunk and the
// rest through the engine.
func (e *Engine) copyChunk(ctx context.Context, rb *rebuild, src, dst *member, l string, off, n int64) error {
	if !rb.relay.Load() {
		if e.modeOf(dst) != ModeWO {
			return errors.New("the replica failed during the rebuild")
		}
		w, err := dst.ctl.PullLayer(ctx, src.replica(), src.id, l, off, n, !rb.st.DirtyOnly)
		switch {
		case err == nil:
			rb.copied.Add(w)
			if !rb.st.DirtyOnly {
				rb.done.Add(w)
			}
			return e.verified(ctx, rb, src, dst, l, off, n)
		case errors.Is(err, ErrNoPull) && ctx.Err() == nil:
			rb.relayFrom(err, func() {
				e.log.Info("rebuild copies through the engine", "replica", dst.addr, "source", src.addr, "why", err.Error())
			})
		case ctx.Err() != nil:
			return ctx.Err()
		default:
			return fmt.Errorf("pull snapshot %s from %s into %s: %w", l, src.addr, dst.addr, err)
		}
	}
	return e.relayChunk(ctx, rb, src, dst, l, off, n)
}

// relayFrom makes the rebuild relay its chunks through the engine for
// the reason err; logged runs once, for the first chunk that finds out.
func (rb *rebuild) relayFrom(err error, logged func()) {
	if rb.relay.Swap(true) {
		return
	}
	rb.mu.Lock()
	rb.st.RelayReason = err.Error()
	rb.mu.Unlock()
	logged()
}

// relayChunk is copyChunk through the engine: read from src, written to
// dst.
func (e *Engine) relayChunk(ctx context.Context, rb *rebuild, src, dst *member, l string, off, n int64) error {
	read := src.ctl.ReadLayer
	if rb.st.DirtyOnly {
		read = src.ctl.ReadSnapshot
	}
	ext, err := read(ctx, l, off, n)
	if err != nil {
		return fmt.Errorf("read snapshot %s from %s: %w", l, src.addr, err)
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	if e.modeOf(dst) != ModeWO {
		return errors.New("the replica failed during the rebuild")
	}
	// Every chunk's data is a buffer of its own, never reused: the
	// replica client sends it without copying, and may still be sending
	// it after a write that failed.
	if rb.st.DirtyOnly {
		// The target may hold stale data here, even where the source
		// has holes: write the whole region, zeros included.
		buf := make([]byte, n)
		for _, x := range ext {
			copy(buf[x.Offset-off:], x.Data)
		}
		ext = []Extent{{Offset: off, Data: buf}}
	}
	for _, x := range ext {
		if err := dst.ctl.WriteLayer(ctx, l, x.Data, x.Offset); err != nil {
			return fmt.Errorf("write snapshot %s to %s: %w", l, dst.addr, err)
		}
		rb.copied.Add(int64(len(x.Data)))
		if !rb.st.DirtyOnly {
			rb.done.Add(int64(len(x.Data)))
		}
	}
	return e.verified(ctx, rb, src, dst, l, off, n)
}

// verified compares the chunk's checksums on both sides (verifyChunk)
// and counts a dirty-only chunk done.
func (e *Engine) verified(ctx context.Context, rb *rebuild, src, dst *member, l string, off, n int64) error {
	if err := e.verifyChunk(ctx, rb, src, dst, l, off, n); err != nil {
		return err
	}
	if rb.st.DirtyOnly {
		rb.done.Add(n)
	}
	return nil
}

// verifyChunk compares the checksums of [off, off+n) of layer l (its own
// data, full) or of the view at l (dirty-only) on src and dst.
func (e *Engine) verifyChunk(ctx context.Context, rb *rebuild, src, dst *member, l string, off, n int64) error {
	sum := func(r Checksummer) func(context.Context, string, int64, int64) (uint32, error) {
		if rb.st.DirtyOnly {
			return r.Checksum
		}
		return r.LayerChecksum
	}
	var a uint32
	var aerr error
	done := make(chan struct{})
	go func() { // both sides at once: they are different processes
		defer close(done)
		a, aerr = sum(src.ctl)(ctx, l, off, n)
	}()
	b, err := sum(dst.ctl)(ctx, l, off, n)
	<-done
	if aerr != nil {
		return fmt.Errorf("verify: checksum on %s: %w", src.addr, aerr)
	}
	if err != nil {
		return fmt.Errorf("verify: checksum on %s: %w", dst.addr, err)
	}
	if a != b {
		return fmt.Errorf("verify: snapshot %s, bytes %d..%d differ after the copy (%08x vs %08x)", l, off, off+n, a, b)
	}
	return nil
}

func (e *Engine) modeOf(m *member) Mode {
	e.mu.Lock()
	defer e.mu.Unlock()
	return m.mode
}

// CancelRebuild stops the rebuild of addr; the replica ends in ERR.
func (e *Engine) CancelRebuild(addr string) error {
	e.mu.Lock()
	rb := e.rebuilds[addr]
	e.mu.Unlock()
	if rb == nil || rb.status().State != RebuildInProgress {
		return fmt.Errorf("%w: no rebuild in progress for %s", ErrInvalid, addr)
	}
	rb.cancel()
	<-rb.fin
	return nil
}

// Rebuilds returns the status of every rebuild this engine ran or runs.
func (e *Engine) Rebuilds() []RebuildStatus {
	e.mu.Lock()
	defer e.mu.Unlock()
	out := make([]RebuildStatus, 0, len(e.rebuilds))
	for _, rb := range e.rebuilds {
		out = append(out, rb.status())
	}
	return out
}

// WaitRebuild blocks until the rebuild of addr ends or ctx does.
func (e *Engine) WaitRebuild(ctx context.Context, addr string) (RebuildStatus, error) {
	e.mu.Lock()
	rb := e.rebuilds[addr]
	e.mu.Unlock()
	if rb == nil {
		return RebuildStatus{}, fmt.Errorf("%w: no rebuild for %s", ErrInvalid, addr)
	}
	select {
	case <-rb.fin:
		return rb.status(), nil
	case <-ctx.Done():
		return rb.status(), ctx.Err()
	}
}
