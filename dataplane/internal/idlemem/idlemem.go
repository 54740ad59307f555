// Package idlemem gives an idle process's spare heap back to the system.
//
// An engine or replica of an attached volume whose application does
// nothing keeps the buffers its last burst of I/O used: sync.Pool entries,
// request buffers, freed heap the Go runtime keeps for reuse. Go frees
// them only at a garbage collection, and a collection happens only when
// the program allocates, which an idle one hardly does. With hundreds of
// idle volumes on a node that is megabytes per process for nothing. Watch
// notices when the process has allocated little over a whole period and
// then, once per such idle stretch, collects twice (sync.Pool keeps its
// entries through one collection) and returns the freed pages.
package idlemem

import (
	"context"
	"runtime/debug"
	"runtime/metrics"
	"time"
)

// Period is how long a process must stay idle before its memory is given
// back, and how often it is checked.
const Period = 30 * time.Second

// IdleBelow is the most a process may allocate in a Period and still
// count as idle: an idle engine's pings to its replicas and a replica's
// answers allocate a little every few seconds.
const IdleBelow = 4 << 20

// allocated is the total the heap has allocated since the process began.
func allocated() uint64 {
	s := []metrics.Sample{{Name: "/gc/heap/allocs:bytes"}}
	metrics.Read(s)
	if s[0].Value.Kind() != metrics.KindUint64 {
		return 0
	}
	return s[0].Value.Uint64()
}

// Watch checks every period until ctx ends and calls release once per
// idle stretch: when less than IdleBelow was allocated over the last
// period, and something more was allocated since the last release.
func Watch(ctx context.Context, period time.Duration, release func()) {
	t := time.NewTicker(period)
	defer t.Stop()
	last, released := allocated(), false
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		now := allocated()
		busy := now-last >= IdleBelow
		last = now
		switch {
		case busy:
			released = false
		case !released:
			release()
			released = true
			last = allocated() // the release itself allocates a little
		}
	}
}

// Release is the release Watch makes in a process: two collections, so
// that what sync.Pool held after the first is freed by the second, and
// the freed pages returned to the system.
func Release() {
	debug.FreeOSMemory()
	debug.FreeOSMemory()
}
