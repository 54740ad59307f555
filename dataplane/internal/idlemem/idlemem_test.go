package idlemem

import (
	"runtime"
	"testing"
)

// The watcher releases once per idle stretch: after a period below both
// bounds, not again while idle, and again after a period above either.
func TestWatcherReleasesOncePerIdleStretch(t *testing.T) {
	var now Activity
	w := NewWatcher(now)
	releases := 0
	tick := func(alloc, syscalls uint64) bool {
		now.Alloc += alloc
		now.Syscalls += syscalls
		return w.Tick(now, func() Activity { releases++; now.Alloc += 1 << 10; return now })
	}
	steps := []struct {
		name            string
		alloc, syscalls uint64
		want            bool
	}{
		{"a busy period (allocation)", 64 << 20, 10, false},
		{"the first idle period", 1 << 20, 50, true},
		{"idle on", 1 << 20, 50, false},
		{"idle on, again", 0, 0, false},
		{"steady I/O from pooled buffers (system calls, little allocation)", 1 << 20, 5000, false},
		{"idle after it", 1 << 20, 50, true},
		{"just under both bounds", IdleAllocBelow - 1, IdleSyscallsBelow - 1, false},
		{"at the allocation bound", IdleAllocBelow, 0, false},
		{"idle after it", 0, 0, true},
	}
	for i, s := range steps {
		if got := tick(s.alloc, s.syscalls); got != s.want {
			t.Fatalf("step %d (%s): release %v, want %v", i, s.name, got, s.want)
		}
	}
	if releases != 3 {
		t.Fatalf("%d releases, want 3", releases)
	}
}

func TestSampleCountsThisProcess(t *testing.T) {
	a := Sample()
	sink = make([]byte, 8<<20)
	b := Sample()
	if b.Alloc-a.Alloc < 8<<20 {
		t.Fatalf("8 MiB allocated, Sample saw %d bytes more", b.Alloc-a.Alloc)
	}
	if b.Syscalls == 0 {
		t.Fatal("no read or write system calls counted (/proc/self/io)")
	}
}

var sink []byte

func TestReleaseReturnsPooledMemory(t *testing.T) {
	var before, after runtime.MemStats
	for range 64 {
		sink = make([]byte, 1<<20)
	}
	sink = nil
	runtime.ReadMemStats(&before)
	Release()
	runtime.ReadMemStats(&after)
	if after.HeapReleased <= before.HeapReleased {
		t.Fatalf("heap released to the system %d bytes before, %d after: nothing given back", before.HeapReleased, after.HeapReleased)
	}
}
