package rawio

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"runtime"
	"sync"
	"syscall"
	"testing"
)

func openFile(t *testing.T, flag int) (*os.File, *File) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(path, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(path, flag, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	w, err := NewFile(f)
	if err != nil {
		t.Fatal(err)
	}
	return f, w
}

func TestFileWritesRawAndThroughOSFile(t *testing.T) {
	if runtime.GOMAXPROCS(0) < 2 {
		t.Skip("raw writes need GOMAXPROCS >= 2")
	}
	for _, raw := range []bool{true, false} {
		f, w := openFile(t, os.O_RDWR)
		if !raw {
			// Every raw slot taken: WriteAt must go through os.File.
			rawWrites.Add(1 << 20)
		}
		want := make([]byte, 300000)
		for i, c := range []struct{ off, n int }{{0, 4096}, {100000, 70000}, {5, 3}, {290000, 10000}} {
			p := bytes.Repeat([]byte{byte(i + 1)}, c.n)
			copy(want[c.off:], p)
			if n, err := w.WriteAt(p, int64(c.off)); n != c.n || err != nil {
				t.Fatalf("raw=%v: WriteAt(%d bytes at %d) = %d, %v", raw, c.n, c.off, n, err)
			}
		}
		if !raw {
			rawWrites.Add(-1 << 20)
		}
		if got := rawWrites.Load(); got != 0 {
			t.Fatalf("raw=%v: %d raw writes still counted", raw, got)
		}
		got, err := os.ReadFile(f.Name())
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want) {
			t.Fatalf("raw=%v: file content differs from what was written", raw)
		}
	}
}

// Concurrent writers never hold more than GOMAXPROCS-1 raw slots, and
// all their data lands.
func TestFileConcurrentWrites(t *testing.T) {
	f, w := openFile(t, os.O_RDWR)
	const writers, each = 8, 64 << 10
	var wg sync.WaitGroup
	errs := make(chan error, writers)
	for i := range writers {
		wg.Go(func() {
			p := bytes.Repeat([]byte{byte(i + 1)}, each)
			for k := range 50 {
				if n := rawWrites.Load(); n > int32(max(runtime.GOMAXPROCS(0)-1, 0)) {
					errs <- errors.New("more raw writes in progress than GOMAXPROCS-1")
					return
				}
				if _, err := w.WriteAt(p[:each/50*(k%50+1)%each+1], int64(i*each)); err != nil {
					errs <- err
					return
				}
			}
			if _, err := w.WriteAt(p, int64(i*each)); err != nil {
				errs <- err
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	got, err := os.ReadFile(f.Name())
	if err != nil {
		t.Fatal(err)
	}
	for i := range writers {
		if !bytes.Equal(got[i*each:(i+1)*each], bytes.Repeat([]byte{byte(i + 1)}, each)) {
			t.Fatalf("writer %d's range is wrong", i)
		}
	}
	if n := rawWrites.Load(); n != 0 {
		t.Fatalf("%d raw writes still counted", n)
	}
}

func TestFileWriteErrors(t *testing.T) {
	if runtime.GOMAXPROCS(0) < 2 {
		t.Skip("raw writes need GOMAXPROCS >= 2")
	}
	ro, w := openFile(t, os.O_RDONLY)
	_, err := w.WriteAt([]byte("x"), 0)
	var pe *os.PathError
	if !errors.As(err, &pe) || pe.Path != ro.Name() || !errors.Is(err, syscall.EBADF) {
		t.Fatalf("raw WriteAt on a read-only file = %v, want a PathError with EBADF", err)
	}
	_, w = openFile(t, os.O_RDWR)
	if _, err := w.WriteAt([]byte("x"), -1); err == nil {
		t.Fatal("WriteAt at a negative offset succeeded")
	}
	f, w := openFile(t, os.O_RDWR)
	f.Close()
	if _, err := w.WriteAt([]byte("x"), 0); !errors.Is(err, os.ErrClosed) {
		t.Fatalf("WriteAt on a closed file = %v, want os.ErrClosed", err)
	}
	if n := rawWrites.Load(); n != 0 {
		t.Fatalf("%d raw writes still counted after errors", n)
	}
}

// TestNoRawWritesWithOneP: within refreshEvery writes of GOMAXPROCS
// dropping to 1, no write is raw any more.
func TestNoRawWritesWithOneP(t *testing.T) {
	prev := runtime.GOMAXPROCS(1)
	defer func() {
		runtime.GOMAXPROCS(prev)
		refreshLimit()
	}()
	for range refreshEvery {
		if acquireRaw() {
			rawWrites.Add(-1)
		}
	}
	if acquireRaw() {
		rawWrites.Add(-1)
		t.Fatal("a raw write was allowed with GOMAXPROCS=1: it would hold the only P")
	}
	if n := rawWrites.Load(); n != 0 {
		t.Fatalf("rawWrites = %d after a refused acquire", n)
	}
}
