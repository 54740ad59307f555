package replica

import (
	"bytes"
	"errors"
	"fmt"
	"hash/crc32"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

func open(t *testing.T, dir string, size int64) *Replica {
	t.Helper()
	return openMode(t, dir, size, false)
}

func openMode(t *testing.T, dir string, size int64, direct bool) *Replica {
	t.Helper()
	r, err := Open(dir, Options{Size: size, ClearDelay: -1, DirectIO: direct})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// model is the expected content of the volume and of each snapshot.
type model struct {
	data  []byte
	snaps []string          // oldest first
	saved map[string][]byte // content when each snapshot was taken
}

func (m *model) check(t *testing.T, r *Replica, what string) {
	t.Helper()
	got := make([]byte, len(m.data))
	if _, err := r.ReadAt(got, 0); err != nil {
		t.Fatalf("%s: read all: %v", what, err)
	}
	if !bytes.Equal(got, m.data) {
		for i := range got {
			if got[i] != m.data[i] {
				t.Fatalf("%s: first difference at byte %d (block %d): got %d want %d", what, i, i/BlockSize, got[i], m.data[i])
			}
		}
	}
	snaps, err := r.Snapshots()
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for i, s := range snaps {
		names = append(names, s.Name)
		if i > 0 && s.Parent != snaps[i-1].Name {
			t.Fatalf("%s: snapshot %s has parent %q, want %q", what, s.Name, s.Parent, snaps[i-1].Name)
		}
	}
	if fmt.Sprint(names) != fmt.Sprint(m.snaps) {
		t.Fatalf("%s: snapshots %v, want %v", what, names, m.snaps)
	}
}

// TestReplicaMatchesModel runs random operations, unaligned ones included,
// against a replica and a byte-slice model, reopening it now and then.
// Seeds 4 and up run with direct I/O and switch between direct and
// buffered I/O at some reopens.
func TestReplicaMatchesModel(t *testing.T) {
	for seed := range uint64(8) {
		t.Run(fmt.Sprint("seed", seed), func(t *testing.T) {
			dir := t.TempDir()
			size := int64(3<<20 + 5*BlockSize)
			direct := seed >= 4
			r := openMode(t, dir, size, direct)
			defer func() { r.Close() }()
			m := &model{data: make([]byte, size), saved: map[string][]byte{}}
			rng := rand.New(rand.NewPCG(seed, 99))
			randRange := func(max int64) (int64, int64) {
				size := int64(len(m.data))
				off := rng.Int64N(size)
				if rng.IntN(2) == 0 {
					off -= off % BlockSize
				}
				n := 1 + rng.Int64N(min(max, size-off))
				return off, n
			}
			next := 0
			for it := range 600 {
				switch op := rng.IntN(100); {
				case op < 40:
					off, n := randRange(64 << 10)
					p := make([]byte, n)
					for i := range p {
						p[i] = byte(rng.Uint32() | 1)
					}
					if _, err := r.WriteAt(p, off); err != nil {
						t.Fatal(err)
					}
					copy(m.data[off:], p)
				case op < 55:
					off, n := randRange(256 << 10)
					got := make([]byte, n)
					if _, err := r.ReadAt(got, off); err != nil {
						t.Fatal(err)
					}
					if !bytes.Equal(got, m.data[off:off+n]) {
						t.Fatalf("it %d: read %d@%d differs", it, n, off)
					}
				case op < 65:
					off, n := randRange(512 << 10)
					if err := r.Unmap(off, n); err != nil {
						t.Fatal(err)
					}
					clear(m.data[off : off+n])
				case op < 73:
					name := fmt.Sprintf("s%d", next)
					next++
					if err := r.Snapshot(SnapshotOptions{Name: name, UserCreated: true}); err != nil {
						t.Fatal(err)
					}
					m.snaps = append(m.snaps, name)
					m.saved[name] = append([]byte(nil), m.data...)
				case op < 80 && len(m.snaps) > 0:
					i := rng.IntN(len(m.snaps))
					if err := r.DeleteSnapshot(m.snaps[i]); err != nil {
						t.Fatal(err)
					}
					delete(m.saved, m.snaps[i])
					m.snaps = append(m.snaps[:i:i], m.snaps[i+1:]...)
				case op < 84 && len(m.snaps) > 0:
					i := rng.IntN(len(m.snaps))
					name := m.snaps[i]
					if err := r.Revert(name); err != nil {
						t.Fatal(err)
					}
					for _, s := range m.snaps[i+1:] {
						delete(m.saved, s)
					}
					m.snaps = m.snaps[:i+1]
					m.data = append(m.data[:0:0], m.saved[name]...)
					// The snapshot is older than any expansion since: pad.
					if grow := r.Size() - int64(len(m.data)); grow > 0 {
						m.data = append(m.data, make([]byte, grow)...)
					}
				case op < 87:
					ns := r.Size() + int64(1+rng.IntN(4))*BlockSize
					if err := r.Expand(ns); err != nil {
						t.Fatal(err)
					}
					m.data = append(m.data, make([]byte, ns-int64(len(m.data)))...)
				case op < 92:
					if err := r.Flush(); err != nil {
						t.Fatal(err)
					}
				default:
					if err := r.Close(); err != nil {
						t.Fatal(err)
					}
					if seed >= 4 && rng.IntN(2) == 0 {
						direct = !direct
					}
					r = openMode(t, dir, 0, direct)
					m.check(t, r, fmt.Sprintf("it %d after reopen (direct I/O %v)", it, direct))
				}
			}
			m.check(t, r, "end")
		})
	}
}

func TestOpenErrors(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "f")
	if err := os.WriteFile(file, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := Open(file, Options{Size: 1 << 20}); !errors.Is(err, ErrNotReplica) {
		t.Fatalf("a file: %v", err)
	}
	other := filepath.Join(dir, "other")
	if err := os.MkdirAll(other, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(other, "precious.db"), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := Open(other, Options{Size: 1 << 20}); !errors.Is(err, ErrNotReplica) {
		t.Fatalf("a non-empty directory: %v", err)
	}
	if _, err := Open(filepath.Join(dir, "new"), Options{}); !errors.Is(err, ErrNotReplica) {
		t.Fatalf("no size, no replica: %v", err)
	}
	if _, err := Open(filepath.Join(dir, "odd"), Options{Size: 1000}); !errors.Is(err, ErrInvalidSize) {
		t.Fatalf("unaligned size: %v", err)
	}
	good := filepath.Join(dir, "good")
	r := open(t, good, 1<<20)
	r.Close()
	if _, err := Open(good, Options{Size: 2 << 20}); !errors.Is(err, ErrSizeMismatch) {
		t.Fatalf("size mismatch: %v", err)
	}
	r = open(t, good, 1<<20) // same size is fine
	defer r.Close()
	if _, err := r.ReadAt(make([]byte, 2), 1<<20-1); !errors.Is(err, ErrOutOfRange) {
		t.Fatalf("read past the end: %v", err)
	}
	if err := r.Snapshot(SnapshotOptions{Name: "../x", UserCreated: true}); !errors.Is(err, ErrInvalidName) {
		t.Fatalf("bad name: %v", err)
	}
	if err := r.Snapshot(SnapshotOptions{Name: "a", UserCreated: true}); err != nil {
		t.Fatal(err)
	}
	if err := r.Snapshot(SnapshotOptions{Name: "a", UserCreated: true}); !errors.Is(err, ErrSnapshotExists) {
		t.Fatalf("duplicate: %v", err)
	}
	if err := r.DeleteSnapshot("zz"); !errors.Is(err, ErrSnapshotNotFound) {
		t.Fatalf("missing: %v", err)
	}
	if err := r.Expand(4096); !errors.Is(err, ErrInvalidSize) {
		t.Fatalf("shrink: %v", err)
	}
}

func allocated(t *testing.T, path string) int64 {
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return st.Blocks * 512
}

// TestUnmapSemantics: unmapped ranges read as zeros; space is freed where
// no snapshot holds older data, and older data never shows through.
func TestUnmapSemantics(t *testing.T) {
	dir := t.TempDir()
	r := open(t, dir, 8<<20)
	defer r.Close()
	ones := bytes.Repeat([]byte{1}, 4<<20)
	mustWrite(t, r, ones, 0)
	r.Flush()
	headPath := filepath.Join(dir, r.meta.Head)
	before := allocated(t, headPath)
	if err := r.Unmap(0, 2<<20); err != nil {
		t.Fatal(err)
	}
	if after := allocated(t, headPath); after > before-(2<<20) {
		t.Fatalf("unmap without snapshots freed %d bytes, want 2 MiB", before-after)
	}
	// Now with older data in a snapshot below.
	mustSnapshot(t, r, SnapshotOptions{Name: "base", UserCreated: true})
	mustWrite(t, r, bytes.Repeat([]byte{2}, 4096), 3<<20)
	if err := r.Unmap(3<<20-100, 1<<20); err != nil { // unaligned, over snapshot data
		t.Fatal(err)
	}
	got := make([]byte, 1<<20)
	mustRead(t, r, got, 3<<20-100)
	if !bytes.Equal(got, make([]byte, 1<<20)) {
		t.Fatal("unmapped range over a snapshot does not read as zeros")
	}
	edge := make([]byte, 2)
	mustRead(t, r, edge, 3<<20-101)
	if edge[0] != 1 || edge[1] != 0 {
		t.Fatalf("bytes around the unmap: %v, want [1 0]", edge)
	}
	// And it stays so after reopening (the zeros are real, not an index trick).
	r.Close()
	r = open(t, dir, 0)
	mustRead(t, r, got, 3<<20-100)
	if !bytes.Equal(got, make([]byte, 1<<20)) {
		t.Fatal("after reopen, snapshot data shows through an unmapped range")
	}
}

func TestDebrisRemovedOnOpen(t *testing.T) {
	dir := t.TempDir()
	r := open(t, dir, 1<<20)
	r.Close()
	if err := os.WriteFile(filepath.Join(dir, "layer-000099.img"), []byte("orphan"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "volume.meta.tmp"), []byte("{half"), 0o600); err != nil {
		t.Fatal(err)
	}
	r = open(t, dir, 0)
	defer r.Close()
	for _, f := range []string{"layer-000099.img", "volume.meta.tmp"} {
		if _, err := os.Stat(filepath.Join(dir, f)); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("%s survived open: %v", f, err)
		}
	}
}

func TestEpochPersists(t *testing.T) {
	dir := t.TempDir()
	r := open(t, dir, 1<<20)
	if err := r.CheckEpoch(0); err != nil {
		t.Fatal(err)
	}
	if err := r.Fence(FenceOptions{Epoch: 7}); err != nil {
		t.Fatal(err)
	}
	if err := r.CheckEpoch(6); !errors.Is(err, ErrStaleEpoch) {
		t.Fatalf("old epoch accepted: %v", err)
	}
	r.Close()
	r = open(t, dir, 0)
	defer r.Close()
	if r.Epoch() != 7 || r.CheckEpoch(7) != nil {
		t.Fatalf("epoch after reopen: %d", r.Epoch())
	}
}

func TestWriteIntentBitmap(t *testing.T) {
	dir := t.TempDir()
	r, err := Open(dir, Options{Size: 16 << 20, RegionSize: 1 << 20, ClearDelay: -1})
	if err != nil {
		t.Fatal(err)
	}
	dirty := func() []int64 {
		in, err := r.Info()
		if err != nil {
			t.Fatal(err)
		}
		var out []int64
		for i := range in.Dirty.Count {
			if in.Dirty.IsDirty(i) {
				out = append(out, i)
			}
		}
		return out
	}
	// A new replica starts clean.
	if d := dirty(); len(d) != 0 {
		t.Fatalf("new replica dirty: %v", d)
	}
	mustWrite(t, r, []byte("x"), 3<<20+5)
	mustWrite(t, r, make([]byte, 8192), 5<<20-4096) // spans regions 4 and 5
	if d := fmt.Sprint(dirty()); d != "[3 4 5]" {
		t.Fatalf("dirty after writes: %s", d)
	}
	// Degraded (the default after open): a flush clears nothing.
	r.Flush()
	r.Flush()
	if d := fmt.Sprint(dirty()); d != "[3 4 5]" {
		t.Fatalf("degraded flush cleared bits: %s", d)
	}
	// The bits are durable: a crash (no Close) and reopen keeps them.
	r2dir := dir
	r.Close()
	r, _ = Open(r2dir, Options{ClearDelay: -1})
	if d := fmt.Sprint(dirty()); d != "[3 4 5]" {
		t.Fatalf("dirty after reopen: %s", d)
	}
	// A complete set: the first flush rotates the window, the second clears.
	if err := r.Fence(FenceOptions{Epoch: 1}); err != nil {
		t.Fatal(err)
	}
	r.Flush()
	r.Flush()
	if d := dirty(); len(d) != 0 {
		t.Fatalf("clean set, quiet regions, two flushes: still dirty %v", d)
	}
	mustWrite(t, r, []byte("y"), 9<<20)
	r.Flush() // written in the current window: kept
	if d := fmt.Sprint(dirty()); d != "[9]" {
		t.Fatalf("recently written region: %s", d)
	}
	// A revert marks everything.
	mustSnapshot(t, r, SnapshotOptions{Name: "s", UserCreated: true})
	if err := r.Revert("s"); err != nil {
		t.Fatal(err)
	}
	if n := len(dirty()); n != 16 {
		t.Fatalf("after revert %d dirty regions, want all 16", n)
	}
	r.Close()
	// A missing bitmap on an existing replica: assume everything differs.
	os.Remove(filepath.Join(dir, dirtyFileName))
	r, _ = Open(dir, Options{ClearDelay: -1})
	defer r.Close()
	if n := len(dirty()); n != 16 {
		t.Fatalf("lost bitmap: %d dirty regions, want all 16", n)
	}
}

func TestSnapshotDeleteKeepsData(t *testing.T) {
	dir := t.TempDir()
	r := open(t, dir, 1<<20)
	defer r.Close()
	mustWrite(t, r, bytes.Repeat([]byte{1}, 8192), 0)
	mustSnapshot(t, r, SnapshotOptions{Name: "a", UserCreated: true})
	mustWrite(t, r, bytes.Repeat([]byte{2}, 4096), 4096)
	mustSnapshot(t, r, SnapshotOptions{Name: "b"})
	mustWrite(t, r, bytes.Repeat([]byte{3}, 4096), 8192)
	want := append(append(bytes.Repeat([]byte{1}, 4096), bytes.Repeat([]byte{2}, 4096)...), bytes.Repeat([]byte{3}, 4096)...)
	for _, name := range []string{"a", "b"} {
		if err := r.DeleteSnapshot(name); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, len(want))
		mustRead(t, r, got, 0)
		if !bytes.Equal(got, want) {
			t.Fatalf("after deleting %s the data changed", name)
		}
	}
	in, _ := r.Info()
	if len(in.Snapshots) != 0 || in.HeadBytes != 3*4096 {
		t.Fatalf("after deleting both: %+v", in)
	}
}

// TestRebuildPrimitives copies the view at a snapshot from one replica into
// another's layer below its head (as a rebuild does) and checks both agree.
func TestRebuildPrimitives(t *testing.T) {
	src := open(t, t.TempDir(), 4<<20)
	defer src.Close()
	mustWrite(t, src, bytes.Repeat([]byte{1}, 8192), 0)
	mustSnapshot(t, src, SnapshotOptions{Name: "old", UserCreated: true})
	mustWrite(t, src, bytes.Repeat([]byte{2}, 4096), 4096)
	mustWrite(t, src, bytes.Repeat([]byte{3}, 4096), 2<<20)
	mustSnapshot(t, src, SnapshotOptions{Name: "rb"})
	mustWrite(t, src, bytes.Repeat([]byte{9}, 4096), 0) // after the rebuild point

	ext, err := src.ReadSnapshot("rb", 0, 4<<20)
	if err != nil {
		t.Fatal(err)
	}
	if len(ext) != 2 || ext[0].Offset != 0 || len(ext[0].Data) != 8192 || ext[1].Offset != 2<<20 {
		t.Fatalf("extents: %d, first at %d (%d bytes)", len(ext), ext[0].Offset, len(ext[0].Data))
	}
	dst := open(t, t.TempDir(), 4<<20)
	defer dst.Close()
	mustSnapshot(t, dst, SnapshotOptions{Name: "rb"})
	mustWrite(t, dst, bytes.Repeat([]byte{7}, 4096), 3<<20) // a new write lands in the head meanwhile
	for _, e := range ext {
		if err := dst.WriteLayer("rb", e.Data, e.Offset); err != nil {
			t.Fatal(err)
		}
	}
	a, _ := src.Checksum("rb", 0, 4<<20)
	b, _ := dst.Checksum("rb", 0, 4<<20)
	if a != b {
		t.Fatalf("checksums differ after the copy: %08x %08x", a, b)
	}
	got := make([]byte, 4096)
	mustRead(t, dst, got, 3<<20)
	if got[0] != 7 {
		t.Fatal("the copy overwrote a newer head write")
	}
	mustRead(t, dst, got, 4096)
	if got[0] != 2 {
		t.Fatal("copied data not visible through the head")
	}
	if _, err := src.ReadSnapshot("nope", 0, 4096); !errors.Is(err, ErrSnapshotNotFound) {
		t.Fatal(err)
	}
}

// TestReadExtentsInto: a view and a layer read into a caller's buffer
// give the extents ReadSnapshot and ReadLayer give, each lying in the
// buffer at its offset from the read's start, extents from two layers
// merged in place; a buffer shorter than the read is refused.
func TestReadExtentsInto(t *testing.T) {
	r := open(t, t.TempDir(), 4<<20)
	defer r.Close()
	mustWrite(t, r, bytes.Repeat([]byte{1}, 8192), 1<<20)
	mustSnapshot(t, r, SnapshotOptions{Name: "old"})
	mustWrite(t, r, bytes.Repeat([]byte{2}, 4096), 1<<20+8192) // contiguous with the older layer's
	mustWrite(t, r, bytes.Repeat([]byte{3}, 4096), 3<<20)
	mustSnapshot(t, r, SnapshotOptions{Name: "rb"})
	const off, n = 1 << 20, 3 << 20
	for _, layerOnly := range []bool{false, true} {
		want, err := r.ReadSnapshot("rb", off, n)
		if layerOnly {
			want, err = r.ReadLayer("rb", off, n)
		}
		if err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, n)
		got, err := r.ReadExtentsInto(buf, "rb", off, n, layerOnly)
		if err != nil {
			t.Fatal(err)
		}
		if len(got) != len(want) || len(got) != 2 {
			t.Fatalf("layer only %v: %d extents, ReadSnapshot/ReadLayer gives %d, want 2", layerOnly, len(got), len(want))
		}
		for i, e := range got {
			if e.Offset != want[i].Offset || !bytes.Equal(e.Data, want[i].Data) {
				t.Fatalf("layer only %v: extent %d at %d (%d bytes), want at %d (%d bytes)", layerOnly, i, e.Offset, len(e.Data), want[i].Offset, len(want[i].Data))
			}
			if at := &buf[e.Offset-off]; &e.Data[0] != at || cap(e.Data) != len(e.Data) {
				t.Fatalf("layer only %v: extent %d does not lie in the buffer at %d with its own length as capacity", layerOnly, i, e.Offset-off)
			}
		}
	}
	if got := len(mustReadInto(t, r, "rb", off, n)[0].Data); got != 3*4096 {
		t.Fatalf("the view's first extent holds %d bytes, want both layers' 12288", got)
	}
	if _, err := r.ReadExtentsInto(make([]byte, n-4096), "rb", off, n, false); !errors.Is(err, ErrInvalidSize) {
		t.Fatalf("a short buffer: %v, want ErrInvalidSize", err)
	}
	for _, layerOnly := range []bool{false, true} {
		own, err := r.ReadExtentsInto(nil, "rb", off, n, layerOnly)
		read := r.ReadSnapshot
		if layerOnly {
			read = r.ReadLayer
		}
		want, werr := read("rb", off, n)
		if err != nil || werr != nil || len(own) != len(want) {
			t.Fatalf("layer only %v, no buffer: %d extents (%v), want %d (%v)", layerOnly, len(own), err, len(want), werr)
		}
		for i := range own {
			if own[i].Offset != want[i].Offset || !bytes.Equal(own[i].Data, want[i].Data) {
				t.Fatalf("layer only %v, no buffer: extent %d differs", layerOnly, i)
			}
		}
	}
}

func mustReadInto(t *testing.T, r *Replica, name string, off, n int64) []Extent {
	t.Helper()
	ext, err := r.ReadExtentsInto(make([]byte, n), name, off, n, false)
	if err != nil {
		t.Fatal(err)
	}
	return ext
}

// TestReplaceChainThenCopyLayers empties a stale replica into the source's
// chain and copies every layer's own data, as a full rebuild does: every
// snapshot then reads the same on both, the names, times and flags match,
// the stale data and its files are gone, and it all survives a reopen.
func TestReplaceChainThenCopyLayers(t *testing.T) {
	const size = 4 << 20
	src := open(t, t.TempDir(), size)
	defer src.Close()
	mustWrite(t, src, bytes.Repeat([]byte{1}, 8192), 0)
	mustSnapshot(t, src, SnapshotOptions{Name: "daily-1", UserCreated: true})
	mustWrite(t, src, bytes.Repeat([]byte{2}, 4096), 4096)
	// A hole in the newer layer over data in the older one: zeros written there.
	if err := src.Unmap(0, 4096); err != nil {
		t.Fatal(err)
	}
	mustSnapshot(t, src, SnapshotOptions{Name: "daily-2", UserCreated: true})
	mustWrite(t, src, bytes.Repeat([]byte{3}, 4096), 2<<20)
	mustSnapshot(t, src, SnapshotOptions{Name: "rb"})
	mustWrite(t, src, bytes.Repeat([]byte{9}, 4096), 0) // after the rebuild point
	sin, _ := src.Info()

	dir := t.TempDir()
	dst := open(t, dir, size)
	mustWrite(t, dst, bytes.Repeat([]byte{7}, size), 0)                       // stale data everywhere
	mustSnapshot(t, dst, SnapshotOptions{Name: "daily-1", UserCreated: true}) // a stale snapshot of the same name
	mustWrite(t, dst, bytes.Repeat([]byte{8}, 4096), 3<<20)

	if err := dst.ReplaceChain(sin.Snapshots); !errors.Is(err, ErrNotRebuilding) {
		t.Fatalf("replacing the chain of a replica not marked rebuilding: %v", err)
	}
	if err := dst.Fence(FenceOptions{Epoch: 5, Degraded: true, Rebuilding: true}); err != nil {
		t.Fatal(err)
	}
	bad := append(append([]SnapshotInfo(nil), sin.Snapshots...), sin.Snapshots[0])
	if err := dst.ReplaceChain(bad); !errors.Is(err, ErrInvalidName) {
		t.Fatalf("a chain naming a snapshot twice: %v", err)
	}
	stale := bytes.Repeat([]byte{7}, size)
	copy(stale[3<<20:], bytes.Repeat([]byte{8}, 4096))
	if got := readAll(t, dst, size); !bytes.Equal(got, stale) {
		t.Fatal("a refused ReplaceChain changed the data")
	}
	if err := dst.ReplaceChain(sin.Snapshots); err != nil {
		t.Fatal(err)
	}
	if got := readAll(t, dst, size); !bytes.Equal(got, make([]byte, size)) {
		t.Fatal("stale data survived ReplaceChain")
	}
	mustWrite(t, dst, bytes.Repeat([]byte{6}, 4096), 3<<20) // a new write lands in the head meanwhile

	for _, s := range sin.Snapshots {
		ext, err := src.ReadLayer(s.Name, 0, size)
		if err != nil {
			t.Fatal(err)
		}
		var n int64
		for _, x := range ext {
			if err := dst.WriteLayer(s.Name, x.Data, x.Offset); err != nil {
				t.Fatal(err)
			}
			n += int64(len(x.Data))
		}
		if n != s.DataBytes {
			t.Fatalf("layer %s: read %d bytes of its own, Info says it holds %d", s.Name, n, s.DataBytes)
		}
	}
	if err := dst.SyncLayers(); err != nil {
		t.Fatal(err)
	}
	dst.Close()
	dst = open(t, dir, 0)
	defer dst.Close()
	din, _ := dst.Info()
	if len(din.Snapshots) != len(sin.Snapshots) {
		t.Fatalf("chain after the copy: %+v, want %+v", din.Snapshots, sin.Snapshots)
	}
	for i, s := range sin.Snapshots {
		d := din.Snapshots[i]
		if d.Name != s.Name || d.Parent != s.Parent || !d.Created.Equal(s.Created) || d.UserCreated != s.UserCreated || d.DataBytes != s.DataBytes {
			t.Fatalf("snapshot %d: %+v, want %+v", i, d, s)
		}
		a, _ := src.Checksum(s.Name, 0, size)
		b, _ := dst.Checksum(s.Name, 0, size)
		la, _ := src.LayerChecksum(s.Name, 0, size)
		lb, err := dst.LayerChecksum(s.Name, 0, size)
		if err != nil || a != b || la != lb {
			t.Fatalf("snapshot %s: view %08x/%08x, layer %08x/%08x, %v", s.Name, a, b, la, lb, err)
		}
	}
	if got := readAll(t, dst, size); got[3<<20] != 6 || got[4096] != 2 || got[0] != 0 || got[2<<20] != 3 {
		t.Fatalf("volume after the copy: %d %d %d %d", got[3<<20], got[4096], got[0], got[2<<20])
	}
	files, _ := filepath.Glob(filepath.Join(dir, "layer-*.img"))
	if len(files) != len(sin.Snapshots)+1 {
		t.Fatalf("%d layer files for %d snapshots and a head: old layers left behind", len(files), len(sin.Snapshots))
	}
}

// TestLayerChecksumSeesHoles: a layer holding zeros where another has a
// hole (which shows older data through) must not checksum the same.
func TestLayerChecksumSeesHoles(t *testing.T) {
	a := open(t, t.TempDir(), 1<<20)
	defer a.Close()
	b := open(t, t.TempDir(), 1<<20)
	defer b.Close()
	for _, r := range []*Replica{a, b} {
		mustWrite(t, r, bytes.Repeat([]byte{1}, 4096), 0)
		mustSnapshot(t, r, SnapshotOptions{Name: "s"})
	}
	mustWrite(t, b, make([]byte, 4096), 8192) // zeros written in b's head only
	mustSnapshot(t, a, SnapshotOptions{Name: "t"})
	mustSnapshot(t, b, SnapshotOptions{Name: "t"})
	x, _ := a.LayerChecksum("t", 0, 1<<20)
	y, _ := b.LayerChecksum("t", 0, 1<<20)
	if x == y {
		t.Fatal("a hole and written zeros checksum the same")
	}
	if _, err := a.LayerChecksum("nope", 0, 4096); !errors.Is(err, ErrSnapshotNotFound) {
		t.Fatal(err)
	}
}

func readAll(t *testing.T, r *Replica, size int64) []byte {
	t.Helper()
	p := make([]byte, size)
	if _, err := r.ReadAt(p, 0); err != nil {
		t.Fatal(err)
	}
	return p
}

// mustWrite writes p at off, failing the test if the write fails.
func mustWrite(t *testing.T, r *Replica, p []byte, off int64) {
	t.Helper()
	if _, err := r.WriteAt(p, off); err != nil {
		t.Fatal(err)
	}
}

// mustRead reads p at off, failing the test if the read fails.
func mustRead(t *testing.T, r *Replica, p []byte, off int64) {
	t.Helper()
	if _, err := r.ReadAt(p, off); err != nil {
		t.Fatal(err)
	}
}

// mustSnapshot takes a snapshot, failing the test if it fails.
func mustSnapshot(t *testing.T, r *Replica, o SnapshotOptions) {
	t.Helper()
	if err := r.Snapshot(o); err != nil {
		t.Fatal(err)
	}
}

// TestDeleteSnapshotWhileWriting deletes a snapshot in each direction
// (into the head; the head into the snapshot's layer) while writers keep
// writing and trimming: writes complete while the copy is held halfway,
// and afterwards the volume holds exactly the last write of every block,
// also after a reopen, and the older snapshot still reads as it was.
func TestDeleteSnapshotWhileWriting(t *testing.T) {
	const size = 8 << 20
	for _, tc := range []struct {
		name          string
		before, after int64 // bytes written before the snapshot, and after it before the delete
	}{
		{"into the head", 2 << 20, 6 << 20},
		{"head into the snapshot", 8 << 20, 1 << 20},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			r := open(t, dir, size)
			want := make([]byte, size)
			put := func(p []byte, off int64) {
				if _, err := r.WriteAt(p, off); err != nil {
					t.Error(err)
				}
			}
			put(bytes.Repeat([]byte{1}, 1<<20), 0)
			mustSnapshot(t, r, SnapshotOptions{Name: "old"})
			base := readAll(t, r, size)
			fill := pattern(2, int(tc.before))
			put(fill, 0)
			mustSnapshot(t, r, SnapshotOptions{Name: "s", UserCreated: true})
			fill3 := pattern(3, int(tc.after))
			put(fill3, 0)
			copy(want, fill)
			copy(want, fill3)

			// Hold the copy after its first chunk until writes to a copied
			// chunk and to one still to copy have gone through; then let
			// each further chunk wait for more writes, so writes land
			// all through the copy.
			held := make(chan struct{})
			release := make(chan struct{})
			var ops atomic.Int64
			chunks := 0
			r.afterMergeChunk = func() {
				chunks++
				if chunks == 1 {
					close(held)
					<-release
				}
				for until := deadline.After(10 * time.Second); ops.Load() < int64(chunks*60) && time.Now().Before(until); {
					time.Sleep(time.Millisecond)
				}
			}
			done := make(chan error, 1)
			go func() { done <- r.DeleteSnapshot("s") }()
			<-held
			wrote := make(chan struct{})
			go func() {
				put(bytes.Repeat([]byte{4}, 4096), 40960) // copied already
				put(bytes.Repeat([]byte{5}, 4096), 5<<20) // not yet
				close(wrote)
			}()
			select {
			case <-wrote:
			case <-time.After(deadline.Scale(20 * time.Second)):
				t.Fatal("a write waited for the whole deletion")
			}
			copy(want[40960:], bytes.Repeat([]byte{4}, 4096))
			copy(want[5<<20:], bytes.Repeat([]byte{5}, 4096))
			close(release)
			var wg sync.WaitGroup
			var mu sync.Mutex
			for w := range 4 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					rng := rand.New(rand.NewPCG(uint64(w), 9))
					for i := 0; i < 200; i++ {
						// Each writer owns the blocks b with b%4 == w.
						b := int64(rng.IntN(size/4096/4)*4 + w)
						if b == 10 || b == 5<<20/4096 {
							continue
						}
						off := b * 4096
						switch rng.IntN(4) {
						case 0:
							if err := r.Unmap(off, 4096); err != nil {
								t.Error(err)
							}
							mu.Lock()
							clear(want[off : off+4096])
							mu.Unlock()
						case 1: // a partial block
							p := pattern(int(b)*1000+i, 512)
							put(p, off+1024)
							mu.Lock()
							copy(want[off+1024:], p)
							mu.Unlock()
						default:
							p := pattern(int(b)*1000+i, 4096)
							put(p, off)
							mu.Lock()
							copy(want[off:], p)
							mu.Unlock()
						}
						ops.Add(1)
					}
				}()
			}
			wg.Wait()
			if err := <-done; err != nil {
				t.Fatal(err)
			}
			check := func(what string) {
				if got := readAll(t, r, size); !bytes.Equal(got, want) {
					for b := int64(0); b < size/4096; b++ {
						if !bytes.Equal(got[b*4096:(b+1)*4096], want[b*4096:(b+1)*4096]) {
							t.Fatalf("%s: block %d differs from the last write", what, b)
						}
					}
				}
				if sum, _ := r.Checksum("old", 0, size); sum != crc32.Checksum(base, crc32.MakeTable(crc32.Castagnoli)) {
					t.Fatalf("%s: the older snapshot changed", what)
				}
				in, _ := r.Info()
				if len(in.Snapshots) != 1 || in.Snapshots[0].Name != "old" {
					t.Fatalf("%s: snapshots %+v", what, in.Snapshots)
				}
			}
			check("after the delete")
			r.Close()
			r = open(t, dir, 0)
			defer r.Close()
			check("after a reopen")
		})
	}
}

func pattern(seed, n int) []byte {
	p := make([]byte, n)
	rng := rand.New(rand.NewPCG(uint64(seed), 5))
	for i := range p {
		p[i] = byte(rng.Uint32())
	}
	return p
}

// TestReadSnapshotAt reads the view at a snapshot into a caller's buffer,
// with buffered and direct I/O: the snapshot's data, holes as zeros over
// whatever the buffer held, none of the writes after it; and it refuses a
// missing snapshot, a misaligned range and one past the end.
func TestReadSnapshotAt(t *testing.T) {
	for _, direct := range []bool{false, true} {
		t.Run(fmt.Sprintf("direct=%v", direct), func(t *testing.T) {
			const size = 4 << 20
			r := openMode(t, t.TempDir(), size, direct)
			defer r.Close()
			want := make([]byte, size)
			write := func(p []byte, off int64) {
				mustWrite(t, r, p, off)
				copy(want[off:], p)
			}
			write(pattern(1, 8192), 0)
			mustSnapshot(t, r, SnapshotOptions{Name: "old", UserCreated: true})
			write(pattern(2, 4096), 4096)
			write(pattern(3, 3*4096), 2<<20)
			mustSnapshot(t, r, SnapshotOptions{Name: "s"})
			mustWrite(t, r, pattern(4, 4096), 0) // in the head: not in the view
			mustWrite(t, r, pattern(5, 4096), 1<<20)

			got := bytes.Repeat([]byte{0xee}, size) // holes must be cleared
			for off := int64(0); off < size; off += 1 << 20 {
				if err := r.ReadSnapshotAt(got[off:off+1<<20], "s", off); err != nil {
					t.Fatal(err)
				}
			}
			if !bytes.Equal(got, want) {
				t.Fatal("ReadSnapshotAt differs from the view at the snapshot")
			}
			for _, tc := range []struct {
				name      string
				off, n    int64
				wantError error
			}{
				{"nope", 0, 4096, ErrSnapshotNotFound},
				{"s", 512, 4096, ErrInvalidSize},
				{"s", 0, 1000, ErrInvalidSize},
				{"s", size - 4096, 8192, ErrOutOfRange},
			} {
				if err := r.ReadSnapshotAt(make([]byte, tc.n), tc.name, tc.off); !errors.Is(err, tc.wantError) {
					t.Errorf("ReadSnapshotAt(%q, %d, %d bytes) = %v, want %v", tc.name, tc.off, tc.n, err, tc.wantError)
				}
			}
		})
	}
}
