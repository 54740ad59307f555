// The snapshot chain: listing it, taking a snapshot, reverting to one and
// expanding the volume, each a change under lockChain with its crash story.
// Deleting a snapshot is in merge.go, the fenced forms in fenced.go, the
// layer I/O a rebuild uses in layerio.go and checksums in checksum.go.

package replica

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"time"
)

// SnapshotInfo describes one snapshot in the chain.
type SnapshotInfo struct {
	Name        string
	Parent      string // the next older snapshot; "" for the oldest
	Created     time.Time
	UserCreated bool
	// DataBytes is the data this layer holds itself (allocated blocks).
	DataBytes int64
}

// Info is a summary of the replica.
type Info struct {
	ID         string
	Rebuilding bool
	Dir        string
	Size       int64
	Epoch      uint64
	Head       string
	HeadBytes  int64 // data held by the head layer
	Snapshots  []SnapshotInfo
	Dirty      DirtyRegions
	// IndexBytes is the memory the block indexes of all layers take.
	IndexBytes int64
	// EpochMembers are the IDs of the replicas RW at Epoch
	// (FenceOptions.Members).
	EpochMembers []string
	// DirtyKeptSince is the epoch since which no write-intent bit was
	// cleared (0: unknown); see metadata.DirtyKeptSince.
	DirtyKeptSince uint64
}

// ID is the replica's ID, fixed when it was created (Info.ID).
func (r *Replica) ID() string {
	r.mu.RLock()
	defer r.mu.RUnlock()
	return r.meta.ID
}

// Info returns the replica's size, epoch, chain and dirty regions.
func (r *Replica) Info() (Info, error) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	if r.closed {
		return Info{}, ErrClosed
	}
	in := Info{ID: r.meta.ID, Rebuilding: r.meta.Rebuilding, Dir: r.dir, Size: r.size.Load(), Epoch: r.epoch.Load(), EpochMembers: slices.Clone(r.meta.EpochMembers), DirtyKeptSince: r.meta.DirtyKeptSince, Head: r.meta.Head, Snapshots: r.snapshotsLocked(), Dirty: r.dirty.snapshot()}
	in.HeadBytes = r.head().idx.count() * BlockSize
	for _, l := range r.layers {
		in.IndexBytes += l.idx.memBytes()
	}
	return in, nil
}

// Snapshots lists the snapshots, oldest first.
func (r *Replica) Snapshots() ([]SnapshotInfo, error) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	if r.closed {
		return nil, ErrClosed
	}
	return r.snapshotsLocked(), nil
}

func (r *Replica) snapshotsLocked() []SnapshotInfo {
	out := make([]SnapshotInfo, 0, len(r.meta.Snapshots))
	for i, s := range r.meta.Snapshots {
		si := SnapshotInfo{Name: s.Name, Created: s.Created, UserCreated: s.UserCreated, DataBytes: r.layers[i].idx.count() * BlockSize}
		if i > 0 {
			si.Parent = r.meta.Snapshots[i-1].Name
		}
		out = append(out, si)
	}
	return out
}

func (r *Replica) findSnapshot(name string) int {
	for i, s := range r.meta.Snapshots {
		if s.Name == name {
			return i
		}
	}
	return -1
}

// createHead creates and opens an empty layer for a new head, taking its
// number from m (the caller commits m). A crash before that commit leaves
// an unnamed file, which open deletes.
func (r *Replica) createHead(m *metadata) (*layer, error) {
	file := layerFile(m.NextLayer)
	m.NextLayer++
	if err := newLayerFile(r.dir, file, m.Size); err != nil {
		return nil, err
	}
	nl, err := openLayer(r.dir, file, "", r.direct)
	if err != nil {
		os.Remove(filepath.Join(r.dir, file))
		return nil, err
	}
	nl.idx.grow(m.Size / BlockSize)
	return nl, nil
}

// commit writes m as the new metadata; on success it becomes r.meta.
func (r *Replica) commit(m metadata) error {
	if err := writeMeta(r.dir, m); err != nil {
		return err
	}
	r.meta = m
	return nil
}

// SnapshotOptions describe a snapshot to take.
type SnapshotOptions struct {
	Name string
	// UserCreated: a user asked for it (not the engine, for a rebuild).
	UserCreated bool
	// Created is the creation time to record (zero: now). The engine
	// gives every replica the same, so that a snapshot is known by its
	// name and time: one deleted and taken again under the same name is
	// another snapshot.
	Created time.Time
}

// Snapshot makes the current head an immutable snapshot called o.Name and
// puts a new empty head on top. The engine pauses I/O around it so that
// every replica snapshots the same data.
//
// Crash story: the new head file is created and synced first; the
// metadata naming it is committed next (atomically). A crash before the
// commit leaves the old metadata and an unnamed file, removed on open; a
// crash after leaves the snapshot taken.
func (r *Replica) Snapshot(o SnapshotOptions) error { return r.snapshot(nil, o) }

func (r *Replica) snapshot(epoch *uint64, o SnapshotOptions) error {
	name, created := o.Name, o.Created
	if created.IsZero() {
		created = time.Now()
	}
	if err := checkName(name); err != nil {
		return err
	}
	unlock, err := r.lockChain(epoch)
	if err != nil {
		return err
	}
	defer unlock()
	if r.findSnapshot(name) >= 0 {
		return fmt.Errorf("%w: %q", ErrSnapshotExists, name)
	}
	old := r.head()
	if err := old.f.Sync(); err != nil {
		return fmt.Errorf("snapshot %s: sync head: %w", name, err)
	}
	m := r.meta
	nl, err := r.createHead(&m)
	if err != nil {
		return fmt.Errorf("snapshot %s: %w", name, err)
	}
	newHead := nl.file
	m.Snapshots = append(append([]snapshotMeta(nil), m.Snapshots...),
		snapshotMeta{Name: name, File: old.file, Created: created.UTC(), UserCreated: o.UserCreated})
	m.Head = newHead
	if err := r.commit(m); err != nil {
		nl.f.Close()
		os.Remove(filepath.Join(r.dir, newHead))
		return fmt.Errorf("snapshot %s: %w", name, err)
	}
	old.name = name
	r.layers = append(r.layers, nl)
	r.log.Info("snapshot created", "name", name)
	return nil
}

// '.', '_' or '-' starting with a letter or digit.
func checkName(name string) error {
	if !snapshotName.MatchString(name) {
		return fmt.Errorf("%w: %q: use 1 to 63 letters, digits, '.', '_' or '-', starting with a letter or digit", ErrInvalidName, name)
	}
	return nil
}

// lockChain takes the locks for a change to the chain (chainMu, then mu
// exclusively), failing if the replica is closed or, when epoch is given,
// the epoch is not current; the caller calls unlock. Fence takes mu
// exclusively too, so a change that passed the check runs before any
// change of epoch, or is refused after it.
func (r *Replica) lockChain(epoch *uint64) (unlock func(), err error) {
	r.chainMu.Lock()
	r.mu.Lock()
	r.sums.changing()
	unlock = func() {
		r.sums.changed()
		r.mu.Unlock()
		r.chainMu.Unlock()
	}
	if r.closed {
		unlock()
		return nil, ErrClosed
	}
	if epoch != nil {
		if err := r.CheckEpoch(*epoch); err != nil {
			unlock()
			return nil, err
		}
	}
	return unlock, nil
}

// Revert discards the head and every snapshot newer than name, and puts a
// new empty head on top of name: the volume then reads as it did when name
// was taken. The replica must not be serving I/O (the engine detaches the
// frontend first). Every region is marked dirty, since the data changed
// wholesale.
//
// Crash story: the new head is created, then the metadata committed, then
// the discarded files removed; a crash leaves either the old chain or the
// reverted one, plus files that open deletes.
func (r *Replica) Revert(name string) error { return r.revert(nil, name) }

func (r *Replica) revert(epoch *uint64, name string) error {
	unlock, err := r.lockChain(epoch)
	if err != nil {
		return err
	}
	defer unlock()
	i, err := r.snapshotIndex(name)
	if err != nil {
		return err
	}
	m := r.meta
	nl, err := r.createHead(&m)
	if err != nil {
		return fmt.Errorf("revert to %s: %w", name, err)
	}
	newHead := nl.file
	if err := r.dirty.markAll(); err != nil {
		nl.f.Close()
		return fmt.Errorf("revert to %s: %w", name, err)
	}
	m.Snapshots = append([]snapshotMeta(nil), m.Snapshots[:i+1]...)
	m.Head = newHead
	if err := r.commit(m); err != nil {
		nl.f.Close()
		return fmt.Errorf("revert to %s: %w", name, err)
	}
	dropped := r.layers[i+1:]
	r.layers = append(r.layers[:i+1:i+1], nl)
	for _, l := range dropped {
		l.f.Close()
		if err := os.Remove(filepath.Join(r.dir, l.file)); err != nil {
			r.log.Error(err, "removing a discarded layer failed; the next open removes it", "file", l.file)
		}
	}
	r.log.Info("reverted", "snapshot", name, "discarded layers", len(dropped))
	return nil
}

// Expand grows the volume to size bytes (a multiple of 4096, not smaller
// than the current size). The new space reads as zeros.
//
// Crash story: the head is extended and synced before the metadata is
// committed; a crash in between leaves a longer head that open trims back.
func (r *Replica) Expand(size int64) error { return r.expand(nil, size) }

func (r *Replica) expand(epoch *uint64, size int64) error {
	unlock, err := r.lockChain(epoch)
	if err != nil {
		return err
	}
	defer unlock()
	cur := r.meta.Size
	if size%BlockSize != 0 || size < cur {
		return fmt.Errorf("%w: cannot expand from %d to %d bytes: the new size must be a multiple of %d and at least the current size",
			ErrInvalidSize, cur, size, BlockSize)
	}
	if size == cur {
		return nil
	}
	head := r.head()
	if err := head.f.Truncate(size); err != nil {
		return fmt.Errorf("expand: %w", err)
	}
	if err := head.f.Sync(); err != nil {
		return fmt.Errorf("expand: %w", err)
	}
	if err := r.dirty.grow(size); err != nil {
		return fmt.Errorf("expand: %w", err)
	}
	m := r.meta
	m.Size = size
	if err := r.commit(m); err != nil {
		return fmt.Errorf("expand: %w", err)
	}
	head.idx.grow(size / BlockSize)
	r.size.Store(size)
	r.log.Info("expanded", "from", cur, "to", size)
	return nil
}
