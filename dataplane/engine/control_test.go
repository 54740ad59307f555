package engine_test

import (
	"context"
	"errors"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cairn-io/cairn/dataplane/engine"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// hung wraps a real replica client whose control calls named in hang do
// not answer until release is closed (then they go through) or their
// context ends (then they fail with its error).
type hung struct {
	engine.Replica
	hang    map[string]bool
	started chan string
	release <-chan struct{}
}

func (h *hung) wait(ctx context.Context, call string) error {
	if !h.hang[call] {
		return nil
	}
	select {
	case h.started <- call:
	default:
	}
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-h.release:
		return nil
	}
}

func (h *hung) Snapshot(ctx context.Context, s engine.SnapshotInfo) error {
	if err := h.wait(ctx, "snapshot"); err != nil {
		return err
	}
	return h.Replica.Snapshot(ctx, s)
}

func (h *hung) ReplaceChain(ctx context.Context, snaps []engine.SnapshotInfo) error {
	if err := h.wait(ctx, "replace chain"); err != nil {
		return err
	}
	return h.Replica.ReplaceChain(ctx, snaps)
}

func (h *hung) DeleteSnapshot(ctx context.Context, name string) error {
	if err := h.wait(ctx, "delete"); err != nil {
		return err
	}
	return h.Replica.DeleteSnapshot(ctx, name)
}

// testDone is closed when the test ends, after the cleanups registered
// later (such as closing the engine) have run.
func testDone(t *testing.T) <-chan struct{} {
	done := make(chan struct{})
	t.Cleanup(func() { close(done) })
	return done
}

// within runs fn and fails the test if it has not returned by d (scaled
// by the suite's deadline factor).
func within(t *testing.T, d time.Duration, what string, fn func()) {
	t.Helper()
	d = deadline.Scale(d)
	done := make(chan struct{})
	go func() { defer close(done); fn() }()
	select {
	case <-done:
	case <-time.After(d):
		t.Fatalf("%s did not return within %v", what, d)
	}
}

// TestDeleteSnapshotHungReplicaFailed: a replica that never answers a
// snapshot deletion is failed when the deletion's deadline passes (it
// used to have none, and the engine waited for ever holding the chain
// lock); the other replica deletes the snapshot and the call succeeds.
// When the only replica hangs, the error is ErrNoReplica with the
// deadline as its cause.
func TestDeleteSnapshotHungReplicaFailed(t *testing.T) {
	ctx := context.Background()
	const timeout = 2 * time.Second
	done := testDone(t) // registered first: runs after the engine is closed
	var stuck *hung
	var stuckAddr string // the first replica dialed (they are dialed at once)
	e, addrs := openWrappedWith(t, 2, engine.Options{ControlTimeout: timeout}, func(addr string, r engine.Replica) engine.Replica {
		h := &hung{Replica: r, started: make(chan string, 1), release: done}
		if stuck == nil {
			h.hang, stuck, stuckAddr = map[string]bool{"delete": true}, h, addr
		}
		return h
	})
	other := addrs[0]
	if other == stuckAddr {
		other = addrs[1]
	}
	if err := e.WriteAt(ctx, pattern(1, 8192), 0, false); err != nil {
		t.Fatal(err)
	}
	if err := e.Snapshot(ctx, "s1"); err != nil {
		t.Fatal(err)
	}
	var err error
	within(t, 10*timeout, "DeleteSnapshot with a hung replica", func() { err = e.DeleteSnapshot(ctx, "s1") })
	if err != nil {
		t.Fatal(err)
	}
	st := map[string]engine.ReplicaStatus{}
	for _, r := range e.Replicas() {
		st[r.Address] = r
	}
	if st[stuckAddr].Mode != engine.ModeERR || !strings.Contains(st[stuckAddr].Error, "deadline") || st[other].Mode != engine.ModeRW {
		t.Fatalf("replicas after the deletion: %+v", st)
	}
	if snaps, err := e.Snapshots(ctx); err != nil || len(snaps) != 0 {
		t.Fatalf("snapshots on the replica left: %+v, %v", snaps, err)
	}

	one, _ := openWrappedWith(t, 1, engine.Options{ControlTimeout: timeout}, func(addr string, r engine.Replica) engine.Replica {
		return &hung{Replica: r, hang: map[string]bool{"delete": true}, started: make(chan string, 1), release: done}
	})
	if err := one.Snapshot(ctx, "s1"); err != nil {
		t.Fatal(err)
	}
	within(t, 10*timeout, "DeleteSnapshot on a hung replica", func() { err = one.DeleteSnapshot(ctx, "s1") })
	if !errors.Is(err, engine.ErrNoReplica) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("deleting on the only replica, hung: %v; want ErrNoReplica caused by the deadline", err)
	}
}

// TestSlowReplicaDoesNotStallTheEngine: while a control call to one
// replica hangs (a snapshot, or the new chain of a replica being added),
// the replica list, the robustness, the epoch and the rebuild list answer,
// and a replica that dies meanwhile is seen as ERR at once; the held
// operation completes when the call returns. The engine used to hold its
// main lock across the call, stalling all of these.
func TestSlowReplicaDoesNotStallTheEngine(t *testing.T) {
	const wait = 10 * time.Second
	responsive := func(t *testing.T, e *engine.Engine, dying *testReplica) {
		t.Helper()
		within(t, wait, "Replicas, Robustness, Epoch and Rebuilds", func() {
			e.Replicas()
			e.Robustness()
			e.Epoch()
			e.Rebuilds()
		})
		dying.kill()
		within(t, wait, "marking a dead replica ERR", func() {
			for modes(e)[dying.addr] != "ERR" {
				time.Sleep(5 * time.Millisecond)
			}
		})
	}
	ctx := context.Background()

	t.Run("snapshot", func(t *testing.T) {
		release := make(chan struct{})
		wrapped := map[string]*hung{}
		e, reps := startWrapped(t, 3, engine.Options{}, func(addr string, r engine.Replica) engine.Replica {
			h := &hung{Replica: r, started: make(chan string, 1), release: release}
			wrapped[addr] = h
			return h
		})
		slow := wrapped[reps[0].addr] // set before any snapshot call starts
		slow.hang = map[string]bool{"snapshot": true}
		t.Cleanup(func() { // before the engine is closed
			select {
			case <-release:
			default:
				close(release)
			}
		})
		snapped := make(chan error, 1)
		go func() { snapped <- e.Snapshot(ctx, "s1") }()
		<-slow.started
		responsive(t, e, reps[2])
		close(release)
		if err := <-snapped; err != nil {
			t.Fatal(err)
		}
		if m := modes(e); m[reps[0].addr] != "RW" || m[reps[1].addr] != "RW" || m[reps[2].addr] != "ERR" {
			t.Fatalf("modes after the snapshot: %v", m)
		}
	})

	t.Run("add", func(t *testing.T) {
		release := make(chan struct{})
		extra := startReplica(t, filepath.Join(t.TempDir(), "x"), 1<<20, "")
		target := &hung{hang: map[string]bool{"replace chain": true}, started: make(chan string, 1), release: release}
		e, reps := startWrapped(t, 2, engine.Options{}, func(addr string, r engine.Replica) engine.Replica {
			if addr == extra.addr {
				target.Replica = r
				return target
			}
			return r
		})
		t.Cleanup(func() {
			select {
			case <-release:
			default:
				close(release)
			}
		})
		added := make(chan error, 1)
		go func() { added <- e.AddReplica(ctx, extra.addr) }()
		<-target.started
		responsive(t, e, reps[1])
		close(release)
		if err := <-added; err != nil {
			t.Fatal(err)
		}
		if st, err := e.WaitRebuild(ctx, extra.addr); err != nil || st.State != engine.RebuildComplete {
			t.Fatalf("rebuild: %+v, %v", st, err)
		}
		if m := modes(e); m[reps[0].addr] != "RW" || m[reps[1].addr] != "ERR" || m[extra.addr] != "RW" {
			t.Fatalf("modes after the add: %v", m)
		}
	})
}
