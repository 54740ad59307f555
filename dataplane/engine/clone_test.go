package engine_test

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"github.com/cairn-io/cairn/dataplane/engine"
	"github.com/cairn-io/cairn/dataplane/engine/replicaclient"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// TestCloneFromSnapshot: a volume of three replicas is filled from
// another volume's replica at a snapshot taken between two writes: every
// replica of the clone holds the data of the snapshot (not the later
// write), only the source's data extents are written, the copy is
// verified, and a second CloneFrom of the same source does nothing.
func TestCloneFromSnapshot(t *testing.T) {
	const size = 16 << 20
	ctx := context.Background()
	src, srcReps := cluster(t, 2, size)
	a := pattern(1, 3<<20)
	if err := src.WriteAt(ctx, a, 1<<20, false); err != nil {
		t.Fatal(err)
	}
	tail := pattern(2, 8192)
	if err := src.WriteAt(ctx, tail, size-8192, false); err != nil {
		t.Fatal(err)
	}
	if err := src.Snapshot(ctx, "snap-1"); err != nil {
		t.Fatal(err)
	}
	// The same name again: refused as existing, no replica failed.
	if err := src.Snapshot(ctx, "snap-1"); !errors.Is(err, engine.ErrSnapshotExists) {
		t.Fatalf("second snapshot snap-1: %v, want ErrSnapshotExists", err)
	}
	if m := modes(src); m[srcReps[0].addr] != "RW" || m[srcReps[1].addr] != "RW" {
		t.Fatalf("source modes after a repeated snapshot: %v", m)
	}
	b := pattern(3, 1<<20)
	if err := src.WriteAt(ctx, b, 1<<20, false); err != nil { // after the snapshot: not cloned
		t.Fatal(err)
	}

	dst, dstReps := cluster(t, 3, size)
	source, err := replicaclient.DialSource(srcReps[1].ctl, deadline.Scale(5*time.Second), nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := dst.CloneFrom(source, srcReps[1].ctl, "snap-1"); err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, deadline.Scale(60*time.Second))
	defer cancel()
	st, err := dst.WaitClone(wctx)
	if err != nil || st.State != engine.RebuildComplete {
		t.Fatalf("clone: %+v, %v", st, err)
	}
	if st.BytesDone != st.BytesTotal || st.BytesTotal != 2*size {
		t.Errorf("progress %d of %d, want %d of %d", st.BytesDone, st.BytesTotal, 2*size, 2*size)
	}
	if want := int64(len(a) + len(tail)); st.BytesCopied != want {
		t.Errorf("copied %d bytes, want only the source's data, %d", st.BytesCopied, want)
	}
	want := make([]byte, size)
	copy(want[1<<20:], a)
	copy(want[size-8192:], tail)
	got := make([]byte, size)
	for _, r := range dstReps {
		for off := 0; off < size; off += 4 << 20 {
			readReplica(t, r, dst.Epoch(), got[off:off+4<<20], int64(off))
		}
		if !bytes.Equal(got, want) {
			t.Fatalf("replica %s of the clone does not hold the snapshot's data", r.addr)
		}
	}

	// Asked again (a controller retrying): the completed copy stands.
	again, err := replicaclient.DialSource(srcReps[1].ctl, deadline.Scale(5*time.Second), nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := dst.CloneFrom(again, srcReps[1].ctl, "snap-1"); err != nil {
		t.Fatal(err)
	}
	if st2, _ := dst.Clone(); st2.Started != st.Started || st2.State != engine.RebuildComplete {
		t.Errorf("a repeated CloneFrom started another copy: %+v", st2)
	}
}

// TestCloneFromMissingSnapshotFails: the copy fails with the cause, and
// a later CloneFrom (of an existing snapshot) starts again.
func TestCloneFromMissingSnapshotFails(t *testing.T) {
	const size = 4 << 20
	ctx := context.Background()
	_, srcReps := cluster(t, 1, size)
	dst, _ := cluster(t, 1, size)
	source, err := replicaclient.DialSource(srcReps[0].ctl, deadline.Scale(5*time.Second), nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := dst.CloneFrom(source, srcReps[0].ctl, "nope"); err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, deadline.Scale(30*time.Second))
	defer cancel()
	st, err := dst.WaitClone(wctx)
	if err != nil || st.State != engine.RebuildFailed || st.Error == "" {
		t.Fatalf("clone of a missing snapshot: %+v, %v", st, err)
	}
}

// TestCloneRefusesSourceBiggerThanVolume: a source with data past the
// clone's end is refused, not cut off.
func TestCloneRefusesSourceBiggerThanVolume(t *testing.T) {
	ctx := context.Background()
	src, srcReps := cluster(t, 1, 8<<20)
	if err := src.WriteAt(ctx, pattern(4, 4096), 6<<20, false); err != nil {
		t.Fatal(err)
	}
	if err := src.Snapshot(ctx, "s"); err != nil {
		t.Fatal(err)
	}
	dst, _ := cluster(t, 1, 4<<20)
	source, err := replicaclient.DialSource(srcReps[0].ctl, deadline.Scale(5*time.Second), nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := dst.CloneFrom(source, srcReps[0].ctl, "s"); err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, deadline.Scale(30*time.Second))
	defer cancel()
	if st, err := dst.WaitClone(wctx); err != nil || st.State != engine.RebuildFailed {
		t.Fatalf("clone of a bigger source: %+v, %v", st, err)
	}
}
