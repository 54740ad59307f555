package engine_test

import (
	"context"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cairn-io/cairn/dataplane/engine"
)

// closeGate records the replica calls still running after the engine's
// Close returned. Once closing is set, a call waits until Close has
// returned (then it is late) or its context ends, whichever comes first:
// a call the engine makes while closing is thereby still running when
// Close returns unless Close waited for it, or cancelled it.
type closeGate struct {
	closing  atomic.Bool
	returned chan struct{}
	mu       sync.Mutex
	late     []string
}

func (g *closeGate) enter(ctx context.Context, call string) {
	if !g.closing.Load() {
		return
	}
	select {
	case <-g.returned:
		g.mu.Lock()
		g.late = append(g.late, call)
		g.mu.Unlock()
	case <-ctx.Done():
	}
}

// gated wraps a real replica client, passing its calls through a
// closeGate; with holdLayers its layer writes wait for their context to
// end, which keeps a rebuild to it in progress until it is cancelled.
type gated struct {
	engine.Replica
	g          *closeGate
	holdLayers bool
	holding    chan struct{}
}

func (r *gated) Info(ctx context.Context) (engine.ReplicaInfo, error) {
	r.g.enter(ctx, "info")
	return r.Replica.Info(ctx)
}

func (r *gated) SetEpoch(ctx context.Context, st engine.EpochState) error {
	r.g.enter(ctx, "set epoch")
	return r.Replica.SetEpoch(ctx, st)
}

func (r *gated) Snapshot(ctx context.Context, s engine.SnapshotInfo) error {
	r.g.enter(ctx, "snapshot")
	return r.Replica.Snapshot(ctx, s)
}

func (r *gated) DeleteSnapshot(ctx context.Context, name string) error {
	r.g.enter(ctx, "delete snapshot")
	return r.Replica.DeleteSnapshot(ctx, name)
}

func (r *gated) Flush(ctx context.Context) error {
	r.g.enter(ctx, "flush")
	return r.Replica.Flush(ctx)
}

func (r *gated) ReadLayer(ctx context.Context, name string, off, length int64) ([]engine.Extent, error) {
	r.g.enter(ctx, "read layer")
	return r.Replica.ReadLayer(ctx, name, off, length)
}

func (r *gated) SyncLayers(ctx context.Context) error {
	r.g.enter(ctx, "sync layers")
	return r.Replica.SyncLayers(ctx)
}

func (r *gated) LayerChecksum(ctx context.Context, name string, off, length int64) (uint32, error) {
	r.g.enter(ctx, "layer checksum")
	return r.Replica.LayerChecksum(ctx, name, off, length)
}

func (r *gated) WriteLayer(ctx context.Context, name string, p []byte, off int64) error {
	r.g.enter(ctx, "write layer")
	if r.holdLayers {
		select {
		case r.holding <- struct{}{}:
		default:
		}
		<-ctx.Done()
		return ctx.Err()
	}
	return r.Replica.WriteLayer(ctx, name, p, off)
}

// TestCloseWaitsForRebuilds: Close with a rebuild in progress returns
// only once the rebuild has stopped: no call of it reaches a replica
// after Close returned (Close used to cancel the rebuild and return, and
// the rebuild went on to delete its snapshot on the replicas).
func TestCloseWaitsForRebuilds(t *testing.T) {
	ctx := context.Background()
	g := &closeGate{returned: make(chan struct{})}
	extra := startReplica(t, filepath.Join(t.TempDir(), "x"), 1<<20, "")
	target := &gated{g: g, holdLayers: true, holding: make(chan struct{}, 1)}
	e, _ := openWrapped(t, 2, func(addr string, r engine.Replica) engine.Replica {
		if addr == extra.addr {
			target.Replica = r
			return target
		}
		return &gated{Replica: r, g: g}
	})
	if err := e.WriteAt(ctx, pattern(1, 8192), 0, false); err != nil {
		t.Fatal(err)
	}
	if err := e.AddReplica(ctx, extra.addr); err != nil {
		t.Fatal(err)
	}
	<-target.holding // the rebuild is copying
	g.closing.Store(true)
	within(t, 30*time.Second, "Close", func() { e.Close() })
	close(g.returned)
	var st engine.RebuildStatus
	within(t, 30*time.Second, "the rebuild's end", func() { st, _ = e.WaitRebuild(ctx, extra.addr) })
	if st.State != engine.RebuildCancelled {
		t.Errorf("rebuild after Close: %+v, want cancelled", st)
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if len(g.late) > 0 {
		t.Fatalf("replica calls still running after Close returned: %v", g.late)
	}
}
