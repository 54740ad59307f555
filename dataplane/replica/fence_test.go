package replica

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
)

// TestFenceNeverGoesBack: an epoch lower than the replica's is refused,
// and so is its own epoch from another owner (two engines that reached
// the same number), also after a reopen; the same epoch from the same
// owner is accepted again with new flags.
func TestFenceNeverGoesBack(t *testing.T) {
	dir := t.TempDir()
	r := open(t, dir, 1<<20)
	if err := r.Fence(FenceOptions{Epoch: 5, Owner: "engine-a"}); err != nil {
		t.Fatal(err)
	}
	var se *StaleEpochError
	if err := r.Fence(FenceOptions{Epoch: 4, Owner: "engine-a"}); !errors.As(err, &se) || se.Request != 4 || se.Current != 5 || !errors.Is(err, ErrStaleEpoch) {
		t.Fatalf("epoch 5 to 4: %v", err)
	}
	if err := r.Fence(FenceOptions{Epoch: 3}); !errors.Is(err, ErrStaleEpoch) {
		t.Fatalf("epoch 5 to 3 with no owner: %v", err)
	}
	if err := r.Fence(FenceOptions{Epoch: 5, Owner: "engine-b"}); !errors.As(err, &se) || !se.OtherOwner {
		t.Fatalf("epoch 5 from another owner: %v", err)
	}
	if err := r.Fence(FenceOptions{Epoch: 5, Owner: "engine-a", Rebuilding: true}); err != nil {
		t.Fatalf("epoch 5 again from its owner: %v", err)
	}
	if in, _ := r.Info(); in.Epoch != 5 || !in.Rebuilding {
		t.Fatalf("after the owner's second Fence: epoch %d, rebuilding %v", in.Epoch, in.Rebuilding)
	}
	if err := r.Fence(FenceOptions{Epoch: 5}); err != nil { // no owner: not checked, owner kept
		t.Fatalf("epoch 5 with no owner: %v", err)
	}
	r.Close()
	r = open(t, dir, 0)
	defer r.Close()
	if err := r.Fence(FenceOptions{Epoch: 5, Owner: "engine-b"}); !errors.As(err, &se) || !se.OtherOwner {
		t.Fatalf("after a reopen, epoch 5 from another owner: %v", err)
	}
	if err := r.Fence(FenceOptions{Epoch: 6, Owner: "engine-b"}); err != nil {
		t.Fatalf("a newer epoch: %v", err)
	}
	if err := r.CheckEpoch(6); err != nil {
		t.Fatal(err)
	}
}

// TestFenceRecordsMembers: the set of RW replica IDs given with an epoch
// is persisted with it, reported by Info (also after a reopen) and
// replaced by the next Fence; a Fence without one leaves none.
func TestFenceRecordsMembers(t *testing.T) {
	dir := t.TempDir()
	r := open(t, dir, 1<<20)
	if err := r.Fence(FenceOptions{Epoch: 2, Owner: "e", Members: []string{"a", "b", "c"}}); err != nil {
		t.Fatal(err)
	}
	if err := r.Fence(FenceOptions{Epoch: 3, Owner: "e", Members: []string{"a", "c"}}); err != nil {
		t.Fatal(err)
	}
	r.Close()
	r = open(t, dir, 0)
	defer r.Close()
	if in, _ := r.Info(); in.Epoch != 3 || !slices.Equal(in.EpochMembers, []string{"a", "c"}) {
		t.Fatalf("after a reopen: epoch %d, members %v; want 3, [a c]", in.Epoch, in.EpochMembers)
	}
	if err := r.Fence(FenceOptions{Epoch: 4}); err != nil {
		t.Fatal(err)
	}
	if in, _ := r.Info(); len(in.EpochMembers) != 0 {
		t.Fatalf("members after a Fence without them: %v", in.EpochMembers)
	}
}

// TestFencedChangesRefusedForStaleEpoch: every change through At carries
// an epoch, and one that is not the replica's is refused without changing
// anything; at the current epoch each goes through.
func TestFencedChangesRefusedForStaleEpoch(t *testing.T) {
	r := open(t, t.TempDir(), 1<<20)
	defer r.Close()
	mustWrite(t, r, pattern(1, 8192), 0)
	if err := r.Snapshot(SnapshotOptions{Name: "s1", UserCreated: true}); err != nil {
		t.Fatal(err)
	}
	mustWrite(t, r, pattern(2, 4096), 0)
	if err := r.Fence(FenceOptions{Epoch: 7, Rebuilding: true}); err != nil {
		t.Fatal(err)
	}
	before, _ := r.Info()
	changes := map[string]func(Fenced) error{
		"snapshot":      func(f Fenced) error { return f.Snapshot(SnapshotOptions{Name: "s2"}) },
		"delete":        func(f Fenced) error { return f.DeleteSnapshot("s1") },
		"revert":        func(f Fenced) error { return f.Revert("s1") },
		"expand":        func(f Fenced) error { return f.Expand(2 << 20) },
		"replace chain": func(f Fenced) error { return f.ReplaceChain([]SnapshotInfo{{Name: "x"}}) },
		"layer write":   func(f Fenced) error { return f.WriteLayer("s1", pattern(3, 4096), 4096) },
	}
	for what, change := range changes {
		for _, stale := range []uint64{0, 6, 8} {
			var se *StaleEpochError
			if err := change(r.At(stale)); !errors.As(err, &se) || se.Request != stale || se.Current != 7 {
				t.Errorf("%s at epoch %d on a replica at 7: %v", what, stale, err)
			}
		}
	}
	after, _ := r.Info()
	if fmt.Sprint(after.Snapshots) != fmt.Sprint(before.Snapshots) || after.Size != before.Size || after.HeadBytes != before.HeadBytes {
		t.Fatalf("refused changes changed the replica:\nbefore %+v\nafter  %+v", before, after)
	}
	if got := readAll(t, r, 8192); !slices.Equal(got[:4096], pattern(2, 4096)) || !slices.Equal(got[4096:], pattern(1, 8192)[4096:]) {
		t.Fatal("refused changes changed the data")
	}
	cur := r.At(7)
	for _, what := range []string{"layer write", "snapshot", "expand", "delete"} {
		if err := changes[what](cur); err != nil {
			t.Errorf("%s at the current epoch: %v", what, err)
		}
	}
	if in, _ := r.Info(); len(in.Snapshots) != 1 || in.Snapshots[0].Name != "s2" || in.Size != 2<<20 {
		t.Fatalf("after the changes at the current epoch: %+v", in)
	}
}

// TestFencedChangeIsAtomicWithFence: once Fence returns, no change sent
// with the old epoch may land, even one being checked at that very moment
// (as TestEpochChangeIsAtomicWithWrites for the data path).
func TestFencedChangeIsAtomicWithFence(t *testing.T) {
	r := open(t, t.TempDir(), 1<<20)
	defer r.Close()
	if err := r.Snapshot(SnapshotOptions{Name: "base"}); err != nil {
		t.Fatal(err)
	}
	for round := uint64(1); round <= 20; round++ {
		epoch := 2 * round
		if err := r.Fence(FenceOptions{Epoch: epoch}); err != nil {
			t.Fatal(err)
		}
		var stop atomic.Bool
		var started atomic.Int64
		var wg sync.WaitGroup
		for w := range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				f := r.At(epoch)
				for i := 0; !stop.Load(); i++ {
					var err error
					if w%2 == 0 {
						err = f.Snapshot(SnapshotOptions{Name: fmt.Sprintf("r%d-w%d-%d", round, w, i)})
					} else {
						err = f.WriteLayer("base", pattern(int(round)*8+w, 4096), int64(w)*4096)
					}
					started.Add(1)
					if err != nil {
						return // refused: stale epoch
					}
				}
			}()
		}
		for started.Load() < 4 {
			// let the changes get going
		}
		if err := r.Fence(FenceOptions{Epoch: epoch + 1}); err != nil { // the new engine takes over
			t.Fatal(err)
		}
		snaps, _ := r.Snapshots()
		layer, _ := r.ReadLayer("base", 0, 4*4096)
		stop.Store(true)
		wg.Wait()
		snapsAfter, _ := r.Snapshots()
		layerAfter, _ := r.ReadLayer("base", 0, 4*4096)
		if len(snapsAfter) != len(snaps) {
			t.Fatalf("round %d: a snapshot with the old epoch was taken after Fence returned", round)
		}
		if fmt.Sprint(layerAfter) != fmt.Sprint(layer) {
			t.Fatalf("round %d: a layer write with the old epoch landed after Fence returned", round)
		}
	}
}
