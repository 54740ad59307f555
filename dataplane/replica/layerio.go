// Rebuild-facing layer I/O: reading a snapshot's view or its own layer as
// extents, writing into a snapshot's layer, syncing the layers, and
// replacing the whole chain before a full rebuild fills it.

package replica

import (
	"fmt"
	"os"
	"path/filepath"
	"time"
)

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
	return r.readExtents(nil, name, off, length, false)
}

// ReadLayer returns the data snapshot name's own layer holds in [off,
// off+length), as extents: only what was written between the previous
// snapshot and this one. A full rebuild copies every layer this way, so the
// rebuilt replica keeps the snapshot history.
func (r *Replica) ReadLayer(name string, off, length int64) ([]Extent, error) {
	return r.readExtents(nil, name, off, length, true)
}

// ReadExtentsInto is ReadLayer (layerOnly) or ReadSnapshot with the
// extents' data in buf, which holds at least length bytes: an extent at
// volume offset o lies at buf[o-off:]. Nothing is allocated for the data
// and contiguous extents are merged without a copy. A source replica
// serves a rebuild's chunks this way from a recycled buffer. The extents
// use buf: the caller keeps it while it uses them. A nil buf reads the
// data into memory of its own, as ReadLayer and ReadSnapshot do.
func (r *Replica) ReadExtentsInto(buf []byte, name string, off, length int64, layerOnly bool) ([]Extent, error) {
	if buf != nil && length > 0 && int64(len(buf)) < length {
		return nil, fmt.Errorf("%w: a buffer of %d bytes for a read of %d", ErrInvalidSize, len(buf), length)
	}
	return r.readExtents(buf, name, off, length, layerOnly)
}

// ReadSnapshotAt fills p with the view at snapshot name from off, holes
// as zeros: ReadSnapshot into a caller's buffer, for a reader that wants
// the bytes rather than the extents (a backup over the data port). off
// and len(p) must be block-aligned. Unlike ReadSnapshot it keeps no
// checksum for a Checksum call to follow: nothing verifies a backup's
// read that way.
func (r *Replica) ReadSnapshotAt(p []byte, name string, off int64) error {
	r.mu.RLock()
	defer r.mu.RUnlock()
	top, err := r.snapshotSpan(name, off, int64(len(p)), "snapshot reads")
	if err != nil {
		return err
	}
	return r.readChain(p, off, top)
}

// readExtents reads the extents of a view (own: of one layer) into buf,
// or into memory of their own when buf is nil.
func (r *Replica) readExtents(buf []byte, name string, off, length int64, own bool) ([]Extent, error) {
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
			var p []byte
			if buf != nil {
				lo, hi := b*BlockSize-off, (b+n)*BlockSize-off
				p = buf[lo:hi:hi]
			} else {
				p = make([]byte, n*BlockSize)
			}
			if _, err := r.layers[li].f.ReadAt(p, b*BlockSize); err != nil {
				return nil, fmt.Errorf("read %s: %w", r.layers[li].file, err)
			}
			// Merge with the previous extent when contiguous (in buf,
			// it lies just before p already).
			if k := len(out) - 1; k >= 0 && out[k].Offset+int64(len(out[k].Data)) == b*BlockSize {
				if buf != nil {
					lo, hi := out[k].Offset-off, (b+n)*BlockSize-off
					out[k].Data = buf[lo:hi:hi]
				} else {
					out[k].Data = append(out[k].Data, p...)
				}
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
		l.f.startWriteback(off, int64(len(p))) // SyncLayers follows the copy
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
