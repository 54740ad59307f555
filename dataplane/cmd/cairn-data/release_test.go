package main

import (
	"context"
	"testing"
	"time"

	"github.com/go-logr/logr"

	"github.com/cairn-io/cairn/dataplane/internal/shm"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// The engine's loop gives an idle volume's shared memory back, keeps what
// is in use, and stops with its context.
func TestReleaseIdleLoop(t *testing.T) {
	r, err := shm.Create("release-test", 4<<20)
	if err != nil {
		t.Skipf("no memfd here: %v", err)
	}
	defer r.Close()
	a := shm.NewArena(r)
	free, held := a.Get(256<<10), a.Get(64<<10)
	for i := range free {
		free[i] = 1
	}
	for i := range held {
		held[i] = 2
	}
	a.Put(free)
	resident := func() int64 {
		t.Helper()
		n, err := r.Resident()
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	if n := resident(); n < 320<<10 {
		t.Fatalf("the region holds %d bytes after 320 KiB were written", n)
	}
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan struct{})
	go func() { releaseIdle(ctx, a, 5*time.Millisecond, logr.Discard()); close(stopped) }()
	for until := deadline.After(10 * time.Second); resident() != 64<<10; {
		if time.Now().After(until) {
			t.Fatalf("the idle buffers were not given back: the region holds %d bytes, want the 64 KiB in use", resident())
		}
		time.Sleep(time.Millisecond) // polling the loop's effect, not waiting for it
	}
	if held[0] != 2 || held[len(held)-1] != 2 {
		t.Fatal("a buffer in use lost its bytes")
	}
	cancel()
	select {
	case <-stopped:
	case <-time.After(deadline.Scale(10 * time.Second)):
		t.Fatal("releaseIdle did not stop when its context ended")
	}
}
