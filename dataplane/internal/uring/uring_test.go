package uring

import (
	"bytes"
	"errors"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"
	"unsafe"
)

const block = 4096

// alignedBuf returns n bytes at a block-aligned address (O_DIRECT).
func alignedBuf(n int) []byte {
	raw := make([]byte, n+block)
	skip := (block - int(uintptr(unsafe.Pointer(&raw[0]))%block)) % block
	return raw[skip : skip+n : skip+n]
}

func ring(t *testing.T) *Ring {
	t.Helper()
	r, err := Shared()
	if err != nil {
		t.Skipf("no io_uring here: %v", err)
	}
	return r
}

func directFile(t *testing.T, size int64) *os.File {
	t.Helper()
	f, err := os.OpenFile(filepath.Join(t.TempDir(), "f"), os.O_RDWR|os.O_CREATE|syscall.O_DIRECT, 0o600)
	if err != nil {
		t.Skipf("O_DIRECT not supported here: %v", err)
	}
	t.Cleanup(func() { f.Close() })
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	return f
}

// TestConcurrentAgainstModel: many goroutines write and read random
// blocks of one O_DIRECT file through the ring at once (more than the
// ring holds, so some wait for a slot); every read returns what the model
// says, and the file read back with plain system calls matches the model.
func TestConcurrentAgainstModel(t *testing.T) {
	r := ring(t)
	const blocks = 512
	f := directFile(t, blocks*block)
	uf, err := r.NewFile(f)
	if err != nil {
		t.Fatal(err)
	}
	model := make([]byte, blocks*block)
	var locks [blocks]sync.Mutex // one writer or reader per block at a time, as the replica's callers guarantee
	var wg sync.WaitGroup
	errs := make(chan error, 1)
	fail := func(err error) {
		select {
		case errs <- err:
		default:
		}
	}
	requests, enters := r.requests.Load(), r.enters.Load()
	for g := range 2 * Entries {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(g), 7))
			buf := alignedBuf(2 * block)
			for range 40 {
				b := rng.IntN(blocks - 1)
				n := 1 + rng.IntN(2)
				for i := b; i < b+n; i++ {
					locks[i].Lock()
				}
				p := buf[:n*block]
				if rng.IntN(2) == 0 {
					for i := range p {
						p[i] = byte(rng.Uint32())
					}
					if w, err := uf.WriteAt(p, int64(b)*block); err != nil || w != len(p) {
						fail(errors.Join(err, io.ErrShortWrite))
					}
					copy(model[b*block:], p)
				} else if rd, err := uf.ReadAt(p, int64(b)*block); err != nil || rd != len(p) || !bytes.Equal(p, model[b*block:b*block+len(p)]) {
					fail(errors.Join(err, errors.New("a read differs from the model")))
				}
				for i := b; i < b+n; i++ {
					locks[i].Unlock()
				}
			}
		}()
	}
	wg.Wait()
	select {
	case err := <-errs:
		t.Fatal(err)
	default:
	}
	requests, enters = r.requests.Load()-requests, r.enters.Load()-enters
	t.Logf("%d requests, %d io_uring_enter calls", requests, enters)
	if enters >= requests {
		t.Errorf("%d requests from %d goroutines took %d io_uring_enter calls: submissions were not combined", requests, 2*Entries, enters)
	}
	all := alignedBuf(blocks * block)
	if _, err := f.ReadAt(all, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(all, model) {
		t.Fatal("the file differs from the model")
	}
}

// TestErrorsAndEOF: a read past the end returns what there is and io.EOF,
// a misaligned O_DIRECT request the kernel's EINVAL, and a write to a
// file opened read-only EBADF; the ring goes on working after each. Once
// as the requests go when alone (blocking calls), once through the ring.
func TestErrorsAndEOF(t *testing.T) {
	shared := ring(t)
	t.Run("alone", func(t *testing.T) { testErrorsAndEOF(t, shared) })
	r, err := New()
	if err != nil {
		t.Fatal(err)
	}
	r.ringOnly = true
	t.Run("ring", func(t *testing.T) {
		testErrorsAndEOF(t, r)
		if r.requests.Load() == 0 {
			t.Fatal("nothing went through the ring")
		}
	})
}

func testErrorsAndEOF(t *testing.T, r *Ring) {
	f := directFile(t, 2*block)
	uf, err := r.NewFile(f)
	if err != nil {
		t.Fatal(err)
	}
	p := alignedBuf(4 * block)
	if n, err := uf.ReadAt(p, block); n != block || !errors.Is(err, io.EOF) {
		t.Fatalf("read across the end: %d, %v", n, err)
	}
	if _, err := uf.WriteAt(p[1:block+1], 0); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("misaligned direct write: %v, want EINVAL", err)
	}
	ro, err := os.OpenFile(f.Name(), os.O_RDONLY|syscall.O_DIRECT, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer ro.Close()
	urf, _ := r.NewFile(ro)
	if _, err := urf.WriteAt(p[:block], 0); !errors.Is(err, syscall.EBADF) {
		t.Fatalf("write to a read-only file: %v, want EBADF", err)
	}
	if _, err := uf.ReadAt(p[:block], -1); err == nil {
		t.Fatal("a read at a negative offset succeeded")
	}
	if _, err := uf.WriteAt(p[:block], -block); err == nil {
		t.Fatal("a write at a negative offset succeeded")
	}
	copy(p, bytes.Repeat([]byte{0xa5}, block))
	if n, err := uf.WriteAt(p[:block], block); n != block || err != nil {
		t.Fatalf("write after the errors: %d, %v", n, err)
	}
	q := alignedBuf(block)
	if n, err := urf.ReadAt(q, block); n != block || err != nil || !bytes.Equal(q, p[:block]) {
		t.Fatalf("read after the errors: %d, %v", n, err)
	}
}

// TestClosedFile: a request on a closed file fails with the os package's
// error and queues nothing.
func TestClosedFile(t *testing.T) {
	shared := ring(t)
	only, err := New()
	if err != nil {
		t.Fatal(err)
	}
	only.ringOnly = true
	for _, r := range []*Ring{shared, only} {
		f := directFile(t, block)
		uf, err := r.NewFile(f)
		if err != nil {
			t.Fatal(err)
		}
		f.Close()
		if _, err := uf.ReadAt(alignedBuf(block), 0); !errors.Is(err, os.ErrClosed) {
			t.Fatalf("read of a closed file (ring only %v): %v", r.ringOnly, err)
		}
	}
}

// BenchmarkDirect4K compares 4 KiB random O_DIRECT I/O at queue depth 32
// through the ring (and through one whose requests each enter the kernel
// themselves) with plain pread/pwrite from as many goroutines, on the
// same file in the same run. Besides ns/op it reports the process's
// CPU time per I/O (cpu-µs/op), the figure the ring is meant to cut.
func BenchmarkDirect4K(b *testing.B) {
	r, err := Shared()
	if err != nil {
		b.Skipf("no io_uring here: %v", err)
	}
	const size = 256 << 20
	f, err := os.OpenFile(filepath.Join(b.TempDir(), "f"), os.O_RDWR|os.O_CREATE|syscall.O_DIRECT, 0o600)
	if err != nil {
		b.Skipf("O_DIRECT not supported here: %v", err)
	}
	defer f.Close()
	fill := alignedBuf(1 << 20)
	for off := int64(0); off < size; off += int64(len(fill)) {
		if _, err := f.WriteAt(fill, off); err != nil {
			b.Fatal(err)
		}
	}
	uf, _ := r.NewFile(f)
	// The same without combined submission: every request enters itself.
	single, err := New()
	if err != nil {
		b.Fatal(err)
	}
	single.oneByOne = true
	sf, _ := single.NewFile(f)
	type rw func(p []byte, off int64) (int, error)
	for _, c := range []struct {
		name string
		fn   rw
	}{{"ring/write", uf.WriteAt}, {"ring-unbatched/write", sf.WriteAt}, {"pwrite", f.WriteAt},
		{"ring/read", uf.ReadAt}, {"ring-unbatched/read", sf.ReadAt}, {"pread", f.ReadAt}} {
		b.Run(c.name, func(b *testing.B) {
			var ru0, ru1 syscall.Rusage
			if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru0); err != nil {
				b.Fatal(err)
			}
			b.SetParallelism(32)
			b.RunParallel(func(pb *testing.PB) {
				p := alignedBuf(block)
				rng := rand.New(rand.NewPCG(rand.Uint64(), 1))
				for pb.Next() {
					if _, err := c.fn(p, rng.Int64N(size/block)*block); err != nil {
						b.Error(err)
						return
					}
				}
			})
			if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru1); err != nil {
				b.Fatal(err)
			}
			cpu := time.Duration(syscall.TimevalToNsec(ru1.Utime)-syscall.TimevalToNsec(ru0.Utime)) +
				time.Duration(syscall.TimevalToNsec(ru1.Stime)-syscall.TimevalToNsec(ru0.Stime))
			b.ReportMetric(float64(cpu.Microseconds())/float64(b.N), "cpu-µs/op")
		})
	}
}
