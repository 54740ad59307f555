package engine

import (
	"sync/atomic"
	"time"
)

// LatencyBuckets are the upper bounds of the latency histogram buckets; the
// last bucket counts everything slower.
var LatencyBuckets = []time.Duration{
	100 * time.Microsecond, 250 * time.Microsecond, 500 * time.Microsecond,
	time.Millisecond, 2500 * time.Microsecond, 5 * time.Millisecond, 10 * time.Millisecond,
	25 * time.Millisecond, 50 * time.Millisecond, 100 * time.Millisecond, time.Second,
}

// opStats counts one kind of operation.
type opStats struct {
	ops, bytes, errors atomic.Uint64
	latency            [12]atomic.Uint64 // len(LatencyBuckets)+1
}

func (s *opStats) record(n int, d time.Duration, err error) {
	s.ops.Add(1)
	s.bytes.Add(uint64(n))
	if err != nil {
		s.errors.Add(1)
	}
	i := 0
	for i < len(LatencyBuckets) && d > LatencyBuckets[i] {
		i++
	}
	s.latency[i].Add(1)
}

// OpMetrics is a snapshot of opStats.
type OpMetrics struct {
	Ops, Bytes, Errors uint64
	// Latency[i] counts operations no slower than LatencyBuckets[i]; the
	// last entry counts the rest.
	Latency []uint64
}

func (s *opStats) snapshot() OpMetrics {
	m := OpMetrics{Ops: s.ops.Load(), Bytes: s.bytes.Load(), Errors: s.errors.Load(), Latency: make([]uint64, len(s.latency))}
	for i := range s.latency {
		m.Latency[i] = s.latency[i].Load()
	}
	return m
}

// stats are per-replica counters.
type stats struct{ byOp [4]opStats }

func (s *stats) record(o op, n int, d time.Duration, err error) { s.byOp[o].record(n, d, err) }

// ioStats are the volume's counters as the frontend sees them: an
// operation's latency runs from the engine receiving it (before it waits
// for overlapping writes or a paused set) to its answer.
type ioStats struct{ byOp [4]opStats }

func (s *ioStats) record(o op, n int, since time.Time, err error) {
	s.byOp[o].record(n, time.Since(since), err)
}

// Metrics are counters for the volume and for each replica.
type Metrics struct {
	Read, Write, Flush, Unmap OpMetrics
	Replicas                  map[string]ReplicaMetrics
}

// ReplicaMetrics are one replica's counters, with latency as seen by the
// engine.
type ReplicaMetrics struct {
	Read, Write, Flush, Unmap OpMetrics
	// SharedWrites counts the writes sent through shared memory (see
	// SharedWriteCounter; 0 for other replicas).
	SharedWrites uint64
}

// Mutations counts the writes and unmaps the volume has answered, so that
// a caller can tell without asking a replica whether the volume's data may
// have changed since it last looked.
func (e *Engine) Mutations() uint64 {
	return e.io_.byOp[opWrite].ops.Load() + e.io_.byOp[opUnmap].ops.Load()
}

// Metrics returns the counters.
func (e *Engine) Metrics() Metrics {
	m := Metrics{
		Read: e.io_.byOp[opRead].snapshot(), Write: e.io_.byOp[opWrite].snapshot(),
		Flush: e.io_.byOp[opFlush].snapshot(), Unmap: e.io_.byOp[opUnmap].snapshot(),
		Replicas: map[string]ReplicaMetrics{},
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, r := range e.members {
		s := &r.stats
		rm := ReplicaMetrics{
			Read: s.byOp[opRead].snapshot(), Write: s.byOp[opWrite].snapshot(),
			Flush: s.byOp[opFlush].snapshot(), Unmap: s.byOp[opUnmap].snapshot(),
		}
		if sc, ok := r.data.(SharedWriteCounter); ok {
			rm.SharedWrites = sc.SharedWrites()
		}
		m.Replicas[r.addr] = rm
	}
	return m
}
