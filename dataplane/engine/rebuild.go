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
	Started     time.Time
	Finished    time.Time
	Error       string
}

type rebuild struct {
	// dirtyLayers: for a dirty-only rebuild, the snapshots the dirty
	// regions are copied into, oldest first (those the replica missed,
	// then the rebuild snapshot).
	dirtyLayers []string
	cancel      context.CancelFunc
	mu          sync.Mutex
	st          RebuildStatus
	done        atomic.Int64
	copied      atomic.Int64
	fin         chan struct{}
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

// AddReplica adds the replica at addr in WO mode behind a snapshot taken
// on every replica at this moment, and rebuilds it in the background:
// the data older than the snapshot is copied from an RW replica while new
// writes reach it directly, then verified, then the replica becomes RW.
// A replica that failed earlier in this engine's life, while the set has
// stayed degraded since, copies only the regions marked dirty in its own
// and the source's write-intent bitmaps; any other copies everything,
// skipping holes. AddReplica returns once the replica is taking writes.
func (e *Engine) AddReplica(ctx context.Context, addr string) error {
	e.mu.Lock()
	for _, m := range e.members {
		if m.addr == addr && m.mode != ModeERR {
			e.mu.Unlock()
			return fmt.Errorf("%w: %s is already a %s member", ErrInvalid, addr, m.mode)
		}
	}
	if rb := e.rebuilds[addr]; rb != nil && rb.status().State == RebuildInProgress {
		e.mu.Unlock()
		return fmt.Errorf("%w: %s is already being rebuilt", ErrInvalid, addr)
	}
	failedID, wasMember := e.failed[addr]
	e.mu.Unlock()

	r, err := e.opts.Dial(ctx, addr)
	if err != nil {
		return fmt.Errorf("add replica %s: %w", addr, err)
	}
	tinfo, err := r.Info(ctx)
	if err == nil && tinfo.Size < e.Size() {
		err = r.Expand(ctx, e.Size())
	}
	if err == nil && tinfo.Size > e.Size() {
		err = fmt.Errorf("%w: the replica is %d bytes, larger than the volume (%d)", ErrInvalid, tinfo.Size, e.Size())
	}
	if err != nil {
		r.Close()
		return fmt.Errorf("add replica %s: %w", addr, err)
	}
	// Only the very replica that failed (same ID, data intact, not halfway
	// through an earlier rebuild) may copy just the dirty regions; a new
	// replica at the same address gets everything.
	dirtyOnly := wasMember && failedID != "" && failedID == tinfo.ID && !tinfo.Rebuilding

	// From here on a failure fails replicas: the caller's cancellation must
	// not cause one.
	ctx = detach(ctx)
	if dirtyOnly {
		tinfo.Snapshots = e.dropDeletedWhileAway(ctx, r, addr, tinfo.Snapshots)
	}

	// Pause I/O: snapshot everyone at the same point, add the new member.
	e.chain.Lock()
	defer e.chain.Unlock() // until the copy has started in the background
	e.pause()
	e.mu.Lock()
	now := time.Now()
	rbSnap := SnapshotInfo{Name: fmt.Sprintf("rebuild-%d-%d", e.epoch, now.UnixNano()%1e6), Created: now}
	snap := rbSnap.Name
	// The source: an RW member. Its snapshots are the history a full
	// rebuild reproduces on the target, layer by layer.
	src, before, err := e.rebuildSourceLocked(ctx, nil, nil)
	chain := before.Snapshots
	// A returning replica resyncs dirty regions only if its snapshots are
	// the oldest of the volume's (those deleted while it was away are gone
	// by now); the ones taken since it left are taken on it too, over its
	// old head, and get their data in the dirty regions like the rebuild
	// snapshot.
	var missed []SnapshotInfo
	if err == nil && dirtyOnly {
		if isPrefix(tinfo.Snapshots, chain) {
			missed = chain[len(tinfo.Snapshots):]
		} else {
			e.log.Info("the returning replica's snapshots are not the volume's oldest; rebuilding it in full", "replica", addr)
			dirtyOnly = false
		}
	}
	// The target first: if it cannot take its new chain (a full disk, say),
	// the members are left untouched. And fence it before that: a
	// returning replica may still hold writes of its old membership (one
	// paused with writes queued, say); one landing after its rebuild
	// snapshot would sit in the new head, above everything the rebuild
	// copies (chaos seed 320047). At the epoch about to be published it
	// refuses them. The fence also marks it rebuilding, which ReplaceChain
	// requires.
	if err == nil {
		err = r.SetEpoch(ctx, e.epoch+1, true, true)
	}
	if err == nil && dirtyOnly {
		// Its old head becomes the oldest snapshot it missed (or the
		// rebuild snapshot), under empty ones for the rest.
		for _, s := range append(append([]SnapshotInfo(nil), missed...), rbSnap) {
			if err = r.Snapshot(ctx, s); err != nil {
				break
			}
		}
	} else if err == nil {
		// Emptied into the source's chain plus the rebuild snapshot.
		err = r.ReplaceChain(ctx, append(append([]SnapshotInfo(nil), chain...), rbSnap))
	}
	for _, m := range e.members {
		if err != nil {
			break
		}
		if m.mode == ModeERR {
			continue
		}
		merr := m.data.Flush(ctx)
		if merr == nil {
			merr = m.ctl.Snapshot(ctx, rbSnap)
		}
		if merr != nil {
			e.setMode(m, ModeERR, fmt.Errorf("rebuild snapshot: %w", merr))
		}
	}
	var srcInfo ReplicaInfo
	if err == nil {
		// Read after the snapshot: the dirty bitmap covers every write
		// below it. If the source failed meanwhile, another RW member with
		// the same chain serves.
		want := append(append([]SnapshotInfo(nil), chain...), rbSnap)
		src, srcInfo, err = e.rebuildSourceLocked(ctx, src, want)
	}
	var nm *member
	if err == nil {
		nm = &member{addr: addr, id: tinfo.ID, since: time.Now()}
		nm.attach(r)
		e.setMode(nm, ModeWO, nil)
		// The new member replaces any failed entry at the same address.
		kept := e.members[:0]
		for _, m := range e.members {
			if m.addr != addr || m.mode != ModeERR {
				kept = append(kept, m)
			}
		}
		e.members = append(kept, nm)
		// Persists "rebuilding" on the new replica with the new epoch.
		err = e.publishEpochLocked(ctx, true)
	}
	rctx, cancel := context.WithCancel(context.Background())
	rb := &rebuild{cancel: cancel, fin: make(chan struct{}), st: RebuildStatus{
		Replica: addr, Snapshot: snap, State: RebuildInProgress, DirtyOnly: dirtyOnly, Started: time.Now()}}
	rb.st.Layers = names(srcInfo.Snapshots)
	rb.dirtyLayers = append(names(missed), snap)
	if src != nil {
		rb.st.Source = src.addr
	}
	if err == nil && nm.mode == ModeERR {
		err = fmt.Errorf("the new replica failed while joining: %w", nm.err)
	}
	if err == nil {
		e.rebuilds[addr] = rb
	} else if e.needBump.Load() {
		// A member failed while we prepared: fence it off before resuming.
		if berr := e.publishEpochLocked(ctx, true); berr != nil {
			e.log.Error(berr, "bumping the epoch after a failed replica add")
		}
	}
	e.mu.Unlock()
	e.resume()
	if err != nil {
		cancel()
		if nm == nil {
			r.Close()
		}
		return fmt.Errorf("add replica %s: %w", addr, err)
	}
	go e.watch(nm)

	// What to copy: the dirty regions of the view at the rebuild snapshot,
	// or every layer's data.
	size := e.Size()
	var regions []span
	var total int64
	if dirtyOnly {
		regions = dirtySpans(size, srcInfo, tinfo)
		for _, s := range regions {
			total += s.n * int64(len(rb.dirtyLayers)) // copied into each
		}
	} else {
		regions = []span{{0, size}}
		for _, s := range srcInfo.Snapshots {
			total += s.DataBytes
		}
	}
	rb.mu.Lock()
	rb.st.BytesTotal = total
	rb.mu.Unlock()
	e.log.Info("rebuild started", "replica", addr, "source", src.addr, "snapshot", snap, "dirtyOnly", dirtyOnly, "bytes", total)
	go e.runRebuild(rctx, rb, src, nm, regions)
	return nil
}

// dropDeletedWhileAway deletes on a returning replica (not a member yet,
// so I/O goes on) the snapshots the volume deleted while it was away:
// deleting the same snapshots leaves the same data in the ones that
// remain, so its dirty regions are still all it lacks. A snapshot is
// known by name and creation time, so one deleted and taken again under
// the same name is deleted here too (and taken on it again by
// AddReplica). It returns the replica's chain afterwards.
func (e *Engine) dropDeletedWhileAway(ctx context.Context, r Replica, addr string, have []SnapshotInfo) []SnapshotInfo {
	rs := e.readable()
	if len(rs) == 0 {
		return have
	}
	info, err := rs[0].ctl.Info(ctx)
	if err != nil {
		return have
	}
	gone := deletedFrom(have, info.Snapshots)
	for _, name := range gone {
		if err := r.DeleteSnapshot(ctx, name); err != nil {
			e.log.Info("could not delete on the returning replica a snapshot the volume deleted while it was away", "replica", addr, "snapshot", name, "error", err.Error())
			break
		}
	}
	if len(gone) > 0 {
		e.log.Info("deleted on the returning replica the snapshots the volume deleted while it was away", "replica", addr, "snapshots", gone)
		if in, err := r.Info(ctx); err == nil {
			return in.Snapshots
		}
	}
	return have
}

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

// rebuildSourceLocked returns an RW member to rebuild from and its info,
// trying prefer first (if not nil), and failing members that cannot
// answer. With want set, only a member whose snapshots are exactly those
// serves (after the rebuild snapshot: the target's chain was made from
// the first source's). Called with I/O paused.
func (e *Engine) rebuildSourceLocked(ctx context.Context, prefer *member, want []SnapshotInfo) (*member, ReplicaInfo, error) {
	ms := e.members
	if prefer != nil {
		ms = append([]*member{prefer}, ms...)
	}
	for _, m := range ms {
		if m.mode != ModeRW {
			continue
		}
		info, err := m.ctl.Info(ctx)
		if err != nil {
			e.setMode(m, ModeERR, fmt.Errorf("rebuild: info: %w", err))
			continue
		}
		if want == nil || sameChain(info.Snapshots, want) {
			return m, info, nil
		}
	}
	if want == nil {
		return nil, ReplicaInfo{}, fmt.Errorf("%w: no RW replica to rebuild from", ErrNoReplica)
	}
	return nil, ReplicaInfo{}, fmt.Errorf("%w: no RW replica with the snapshots %v left to rebuild from", ErrNoReplica, names(want))
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

// dirtySpans is the union of two write-intent bitmaps as byte ranges.
func dirtySpans(size int64, a, b ReplicaInfo) []span {
	rs := a.DirtyRegionSize
	if rs <= 0 || rs != b.DirtyRegionSize {
		return []span{{0, size}} // bitmaps not comparable: copy everything
	}
	var out []span
	for r := int64(0); r*rs < size; r++ {
		if bit(a.Dirty, a.DirtyCount, r) || bit(b.Dirty, b.DirtyCount, r) {
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
		e.pause()
		e.mu.Lock()
		if dst.mode != ModeWO {
			err = fmt.Errorf("the replica left write-only mode during the rebuild: %w", dst.err)
		} else if err = e.setMode(dst, ModeRW, nil); err == nil {
			err = e.publishEpochLocked(detach(ctx), true)
		}
		e.mu.Unlock()
		e.resume()
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
	if err != nil {
		if e.markFailed(dst, fmt.Errorf("rebuild %s: %w", st, err)) {
			e.afterFailure(context.Background())
		}
		e.log.Info("rebuild ended", "replica", dst.addr, "state", string(st), "error", err.Error())
	} else {
		e.log.Info("rebuild complete", "replica", dst.addr, "copied", rb.copied.Load())
	}
	if rb.st.Snapshot == "" {
		return
	}
	// The rebuild snapshot has served its purpose, or the rebuild failed
	// or was cancelled and the members keep it for nothing: merge it away
	// on every replica, or each rebuild would leave a layer behind for
	// good.
	e.mu.Lock()
	e.doneSnaps[rb.st.Snapshot] = true
	e.mu.Unlock()
	e.removeDoneSnapshots()
}

// removeDoneSnapshots deletes the snapshots of completed rebuilds. One
// that another rebuild in progress still reads (it started meanwhile and
// copies it as a layer) is kept until that rebuild ends and calls this
// again.
func (e *Engine) removeDoneSnapshots() {
	e.mu.Lock()
	var todo []string
	for name := range e.doneSnaps {
		todo = append(todo, name)
	}
	e.mu.Unlock()
	for _, name := range todo {
		err := e.DeleteSnapshot(context.Background(), name)
		switch {
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
// snapshot, then compares checksums: for a dirty-only rebuild, the dirty
// regions of the view at each snapshot it missed and at the rebuild
// snapshot, written whole (zeros included, so none of the target's stale
// data shows through the source's holes) into that snapshot's layer; for
// a full one, every layer's own data into the same layer of the target
// (emptied before it joined).
func (e *Engine) copyAndVerify(ctx context.Context, rb *rebuild, src, dst *member, regions []span) error {
	layers := rb.st.Layers
	if rb.st.DirtyOnly {
		layers = rb.dirtyLayers
	}
	for _, l := range layers {
		if err := e.copyLayer(ctx, rb, src, dst, l, regions); err != nil {
			return err
		}
	}
	if err := dst.ctl.SyncLayers(ctx); err != nil {
		return fmt.Errorf("sync %s: %w", dst.addr, err)
	}
	sum := func(r Checksummer) func(context.Context, string, int64, int64) (uint32, error) {
		if rb.st.DirtyOnly {
			return r.Checksum
		}
		return r.LayerChecksum
	}
	for _, l := range layers {
		err := eachChunk(regions, func(off, n int64) error {
			if err := ctx.Err(); err != nil {
				return err
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
		})
		if err != nil {
			return err
		}
	}
	return nil
}

// copyLayer copies the regions of snapshot layer l from src to dst: the
// view, filled (dirty-only), or the layer's own extents (full). The next
// chunk is read from src while the current one is written to dst.
func (e *Engine) copyLayer(ctx context.Context, rb *rebuild, src, dst *member, l string, regions []span) error {
	type chunk struct {
		off, n int64
		ext    []Extent
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	chunks := make(chan chunk, 1)
	readErr := make(chan error, 1)
	go func() {
		defer close(chunks)
		readErr <- func() error {
			read := src.ctl.ReadLayer
			if rb.st.DirtyOnly {
				read = src.ctl.ReadSnapshot
			}
			return eachChunk(regions, func(off, n int64) error {
				ext, err := read(ctx, l, off, n)
				if err != nil {
					return fmt.Errorf("read snapshot %s from %s: %w", l, src.addr, err)
				}
				select {
				case chunks <- chunk{off, n, ext}:
					return nil
				case <-ctx.Done():
					return ctx.Err()
				}
			})
		}()
	}()
	for c := range chunks {
		if err := ctx.Err(); err != nil {
			return err
		}
		if e.modeOf(dst) != ModeWO {
			return errors.New("the replica failed during the rebuild")
		}
		ext := c.ext
		if rb.st.DirtyOnly {
			// The target may hold stale data here, even where the source
			// has holes: write the whole region, zeros included.
			buf := make([]byte, c.n)
			for _, x := range ext {
				copy(buf[x.Offset-c.off:], x.Data)
			}
			ext = []Extent{{Offset: c.off, Data: buf}}
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
		if rb.st.DirtyOnly {
			rb.done.Add(c.n)
		}
	}
	if err := <-readErr; err != nil {
		return err
	}
	return ctx.Err()
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
