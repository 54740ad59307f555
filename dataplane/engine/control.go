package engine

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"
)

// ReplicaStatus describes one member of the set.
type ReplicaStatus struct {
	Address string
	Mode    Mode
	Since   time.Time
	Error   string
}

// Replicas lists the members with their modes.
func (e *Engine) Replicas() []ReplicaStatus {
	e.mu.Lock()
	defer e.mu.Unlock()
	out := make([]ReplicaStatus, 0, len(e.members))
	for _, m := range e.members {
		s := ReplicaStatus{Address: m.addr, Mode: m.mode, Since: m.since}
		if m.err != nil {
			s.Error = m.err.Error()
		}
		out = append(out, s)
	}
	return out
}

// Robustness summarises the set: "healthy" (every wanted replica RW),
// "degraded" (some RW, fewer than wanted) or "faulted" (none RW).
func (e *Engine) Robustness() string {
	e.mu.Lock()
	defer e.mu.Unlock()
	switch rw := e.rwCountLocked(); {
	case rw == 0:
		return "faulted"
	case rw < e.wanted:
		return "degraded"
	}
	return "healthy"
}

// RemoveReplica drops a member: it is failed (if not already) and
// forgotten. The last RW replica cannot be removed.
func (e *Engine) RemoveReplica(ctx context.Context, addr string) error {
	ctx = detach(ctx)
	e.mu.Lock()
	idx := -1
	for i, m := range e.members {
		if m.addr == addr {
			idx = i
		}
	}
	if idx < 0 {
		e.mu.Unlock()
		return fmt.Errorf("%w: %s is not a member", ErrInvalid, addr)
	}
	m := e.members[idx]
	if m.mode == ModeRW && e.rwCountLocked() == 1 {
		e.mu.Unlock()
		return fmt.Errorf("%w: %s is the last RW replica; removing it would lose the volume", ErrInvalid, addr)
	}
	rb := e.rebuilds[addr]
	e.mu.Unlock()
	if rb != nil && rb.status().State == RebuildInProgress {
		rb.cancel()
		<-rb.fin
	}
	if e.markFailed(m, errors.New("removed on request")) {
		e.afterFailure(ctx)
	}
	e.mu.Lock()
	for i, x := range e.members {
		if x == m {
			e.members = append(e.members[:i:i], e.members[i+1:]...)
			break
		}
	}
	e.mu.Unlock()
	e.changed()
	return nil
}

// forEachWritable runs fn on every RW and WO member (given the mode it
// had), all at once, with I/O paused, and fails those for which it errs.
// It returns ErrNoReplica if no RW replica succeeded and is still RW.
func (e *Engine) forEachWritable(ctx context.Context, what string, fn func(m *member, mode Mode) error) error {
	// fn's callers pass a detached ctx too: a failure here fails the replica.
	ctx = detach(ctx)
	e.pause()
	defer e.resume()
	e.mu.Lock()
	closed := e.closed
	ms, modes := e.selectLocked(ModeRW, ModeWO)
	e.mu.Unlock()
	if closed {
		return ErrClosed
	}
	errs := each(ms, func(i int, m *member) error { return fn(m, modes[i]) })
	failed := false
	var last error
	e.mu.Lock()
	for i, m := range ms {
		if errs[i] != nil {
			failed = e.setMode(m, ModeERR, fmt.Errorf("%s: %w", what, errs[i])) == nil || failed
			last = errs[i]
		}
	}
	e.mu.Unlock()
	// Fence off the replicas failed here, and any failed meanwhile, before
	// I/O resumes.
	if failed || e.needBump.Load() {
		if err := e.publishEpoch(ctx, true); err != nil {
			return err
		}
	}
	if e.stillRW(ms, modes, errs) == 0 {
		if last == nil {
			return fmt.Errorf("%w: no RW replica", ErrNoReplica)
		}
		return fmt.Errorf("%w: %s failed on every replica: %w", ErrNoReplica, what, last)
	}
	return nil
}

// ErrSnapshotExists: a snapshot of that name exists already.
var ErrSnapshotExists = errors.New("snapshot exists")

// Snapshot takes a crash-consistent snapshot: new I/O is paused and I/O in
// flight drained, every replica is flushed and snapshotted under the same
// name, then I/O resumes. A name an RW replica already has is refused with
// ErrSnapshotExists before anything is paused: a caller retrying a
// snapshot whose answer it lost learns it was taken, and no replica is
// failed for refusing a name it has.
func (e *Engine) Snapshot(ctx context.Context, name string) error {
	ctx = detach(ctx)
	e.chain.Lock()
	defer e.chain.Unlock()
	defer e.layersChanged()
	if snaps, err := e.Snapshots(ctx); err == nil && slices.ContainsFunc(snaps, func(s SnapshotInfo) bool { return s.Name == name }) {
		return fmt.Errorf("%w: %s", ErrSnapshotExists, name)
	}
	created := time.Now() // the same on every replica: with the name, it identifies the snapshot
	return e.forEachWritable(ctx, "snapshot "+name, func(m *member, _ Mode) error {
		if err := m.data.Flush(ctx); err != nil {
			return err
		}
		return m.ctl.Snapshot(ctx, SnapshotInfo{Name: name, UserCreated: true, Created: created})
	})
}

// Snapshots lists the snapshots as the first RW replica reports them.
func (e *Engine) Snapshots(ctx context.Context) ([]SnapshotInfo, error) {
	info, err := e.LayerInfo(ctx)
	if err != nil {
		return nil, err
	}
	return info.Snapshots, nil
}

// LayerInfo returns what an RW replica reports of its layers: its
// snapshots, oldest first, and the data its head layer holds (HeadBytes).
// The replicas in RW mode hold the same data, so one answers for all.
func (e *Engine) LayerInfo(ctx context.Context) (ReplicaInfo, error) {
	rs := e.readable()
	if len(rs) == 0 {
		return ReplicaInfo{}, fmt.Errorf("%w: no RW replica", ErrNoReplica)
	}
	return rs[0].ctl.Info(ctx)
}

// ErrSnapshotNotFound is what a Replica returns (wrapped) for a missing
// snapshot; the client implementation maps its transport's code to it.
var ErrSnapshotNotFound = errors.New("snapshot not found")

// DeleteSnapshot removes a snapshot on every replica (merging its data
// into its child) without pausing I/O: a deletion leaves every read the
// same, and replicas merge while serving. The replicas delete in
// parallel; one that fails to, or has not finished within its deadline
// (Options.ControlTimeout plus the time to merge the snapshot's data), is
// failed (it needs a rebuild). Replicas
// that never had the snapshot are skipped; if none had it, the error
// wraps ErrSnapshotNotFound. A snapshot an active rebuild reads cannot be
// deleted.
func (e *Engine) DeleteSnapshot(ctx context.Context, name string) error {
	return e.deleteSnapshot(detach(ctx), name)
}

// deleteSnapshot is DeleteSnapshot with ctx as given: the engine's own
// deletions pass its stop context, which Close cancels.
func (e *Engine) deleteSnapshot(ctx context.Context, name string) error {
	e.chain.Lock()
	defer e.chain.Unlock()
	defer e.layersChanged()
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return ErrClosed
	}
	for _, rb := range e.rebuilds {
		if st := rb.status(); st.State == RebuildInProgress && slices.Contains(st.Layers, name) {
			e.mu.Unlock()
			return fmt.Errorf("%w: snapshot %s is in use by the rebuild of %s; delete it when the rebuild has finished (ctl rebuilds), or cancel the rebuild", ErrInvalid, name, st.Replica)
		}
	}
	e.mu.Unlock()
	ms, _ := e.writable()
	errs := each(ms, func(_ int, m *member) error {
		// The deadline grows with the data to merge, as this replica
		// holds it; one that cannot tell is failed like one that cannot
		// delete.
		info, err := m.ctl.Info(ctx)
		if err != nil {
			return err
		}
		return m.ctl.DeleteSnapshot(ctx, name, snapshotBytes(info.Snapshots, name))
	})
	ok, had, failed := 0, 0, false
	var last error
	for i, m := range ms {
		err := errs[i]
		if err != nil && !errors.Is(err, ErrSnapshotNotFound) {
			failed = e.markFailed(m, fmt.Errorf("delete snapshot %s: %w", name, err)) || failed
			last = err
			continue
		}
		if err == nil {
			had++
		}
		if e.modeOf(m) == ModeRW {
			ok++
		}
	}
	if failed {
		e.afterFailure(ctx)
	}
	switch {
	case ok == 0 && last != nil:
		return fmt.Errorf("%w: delete snapshot %s failed on every replica: %w", ErrNoReplica, name, last)
	case ok == 0:
		return fmt.Errorf("%w: no RW replica", ErrNoReplica)
	case had == 0 && last == nil:
		return fmt.Errorf("%w: %s", ErrSnapshotNotFound, name)
	}
	return nil
}

// Revert makes the volume read as it did at snapshot name, on every
// replica; replicas that lack the snapshot are failed (they need a
// rebuild). A name the RW replicas do not list is refused with
// ErrSnapshotNotFound before any replica is touched: a mistyped name must
// not fail every replica. The frontend's users must have stopped using
// the volume: the data changes under them.
func (e *Engine) Revert(ctx context.Context, name string) error {
	ctx = detach(ctx)
	e.chain.Lock()
	defer e.chain.Unlock()
	defer e.layersChanged()
	if snaps, err := e.Snapshots(ctx); err == nil && !slices.ContainsFunc(snaps, func(s SnapshotInfo) bool { return s.Name == name }) {
		return fmt.Errorf("%w: %s: no RW replica has it", ErrSnapshotNotFound, name)
	}
	return e.forEachWritable(ctx, "revert to "+name, func(m *member, mode Mode) error {
		if mode == ModeWO {
			return errors.New("a replica being rebuilt cannot be reverted")
		}
		return m.ctl.Revert(ctx, name)
	})
}

// Expand grows the volume on every replica.
func (e *Engine) Expand(ctx context.Context, size int64) error {
	ctx = detach(ctx)
	e.chain.Lock()
	defer e.chain.Unlock()
	if cur := e.Size(); size < cur || size%4096 != 0 {
		return fmt.Errorf("%w: cannot expand from %d to %d bytes (must grow, in multiples of 4096)", ErrInvalid, cur, size)
	}
	err := e.forEachWritable(ctx, "expand", func(m *member, _ Mode) error { return m.ctl.Expand(ctx, size) })
	if err == nil {
		e.size.Store(size)
	}
	e.layersChanged()
	return err
}
