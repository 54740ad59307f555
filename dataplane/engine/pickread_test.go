package engine

import (
	"testing"
	"time"
)

// TestPickRead: the replica on the engine's node keeps the reads, however
// long its queue, while its latency is under offNodeSlowdown times an
// off-node replica's expected wait, and loses them beyond; off the node
// the lowest latency times queue wins; a replica not read yet goes first;
// one not read for readProbeInterval is taken once, by one read.
func TestPickRead(t *testing.T) {
	now := time.Now().UnixNano()
	mk := func(addr string, latNs, reading int64) *member {
		m := &member{addr: addr}
		m.readNs.Store(latNs)
		m.reading.Store(reading)
		m.lastRead.Store(now)
		return m
	}
	local := func(lat, q int64) *member { return mk("unix:/run/r0.sock,127.0.0.1:2", lat, q) }
	remote := func(lat, q int64) *member { return mk("10.0.0.2:1,10.0.0.2:2", lat, q) }
	for _, tc := range []struct {
		name string
		rs   []*member
		want int
	}{
		{"an idle node's replica", []*member{remote(100e3, 0), local(100e3, 0)}, 1},
		{"the node's replica with 32 reads queued", []*member{remote(100e3, 0), local(100e3, 32)}, 1},
		{"the node's replica 10x slower", []*member{remote(100e3, 0), local(1000e3, 0)}, 1},
		{"the node's replica 20x slower", []*member{remote(100e3, 0), local(2000e3, 0)}, 0},
		{"the node's replica 10x slower than a busy remote", []*member{remote(100e3, 3), local(1000e3, 0)}, 1},
		{"two remote: the lower latency", []*member{remote(300e3, 0), remote(100e3, 0)}, 1},
		{"two remote: the shorter queue", []*member{remote(100e3, 3), remote(100e3, 0)}, 1},
		{"a replica not read yet", []*member{local(100e3, 0), remote(0, 0)}, 1},
	} {
		if got := pickRead(tc.rs, now); got != tc.want {
			t.Errorf("%s: picked %d, want %d", tc.name, got, tc.want)
		}
	}

	rs := []*member{local(100e3, 0), remote(100e3, 0)}
	rs[1].lastRead.Store(now - int64(readProbeInterval))
	if got := pickRead(rs, now); got != 1 {
		t.Fatalf("a replica not read for %s was not probed: picked %d", readProbeInterval, got)
	}
	if got := pickRead(rs, now); got != 0 {
		t.Fatalf("the probe was taken twice: picked %d", got)
	}
}
