package engine_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/cairn-io/cairn/dataplane/engine"
)

// hung wraps a real replica client whose control calls named in hang
// never answer: they return only when their context ends (or when the
// test ends, on an engine that gives them no deadline).
type hung struct {
	engine.Replica
	hang     map[string]bool
	started  chan string
	testDone <-chan struct{}
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
	case <-h.testDone:
		return errors.New("released at the end of the test")
	}
}

func (h *hung) DeleteSnapshot(ctx context.Context, name string) error {
	if err := h.wait(ctx, "delete"); err != nil {
		return err
	}
	return h.Replica.DeleteSnapshot(ctx, name)
}

// testDone is closed when the test ends, before the engine is closed.
func testDone(t *testing.T) <-chan struct{} {
	done := make(chan struct{})
	t.Cleanup(func() { close(done) })
	return done
}

// within runs fn and fails the test if it has not returned by d.
func within(t *testing.T, d time.Duration, what string, fn func()) {
	t.Helper()
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
	e, addrs := openWrappedWith(t, 2, engine.Options{ControlTimeout: timeout}, func(addr string, r engine.Replica) engine.Replica {
		h := &hung{Replica: r, started: make(chan string, 1), testDone: done}
		if stuck == nil {
			h.hang, stuck = map[string]bool{"delete": true}, h
		}
		return h
	})
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
	if st[addrs[0]].Mode != engine.ModeERR || !strings.Contains(st[addrs[0]].Error, "deadline") || st[addrs[1]].Mode != engine.ModeRW {
		t.Fatalf("replicas after the deletion: %+v", st)
	}
	if snaps, err := e.Snapshots(ctx); err != nil || len(snaps) != 0 {
		t.Fatalf("snapshots on the replica left: %+v, %v", snaps, err)
	}

	one, _ := openWrappedWith(t, 1, engine.Options{ControlTimeout: timeout}, func(addr string, r engine.Replica) engine.Replica {
		return &hung{Replica: r, hang: map[string]bool{"delete": true}, started: make(chan string, 1), testDone: done}
	})
	if err := one.Snapshot(ctx, "s1"); err != nil {
		t.Fatal(err)
	}
	within(t, 10*timeout, "DeleteSnapshot on a hung replica", func() { err = one.DeleteSnapshot(ctx, "s1") })
	if !errors.Is(err, engine.ErrNoReplica) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("deleting on the only replica, hung: %v; want ErrNoReplica caused by the deadline", err)
	}
}
