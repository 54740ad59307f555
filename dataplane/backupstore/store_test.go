package backupstore

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/go-logr/logr/testr"

	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

const (
	imageSize = 64 << 20
	testBS    = DefaultBlockSize
	testVol   = "pvc-0a1b2c"
)

func testOptions(t *testing.T) Options {
	return Options{
		Log:           testr.New(t),
		CallTimeout:   deadline.Scale(30 * time.Second),
		LeaseDuration: deadline.Scale(2 * time.Minute),
		GCMinAge:      -1,
		RetryBackoff:  10 * time.Millisecond,
	}
}

func newStore(t *testing.T, tg Target, opts Options) *Store {
	s, err := New(tg, opts)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// image is a sparse volume image in a file and its expected bytes.
type image struct {
	f    *os.File
	data []byte
	rnd  *rand.Rand
}

// newImage makes a 64 MiB sparse file: random regions (whole blocks, part
// blocks, the volume's end), a compressible region, a block written as
// explicit zeros, a block that repeats block 0, and holes.
func newImage(t *testing.T) *image {
	f, err := os.Create(filepath.Join(t.TempDir(), "volume.img"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = f.Close() })
	if err := f.Truncate(imageSize); err != nil {
		t.Fatal(err)
	}
	img := &image{f: f, data: make([]byte, imageSize), rnd: rand.New(rand.NewChaCha8([32]byte{28}))}
	img.random(t, 0, 5<<20)
	img.random(t, 10<<20+100<<10, 1<<20)
	img.random(t, 20<<20, 3<<20)
	img.random(t, 40<<20+4096, 4096)
	img.random(t, imageSize-3<<19, 3<<19)
	img.write(t, 30<<20, make([]byte, testBS))
	img.write(t, 26<<20, bytes.Repeat([]byte("cairn compressible "), 100<<10/19))
	img.write(t, 48<<20, img.data[:testBS])
	return img
}

func (img *image) random(t *testing.T, off, n int64) {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(img.rnd.Uint32())
	}
	img.write(t, off, b)
}

func (img *image) write(t *testing.T, off int64, b []byte) {
	if _, err := img.f.WriteAt(b, off); err != nil {
		t.Fatal(err)
	}
	copy(img.data[off:], b)
}

func (img *image) snapshot() []byte { return bytes.Clone(img.data) }

// distinctBlocks counts the distinct non-zero blocks of data.
func distinctBlocks(data []byte) int {
	seen := map[Hash]bool{}
	for off := 0; off < len(data); off += testBS {
		b := data[off:min(off+testBS, len(data))]
		if !isZero(b) {
			seen[sha256.Sum256(b)] = true
		}
	}
	return len(seen)
}

// restoreAndCompare restores a backup into a new sparse file (holes, or
// zeros written over a file of 0xFF bytes) and compares every byte.
func restoreAndCompare(t *testing.T, s *Store, name string, want []byte, writeZeros bool) {
	t.Helper()
	f, err := os.Create(filepath.Join(t.TempDir(), "restore.img"))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = f.Close() }()
	if writeZeros {
		if _, err := f.Write(bytes.Repeat([]byte{0xff}, len(want))); err != nil {
			t.Fatal(err)
		}
	}
	var last, total int64
	_, err = s.Restore(testCtx(t), RestoreOptions{Volume: testVol, Name: name, Dest: f, WriteZeros: writeZeros,
		Progress: func(done, tot int64) { last, total = done, tot }})
	if err != nil {
		t.Fatalf("restore %s: %v", name, err)
	}
	if last != int64(len(want)) || total != int64(len(want)) {
		t.Errorf("restore %s: progress ended at %d of %d, want %d of %d", name, last, total, len(want), len(want))
	}
	got, err := os.ReadFile(f.Name())
	if err != nil {
		t.Fatal(err)
	}
	if len(got) < len(want) {
		got = append(got, make([]byte, len(want)-len(got))...) // a trailing hole
	}
	if !bytes.Equal(got, want) {
		for i := range want {
			if got[i] != want[i] {
				t.Fatalf("restore %s (writeZeros %v): first difference at byte %d", name, writeZeros, i)
			}
		}
	}
}

func blockObjects(t *testing.T, tg Target) map[string]Object {
	return listKeys(t, tg, blockPrefix(testVol))
}

// TestRoundTrip: a sparse image with random, compressible, repeated and
// zero regions backs up and restores byte for byte, with holes and with
// zeros written; zero blocks are not stored and a repeated block is
// stored once.
func TestRoundTrip(t *testing.T) {
	for _, k := range targetKinds() {
		t.Run(k.name, func(t *testing.T) {
			tg, _ := k.new(t)
			s := newStore(t, tg, testOptions(t))
			img := newImage(t)
			var last, total int64
			res, err := s.Backup(testCtx(t), BackupOptions{Volume: testVol, Name: "b1", Source: img.f, Size: imageSize,
				Progress: func(done, tot int64) { last, total = done, tot }})
			if err != nil {
				t.Fatal(err)
			}
			if last != imageSize || total != imageSize {
				t.Errorf("progress ended at %d of %d, want %d of %d", last, total, imageSize, imageSize)
			}
			want := distinctBlocks(img.data)
			if got := len(blockObjects(t, tg)); got != want || res.Info.NewBlocks != int64(want) {
				t.Errorf("%d block objects, backup says %d new; the image has %d distinct non-zero blocks", got, res.Info.NewBlocks, want)
			}
			if res.Info.NewBytes >= int64(want)*testBS {
				t.Errorf("stored %d bytes for %d blocks: the compressible block did not compress", res.Info.NewBytes, want)
			}
			list, err := s.List(testCtx(t), testVol)
			if err != nil || len(list) != 1 || list[0].Name != "b1" || list[0].Size != imageSize {
				t.Fatalf("List = %+v, %v; want b1", list, err)
			}
			restoreAndCompare(t, s, "b1", img.data, false)
			restoreAndCompare(t, s, "b1", img.data, true)
			if _, err := s.Backup(testCtx(t), BackupOptions{Volume: testVol, Name: "b1", Source: img.f, Size: imageSize}); !errors.Is(err, ErrBackupExists) {
				t.Errorf("second backup named b1: %v, want ErrBackupExists", err)
			}
		})
	}
}

// TestIncremental: after a few ranges change, a backup with the parent
// and the changed ranges uploads only the blocks whose content is new, and
// each backup restores to the image as it was at its time.
func TestIncremental(t *testing.T) {
	for _, k := range targetKinds() {
		t.Run(k.name, func(t *testing.T) {
			tg, _ := k.new(t)
			ct := &countingTarget{Target: tg}
			s := newStore(t, ct, testOptions(t))
			img := newImage(t)
			if _, err := s.Backup(testCtx(t), BackupOptions{Volume: testVol, Name: "full", Source: img.f, Size: imageSize}); err != nil {
				t.Fatal(err)
			}
			before := img.snapshot()
			ct.reset()
			changed := []Range{
				{Offset: 3<<20 + 17, Length: 100},  // inside block 1: new content
				{Offset: 16<<20 - 10, Length: 20},  // across blocks 7 and 8 (a hole before): 2 new blocks
				{Offset: 20 << 20, Length: testBS}, // block 10 zeroed: nothing to upload
				{Offset: 48 << 20, Length: 4096},   // block 24, a copy of block 0 before: rewritten with block 0's bytes
			}
			img.random(t, changed[0].Offset, changed[0].Length)
			img.random(t, changed[1].Offset, changed[1].Length)
			img.write(t, changed[2].Offset, make([]byte, testBS))
			img.write(t, changed[3].Offset, img.data[:4096])
			var total int64
			res, err := s.Backup(testCtx(t), BackupOptions{Volume: testVol, Name: "incr", Parent: "full", Source: img.f, Size: imageSize,
				Changed: changed, Progress: func(_, tot int64) { total = tot }})
			if err != nil {
				t.Fatal(err)
			}
			// Blocks 1, 7, 8 are new; block 24 equals block 0, which the
			// parent references; block 10 is zero now.
			if got := ct.puts.Load(); got != 3 || res.Info.NewBlocks != 3 {
				t.Errorf("incremental backup put %d blocks (%d bytes), says %d new; want 3", got, ct.bytes.Load(), res.Info.NewBlocks)
			}
			if res.Info.NewBytes != ct.bytes.Load() || res.Info.NewBytes > 3*maxBlockObject(testBS) {
				t.Errorf("incremental backup says %d bytes new, %d were put", res.Info.NewBytes, ct.bytes.Load())
			}
			if res.ReadBytes != 5*testBS || total != 5*testBS {
				t.Errorf("incremental backup read %d bytes (progress total %d), want the 5 changed blocks: %d", res.ReadBytes, total, 5*testBS)
			}
			restoreAndCompare(t, s, "full", before, false)
			restoreAndCompare(t, s, "incr", img.data, false)
			list, err := s.List(testCtx(t), testVol)
			if err != nil || len(list) != 2 || list[0].Name != "full" || list[1].Name != "incr" || list[1].Parent != "full" {
				t.Errorf("List = %+v, %v; want full, incr", list, err)
			}
		})
	}
}

// TestCorruptBlock: a byte flipped in a stored block fails the restore with
// a BlockError naming that block (key, hash and offset).
func TestCorruptBlock(t *testing.T) {
	for _, k := range targetKinds() {
		t.Run(k.name, func(t *testing.T) {
			tg, _ := k.new(t)
			s := newStore(t, tg, testOptions(t))
			img := newImage(t)
			if _, err := s.Backup(testCtx(t), BackupOptions{Volume: testVol, Name: "b1", Source: img.f, Size: imageSize}); err != nil {
				t.Fatal(err)
			}
			// Block 10 (offset 20 MiB) is random, so stored as it is.
			h := Hash(sha256.Sum256(img.data[20<<20 : 22<<20]))
			key := blockKey(testVol, h)
			rc, err := tg.Get(testCtx(t), key)
			if err != nil {
				t.Fatal(err)
			}
			obj, err := readLimited(rc, maxBlockObject(testBS))
			_ = rc.Close()
			if err != nil {
				t.Fatal(err)
			}
			obj[len(obj)/2] ^= 0x01
			if err := tg.Put(testCtx(t), key, obj); err != nil {
				t.Fatal(err)
			}
			_, err = s.Restore(testCtx(t), RestoreOptions{Volume: testVol, Name: "b1", Dest: &discard{}})
			var be *BlockError
			if !errors.As(err, &be) || !errors.Is(err, ErrCorrupt) {
				t.Fatalf("restore of a corrupt block: %v, want a BlockError wrapping ErrCorrupt", err)
			}
			if be.Key != key || be.Hash != h || be.Offset != 20<<20 {
				t.Errorf("BlockError names %s at %d, want %s at %d", be.Key, be.Offset, key, 20<<20)
			}
		})
	}
}

type discard struct{}

func (discard) WriteAt(p []byte, _ int64) (int, error) { return len(p), nil }
