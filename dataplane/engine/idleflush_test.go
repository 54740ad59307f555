package engine_test

import (
	"context"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"github.com/cairn-io/cairn/dataplane/engine"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// TestIdleVolumeBitsClear: after writes with no flush from the client,
// the engine flushes the replicas itself, so their write-intent bits
// clear; with IdleFlush negative they stay set.
func TestIdleVolumeBitsClear(t *testing.T) {
	// At least two idle flushes, a second apart (scaled), come before a bit
	// clears: the check that the write marked its regions runs well before.
	for _, idle := range []time.Duration{deadline.Scale(time.Second), -1} {
		t.Run(fmt.Sprint("IdleFlush=", idle), func(t *testing.T) {
			var reps []*testReplica
			var addrs []string
			for i := range 2 {
				tr := startReplica(t, filepath.Join(t.TempDir(), fmt.Sprint("r", i)), 8<<20, "")
				reps = append(reps, tr)
				addrs = append(addrs, tr.addr)
			}
			e, err := engine.Open(context.Background(), engine.Options{Name: "idle", Replicas: addrs, Dial: dialer(), IdleFlush: idle})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { e.Close() })
			if err := e.WriteAt(context.Background(), pattern(1, 4<<20), 0, false); err != nil {
				t.Fatal(err)
			}
			if n := dirtyCount(t, reps[0]); n != 4 {
				t.Fatalf("a 4 MiB write marks %d regions, want 4", n)
			}
			if idle > 0 {
				waitFor(t, "the bits of an idle volume to clear", func() bool { return dirtyCount(t, reps[0])+dirtyCount(t, reps[1]) == 0 })
				// After its three flushes the flusher waits for a write;
				// the next writes wake it. (The test never flushes, so
				// the volume's flushes are the idle ones.)
				waitFor(t, "the three idle flushes", func() bool { return e.Metrics().Flush.Ops >= 3 })
				if err := e.WriteAt(context.Background(), pattern(2, 2<<20), 4<<20, false); err != nil {
					t.Fatal(err)
				}
				if n := dirtyCount(t, reps[0]); n != 2 {
					t.Fatalf("a 2 MiB write marks %d regions, want 2", n)
				}
				waitFor(t, "the bits of the second writes to clear", func() bool { return dirtyCount(t, reps[0])+dirtyCount(t, reps[1]) == 0 })
				return
			}
			// Without idle flushes nothing clears them: a flush from the
			// client still does (the clear delay is 0 here).
			time.Sleep(3 * time.Second) // three idle-flush intervals of the other case, none sent
			if n := dirtyCount(t, reps[0]); n != 4 {
				t.Fatalf("with IdleFlush off, %d regions are marked, want 4", n)
			}
			if err := e.Flush(context.Background()); err != nil {
				t.Fatal(err)
			}
			waitFor(t, "the bits to clear after a flush", func() bool { return e.Flush(context.Background()) == nil && dirtyCount(t, reps[0]) == 0 })
		})
	}
}
