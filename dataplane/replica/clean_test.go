package replica

import (
	"fmt"
	"testing"
	"time"
)

// TestFlushCleanClearsEveryQuietBit: with a clear delay no test outlasts,
// a plain flush keeps the bits of regions just written; a clean flush
// clears every bit but those of writes still in flight, and only in a
// complete set; the clear survives a reopen.
func TestFlushCleanClearsEveryQuietBit(t *testing.T) {
	dir := t.TempDir()
	r, err := Open(dir, Options{Size: 16 << 20, RegionSize: 1 << 20, ClearDelay: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	dirty := func() string {
		t.Helper()
		in, err := r.Info()
		if err != nil {
			t.Fatal(err)
		}
		var out []int64
		for i := range in.Dirty.Count {
			if in.Dirty.IsDirty(i) {
				out = append(out, i)
			}
		}
		return fmt.Sprint(out)
	}
	mustWrite(t, r, []byte("a"), 1<<20)
	mustWrite(t, r, []byte("b"), 7<<20)
	// Degraded (the default after open): a clean flush clears nothing.
	if err := r.FlushClean(); err != nil {
		t.Fatal(err)
	}
	if d := dirty(); d != "[1 7]" {
		t.Fatalf("a clean flush in a degraded set left %s, want [1 7]", d)
	}
	if err := r.Fence(FenceOptions{Epoch: 1}); err != nil {
		t.Fatal(err)
	}
	if err := r.FlushEpoch(1); err != nil {
		t.Fatal(err)
	}
	if d := dirty(); d != "[1 7]" {
		t.Fatalf("a plain flush within the clear delay left %s, want [1 7]", d)
	}
	// A write in flight (begun, not ended) keeps its bit through a clean
	// flush; the others clear.
	if err := r.dirty.begin(12<<20, 4096); err != nil {
		t.Fatal(err)
	}
	if err := r.FlushCleanEpoch(2); err == nil {
		t.Fatal("a clean flush of another epoch was accepted")
	}
	if d := dirty(); d != "[1 7 12]" {
		t.Fatalf("a refused clean flush changed the bits: %s", d)
	}
	if err := r.FlushCleanEpoch(1); err != nil {
		t.Fatal(err)
	}
	if d := dirty(); d != "[12]" {
		t.Fatalf("after a clean flush with a write in flight in region 12: %s, want [12]", d)
	}
	r.dirty.end(12<<20, 4096)
	// A write after the clean flush marks its region again.
	mustWrite(t, r, []byte("c"), 3<<20)
	if d := dirty(); d != "[3 12]" {
		t.Fatalf("a write after the clean flush: %s, want [3 12]", d)
	}
	if err := r.FlushClean(); err != nil {
		t.Fatal(err)
	}
	r.Close()
	r, err = Open(dir, Options{ClearDelay: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if d := dirty(); d != "[]" {
		t.Fatalf("after a clean flush and a reopen: %s, want none", d)
	}
}
