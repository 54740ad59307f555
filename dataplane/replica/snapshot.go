package replica

import (
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"os"
	"path/filepath"
	"slices"
	"sync"
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
}

// Info returns the replica's size, epoch, chain and dirty regions.
func (r *Replica) Info() (Info, error) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	if r.closed {
		return Info{}, ErrClosed
	}
	in := Info{ID: r.meta.ID, Rebuilding: r.meta.Rebuilding, Dir: r.dir, Size: r.size.Load(), Epoch: r.epoch.Load(), EpochMembers: slices.Clone(r.meta.EpochMembers), Head: r.meta.Head, Snapshots: r.snapshotsLocked(), Dirty: r.dirty.snapshot()}
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

// DeleteSnapshot removes a snapshot, leaving what every read returns
// unchanged. It copies whichever side is smaller:
//
//   - the snapshot's blocks into its child (the next newer snapshot or the
//     head) where the child has none; or, when the child holds less,
//   - the child's blocks into the snapshot's layer, which then takes the
//     child's place (after a dirty-only rebuild, the rebuild snapshot can
//     hold much and the head only the writes since: this copies the few).
//
// I/O goes on meanwhile: the copy runs a chunk at a time, holding the I/O
// lock shared, and writes to the replica wait only for the chunk being
// copied (mergeState). Other changes to the chain wait for the deletion.
// In the second case the head's blocks written during the copy are copied
// again at the end, with I/O held off for just that.
//
// Crash story: in the first case each copied block equals what a read
// already returned, so a crash mid-copy changes nothing visible. The
// second rewrites the snapshot's layer, so the intent is committed first
// (the snapshot is marked deleting and no longer served); a crash mid-copy
// is finished by the next open. Either way the metadata without the
// snapshot is committed before any file is removed.
func (r *Replica) DeleteSnapshot(name string) error { return r.deleteSnapshotNamed(nil, name) }

func (r *Replica) deleteSnapshotNamed(epoch *uint64, name string) error {
	unlock, err := r.lockChain(epoch)
	if err != nil {
		return err
	}
	defer unlock()
	i, err := r.snapshotIndex(name)
	if err != nil {
		return err
	}
	if err := r.deleteSnapshot(i); err != nil {
		return fmt.Errorf("delete snapshot %s: %w", name, err)
	}
	r.log.Info("snapshot deleted", "name", name)
	return nil
}

// checkName refuses a snapshot name that is not 1 to 63 letters, digits,
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

// Fenced is the replica's changes to its chain and size as a caller of
// one epoch makes them: each is refused with a *StaleEpochError unless
// that epoch is the replica's current one, checked atomically with the
// change (see lockChain), as data requests are (ReadAtEpoch). A stale
// engine, one a newer engine has fenced out, can then no longer change
// the replica. The control API takes every change through here.
type Fenced struct {
	r     *Replica
	epoch uint64
}

// At returns the replica's changes as a caller of epoch makes them.
func (r *Replica) At(epoch uint64) Fenced { return Fenced{r: r, epoch: epoch} }

// Snapshot is Replica.Snapshot, fenced.
func (f Fenced) Snapshot(o SnapshotOptions) error { return f.r.snapshot(&f.epoch, o) }

// DeleteSnapshot is Replica.DeleteSnapshot, fenced when it starts: once
// admitted, a deletion runs to the end even if the epoch changes
// meanwhile. It changes no read, and the engine that asked for it can
// bump the epoch while it merges (another replica failing); in the case
// that rewrites the snapshot's layer, the intent is committed under the
// same hold as the check.
func (f Fenced) DeleteSnapshot(name string) error { return f.r.deleteSnapshotNamed(&f.epoch, name) }

// Revert is Replica.Revert, fenced.
func (f Fenced) Revert(name string) error { return f.r.revert(&f.epoch, name) }

// Expand is Replica.Expand, fenced.
func (f Fenced) Expand(size int64) error { return f.r.expand(&f.epoch, size) }

// ReplaceChain is Replica.ReplaceChain, fenced.
func (f Fenced) ReplaceChain(snaps []SnapshotInfo) error { return f.r.replaceChain(&f.epoch, snaps) }

// WriteLayer is Replica.WriteLayer, fenced.
func (f Fenced) WriteLayer(name string, p []byte, off int64) error {
	return f.r.writeLayer(&f.epoch, name, p, off)
}

// mergeState coordinates a snapshot deletion's copy with writes: every
// write (head, unmap, rebuild layer write) holds mu shared and records
// the blocks it wrote in touched (only when the child's blocks are copied
// into the snapshot's layer: they must be copied again); the copy holds
// mu exclusively for one chunk at a time.
type mergeState struct {
	mu      sync.RWMutex
	touched *blockIndex
}

// mergeChunk is how many blocks a deletion copies per hold of the merge
// lock: 1 MiB, so a write waits at most about one such copy.
const mergeChunk = 256

// fence makes a write wait for the chunk a deletion is copying and
// records what it wrote; it returns the function that ends it. Callers
// hold mu shared.
func (r *Replica) fence(off, length int64) func() {
	ms := r.merge
	if ms == nil || length <= 0 {
		return func() {}
	}
	ms.mu.RLock()
	return func() {
		if ms.touched != nil {
			first := off / BlockSize
			ms.touched.set(first, (off+length+BlockSize-1)/BlockSize-first)
		}
		ms.mu.RUnlock()
	}
}

// deleteSnapshot removes snapshot i. The caller holds chainMu and mu
// exclusively; mu is released while data is copied and held again on
// return.
func (r *Replica) deleteSnapshot(i int) error {
	src, child := r.layers[i], r.layers[i+1]
	intoChild := !r.meta.Snapshots[i].Deleting && child.idx.count() >= src.idx.count()
	if !intoChild {
		if !r.meta.Snapshots[i].Deleting {
			m := r.meta
			m.Snapshots = append([]snapshotMeta(nil), m.Snapshots...)
			m.Snapshots[i].Deleting = true
			if err := r.commit(m); err != nil {
				return err
			}
		}
		if fi, err := child.f.Stat(); err == nil && fi.Size() > 0 {
			if err := src.f.Truncate(max(fi.Size(), r.meta.Size)); err != nil { // the child may be longer (expansion)
				return err
			}
			src.idx.grow(fi.Size() / BlockSize)
		}
	}
	ms := &mergeState{}
	if !intoChild { // writes to the child during the copy must be copied again
		ms.touched = newBlockIndex(max(child.idx.blocks, src.idx.blocks))
	}
	r.merge = ms
	r.mu.Unlock()
	var err error
	if intoChild {
		err = r.copyOnline(ms, src, child, true)
	} else {
		err = r.copyOnline(ms, child, src, false)
	}
	r.mu.Lock()
	r.merge = nil
	if err == nil && r.closed {
		err = ErrClosed
	}
	if err != nil {
		return err
	}
	if intoChild {
		return r.dropIntoChild(i)
	}
	return r.takeChildsPlace(i, ms.touched)
}

// copyOnline copies from's blocks into to, chunk by chunk (only where to
// has none when onlyMissing), holding mu shared and the merge lock
// exclusively per chunk.
func (r *Replica) copyOnline(ms *mergeState, from, to *layer, onlyMissing bool) error {
	buf := make([]byte, mergeChunk*BlockSize)
	blocks := from.idx.blocks
	for c := int64(0); c < blocks; c += mergeChunk {
		err := func() error {
			r.mu.RLock()
			defer r.mu.RUnlock()
			if r.closed {
				return ErrClosed
			}
			ms.mu.Lock()
			defer ms.mu.Unlock()
			return eachRun(from.idx, c, min(mergeChunk, blocks-c), true, func(b, n int64) error {
				if !onlyMissing {
					return copyBlocks(from, to, b, n, buf)
				}
				return eachRun(to.idx, b, n, false, func(b, n int64) error { return copyBlocks(from, to, b, n, buf) })
			})
		}()
		if err != nil {
			return err
		}
		if r.afterMergeChunk != nil {
			r.afterMergeChunk()
		}
	}
	return nil
}

// eachRun calls fn for every run of blocks in [b, b+n) that holds data
// in x (data true) or is a hole there (data false).
func eachRun(x *blockIndex, b, n int64, data bool, fn func(b, n int64) error) error {
	for end := b + n; b < end; {
		k, has := x.run(b, end-b)
		if has == data {
			if err := fn(b, k); err != nil {
				return err
			}
		}
		b += k
	}
	return nil
}

// dropIntoChild ends a deletion whose blocks went into the child: the
// snapshot's layer goes. Called with mu held exclusively.
func (r *Replica) dropIntoChild(i int) error {
	src, child := r.layers[i], r.layers[i+1]
	if err := child.f.Sync(); err != nil {
		return fmt.Errorf("sync: %w", err)
	}
	m := r.meta
	m.Snapshots = append(append([]snapshotMeta(nil), m.Snapshots[:i]...), m.Snapshots[i+1:]...)
	if err := r.commit(m); err != nil {
		return err
	}
	src.f.Close()
	r.layers = append(r.layers[:i:i], r.layers[i+1:]...)
	r.removeFile(src.file)
	return nil
}

// takeChildsPlace ends a deletion that copied the child's blocks into the
// snapshot's layer: the blocks written to the child during the copy
// (touched) are copied again, then the snapshot's file takes the child's
// place. Called with mu held exclusively, so no write runs meanwhile.
func (r *Replica) takeChildsPlace(i int, touched *blockIndex) error {
	src, child := r.layers[i], r.layers[i+1]
	buf := make([]byte, mergeChunk*BlockSize)
	err := eachRun(touched, 0, touched.blocks, true, func(b, n int64) error {
		return eachRun(child.idx, b, n, true, func(b, n int64) error { return copyBlocks(child, src, b, n, buf) })
	})
	if err != nil {
		return err
	}
	if err := src.f.Sync(); err != nil {
		return fmt.Errorf("sync: %w", err)
	}
	m := r.meta
	m.Snapshots = append([]snapshotMeta(nil), m.Snapshots...)
	if i+1 < len(m.Snapshots) {
		m.Snapshots[i+1].File = src.file // the child snapshot now lives in src's file
	} else {
		m.Head = src.file // the child was the head
	}
	m.Snapshots = append(m.Snapshots[:i:i], m.Snapshots[i+1:]...)
	if err := r.commit(m); err != nil {
		return err
	}
	child.f.Close()
	src.name = child.name
	r.layers = append(r.layers[:i+1:i+1], r.layers[i+2:]...)
	r.removeFile(child.file)
	return nil
}

func (r *Replica) removeFile(name string) {
	if err := os.Remove(filepath.Join(r.dir, name)); err != nil {
		r.log.Error(err, "removing a layer file failed; the next open removes it", "file", name)
	}
}

// copyBlocks copies blocks [b, b+n) from one layer's file to another's.
func copyBlocks(from, to *layer, b, n int64, buf []byte) error {
	for n > 0 {
		k := min(n, int64(len(buf))/BlockSize)
		p := buf[:k*BlockSize]
		if _, err := from.f.ReadAt(p, b*BlockSize); err != nil {
			return fmt.Errorf("read %s: %w", from.file, err)
		}
		if _, err := to.f.WriteAt(p, b*BlockSize); err != nil {
			return fmt.Errorf("write %s: %w", to.file, err)
		}
		to.idx.set(b, k)
		b += k
		n -= k
	}
	return nil
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

// Extent is a run of data in a volume view.
type Extent struct {
	Offset int64
	Data   []byte
}

// snapshotIndex returns the index of snapshot name in the chain, or an
// error if the replica is closed or the snapshot is missing (or being
// deleted). Callers hold r.mu.
func (r *Replica) snapshotIndex(name string) (int, error) {
	if r.closed {
		return 0, ErrClosed
	}
	i := r.findSnapshot(name)
	if i < 0 || r.meta.Snapshots[i].Deleting {
		return 0, fmt.Errorf("%w: %q", ErrSnapshotNotFound, name)
	}
	return i, nil
}

// snapshotTop returns how many layers make up the view at snapshot name
// (that layer and everything older), or an error.
func (r *Replica) snapshotTop(name string) (int, error) {
	i, err := r.snapshotIndex(name)
	return i + 1, err
}

// snapshotSpan checks a request on snapshot name: the snapshot is served,
// [off, off+length) lies in the volume and, when aligned names the
// request ("layer writes"), is block-aligned. It returns snapshotTop.
// Callers hold mu.
func (r *Replica) snapshotSpan(name string, off, length int64, aligned string) (int, error) {
	top, err := r.snapshotTop(name)
	if err != nil {
		return 0, err
	}
	if err := r.checkRange(off, length); err != nil {
		return 0, err
	}
	if aligned != "" && (off%BlockSize != 0 || length%BlockSize != 0) {
		return 0, fmt.Errorf("%w: %s must be block-aligned", ErrInvalidSize, aligned)
	}
	return top, nil
}

// ReadSnapshot returns the data in [off, off+length) of the volume as it was
// when snapshot name was taken, as extents; ranges no layer holds (holes,
// which read as zeros) are left out. A rebuild that copies only dirty
// regions copies this view.
func (r *Replica) ReadSnapshot(name string, off, length int64) ([]Extent, error) {
	return r.readExtents(name, off, length, false)
}

// ReadLayer returns the data snapshot name's own layer holds in [off,
// off+length), as extents: only what was written between the previous
// snapshot and this one. A full rebuild copies every layer this way, so the
// rebuilt replica keeps the snapshot history.
func (r *Replica) ReadLayer(name string, off, length int64) ([]Extent, error) {
	return r.readExtents(name, off, length, true)
}

func (r *Replica) readExtents(name string, off, length int64, own bool) ([]Extent, error) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	top, err := r.snapshotSpan(name, off, length, "snapshot reads")
	if err != nil {
		return nil, err
	}
	gen := r.sums.gen.Load()
	var out []Extent
	for b, end := off/BlockSize, (off+length)/BlockSize; b < end; {
		li, n := r.resolveIn(b, end-b, top, own)
		if li >= 0 {
			p := make([]byte, n*BlockSize)
			if _, err := r.layers[li].f.ReadAt(p, b*BlockSize); err != nil {
				return nil, fmt.Errorf("read %s: %w", r.layers[li].file, err)
			}
			// Merge with the previous extent when contiguous.
			if k := len(out) - 1; k >= 0 && out[k].Offset+int64(len(out[k].Data)) == b*BlockSize {
				out[k].Data = append(out[k].Data, p...)
			} else {
				out = append(out, Extent{Offset: b * BlockSize, Data: p})
			}
		}
		b += n
	}
	r.sums.put(gen, sumKey{name, off, length, own}, out)
	return out, nil
}

// resolveIn is resolve through layers[:top], or (own) through layer top-1
// alone.
func (r *Replica) resolveIn(b, limit int64, top int, own bool) (int, int64) {
	if !own {
		return r.resolve(b, limit, top)
	}
	n, data := r.layers[top-1].idx.run(b, limit)
	if data {
		return top - 1, n
	}
	return -1, n
}

// WriteLayer writes p at off directly into the layer of snapshot name, not
// the head. A rebuild uses it to fill in, under a new replica's head, the
// data older than the rebuild snapshot while the head already takes new
// writes. The replica must not serve reads meanwhile (the engine keeps it
// write-only), since snapshots are otherwise immutable.
func (r *Replica) WriteLayer(name string, p []byte, off int64) error {
	return r.writeLayer(nil, name, p, off)
}

func (r *Replica) writeLayer(epoch *uint64, name string, p []byte, off int64) error {
	return r.locked(epoch, func() error {
		top, err := r.snapshotSpan(name, off, int64(len(p)), "layer writes")
		if err != nil {
			return err
		}
		defer r.fence(off, int64(len(p)))()
		l := r.layers[top-1]
		if _, err := l.f.WriteAt(p, off); err != nil {
			return fmt.Errorf("write %s: %w", l.file, err)
		}
		l.idx.set(off/BlockSize, int64(len(p))/BlockSize)
		r.sums.layerWritten()
		return nil
	})
}

// SyncLayers makes every layer's data durable (after a rebuild's copy).
func (r *Replica) SyncLayers() error {
	r.mu.RLock()
	defer r.mu.RUnlock()
	if r.closed {
		return ErrClosed
	}
	for _, l := range r.layers {
		if err := l.f.Sync(); err != nil {
			return fmt.Errorf("sync %s: %w", l.file, err)
		}
	}
	return nil
}

// Checksum returns the CRC-32C of [off, off+length) of the volume as it was
// at snapshot name (holes count as zeros), to verify a rebuild.
func (r *Replica) Checksum(name string, off, length int64) (uint32, error) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	top, err := r.snapshotSpan(name, off, length, "")
	if err != nil {
		return 0, err
	}
	if crc, ok := r.sums.take(sumKey{name, off, length, false}); ok {
		return crc, nil
	}
	h := crc32.New(castagnoli)
	buf := make([]byte, min(length, 1<<20))
	for done := int64(0); done < length; {
		n := min(int64(len(buf)), length-done)
		if err := r.readChain(buf[:n], off+done, top); err != nil {
			return 0, err
		}
		h.Write(buf[:n])
		done += n
	}
	return h.Sum32(), nil
}

// LayerChecksum returns a CRC-32C of what snapshot name's own layer holds
// in [off, off+length) (block-aligned): its data and where that data lies,
// so a hole and a block of written zeros differ (in a layer they do: the
// hole shows the older layers through). Two layers with the same data at
// the same blocks have the same sum.
func (r *Replica) LayerChecksum(name string, off, length int64) (uint32, error) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	top, err := r.snapshotSpan(name, off, length, "layer checksums")
	if err != nil {
		return 0, err
	}
	if crc, ok := r.sums.take(sumKey{name, off, length, true}); ok {
		return crc, nil
	}
	l := r.layers[top-1]
	h := crc32.New(castagnoli)
	var runs []int64 // first and end block of each maximal data run
	buf := make([]byte, min(length, 1<<20))
	err = eachRun(l.idx, off/BlockSize, length/BlockSize, true, func(b, n int64) error {
		if k := len(runs); k > 0 && runs[k-1] == b {
			runs[k-1] = b + n
		} else {
			runs = append(runs, b, b+n)
		}
		for c := b; c < b+n; {
			k := min(b+n-c, int64(len(buf))/BlockSize)
			if _, err := l.f.ReadAt(buf[:k*BlockSize], c*BlockSize); err != nil {
				return fmt.Errorf("read %s: %w", l.file, err)
			}
			h.Write(buf[:k*BlockSize])
			c += k
		}
		return nil
	})
	if err != nil {
		return 0, err
	}
	var x [8]byte
	for _, v := range runs {
		binary.LittleEndian.PutUint64(x[:], uint64(v))
		h.Write(x[:])
	}
	return h.Sum32(), nil
}

// ReplaceChain discards the replica's data, every snapshot and the head,
// and puts in their place empty snapshots described by snaps (oldest
// first: name, creation time, whether a user took it) under an empty head.
// A full rebuild starts its target this way and then fills each
// snapshot's layer from a healthy replica's (ReadLayer, WriteLayer), so the
// rebuilt replica keeps the volume's snapshot history. Since it empties the
// replica, it refuses unless the replica is marked rebuilding (Fence),
// which keeps any engine from opening it as a healthy member until the
// rebuild completes.
//
// Crash story: the new layer files are created and synced, then the
// metadata naming them committed, then the old files removed; a crash
// leaves the old chain or the new one, plus files that open deletes.
func (r *Replica) ReplaceChain(snaps []SnapshotInfo) error { return r.replaceChain(nil, snaps) }

func (r *Replica) replaceChain(epoch *uint64, snaps []SnapshotInfo) error {
	seen := make(map[string]bool, len(snaps))
	for _, s := range snaps {
		if err := checkName(s.Name); err != nil {
			return err
		}
		if seen[s.Name] {
			return fmt.Errorf("%w: %q twice in the chain", ErrInvalidName, s.Name)
		}
		seen[s.Name] = true
	}
	unlock, err := r.lockChain(epoch)
	if err != nil {
		return err
	}
	defer unlock()
	if !r.meta.Rebuilding {
		return fmt.Errorf("%w: replacing the chain would empty a replica that may be in use; set the rebuilding flag first", ErrNotRebuilding)
	}
	m := r.meta
	m.Snapshots = make([]snapshotMeta, 0, len(snaps))
	var fresh []*layer
	undo := func(err error) error {
		for _, l := range fresh {
			l.f.Close()
			os.Remove(filepath.Join(r.dir, l.file))
		}
		return fmt.Errorf("replace chain: %w", err)
	}
	for _, s := range snaps {
		nl, err := r.createHead(&m)
		if err != nil {
			return undo(err)
		}
		nl.name = s.Name
		fresh = append(fresh, nl)
		created := s.Created.UTC()
		if s.Created.IsZero() {
			created = time.Now().UTC()
		}
		m.Snapshots = append(m.Snapshots, snapshotMeta{Name: s.Name, File: nl.file, Created: created, UserCreated: s.UserCreated})
	}
	head, err := r.createHead(&m)
	if err != nil {
		return undo(err)
	}
	fresh = append(fresh, head)
	m.Head = head.file
	if err := r.commit(m); err != nil {
		return undo(err)
	}
	old := r.layers
	r.layers = fresh
	for _, l := range old {
		l.f.Close()
		r.removeFile(l.file)
	}
	r.log.Info("chain replaced for a rebuild", "snapshots", len(snaps), "discarded layers", len(old))
	return nil
}

var castagnoli = crc32.MakeTable(crc32.Castagnoli)
