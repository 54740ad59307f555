package idlemem

import (
	"context"
	"runtime"
	"testing"
	"time"

	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

var sink [][]byte

// burst allocates n bytes of garbage.
func burst(n int) {
	for range n >> 20 {
		sink = append(sink, make([]byte, 1<<20))
	}
	sink = nil
}

func TestWatchReleasesOncePerIdleStretch(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	released := make(chan struct{}, 16)
	const period = 50 * time.Millisecond
	go Watch(ctx, period, func() { released <- struct{}{} })
	wait := func(what string) {
		t.Helper()
		select {
		case <-released:
		case <-time.After(deadline.Scale(10 * time.Second)):
			t.Fatalf("no release %s", what)
		}
	}
	burst(64 << 20)
	wait("after a burst and an idle period")
	// Idle on: no second release (a window the rule must hold over).
	select {
	case <-released:
		t.Fatal("released again with nothing allocated since the last release")
	case <-time.After(10 * period):
	}
	burst(64 << 20)
	wait("after a second burst")
}

func TestReleaseReturnsPooledMemory(t *testing.T) {
	var before, after runtime.MemStats
	burst(64 << 20)
	runtime.ReadMemStats(&before)
	Release()
	runtime.ReadMemStats(&after)
	if after.HeapReleased <= before.HeapReleased {
		t.Fatalf("heap released to the system %d bytes before, %d after: nothing given back", before.HeapReleased, after.HeapReleased)
	}
}
