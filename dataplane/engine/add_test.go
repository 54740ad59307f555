package engine_test

import (
	"context"
	"errors"
	"slices"
	"testing"

	"github.com/cairn-io/cairn/dataplane/engine"
	"github.com/cairn-io/cairn/dataplane/engine/replicaclient"
	"github.com/cairn-io/cairn/dataplane/replica"
)

// TestStaleEngineAddLeavesNewerOwnersReplicaAlone: an engine that a newer
// engine has fenced out, adding back a replica the newer engine owns,
// changes nothing on it. Engine A serves r0, r1, r2 with a snapshot s0;
// engine B takes r1 and r2 over, A fails them and goes on alone on r0,
// deletes s0 and doubles the volume; r2 dies under B, whose epoch then
// passes A's. A's add of r1 (a returning replica to A: dirty regions only)
// would expand r1 and delete s0 on it: its client sent r1's own epoch with
// those calls, and only the SetEpoch that followed was refused. Now the
// add fences r1 first, which r1 refuses: its size, snapshots and epoch
// stay as B left them.
func TestStaleEngineAddLeavesNewerOwnersReplicaAlone(t *testing.T) {
	ctx := context.Background()
	const size = 1 << 20
	a, reps := cluster(t, 3, size)
	if err := a.Snapshot(ctx, "s0"); err != nil {
		t.Fatal(err)
	}
	r1 := reps[1]

	// B opens without r0, which A still has RW: an engine may do so only
	// when the replicas record no member list with their epoch (set by an
	// older cairn-data), so B is shown none.
	dial := dialer()
	b, err := engine.Open(ctx, engine.Options{Name: "newer", Replicas: []string{reps[1].addr, reps[2].addr},
		Dial: func(ctx context.Context, addr string) (engine.Replica, error) {
			r, err := dial(ctx, addr)
			if err != nil {
				return nil, err
			}
			return noMembers{r}, nil
		}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	// A's next write is refused by r1 and r2 (B's epoch): A fails them and
	// bumps its epoch on r0, to B's number.
	if err := a.WriteAt(ctx, pattern(1, 4096), 0, false); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "A to fail r1 and r2", func() bool {
		m := modes(a)
		return m[r1.addr] == "ERR" && m[reps[2].addr] == "ERR"
	})
	if err := a.DeleteSnapshot(ctx, "s0"); err != nil {
		t.Fatal(err)
	}
	if err := a.Expand(ctx, 2*size); err != nil {
		t.Fatal(err)
	}
	// r2 dies under B: B's epoch on r1 moves past A's.
	reps[2].kill()
	waitFor(t, "B's epoch on r1 to pass A's", func() bool { return r1.run.Replica.Epoch() > a.Epoch() })

	before, err := r1.run.Replica.Info()
	if err != nil {
		t.Fatal(err)
	}
	if before.Size != size || !slices.Equal(snapNames(before), []string{"s0"}) {
		t.Fatalf("r1 under B: size %d, snapshots %v; want %d, [s0]", before.Size, snapNames(before), size)
	}
	err = a.AddReplica(ctx, r1.addr)
	if !errors.Is(err, replicaclient.ErrStaleEpoch) {
		t.Fatalf("the stale engine's add of a replica a newer engine owns: %v, want ErrStaleEpoch", err)
	}
	after, err := r1.run.Replica.Info()
	if err != nil {
		t.Fatal(err)
	}
	if after.Size != before.Size || !slices.Equal(snapNames(after), snapNames(before)) || after.Epoch != before.Epoch || after.Rebuilding {
		t.Fatalf("the stale engine changed the newer engine's replica: size %d -> %d, snapshots %v -> %v, epoch %d -> %d, rebuilding %v",
			before.Size, after.Size, snapNames(before), snapNames(after), before.Epoch, after.Epoch, after.Rebuilding)
	}
	if err := b.WriteAt(ctx, pattern(2, 4096), 0, false); err != nil || modes(b)[r1.addr] != "RW" {
		t.Fatalf("the newer engine after the stale add: write %v, modes %v", err, modes(b))
	}
}

func snapNames(in replica.Info) []string {
	var out []string
	for _, s := range in.Snapshots {
		out = append(out, s.Name)
	}
	return out
}

// noMembers is a replica whose Info shows no member list with its epoch,
// as one whose epoch an older cairn-data set.
type noMembers struct{ engine.Replica }

func (r noMembers) Info(ctx context.Context) (engine.ReplicaInfo, error) {
	in, err := r.Replica.Info(ctx)
	in.EpochMembers = nil
	return in, err
}
