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
// read regularly (a failure there would be noticed); the data read is
// right either way.
func TestReadsGoWhereTheyAreCheapest(t *testing.T) {
	var wrapped []*slowReads
	e, _ := openWrapped(t, 2, func(addr string, r engine.Replica) engine.Replica {
		s := &slowReads{Replica: r}
		if len(wrapped) == 1 {
			s.delay = 3 * time.Millisecond
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
	const n = 400
	got := make([]byte, 4096)
	for range n {
		if err := e.ReadAt(ctx, got, 0); err != nil {
			t.Fatal(err)
		}
		if string(got) != string(want) {
			t.Fatal("read the wrong data")
		}
	}
	fast, slow := wrapped[0].reads.Load(), wrapped[1].reads.Load()
	t.Logf("reads: fast replica %d, slow replica %d", fast, slow)
	if fast+slow != n {
		t.Fatalf("%d reads made, %d counted", n, fast+slow)
	}
	if fast < n*3/4 {
		t.Fatalf("the fast replica served only %d of %d reads", fast, n)
	}
	if slow < n/(2*8)-2 {
		t.Fatalf("the slow replica was read %d times: it must still be read about one read in %d", slow, 2*8)
	}
}
