package replica

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"testing"
)

// TestKeptSinceFollowsTheSet: the epoch since which no write-intent bit
// was cleared starts at the first degraded fence, stays through later
// degraded ones and a reopen, restarts at each fence of a replica being
// rebuilt, and is reset by a fence of a set that is not degraded.
func TestKeptSinceFollowsTheSet(t *testing.T) {
	dir := t.TempDir()
	r := open(t, dir, 4<<20)
	steps := []struct {
		o    FenceOptions
		want uint64
	}{
		{FenceOptions{Epoch: 2}, 0},
		{FenceOptions{Epoch: 3, Degraded: true}, 3},
		{FenceOptions{Epoch: 4, Degraded: true}, 3},
		{FenceOptions{Epoch: 5, Degraded: true, Rebuilding: true}, 5},
		{FenceOptions{Epoch: 6, Degraded: true}, 5},
		{FenceOptions{Epoch: 7}, 0},
		{FenceOptions{Epoch: 8, Degraded: true}, 8},
	}
	for _, s := range steps {
		if err := r.Fence(s.o); err != nil {
			t.Fatal(err)
		}
		if in, _ := r.Info(); in.DirtyKeptSince != s.want {
			t.Fatalf("after %+v: kept since %d, want %d", s.o, in.DirtyKeptSince, s.want)
		}
	}
	r.Close()
	r = open(t, dir, 0)
	defer r.Close()
	if in, _ := r.Info(); in.DirtyKeptSince != 8 {
		t.Fatalf("after a reopen: kept since %d, want 8", in.DirtyKeptSince)
	}
}

// TestFenceMarks: a degraded fence marks its ranges durably (also after
// a reopen); ranges with a set that is not degraded, or outside the
// volume, are refused and change nothing (not the epoch either).
func TestFenceMarks(t *testing.T) {
	dir := t.TempDir()
	const region = DefaultRegionSize
	r := open(t, dir, 8*region)
	if err := r.Fence(FenceOptions{Epoch: 2}); err != nil {
		t.Fatal(err)
	}
	for _, bad := range []FenceOptions{
		{Epoch: 3, Mark: []Range{{Offset: region, Length: 10}}},
		{Epoch: 3, Degraded: true, Mark: []Range{{Offset: 8 * region, Length: 1}}},
		{Epoch: 3, Degraded: true, Mark: []Range{{Offset: -1, Length: 1}}},
	} {
		if err := r.Fence(bad); !errors.Is(err, ErrOutOfRange) {
			t.Fatalf("%+v: %v, want ErrOutOfRange", bad, err)
		}
		if in, _ := r.Info(); in.Epoch != 2 || in.Dirty.Dirty() != 0 || in.DirtyKeptSince != 0 {
			t.Fatalf("a refused fence changed the replica: epoch %d, %d dirty, kept since %d", in.Epoch, in.Dirty.Dirty(), in.DirtyKeptSince)
		}
	}
	if err := r.Fence(FenceOptions{Epoch: 3, Degraded: true, Mark: []Range{{Offset: region + 5, Length: region}, {Offset: 6 * region, Length: 1}}}); err != nil {
		t.Fatal(err)
	}
	r.Close()
	r = open(t, dir, 0)
	defer r.Close()
	in, _ := r.Info()
	for reg := range int64(8) {
		want := reg == 1 || reg == 2 || reg == 6
		if in.Dirty.IsDirty(reg) != want {
			t.Fatalf("region %d dirty %v, want %v (bits %b)", reg, in.Dirty.IsDirty(reg), want, in.Dirty.Bits)
		}
	}
}

// TestMetadataWithoutKeptSinceLoads: metadata written before the marker
// existed opens, and reports the marker as unknown (0).
func TestMetadataWithoutKeptSinceLoads(t *testing.T) {
	dir := t.TempDir()
	r := open(t, dir, 4<<20)
	if err := r.Fence(FenceOptions{Epoch: 4, Degraded: true}); err != nil {
		t.Fatal(err)
	}
	r.Close()
	path := filepath.Join(dir, metaFileName)
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	if _, ok := m["dirtyKeptSince"]; !ok {
		t.Fatalf("the marker is not in the metadata: %s", b)
	}
	delete(m, "dirtyKeptSince")
	if b, err = json.Marshal(m); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
	r = open(t, dir, 0)
	defer r.Close()
	if in, _ := r.Info(); in.Epoch != 4 || in.DirtyKeptSince != 0 {
		t.Fatalf("old metadata: epoch %d, kept since %d; want 4 and 0 (unknown)", in.Epoch, in.DirtyKeptSince)
	}
}
