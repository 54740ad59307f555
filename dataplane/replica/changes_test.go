package replica

import (
	"bytes"
	"errors"
	"math/rand/v2"
	"slices"
	"testing"
)

func TestChangedLayers(t *testing.T) {
	chain := []string{"a", "b", "c", "d"}
	for _, tc := range []struct {
		base, snap string
		lo, hi     int
		err        error
	}{
		{"", "a", 0, 1, nil},
		{"", "c", 0, 3, nil},
		{"a", "b", 1, 2, nil},
		{"a", "d", 1, 4, nil},
		{"b", "d", 2, 4, nil},
		{"c", "c", 0, 0, ErrInvalidName},
		{"d", "b", 0, 0, ErrInvalidName},
		{"x", "b", 0, 0, ErrSnapshotNotFound},
		{"a", "x", 0, 0, ErrSnapshotNotFound},
		{"", "", 0, 0, ErrSnapshotNotFound},
	} {
		lo, hi, err := ChangedLayers(chain, tc.base, tc.snap)
		if !errors.Is(err, tc.err) || lo != tc.lo || hi != tc.hi {
			t.Errorf("ChangedLayers(%q, %q) = %d, %d, %v; want %d, %d, %v", tc.base, tc.snap, lo, hi, err, tc.lo, tc.hi, tc.err)
		}
	}
}

// boolLayer is a layer's index as a plain slice (a fake for unionRun).
type boolLayer []bool

func (l boolLayer) run(b, limit int64) (int64, bool) {
	if b >= int64(len(l)) {
		return limit, false
	}
	n := int64(1)
	for b+n < int64(len(l)) && n < limit && l[b+n] == l[b] {
		n++
	}
	return n, l[b]
}

func layerOf(s string) boolLayer {
	l := make(boolLayer, len(s))
	for i, c := range s {
		l[i] = c == 'x'
	}
	return l
}

func TestChangedRanges(t *testing.T) {
	const B = BlockSize
	for _, tc := range []struct {
		name   string
		layers []string
		off    int64
		length int64
		max    int
		want   []Range
		next   int64
	}{
		{"none", nil, 0, 8 * B, 10, []Range{}, 8 * B},
		{"one layer", []string{"xx..x..."}, 0, 8 * B, 10, []Range{{0, 2 * B}, {4 * B, B}}, 8 * B},
		{"union joins", []string{"xx......", "..xx....", "......x."}, 0, 8 * B, 10, []Range{{0, 4 * B}, {6 * B, B}}, 8 * B},
		{"overlap", []string{"xxxx....", ".xx.xx.."}, 0, 8 * B, 10, []Range{{0, 6 * B}}, 8 * B},
		{"window", []string{"xxxxxxxx"}, 2 * B, 3 * B, 10, []Range{{2 * B, 3 * B}}, 5 * B},
		{"shorter layer", []string{"x.", "....xx.."}, 0, 8 * B, 10, []Range{{0, B}, {4 * B, 2 * B}}, 8 * B},
		{"paged", []string{"x.x.x.x."}, 0, 8 * B, 2, []Range{{0, B}, {2 * B, B}}, 4 * B},
		{"paged rest", []string{"x.x.x.x."}, 4 * B, 4 * B, 2, []Range{{4 * B, B}, {6 * B, B}}, 8 * B},
		{"last range grows past max", []string{"x.xxxx.."}, 0, 8 * B, 2, []Range{{0, B}, {2 * B, 4 * B}}, 8 * B},
	} {
		var ls []runner
		for _, s := range tc.layers {
			ls = append(ls, layerOf(s))
		}
		got, next, err := changedRanges(ls, tc.off, tc.length, tc.max)
		if err != nil || !slices.Equal(got, tc.want) || next != tc.next {
			t.Errorf("%s: got %v next %d err %v; want %v next %d", tc.name, got, next, err, tc.want, tc.next)
		}
	}
}

// TestChangesRandomUnion checks changedRanges against a block-by-block
// union on random layers, listed page by page.
func TestChangesRandomUnion(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 8))
	for it := range 200 {
		blocks := 1 + rng.IntN(300)
		var ls []runner
		union := make([]bool, blocks)
		for range rng.IntN(4) {
			l := make(boolLayer, 1+rng.IntN(blocks))
			for i := range l {
				l[i] = rng.IntN(3) == 0
				union[i] = union[i] || l[i]
			}
			ls = append(ls, l)
		}
		got := make([]bool, blocks)
		max := 1 + rng.IntN(5)
		for off, end := int64(0), int64(blocks)*BlockSize; off < end; {
			rs, next, err := changedRanges(ls, off, end-off, max)
			if err != nil || len(rs) > max || next <= off && len(rs) == 0 {
				t.Fatalf("iteration %d: %v (%d ranges, max %d), next %d after %d", it, err, len(rs), max, next, off)
			}
			for _, r := range rs {
				for b := r.Offset / BlockSize; b < (r.Offset+r.Length)/BlockSize; b++ {
					got[b] = true
				}
			}
			off = next
		}
		if !slices.Equal(got, union) {
			t.Fatalf("iteration %d: got %v want %v", it, got, union)
		}
	}
}

// TestReplicaChanges: on a real replica with a few snapshots (one of them
// deleted, an unmap over older data), every block where the view at a
// snapshot differs from the view at an earlier one is in Changes.
func TestReplicaChanges(t *testing.T) {
	const size = 64 * BlockSize
	r := open(t, t.TempDir(), size)
	defer r.Close()
	write := func(b int64, v byte) {
		if _, err := r.WriteAt(bytes.Repeat([]byte{v}, BlockSize), b*BlockSize); err != nil {
			t.Fatal(err)
		}
	}
	views := map[string][]byte{"": make([]byte, size)}
	snap := func(name string) {
		if err := r.Snapshot(SnapshotOptions{Name: name}); err != nil {
			t.Fatal(err)
		}
		v := make([]byte, size)
		if _, err := r.ReadAt(v, 0); err != nil {
			t.Fatal(err)
		}
		views[name] = v
	}
	write(1, 1)
	write(2, 1)
	snap("s1")
	write(2, 2)
	write(10, 2)
	snap("s2")
	write(20, 3)
	if err := r.Unmap(1*BlockSize, BlockSize); err != nil { // over s1's data: zeros are written
		t.Fatal(err)
	}
	snap("s3")
	write(30, 4)
	snap("s4")
	write(40, 5) // in the head only: no snapshot has it

	changed := func(snap, base string) []bool {
		rs, next, err := r.Changes(snap, base, 0, size, MaxChangeRanges)
		if err != nil || next != size {
			t.Fatalf("Changes(%s, %s): next %d, %v", snap, base, next, err)
		}
		out := make([]bool, size/BlockSize)
		for _, x := range rs {
			for b := x.Offset / BlockSize; b < (x.Offset+x.Length)/BlockSize; b++ {
				out[b] = true
			}
		}
		return out
	}
	wantExactly := func(snap, base string, blocks ...int) {
		t.Helper()
		got := changed(snap, base)
		for b := range got {
			if got[b] != slices.Contains(blocks, b) {
				t.Errorf("Changes(%s, base %q): block %d listed %v, want blocks %v", snap, base, b, got[b], blocks)
			}
		}
		coverDiff(t, snap, base, got, views)
	}
	wantExactly("s1", "", 1, 2)
	wantExactly("s2", "s1", 2, 10)
	wantExactly("s3", "s1", 1, 2, 10, 20)
	wantExactly("s4", "s2", 1, 20, 30)
	wantExactly("s4", "", 1, 2, 10, 20, 30)

	// Deleting a snapshot between base and snap keeps the union.
	if err := r.DeleteSnapshot("s2"); err != nil {
		t.Fatal(err)
	}
	wantExactly("s3", "s1", 1, 2, 10, 20)
	wantExactly("s4", "s1", 1, 2, 10, 20, 30)

	for _, tc := range []struct {
		snap, base string
		off, n     int64
		max        int
		err        error
	}{
		{"s2", "", 0, size, 10, ErrSnapshotNotFound},
		{"s3", "s2", 0, size, 10, ErrSnapshotNotFound},
		{"s1", "s3", 0, size, 10, ErrInvalidName},
		{"s3", "", 0, size + BlockSize, 10, ErrOutOfRange},
		{"s3", "", 1, BlockSize, 10, ErrInvalidSize},
		{"s3", "", 0, size, 0, ErrInvalidSize},
		{"s3", "", 0, size, MaxChangeRanges + 1, ErrInvalidSize},
	} {
		if _, _, err := r.Changes(tc.snap, tc.base, tc.off, tc.n, tc.max); !errors.Is(err, tc.err) {
			t.Errorf("Changes(%s, %q, %d, %d, %d) = %v, want %v", tc.snap, tc.base, tc.off, tc.n, tc.max, err, tc.err)
		}
	}
}

// coverDiff fails if a block differing between the views at base and snap
// is not in listed.
func coverDiff(t *testing.T, snap, base string, listed []bool, views map[string][]byte) {
	t.Helper()
	a, b := views[base], views[snap]
	for blk := range listed {
		lo, hi := blk*BlockSize, (blk+1)*BlockSize
		if !bytes.Equal(a[lo:hi], b[lo:hi]) && !listed[blk] {
			t.Errorf("Changes(%s, base %q) misses block %d, which differs", snap, base, blk)
		}
	}
}

// TestReplicaChangesScanBound: one call looks at 16 GiB of the span at
// most and says where to continue; the listing continued finds data
// beyond.
func TestReplicaChangesScanBound(t *testing.T) {
	const size = 20 << 30
	r := open(t, t.TempDir(), size)
	defer r.Close()
	if _, err := r.WriteAt(bytes.Repeat([]byte{1}, BlockSize), 18<<30); err != nil {
		t.Fatal(err)
	}
	if err := r.Snapshot(SnapshotOptions{Name: "s1"}); err != nil {
		t.Fatal(err)
	}
	rs, next, err := r.Changes("s1", "", 0, size, MaxChangeRanges)
	if err != nil || len(rs) != 0 || next != maxChangeScan*BlockSize {
		t.Fatalf("first call: %v next %d, %v; want nothing up to %d", rs, next, err, maxChangeScan*BlockSize)
	}
	rs, next, err = r.Changes("s1", "", next, size-next, MaxChangeRanges)
	if err != nil || next != size || !slices.Equal(rs, []Range{{Offset: 18 << 30, Length: BlockSize}}) {
		t.Fatalf("continued: %v next %d, %v", rs, next, err)
	}
}
