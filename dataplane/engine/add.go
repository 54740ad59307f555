package engine

import (
	"context"
	"fmt"
	"time"
)

// AddReplica adds the replica at addr in WO mode behind a snapshot taken
// on every replica at this moment, and rebuilds it in the background:
// the data older than the snapshot is copied from an RW replica while new
// writes reach it directly, then verified, then the replica becomes RW.
// A replica that held data of the volume copies only the regions marked
// dirty in its own and the source's write-intent bitmaps (and in the
// engine's record of the writes made while it was away) if it failed
// earlier in this engine's life while the set stayed degraded since, or
// if the source has kept its bits since the replica left (keptFor: also
// after an engine restart); any other copies everything, skipping holes. The failed replica is recognised by its ID, not its
// address: a replica process restarted on its data directory usually gets
// other ports. AddReplica returns once the replica is taking writes.
func (e *Engine) AddReplica(ctx context.Context, addr string) error {
	if err := e.checkAddable(addr); err != nil {
		return err
	}
	a, err := e.dialTarget(ctx, addr)
	if err != nil {
		return fmt.Errorf("add replica %s: %w", addr, err)
	}
	// Only the very replica that failed (same ID, data intact, not halfway
	// through an earlier rebuild) may copy just the dirty regions; a new
	// replica, at the same address or not, gets everything.
	a.dirtyOnly, a.byMarker, a.fullReason = e.resyncKind(a.info)

	// From here on a failure fails replicas: the caller's cancellation must
	// not cause one.
	ctx = detach(ctx)
	if a.dirtyOnly {
		a.info.Snapshots = e.dropDeletedWhileAway(ctx, a.target, a.info.Snapshots)
	}
	e.chain.Lock()
	defer e.chain.Unlock() // until the copy has started in the background
	rb, err := e.join(ctx, a)
	if err != nil {
		a.target.close()
		return fmt.Errorf("add replica %s: %w", addr, err)
	}
	e.startRebuild(a, rb)
	return nil
}

// addition is a replica being added: what AddReplica's steps learn about
// it and decide.
type addition struct {
	target *member
	// info is what the target reported when dialed (its snapshots as
	// they are after dropDeletedWhileAway).
	info      ReplicaInfo
	dirtyOnly bool
	// byMarker: dirtyOnly holds only if the source's DirtyKeptSince
	// marker covers the target's absence (keptFor), checked once the
	// source is picked; the engine has no record of it leaving.
	byMarker bool
	// fullReason: why a replica that held data is rebuilt in full (with
	// byMarker, why the engine's own record cannot tell).
	fullReason string
	// snap is the rebuild snapshot, taken on every member and the target.
	snap SnapshotInfo
	// chain is the source's snapshots before snap; missed, for a
	// dirty-only rebuild, the end of chain taken while the target was away.
	chain, missed []SnapshotInfo
	// src is the member the rebuild copies from, srcInfo what it reported
	// after snap was taken.
	src     *member
	srcInfo ReplicaInfo
}

// checkAddable refuses addr if it is a member (not ERR) or being rebuilt.
func (e *Engine) checkAddable(addr string) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.checkAddableLocked(addr)
}

func (e *Engine) checkAddableLocked(addr string) error {
	if e.closed {
		return ErrClosed
	}
	for _, m := range e.members {
		if m.addr == addr && m.mode != ModeERR {
			return fmt.Errorf("%w: %s is already a %s member", ErrInvalid, addr, m.mode)
		}
	}
	if rb := e.rebuilds[addr]; rb != nil && rb.status().State == RebuildInProgress {
		return fmt.Errorf("%w: %s is already being rebuilt", ErrInvalid, addr)
	}
	return nil
}

// resyncKind decides whether a replica being added, as it reported
// itself before the fence, may copy dirty regions only: the replica with
// this ID failed in this engine's life while the set stayed degraded since
// (see Engine.failed) and is not halfway through an earlier rebuild. A
// replica that held data of the volume (it was given an epoch) that the
// engine has no such record of may still, byMarker, if the source picked
// later has kept its write-intent bits since the replica left (keptFor);
// fullReason then says why the engine's record cannot tell, for the
// status of a full rebuild if the source cannot either.
func (e *Engine) resyncKind(info ReplicaInfo) (dirtyOnly, byMarker bool, fullReason string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	_, failed := e.failed[info.ID]
	switch {
	case info.Rebuilding:
		return false, false, "an earlier rebuild of it did not finish: its data is incomplete"
	case info.ID != "" && failed:
		return true, false, ""
	case info.Epoch == 0:
		return false, false, "" // a new replica: everything is to copy
	case e.forgot[info.ID] != "":
		return true, true, e.forgot[info.ID]
	default:
		return true, true, "this engine did not see the replica leave (it was away when the engine started, or the engine restarted while it was away)"
	}
}

// dialTarget connects to the replica at addr, fences it (fenceTarget)
// and makes it the volume's size: a smaller one is expanded, a larger one
// refused. Nothing changes the replica before the fence: one that a newer
// engine owns refuses it and is left as it was. The member it returns in
// a.target is new (not in the set yet); a.info is what the replica
// reported before the fence, so its own rebuilding flag, not the one the
// fence sets, decides whether it may resync dirty regions only.
func (e *Engine) dialTarget(ctx context.Context, addr string) (*addition, error) {
	r, err := e.opts.Dial(ctx, addr)
	if err != nil {
		return nil, err
	}
	m := &member{addr: addr, since: time.Now()}
	m.attach(r, e.opts.ControlTimeout)
	info, err := m.ctl.Info(ctx)
	if err == nil && info.Size > e.Size() {
		err = fmt.Errorf("%w: the replica is %d bytes, larger than the volume (%d)", ErrInvalid, info.Size, e.Size())
	}
	if err == nil {
		err = e.fenceTarget(ctx, m)
	}
	if err == nil && info.Size < e.Size() {
		err = m.ctl.Expand(ctx, e.Size())
	}
	if err != nil {
		m.close()
		return nil, err
	}
	m.id = info.ID
	return &addition{target: m, info: info}, nil
}

// fenceTarget gives a replica being added the epoch about to be published
// (the current one + 1), marked rebuilding, before anything changes it
// (dialTarget, prepareTarget). The replica's control calls carry the epoch
// its client last set, or before that the replica's own: without this
// fence, a stale engine (one a newer engine has fenced out) adding a
// replica the newer engine owns would still expand it or delete its
// snapshots. An epoch never goes back and the current one is taken only
// from the engine that set it, so such a replica refuses (ErrStaleEpoch
// from the client) and is not touched. Rebuilding is persisted with the
// epoch: a replica that missed writes now carries an epoch newer than the
// members', and a later engine must not trust it (if this add fails
// after the fence, the next add of it rebuilds it in full for the same
// reason). The data path is left alone: the target takes no I/O until it
// joins, when publishEpoch sets it.
func (e *Engine) fenceTarget(ctx context.Context, t *member) error {
	e.mu.Lock()
	st := EpochState{Epoch: e.epoch + 1, Degraded: true, Rebuilding: true, Members: e.rwIDsLocked()}
	e.mu.Unlock()
	if err := t.ctl.SetEpoch(ctx, st); err != nil {
		return fmt.Errorf("fence: %w", err)
	}
	return nil
}

// dropDeletedWhileAway deletes on a returning replica (not a member yet,
// so I/O goes on) the snapshots the volume deleted while it was away:
// deleting the same snapshots leaves the same data in the ones that
// remain, so its dirty regions are still all it lacks. A snapshot is
// known by name and creation time, so one deleted and taken again under
// the same name is deleted here too (and taken on it again by
// AddReplica). It returns the replica's chain afterwards.
func (e *Engine) dropDeletedWhileAway(ctx context.Context, t *member, have []SnapshotInfo) []SnapshotInfo {
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
		if err := t.ctl.DeleteSnapshot(ctx, name, snapshotBytes(have, name)); err != nil {
			e.log.Info("could not delete on the returning replica a snapshot the volume deleted while it was away", "replica", t.addr, "snapshot", name, "error", err.Error())
			break
		}
	}
	if len(gone) > 0 {
		e.log.Info("deleted on the returning replica the snapshots the volume deleted while it was away", "replica", t.addr, "snapshots", gone)
		if in, err := t.ctl.Info(ctx); err == nil {
			return in.Snapshots
		}
	}
	return have
}

// join makes a.target a WO member behind a rebuild snapshot, with I/O
// paused so that every member takes the snapshot at the same point and
// every write after it reaches the target: it picks the source, prepares
// the target, snapshots the members, admits the target and registers
// its rebuild. If it fails, the members are left as they were, less any
// that failed meanwhile (fenced off before I/O resumes). The caller holds
// e.chain: no other member is added meanwhile. e.mu is taken only around
// reading and changing the set, never across a call to a replica.
func (e *Engine) join(ctx context.Context, a *addition) (rb *rebuild, err error) {
	e.pause()
	defer e.resume()
	defer func() {
		if err != nil && e.needBump.Load() {
			// A member failed while we prepared: fence it off before resuming.
			if berr := e.publishEpoch(ctx, true); berr != nil {
				e.log.Error(berr, "bumping the epoch after a failed replica add")
			}
		}
	}()
	if err := e.recheck(a); err != nil {
		return nil, err
	}
	if err := e.plan(ctx, a); err != nil {
		return nil, err
	}
	if err := e.prepareTarget(ctx, a); err != nil {
		return nil, err
	}
	e.snapshotMembers(ctx, a.snap)
	// Read the source's info after the snapshot: its dirty bitmap covers
	// every write below it. If the source failed meanwhile, another RW
	// member with the same chain serves.
	want := append(append([]SnapshotInfo(nil), a.chain...), a.snap)
	if a.src, a.srcInfo, err = e.rebuildSource(ctx, a.src, want); err != nil {
		return nil, err
	}
	if ok, why := keptFor(a.srcInfo, a.info); a.dirtyOnly && a.byMarker && !ok {
		// Another source than plan's (that one failed meanwhile), which
		// cannot vouch for the target's dirty regions; its chain is set
		// for a dirty-only rebuild. It is marked rebuilding: the next
		// add of it copies everything.
		return nil, fmt.Errorf("%w: the rebuild source changed to %s, which %s", ErrNoReplica, a.src.addr, why)
	}
	return e.admit(ctx, a)
}

// recheck repeats checkAddable now that no other add can run (e.chain is
// held): another add of the same address may have joined since, and the
// set may have become healthy since, clearing the failed record that
// allowed a dirty-only rebuild (the survivors' bits for the target's
// missed writes may be gone: the source's marker decides).
func (e *Engine) recheck(a *addition) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if err := e.checkAddableLocked(a.target.addr); err != nil {
		return err
	}
	if _, failed := e.failed[a.info.ID]; a.dirtyOnly && !a.byMarker && !failed {
		// The source's marker decides (plan).
		a.byMarker, a.fullReason = true, e.forgot[a.info.ID]
	}
	return nil
}

// plan names the rebuild snapshot and picks the source: an RW member,
// whose snapshots are the history a full rebuild reproduces on the
// target, layer by layer. A returning replica resyncs dirty regions only
// if its snapshots are the oldest of the volume's (those deleted while it
// was away are gone by now); the ones taken since it left are taken on it
// too, over its old head, and get their data in the dirty regions like the
// rebuild snapshot. Called with I/O paused.
func (e *Engine) plan(ctx context.Context, a *addition) error {
	now := time.Now()
	a.snap = SnapshotInfo{Name: fmt.Sprintf("rebuild-%d-%d", e.Epoch(), now.UnixNano()%1e6), Created: now}
	src, before, err := e.rebuildSource(ctx, nil, nil)
	if err != nil {
		return err
	}
	a.src, a.chain = src, before.Snapshots
	if a.dirtyOnly && a.byMarker {
		if ok, why := keptFor(before, a.info); ok {
			e.log.Info("the source has kept its write-intent bits since the returning replica left: changed regions only", "replica", a.target.addr, "engine", a.fullReason, "keptSince", before.DirtyKeptSince, "replicaEpoch", a.info.Epoch)
			a.fullReason = ""
		} else {
			e.log.Info("which writes the returning replica missed is not known; rebuilding it in full", "replica", a.target.addr, "why", a.fullReason, "source", why)
			a.dirtyOnly, a.fullReason = false, "history unknown: "+a.fullReason+"; "+why
		}
	}
	if a.dirtyOnly {
		if isPrefix(a.info.Snapshots, a.chain) {
			a.missed = a.chain[len(a.info.Snapshots):]
		} else {
			e.log.Info("the returning replica's snapshots are not the volume's oldest; rebuilding it in full", "replica", a.target.addr)
			a.dirtyOnly, a.fullReason = false, "its snapshots are not the volume's oldest"
		}
	}
	return nil
}

// prepareTarget fences the target again and gives it its new chain,
// before any member is touched: if it cannot take its chain (a full disk,
// say), the members are left as they were. The target was fenced when
// dialed; the epoch about to be published may have moved since (a failure
// meanwhile), so it is fenced at the one about to be published now, with
// I/O paused: a returning replica may still hold writes of its old
// membership (one paused with writes queued, say); one landing after its
// rebuild snapshot would sit in the new head, above everything the
// rebuild copies (chaos seed 320047). At the epoch about to be published
// it refuses them. The fence also marks it rebuilding, which ReplaceChain
// requires. Called with I/O paused.
func (e *Engine) prepareTarget(ctx context.Context, a *addition) error {
	t := a.target
	if err := e.fenceTarget(ctx, t); err != nil {
		return err
	}
	if !a.dirtyOnly {
		// Emptied into the source's chain plus the rebuild snapshot.
		return t.ctl.ReplaceChain(ctx, append(append([]SnapshotInfo(nil), a.chain...), a.snap))
	}
	// Its old head becomes the oldest snapshot it missed (or the rebuild
	// snapshot), under empty ones for the rest.
	for _, s := range append(append([]SnapshotInfo(nil), a.missed...), a.snap) {
		if err := t.ctl.Snapshot(ctx, s); err != nil {
			return err
		}
	}
	return nil
}

// snapshotMembers flushes every writable member and takes the rebuild
// snapshot on it, all at once; one that fails is failed. Called with I/O
// paused.
func (e *Engine) snapshotMembers(ctx context.Context, snap SnapshotInfo) {
	defer e.layersChanged()
	ms, _ := e.writable()
	errs := each(ms, func(_ int, m *member) error {
		if err := m.data.Flush(ctx); err != nil {
			return err
		}
		return m.ctl.Snapshot(ctx, snap)
	})
	e.mu.Lock()
	defer e.mu.Unlock()
	for i, m := range ms {
		if errs[i] != nil {
			_ = e.setMode(m, ModeERR, fmt.Errorf("rebuild snapshot: %w", errs[i])) // refused only if already ERR
		}
	}
}

// rebuildSource returns an RW member to rebuild from and its info, trying
// prefer first (if not nil), and failing members that cannot answer. With
// want set, only a member whose snapshots are exactly those serves (after
// the rebuild snapshot: the target's chain was made from the first
// source's). Called with I/O paused.
func (e *Engine) rebuildSource(ctx context.Context, prefer *member, want []SnapshotInfo) (*member, ReplicaInfo, error) {
	ms := e.readable()
	if prefer != nil {
		ms = append([]*member{prefer}, ms...)
	}
	for _, m := range ms {
		if e.modeOf(m) != ModeRW {
			continue
		}
		info, err := m.ctl.Info(ctx)
		if err != nil {
			_ = e.become(m, ModeERR, fmt.Errorf("rebuild: info: %w", err)) // refused only if already ERR
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

// admit adds the target to the set as WO, in place of any failed entry at
// its address, and publishes the new epoch, which persists "rebuilding"
// on it; then it registers the rebuild. If the publication fails, or
// fails the target, or the engine was closed meanwhile, the target is
// failed. Called with I/O paused.
func (e *Engine) admit(ctx context.Context, a *addition) (*rebuild, error) {
	t := a.target
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return nil, ErrClosed
	}
	if err := e.setMode(t, ModeWO, nil); err != nil {
		e.mu.Unlock()
		return nil, err
	}
	kept := e.members[:0]
	for _, m := range e.members {
		if m.addr != t.addr || m.mode != ModeERR {
			kept = append(kept, m)
		}
	}
	e.members = append(kept, t)
	e.mu.Unlock()
	err := e.publishEpoch(ctx, true)
	e.mu.Lock()
	defer e.mu.Unlock()
	switch {
	case err != nil:
	case t.mode == ModeERR:
		err = fmt.Errorf("the new replica failed while joining: %w", t.err)
	case e.closed:
		err = ErrClosed
	}
	if err != nil {
		_ = e.setMode(t, ModeERR, err) // refused only if already ERR
		return nil, err
	}
	rb := newRebuild(e.stop, a)
	e.rebuilds[t.addr] = rb
	e.changed()
	e.bg.Add(1) // done when the rebuild ends (startRebuild)
	return rb, nil
}

// newRebuild is the record of a's rebuild, in progress; its context ends
// with parent's.
func newRebuild(parent context.Context, a *addition) *rebuild {
	ctx, cancel := context.WithCancel(parent)
	rb := &rebuild{ctx: ctx, cancel: cancel, fin: make(chan struct{}), st: RebuildStatus{
		Replica: a.target.addr, Source: a.src.addr, Snapshot: a.snap.Name, State: RebuildInProgress,
		DirtyOnly: a.dirtyOnly, FullReason: a.fullReason, Started: time.Now(), Layers: names(a.srcInfo.Snapshots)}}
	rb.dirtyLayers = append(names(a.missed), a.snap.Name)
	return rb
}

// startRebuild starts watching the new member and copying into it in the
// background: the dirty regions of the view at the rebuild snapshot, or
// every layer's data.
func (e *Engine) startRebuild(a *addition, rb *rebuild) {
	go e.watch(a.target)
	size := e.Size()
	var regions []span
	var total int64
	if a.dirtyOnly {
		regions = dirtySpans(size, a.srcInfo, a.info, &e.away)
		for _, s := range regions {
			total += s.n * int64(len(rb.dirtyLayers)) // copied into each
		}
	} else {
		regions = []span{{0, size}}
		for _, s := range a.srcInfo.Snapshots {
			total += s.DataBytes
		}
	}
	rb.mu.Lock()
	rb.st.BytesTotal = total
	rb.mu.Unlock()
	if a.dirtyOnly {
		e.log.Info("rebuild started: changed regions only", "replica", a.target.addr, "source", a.src.addr, "snapshot", a.snap.Name, "bytes", total)
	} else {
		e.log.Info("rebuild started: full", "replica", a.target.addr, "source", a.src.addr, "snapshot", a.snap.Name, "bytes", total, "why", a.fullReason)
	}
	go func() {
		defer e.bg.Done()
		e.runRebuild(rb.ctx, rb, a.src, a.target, regions)
	}()
}
