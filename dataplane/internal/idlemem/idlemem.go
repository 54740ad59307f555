// Package idlemem gives an idle process's spare heap back to the system.
//
// An engine or replica of an attached volume whose application does
// nothing keeps the buffers its last burst of I/O used: sync.Pool entries,
// request buffers, freed heap the Go runtime keeps for reuse. Go frees
// them only at a garbage collection, and a collection happens only when
// the program allocates, which an idle one hardly does. With hundreds of
// idle volumes on a node that is megabytes per process for nothing. Watch
// notices when the process has done next to nothing over a whole period
// (little heap allocated, few read and write system calls) and then, once
// per such idle stretch, collects twice (sync.Pool keeps its entries
// through one collection) and returns the freed pages.
package idlemem

import (
	"bufio"
	"context"
	"os"
	"runtime/debug"
	"runtime/metrics"
	"strconv"
	"strings"
	"time"
)

// Period is how long a process must stay idle before its memory is given
// back, and how often it is checked.
const Period = 30 * time.Second

// Most a process may do in a Period and still count as idle. An idle
// engine pings its replicas every 2 s on each data connection and a
// replica answers: measured, about 600 read and write system calls in a
// period for an engine of three replicas and 250 for a replica, and a
// little allocation. A volume doing more than a few requests a second is
// above the system-call bound (each request is a read and a write on a
// socket at every hop); its buffers come from pools and shared memory, so
// the system calls are what show it.
const (
	IdleAllocBelow    = 4 << 20
	IdleSyscallsBelow = 2000
)

// Activity is what the process has done since it began.
type Activity struct {
	Alloc    uint64 // bytes allocated on the heap
	Syscalls uint64 // read and write system calls (/proc/self/io syscr + syscw; 0 where unreadable)
}

// Sample reads the process's Activity.
func Sample() Activity {
	s := []metrics.Sample{{Name: "/gc/heap/allocs:bytes"}}
	metrics.Read(s)
	var a Activity
	if s[0].Value.Kind() == metrics.KindUint64 {
		a.Alloc = s[0].Value.Uint64()
	}
	f, err := os.Open("/proc/self/io")
	if err != nil {
		return a
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, _ := strings.Cut(sc.Text(), ": ")
		if k == "syscr" || k == "syscw" {
			n, _ := strconv.ParseUint(v, 10, 64)
			a.Syscalls += n
		}
	}
	return a
}

// Watcher decides, a period at a time, when to release: after a period
// below both idle bounds, once, then not again until a period above
// either of them.
type Watcher struct {
	last     Activity
	released bool
}

// NewWatcher starts watching from the activity a.
func NewWatcher(a Activity) *Watcher { return &Watcher{last: a} }

// Tick takes the activity at the end of a period and says whether to
// release now. after is the activity once the release is done (the
// release itself allocates a little); it is called only on a release.
func (w *Watcher) Tick(now Activity, after func() Activity) bool {
	busy := now.Alloc-w.last.Alloc >= IdleAllocBelow || now.Syscalls-w.last.Syscalls >= IdleSyscallsBelow
	w.last = now
	switch {
	case busy:
		w.released = false
	case !w.released:
		w.released = true
		w.last = after()
		return true
	}
	return false
}

// Watch checks every period until ctx ends and calls release once per
// idle stretch, as Watcher decides.
func Watch(ctx context.Context, period time.Duration, release func()) {
	t := time.NewTicker(period)
	defer t.Stop()
	w := NewWatcher(Sample())
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		w.Tick(Sample(), func() Activity { release(); return Sample() })
	}
}

// Release is the release Watch makes in a process: two collections, so
// that what sync.Pool held after the first is freed by the second, and
// the freed pages returned to the system.
func Release() {
	debug.FreeOSMemory()
	debug.FreeOSMemory()
}
