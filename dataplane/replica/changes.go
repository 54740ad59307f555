// The change map between two snapshots of one chain: where the view at a
// snapshot may differ from the view at an earlier one, from the layers'
// block indexes alone (no data is read). An incremental backup uploads
// only these ranges.

package replica

import "fmt"

// Range is a byte range of the volume.
type Range struct {
	Offset, Length int64
}

// MaxChangeRanges bounds the ranges one Changes call returns; the caller
// continues from the returned offset.
const MaxChangeRanges = 1 << 16

// maxChangeScan bounds the blocks one Changes call looks at (16 GiB of the
// volume), so that a call holds the replica's lock for a bounded time
// however the layers' indexes are shaped.
const maxChangeScan int64 = 1 << 22

// ChangedLayers returns the layers [lo, hi) whose data makes up the
// difference between the view at snapshot base and the view at snapshot
// snap, for a chain of snapshot names (oldest first): every layer after
// base up to and including snap. An empty base means the view before the
// first snapshot (all zeros), so every layer up to snap. base must be
// older than snap.
func ChangedLayers(chain []string, base, snap string) (lo, hi int, err error) {
	s := indexOf(chain, snap)
	if s < 0 {
		return 0, 0, fmt.Errorf("%w: %q", ErrSnapshotNotFound, snap)
	}
	if base == "" {
		return 0, s + 1, nil
	}
	b := indexOf(chain, base)
	if b < 0 {
		return 0, 0, fmt.Errorf("%w: base %q", ErrSnapshotNotFound, base)
	}
	if b >= s {
		return 0, 0, fmt.Errorf("%w: base snapshot %q is not older than %q", ErrInvalidName, base, snap)
	}
	return b + 1, s + 1, nil
}

func indexOf(chain []string, name string) int {
	for i, n := range chain {
		if n == name {
			return i
		}
	}
	return -1
}

// runner is what unionRun needs of a layer's index: how many blocks from
// b share b's state, and that state.
type runner interface {
	run(b, limit int64) (n int64, data bool)
}

// unionRun returns how many blocks from b (at most limit) are in the same
// state in the union of layers (data if any layer holds data), and that
// state. A data run may end before the union's does (the caller merges
// adjacent runs); a hole run is exact.
func unionRun(layers []runner, b, limit int64) (n int64, data bool) {
	n = limit
	for _, l := range layers {
		rn, d := l.run(b, limit)
		if d {
			if !data || rn > n {
				n = rn
			}
			data = true
		} else if !data {
			n = min(n, rn)
		}
	}
	return max(n, 1), data
}

// appendRange adds [off, off+n) to rs, merging it with the last range when
// they touch.
func appendRange(rs []Range, off, n int64) []Range {
	if k := len(rs) - 1; k >= 0 && rs[k].Offset+rs[k].Length == off {
		rs[k].Length += n
		return rs
	}
	return append(rs, Range{Offset: off, Length: n})
}

// Changes returns the byte ranges in [off, off+length) where the view at
// snapshot snap may differ from the view at the earlier snapshot base
// (from all zeros when base is empty): the union of the data blocks of
// every layer after base up to snap. It is a superset of the difference,
// never a subset: a block rewritten with the same bytes, or unmapped over
// older data (zeros are written then), is listed too. At most max ranges
// (1 to MaxChangeRanges) are returned, from at most 16 GiB of the span;
// next is where a further call continues, off+length when the span is
// done. off and length must be
// block-aligned.
//
// Deleting a snapshot merges its layer into a neighbour of the chain and
// keeps the union between two remaining snapshots the same, so calls
// continuing a listing stay correct while snapshots other than base and
// snap are deleted; deleting base or snap fails the call (not found).
func (r *Replica) Changes(snap, base string, off, length int64, max int) (rs []Range, next int64, err error) {
	if max < 1 || max > MaxChangeRanges {
		return nil, 0, fmt.Errorf("%w: at most %d ranges per call, asked for %d", ErrInvalidSize, MaxChangeRanges, max)
	}
	r.mu.RLock()
	defer r.mu.RUnlock()
	if _, err := r.snapshotSpan(snap, off, length, "change listings"); err != nil {
		return nil, 0, err
	}
	if base != "" {
		if _, err := r.snapshotIndex(base); err != nil {
			return nil, 0, err
		}
	}
	chain := make([]string, len(r.meta.Snapshots))
	for i, s := range r.meta.Snapshots {
		chain[i] = s.Name
	}
	lo, hi, err := ChangedLayers(chain, base, snap)
	if err != nil {
		return nil, 0, err
	}
	layers := make([]runner, 0, hi-lo)
	for _, l := range r.layers[lo:hi] {
		layers = append(layers, l.idx)
	}
	return changedRanges(layers, off, min(length, maxChangeScan*BlockSize), max)
}

// changedRanges lists the data runs of the union of layers in [off,
// off+length), at most max of them, and where to continue.
func changedRanges(layers []runner, off, length int64, max int) ([]Range, int64, error) {
	rs := []Range{}
	end := (off + length) / BlockSize
	for b := off / BlockSize; b < end; {
		n, data := unionRun(layers, b, end-b)
		n = min(n, end-b)
		if data {
			if len(rs) == max && rs[max-1].Offset+rs[max-1].Length != b*BlockSize {
				return rs, b * BlockSize, nil
			}
			rs = appendRange(rs, b*BlockSize, n*BlockSize)
		}
		b += n
	}
	return rs, off + length, nil
}
