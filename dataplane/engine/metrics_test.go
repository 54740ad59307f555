package engine_test

import (
	"context"
	"testing"
	"time"

	"github.com/cairn-io/cairn/dataplane/engine"
)

// slowIO wraps a real replica client: its reads and writes take at least
// delay longer, as on a slow disk or link. It does not implement
// WriteStarter, so the engine writes to it synchronously.
type slowIO struct {
	engine.Replica
	delay time.Duration
}

func (s *slowIO) ReadAt(ctx context.Context, p []byte, off int64) error {
	time.Sleep(s.delay)
	return s.Replica.ReadAt(ctx, p, off)
}

func (s *slowIO) WriteAt(ctx context.Context, p []byte, off int64, fua bool) error {
	time.Sleep(s.delay)
	return s.Replica.WriteAt(ctx, p, off, fua)
}

// TestLatencyHistogramsMeasureTime: with replicas that take at least 3 ms
// per request, every read and write lands in a bucket above 2.5 ms, for
// the volume as for each replica (the volume's histogram recorded a
// duration of zero for every operation, all in the first bucket).
func TestLatencyHistogramsMeasureTime(t *testing.T) {
	const delay = 3 * time.Millisecond
	e, addrs := openWrapped(t, 2, func(addr string, r engine.Replica) engine.Replica {
		return &slowIO{Replica: r, delay: delay}
	})
	ctx := context.Background()
	const n = 10
	for i := range n {
		if err := e.WriteAt(ctx, pattern(i, 4096), int64(i)*4096, false); err != nil {
			t.Fatal(err)
		}
		if err := e.ReadAt(ctx, make([]byte, 4096), int64(i)*4096); err != nil {
			t.Fatal(err)
		}
	}
	// The first bucket whose bound is at least the delay.
	first := 0
	for engine.LatencyBuckets[first] < delay {
		first++
	}
	check := func(what string, m engine.OpMetrics, ops uint64) {
		t.Helper()
		if m.Ops != ops {
			t.Fatalf("%s: %d operations counted, want %d", what, m.Ops, ops)
		}
		var in uint64
		for i, c := range m.Latency {
			if i < first && c > 0 {
				t.Fatalf("%s: %d operations faster than %v, all took at least %v (histogram %v)", what, c, engine.LatencyBuckets[i], delay, m.Latency)
			}
			in += c
		}
		if in != ops {
			t.Fatalf("%s: the histogram holds %d operations, want %d (%v)", what, in, ops, m.Latency)
		}
	}
	m := e.Metrics()
	check("volume writes", m.Write, n)
	check("volume reads", m.Read, n)
	var reads uint64
	for _, a := range addrs {
		check("writes to "+a, m.Replicas[a].Write, n)
		reads += m.Replicas[a].Read.Ops
	}
	if reads != n {
		t.Fatalf("the replicas served %d reads, want %d", reads, n)
	}
}
