package engine_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cairn-io/cairn/dataplane/engine"
)

// slowReads wraps a real replica client: every read waits delay first, and
// reads are counted.
type slowReads struct {
	engine.Replica
	delay time.Duration
	reads atomic.Int64
}

func (s *slowReads) ReadAt(ctx context.Context, p []byte, off int64) error {
	s.reads.Add(1)
	time.Sleep(s.delay)
	return s.Replica.ReadAt(ctx, p, off)
}

// TestReadsGoWhereTheyAreCheapest: with one replica far slower to read
// than the other (as a replica over the network is beside one on the
// engine's node), most reads go to the fast one, and the slow one is still
// read about every readProbeInterval (a failure there would be noticed);
// the data read is right either way.
func TestReadsGoWhereTheyAreCheapest(t *testing.T) {
	var wrapped []*slowReads
	e, _ := openWrapped(t, 2, func(addr string, r engine.Replica) engine.Replica {
		s := &slowReads{Replica: r}
		if len(wrapped) == 1 {
			// Far beyond what a loaded machine adds to a loopback read
			// (3 ms was not: the fast replica's reads took 5 ms under a
			// load of 20, and the pick rightly spread them).
			s.delay = 20 * time.Millisecond
		}
		wrapped = append(wrapped, s)
		return s
	})
	ctx := context.Background()
	want := pattern(7, 4096)
	if err := e.WriteAt(ctx, want, 0, true); err != nil {
		t.Fatal(err)
	}
	for _, w := range wrapped {
		w.reads.Store(0)
	}
	const span = time.Second
	got := make([]byte, 4096)
	n := int64(0)
	for began := time.Now(); time.Since(began) < span; n++ {
		if err := e.ReadAt(ctx, got, 0); err != nil {
			t.Fatal(err)
		}
		if string(got) != string(want) {
			t.Fatal("read the wrong data")
		}
	}
	fast, slow := wrapped[0].reads.Load(), wrapped[1].reads.Load()
	t.Logf("reads in %s: fast replica %d, slow replica %d", span, fast, slow)
	if fast+slow != n {
		t.Fatalf("%d reads made, %d counted", n, fast+slow)
	}
	if fast < n*3/4 {
		t.Fatalf("the fast replica served only %d of %d reads", fast, n)
	}
	// One probe per interval (100 ms); a loaded machine may stretch the
	// span's reads but not cut the probes below half.
	if slow < 5 {
		t.Fatalf("the slow replica was read %d times in %s: it must still be read about every 100 ms", slow, span)
	}
}
