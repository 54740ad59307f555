package rawio

import (
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"unsafe"
)

// rawWrites counts File writes in progress as raw calls, process-wide.
var rawWrites atomic.Int32

// rawLimit caches GOMAXPROCS-1 (runtime.GOMAXPROCS takes the scheduler's
// global lock); it is read again every refreshEvery writes, since
// GOMAXPROCS can change while the process runs.
var (
	rawLimit    atomic.Int32
	limitChecks atomic.Uint32
)

const refreshEvery = 1024

func init() { refreshLimit() }

func refreshLimit() { rawLimit.Store(int32(runtime.GOMAXPROCS(0) - 1)) }

// File writes a regular file with raw pwrite calls when it may (see the
// package comment), and through os.File otherwise. It is meant for
// buffered writes (a file opened with O_DIRECT waits for the device on
// every write: use os.File). Safe for concurrent use.
type File struct {
	f  *os.File
	rc syscall.RawConn
}

// NewFile returns a File writing to f, which stays the caller's to close.
func NewFile(f *os.File) (*File, error) {
	rc, err := f.SyscallConn()
	if err != nil {
		return nil, err
	}
	return &File{f: f, rc: rc}, nil
}

// WriteAt writes all of p at off, like os.File.WriteAt.
func (w *File) WriteAt(p []byte, off int64) (int, error) {
	if len(p) == 0 || off < 0 || !acquireRaw() {
		return w.f.WriteAt(p, off)
	}
	defer rawWrites.Add(-1)
	pw := pwrites.Get().(*pwrite)
	defer pwrites.Put(pw)
	done := 0
	for done < len(p) {
		pw.p, pw.off, pw.n, pw.errno = p[done:], off+int64(done), 0, 0
		// Control holds a reference on the descriptor for the call, so a
		// concurrent Close cannot free (and a later open reuse) its number.
		cerr := w.rc.Control(pw.fn)
		pw.p = nil
		if cerr != nil {
			// The file is closed: os.File says so in its own words.
			n, err := w.f.WriteAt(p[done:], off+int64(done))
			return done + n, err
		}
		err := error(nil)
		if pw.errno != 0 {
			err = pw.errno
		} else if pw.n == 0 {
			err = syscall.EIO // pwrite wrote nothing and said nothing: do not spin
		}
		if err != nil {
			return done, &os.PathError{Op: "write", Path: w.f.Name(), Err: err}
		}
		done += pw.n
	}
	return done, nil
}

// acquireRaw counts a raw write in if fewer than GOMAXPROCS-1 are in
// progress; the caller then decrements rawWrites when done. The count is
// taken with compare-and-swap, so it never exceeds the limit even for a
// moment (an add-then-undo would let a reader see one too many).
func acquireRaw() bool {
	if limitChecks.Add(1)%refreshEvery == 0 {
		refreshLimit()
	}
	limit := rawLimit.Load()
	for {
		n := rawWrites.Load()
		if n >= limit {
			return false
		}
		if rawWrites.CompareAndSwap(n, n+1) {
			return true
		}
	}
}

// pwrite is one raw pwrite's arguments and results, with the function
// RawConn.Control runs built once (a closure made per call would be
// allocated per call).
type pwrite struct {
	p     []byte
	off   int64
	n     int
	errno syscall.Errno
	fn    func(fd uintptr)
}

var pwrites = sync.Pool{New: func() any {
	pw := &pwrite{}
	pw.fn = pw.do
	return pw
}}

func (pw *pwrite) do(fd uintptr) {
	pw.n, pw.errno = rawCall(syscall.SYS_PWRITE64, fd, unsafe.Pointer(&pw.p[0]), uintptr(len(pw.p)), uintptr(pw.off))
}
