package idlemem

import (
	"fmt"
	"os"
	"runtime"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
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

func TestCodeMappingsPicksTheExecutablesReadOnlyMappings(t *testing.T) {
	maps := `00400000-00c0e000 r-xp 00000000 fe:00 10421317                           /bin/cairn-data
00c0e000-014e6000 r--p 0080e000 fe:00 10421317                           /bin/cairn-data
014e6000-0155a000 rw-p 010e6000 fe:00 10421317                           /bin/cairn-data
0155a000-035b1000 rw-p 00000000 00:00 0
7f1b75000000-7f1b75001000 r--p 00000000 fe:01 10421317                   /other/device/same/inode
7f1b76000000-7f1b76001000 r--s 00000000 fe:00 10421317                   /bin/cairn-data
7f1b77000000-7f1b77001000 r--p 00000000 fe:00 99                         /lib/other
garbage line
7ffceb149000-7ffceb16a000 rw-p 00000000 00:00 0                          [stack]
`
	got := codeMappings(maps, "fe:00", 10421317)
	want := []mapping{{0x400000, 0xc0e000}, {0xc0e000, 0x14e6000}}
	if len(got) != len(want) || got[0] != want[0] || got[1] != want[1] {
		t.Fatalf("codeMappings = %#v, want %#v (private read-only mappings of that device and inode only)", got, want)
	}
}

// UnmapCode leaves the test binary running with fewer of its code pages
// mapped than its start-up left.
func TestUnmapCodeDropsResidentCode(t *testing.T) {
	before := residentCode(t)
	covered, err := UnmapCode()
	if err != nil {
		t.Fatal(err)
	}
	after := residentCode(t)
	t.Logf("executable's read-only mappings: %d KiB of address space, %d KiB resident before, %d KiB after", covered>>10, before>>10, after>>10)
	if covered == 0 || before == 0 {
		t.Fatalf("found no code mappings of the test binary (covered %d, resident %d)", covered, before)
	}
	// What runs between the two readings (this test, the runtime) maps
	// some back, with its neighbours: in a binary this small that is a
	// good part of it, so the bound is only that a clear share is gone.
	if after > before-before/8 {
		t.Fatalf("resident code went from %d to %d KiB; want at least an eighth less", before>>10, after>>10)
	}
}

// residentCode sums the Rss of the process's private read-only mappings
// of its executable, from /proc/self/smaps.
func residentCode(t *testing.T) int64 {
	t.Helper()
	exe, err := os.Stat("/proc/self/exe")
	if err != nil {
		t.Skip("no /proc:", err)
	}
	st := exe.Sys().(*syscall.Stat_t)
	dev := fmt.Sprintf("%02x:%02x", unix.Major(st.Dev), unix.Minor(st.Dev))
	smaps, err := os.ReadFile("/proc/self/smaps")
	if err != nil {
		t.Fatal(err)
	}
	var total int64
	in := false
	for line := range strings.Lines(string(smaps)) {
		if f := strings.Fields(line); len(f) >= 5 && strings.Contains(f[0], "-") && !strings.HasSuffix(f[0], ":") {
			in = len(codeMappings(line, dev, st.Ino)) == 1
			continue
		}
		if in && strings.HasPrefix(line, "Rss:") {
			var kb int64
			if _, err := fmt.Sscanf(line, "Rss: %d kB", &kb); err != nil {
				t.Fatalf("smaps line %q: %v", line, err)
			}
			total += kb << 10
		}
	}
	return total
}
