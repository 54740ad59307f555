package engine_test

import (
	"bytes"
	"context"
	"testing"

	"github.com/cairn-io/cairn/dataplane/engine"
)

// TestDirtyOnlyAfterEngineRestart: a replica away while half the volume
// is unmapped and a region rewritten, and the engine restarted meanwhile
// (the new one has no record of it leaving), resyncs dirty regions only
// from the survivor, which has kept its write-intent bits since the
// replica left (how much that copies is checked with processes, in
// TestReturningReplicaCopiesWhatChanged: here the first write's bits
// never clear); alone, it then reads the volume as written: none of its
// old data shows where the survivor has holes.
func TestDirtyOnlyAfterEngineRestart(t *testing.T) {
	ctx := context.Background()
	const size = 8 << 20
	e, reps := cluster(t, 2, size)
	if err := e.WriteAt(ctx, pattern(1, size), 0, false); err != nil {
		t.Fatal(err)
	}
	r1 := reps[1]
	r1.kill()
	waitFor(t, "ERR", func() bool { return modes(e)[r1.addr] == "ERR" })
	if err := e.Unmap(ctx, 0, size/2); err != nil {
		t.Fatal(err)
	}
	fresh := pattern(2, 1<<20)
	if err := e.WriteAt(ctx, fresh, 6<<20, false); err != nil {
		t.Fatal(err)
	}
	e.Close()
	e2, err := engine.Open(ctx, engine.Options{Replicas: []string{reps[0].addr}, Dial: dialer(), Wanted: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer e2.Close()
	back := startReplica(t, r1.dir, 0, r1.addr)
	if err := e2.AddReplica(ctx, back.addr); err != nil {
		t.Fatal(err)
	}
	st, err := e2.WaitRebuild(ctx, back.addr)
	if err != nil || st.State != engine.RebuildComplete || !st.DirtyOnly || st.FullReason != "" {
		t.Fatalf("rebuild: %+v %v; want dirty-only", st, err)
	}
	reps[0].kill()
	waitFor(t, "source dropped", func() bool { return modes(e2)[reps[0].addr] == "ERR" })
	want := pattern(1, size)
	clear(want[:size/2])
	copy(want[6<<20:], fresh)
	got := make([]byte, size)
	if err := e2.ReadAt(ctx, got, 0); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("the returned replica alone reads other data: %v", err)
	}
}
