// Deleting a snapshot: merging its layer with its child's while I/O goes on.

package replica

import (
	"fmt"
	"os"
	"path/filepath"
	"sync"
)

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
