package replica

import (
	"bytes"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// TestBlockFile writes and reads a layer file, with direct I/O and
// buffered (in 16 KiB pieces), at aligned and unaligned offsets, lengths
// and memory addresses, and checks every byte against a model and against
// the file read through the page cache.
func TestBlockFile(t *testing.T) {
	for _, direct := range []bool{true, false} {
		t.Run(map[bool]string{true: "direct", false: "buffered"}[direct], func(t *testing.T) { testBlockFile(t, direct) })
	}
}

func testBlockFile(t *testing.T, direct bool) {
	path := filepath.Join(t.TempDir(), "layer")
	const size = 1 << 20
	if err := os.WriteFile(path, make([]byte, size), 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := openBlockFile(path, direct)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fl, err := unix.FcntlInt(f.Fd(), unix.F_GETFL, 0)
	if err != nil || (fl&unix.O_DIRECT != 0) != direct {
		t.Fatalf("O_DIRECT is %v, want %v (flags %#x, %v)", fl&unix.O_DIRECT != 0, direct, fl, err)
	}
	model := make([]byte, size)
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range 400 {
		off := rng.Int64N(size - 64<<10)
		n := 1 + rng.IntN(64<<10)
		if i%2 == 0 { // aligned offset and length half of the time
			off &^= BlockSize - 1
			n = (n + BlockSize - 1) &^ (BlockSize - 1)
		}
		shift := rng.IntN(3) * 512 // memory aligned, or not
		buf := make([]byte, n+shift)[shift:]
		if rng.IntN(2) == 0 {
			for j := range buf {
				buf[j] = byte(rng.Uint32())
			}
			if w, err := f.WriteAt(buf, off); err != nil || w != n {
				t.Fatalf("write %d@%d: %d, %v", n, off, w, err)
			}
			copy(model[off:], buf)
			continue
		}
		if r, err := f.ReadAt(buf, off); err != nil || r != n {
			t.Fatalf("read %d@%d: %d, %v", n, off, r, err)
		}
		if !bytes.Equal(buf, model[off:off+int64(n)]) {
			t.Fatalf("read %d@%d differs from what was written", n, off)
		}
	}
	cached, err := os.ReadFile(path)
	if err != nil || !bytes.Equal(cached, model) {
		t.Fatalf("the file read through the page cache differs from the model (%v)", err)
	}
	// A read across the end of the file returns what there is and EOF.
	tail := make([]byte, 3*BlockSize)
	if n, err := f.ReadAt(tail, size-BlockSize-100); n != BlockSize+100 || err == nil {
		t.Fatalf("read across the end: %d, %v", n, err)
	}
}
