package replica

import (
	"bytes"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/cairn-io/cairn/dataplane/internal/uring"
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
	if _, uerr := uring.Shared(); direct && uerr == nil && f.ring == nil {
		t.Fatal("a direct file is read and written with plain system calls though the process has an io_uring")
	} else if direct {
		t.Logf("direct I/O through %s", DirectIOPath())
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

// TestBlockFileNoReadahead checks that a buffered layer file is read
// without readahead: after a 4 KiB read of data not in the page cache, only
// that page is cached (mincore), where the kernel's readahead would have
// cached tens of pages after it.
func TestBlockFileNoReadahead(t *testing.T) {
	const size = 8 << 20
	path := filepath.Join(t.TempDir(), "layer")
	if err := os.WriteFile(path, bytes.Repeat([]byte{7}, size), 0o600); err != nil {
		t.Fatal(err)
	}
	resident := func(f *os.File) int {
		m, err := unix.Mmap(int(f.Fd()), 0, size, unix.PROT_READ, unix.MAP_SHARED)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = unix.Munmap(m) }()
		vec := make([]byte, size/os.Getpagesize())
		if _, _, e := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&m[0])), uintptr(len(m)), uintptr(unsafe.Pointer(&vec[0]))); e != 0 {
			t.Fatal(e)
		}
		n := 0
		for _, v := range vec {
			n += int(v & 1)
		}
		return n
	}
	for _, tc := range []struct {
		name      string
		open      func() (*os.File, func(p []byte, off int64) (int, error))
		readahead bool
	}{
		{"plain file (control: the kernel reads ahead)", func() (*os.File, func([]byte, int64) (int, error)) {
			f, err := os.Open(path)
			if err != nil {
				t.Fatal(err)
			}
			return f, f.ReadAt
		}, true},
		{"blockFile", func() (*os.File, func([]byte, int64) (int, error)) {
			f, err := openBlockFile(path, false)
			if err != nil {
				t.Fatal(err)
			}
			return f.File, f.ReadAt
		}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f, read := tc.open()
			defer f.Close()
			// Drop the file's clean pages from the page cache.
			if err := unix.Fdatasync(int(f.Fd())); err != nil {
				t.Fatal(err)
			}
			if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED); err != nil {
				t.Fatal(err)
			}
			if n := resident(f); n != 0 {
				t.Skipf("%d pages still cached after FADV_DONTNEED; cannot tell readahead here", n)
			}
			if _, err := read(make([]byte, 4096), 0); err != nil { // a read at 0 starts readahead
				t.Fatal(err)
			}
			n := resident(f)
			if tc.readahead && n <= 1 {
				t.Skipf("the kernel read ahead nothing for a plain file (%d pages); cannot tell readahead here", n)
			}
			if !tc.readahead && n != 1 {
				t.Fatalf("%d pages cached after a 4 KiB read, want 1 (no readahead)", n)
			}
			t.Logf("%d pages cached after a 4 KiB read", n)
		})
	}
}
