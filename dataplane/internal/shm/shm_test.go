package shm

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

func newRegion(t *testing.T, size int) *Region {
	t.Helper()
	r, err := Create("test", size)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	return r
}

func TestMapSeesEngineWritesReadOnly(t *testing.T) {
	r := newRegion(t, 1<<20)
	copy(r.Bytes()[4096:], "hello, replica")
	// Map through a second descriptor, as a replica gets one over SCM_RIGHTS.
	fd, err := unix.Dup(r.FD())
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	m, err := Map(fd, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	got, ok := m.Slice(4096, 14)
	if !ok || string(got) != "hello, replica" {
		t.Fatalf("Slice = %q, %v", got, ok)
	}
	copy(r.Bytes()[4096:], "HELLO")
	if string(got[:5]) != "HELLO" {
		t.Fatalf("mapping does not share memory: %q", got)
	}
	// The replica's view must be read-only: find it in /proc/self/maps.
	if perm := mappingPerm(t, m.mem); perm != "r--s" {
		t.Fatalf("replica mapping has permissions %q, want r--s", perm)
	}
	if perm := mappingPerm(t, r.mem); perm != "rw-s" {
		t.Fatalf("engine mapping has permissions %q, want rw-s", perm)
	}
}

func mappingPerm(t *testing.T, mem []byte) string {
	t.Helper()
	f, err := os.Open("/proc/self/maps")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	start := fmt.Sprintf("%x-", uintptrOf(mem))
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if strings.HasPrefix(sc.Text(), start) {
			return strings.Fields(sc.Text())[1]
		}
	}
	t.Fatalf("mapping at %s not in /proc/self/maps", start)
	return ""
}

func TestSliceBounds(t *testing.T) {
	r := newRegion(t, 64<<10)
	m, err := Map(r.FD(), 64<<10)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	for _, c := range []struct {
		off uint64
		n   uint32
		ok  bool
	}{
		{0, 64 << 10, true},
		{60 << 10, 4 << 10, true},
		{60 << 10, 4<<10 + 1, false},
		{64 << 10, 1, false},
		{1<<64 - 1, 2, false}, // off+n would wrap
		{0, 0, false},
	} {
		b, ok := m.Slice(c.off, c.n)
		if ok != c.ok || (ok && (len(b) != int(c.n) || cap(b) != int(c.n))) {
			t.Errorf("Slice(%d, %d) = len %d cap %d, %v; want ok=%v", c.off, c.n, len(b), cap(b), ok, c.ok)
		}
	}
}

func TestMapRefusesWhatItCannotTrust(t *testing.T) {
	r := newRegion(t, 64<<10)
	if _, err := Map(r.FD(), 128<<10); err == nil || !strings.Contains(err.Error(), "announced") {
		t.Errorf("Map of a region smaller than announced: %v", err)
	}
	unsealed, err := unix.MemfdCreate("unsealed", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(unsealed)
	if err := unix.Ftruncate(unsealed, 64<<10); err != nil {
		t.Fatal(err)
	}
	if _, err := Map(unsealed, 4096); err == nil || !strings.Contains(err.Error(), "shrink") {
		t.Errorf("Map of an unsealed memfd (could shrink under the mapping): %v", err)
	}
	f, err := os.Create(filepath.Join(t.TempDir(), "plain"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(64 << 10); err != nil {
		t.Fatal(err)
	}
	if _, err := Map(int(f.Fd()), 4096); err == nil {
		t.Error("Map of a plain file succeeded")
	}
}

func TestOffset(t *testing.T) {
	r := newRegion(t, 64<<10)
	mem := r.Bytes()
	if off, ok := r.Offset(mem[8192:12288]); !ok || off != 8192 {
		t.Errorf("Offset inside = %d, %v", off, ok)
	}
	if off, ok := r.Offset(mem[60<<10:]); !ok || off != 60<<10 {
		t.Errorf("Offset of the tail = %d, %v", off, ok)
	}
	if _, ok := r.Offset(make([]byte, 4096)); ok {
		t.Error("a heap slice is inside the region")
	}
	if _, ok := r.Offset(mem[4096:4096]); ok {
		t.Error("an empty slice is inside the region")
	}
}

func TestArenaCarvesReusesAndFallsBack(t *testing.T) {
	r := newRegion(t, 1<<20) // classes up to 128 KiB may use it
	a := NewArena(r)
	b := a.Get(100 << 10) // class 128 KiB
	off, ok := r.Offset(b[:cap(b)])
	if !ok || len(b) != 100<<10 || cap(b) != 128<<10 {
		t.Fatalf("Get(100 KiB): in region %v, len %d cap %d", ok, len(b), cap(b))
	}
	if a.InUse() != 1 {
		t.Fatalf("InUse = %d, want 1", a.InUse())
	}
	a.Put(b)
	b2 := a.Get(128 << 10)
	if off2, _ := r.Offset(b2); off2 != off {
		t.Errorf("a returned slot was not reused: %d then %d", off, off2)
	}
	a.Put(b2)
	if a.InUse() != 0 {
		t.Fatalf("InUse after Put = %d", a.InUse())
	}
	// 256 KiB is more than an eighth of 1 MiB: heap.
	if big := a.Get(256 << 10); func() bool { _, in := r.Offset(big); return in }() {
		t.Error("a 256 KiB buffer came from a 1 MiB region")
	}
	// Writes through arena slices are region memory.
	small := a.Get(4096)
	copy(small, "x")
	if o, in := r.Offset(small); !in || r.Bytes()[o] != 'x' {
		t.Error("arena slice is not region memory")
	}
	a.Put(small)
	// Exhaust the rest of the region with 128 KiB slots (one is free
	// already; the 4 KiB slot took the start of the second).
	var held [][]byte
	for range 7 {
		b := a.Get(128 << 10)
		if _, in := r.Offset(b); !in {
			t.Fatalf("slot %d of 8 came from the heap", len(held))
		}
		held = append(held, b)
	}
	extra := a.Get(128 << 10)
	if _, in := r.Offset(extra); in {
		t.Fatal("an eighth 128 KiB slot fit beside a 4 KiB one in 1 MiB")
	}
	a.Put(extra) // to the heap pool; must not enter the region's free list
	for _, b := range held {
		a.Put(b)
	}
	if a.InUse() != 0 {
		t.Fatalf("InUse = %d after returning everything", a.InUse())
	}
}

func TestArenaWithoutRegion(t *testing.T) {
	a := NewArena(nil)
	b := a.Get(5000)
	if len(b) != 5000 || cap(b) != 8192 {
		t.Fatalf("Get(5000): len %d cap %d", len(b), cap(b))
	}
	a.Put(b)
	if a.Get(0) != nil {
		t.Error("Get(0) is not nil")
	}
	huge := a.Get(64 << 20)
	if len(huge) != 64<<20 {
		t.Fatal("Get beyond the largest class")
	}
	a.Put(huge) // ignored
	a.Put(bytes.Repeat([]byte{1}, 3000))
}

func uintptrOf(b []byte) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(b))) }

func TestReleaseIdleFreesOnlyIdleMemory(t *testing.T) {
	r := newRegion(t, 4<<20)
	a := NewArena(r)
	resident := func() int64 {
		t.Helper()
		n, err := r.Resident()
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	if n := resident(); n != 0 {
		t.Fatalf("a fresh region holds %d bytes", n)
	}
	b := a.Get(128 << 10)
	held := a.Get(64 << 10)
	for i := range b {
		b[i] = 0xaa
	}
	for i := range held {
		held[i] = 0xbb
	}
	a.Put(b)
	if n := resident(); n < 192<<10 {
		t.Fatalf("after writing 192 KiB the region holds %d bytes", n)
	}
	// Slots were handed out since the last call: a busy arena keeps its pages.
	if n, err := a.ReleaseIdle(); n != 0 || err != nil {
		t.Fatalf("first ReleaseIdle on a busy arena released %d (%v)", n, err)
	}
	// Nothing taken since: the free 128 KiB slot goes, the held one stays.
	if n, err := a.ReleaseIdle(); n != 128<<10 || err != nil {
		t.Fatalf("ReleaseIdle on an idle arena released %d (%v), want 128 KiB", n, err)
	}
	if n := resident(); n != 64<<10 {
		t.Fatalf("after the release the region holds %d bytes, want the 64 KiB in use", n)
	}
	if held[0] != 0xbb || held[len(held)-1] != 0xbb {
		t.Fatal("a slot in use lost its bytes")
	}
	// Nothing left to release; a released slot is reused and works.
	if n, _ := a.ReleaseIdle(); n != 0 {
		t.Fatalf("a second idle release freed %d bytes again", n)
	}
	b = a.Get(128 << 10)
	if b[0] != 0 {
		t.Fatal("a released slot does not read as zeros")
	}
	b[0] = 1 // writable again (a fault here would kill the test)
	a.Put(b)
	a.Put(held)
	if _, err := a.ReleaseIdle(); err != nil { // busy since the last call
		t.Fatal(err)
	}
	if n, _ := a.ReleaseIdle(); n != 192<<10 {
		t.Fatalf("idle release after everything came back freed %d, want 192 KiB", n)
	}
	if n := resident(); n != 0 {
		t.Fatalf("an idle arena's region still holds %d bytes", n)
	}
	if n, err := NewArena(nil).ReleaseIdle(); n != 0 || err != nil {
		t.Fatal("ReleaseIdle without a region")
	}
}
