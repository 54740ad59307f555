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
// through one collection) and returns the freed pages. It also lets go of
// the pages of its own executable it has mapped but no longer runs
// (UnmapCode).
package idlemem

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"runtime/debug"
	"runtime/metrics"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
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
// the freed pages returned to the system; then the executable's code
// pages unmapped (UnmapCode).
func Release() {
	debug.FreeOSMemory()
	debug.FreeOSMemory()
	_, _ = UnmapCode() // best effort: a process without /proc keeps its mappings
}

// UnmapCode drops the process's page-table entries for the read-only
// mappings of its own executable (code, read-only data) and returns how
// many bytes of address space it covered. The pages stay in the page
// cache, shared by every process of the binary; the next instruction or
// read that needs one maps it back with a minor fault.
//
// Why: a Go binary's start-up (package initialisation, the first gRPC and
// TLS set-up) runs code from all over its 8 MiB of text, and the kernel
// maps the neighbours of every page it faults in (fault-around), so an
// idle engine or replica has 13 MiB of the binary resident, counted in
// its RSS four times per volume. What it runs while idle (timers, pings,
// the poller) is a few hundred KiB; after this only that is mapped again.
// Writable mappings (.data, .bss, the heap) are left alone: dropping them
// would lose their contents.
func UnmapCode() (int64, error) {
	exe, err := os.Stat("/proc/self/exe")
	if err != nil {
		return 0, err
	}
	st, ok := exe.Sys().(*syscall.Stat_t)
	if !ok {
		return 0, errors.New("idlemem: no inode for /proc/self/exe")
	}
	maps, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		return 0, err
	}
	var covered int64
	dev := fmt.Sprintf("%02x:%02x", unix.Major(st.Dev), unix.Minor(st.Dev))
	for _, m := range codeMappings(string(maps), dev, st.Ino) {
		if _, _, errno := unix.Syscall(unix.SYS_MADVISE, m.start, m.end-m.start, unix.MADV_DONTNEED); errno != 0 {
			return covered, fmt.Errorf("idlemem: madvise %#x-%#x: %w", m.start, m.end, errno)
		}
		covered += int64(m.end - m.start)
	}
	return covered, nil
}

// mapping is an address range of /proc/self/maps.
type mapping struct{ start, end uintptr }

// codeMappings picks from /proc/self/maps text the private, read-only
// mappings of the file on device dev ("major:minor" in hex, as maps
// writes it) with inode ino. A line is "start-end perms offset dev inode
// path"; perms "r-xp" or "r--p".
func codeMappings(maps, dev string, ino uint64) []mapping {
	var out []mapping
	for line := range strings.Lines(maps) {
		f := strings.Fields(line)
		if len(f) < 6 || len(f[1]) != 4 || f[1][0] != 'r' || f[1][1] != '-' || f[1][3] != 'p' {
			continue
		}
		if n, err := strconv.ParseUint(f[4], 10, 64); err != nil || n != ino || f[3] != dev {
			continue
		}
		lo, hi, ok := strings.Cut(f[0], "-")
		if !ok {
			continue
		}
		start, err1 := strconv.ParseUint(lo, 16, 64)
		end, err2 := strconv.ParseUint(hi, 16, 64)
		if err1 != nil || err2 != nil || end <= start {
			continue
		}
		out = append(out, mapping{uintptr(start), uintptr(end)})
	}
	return out
}
