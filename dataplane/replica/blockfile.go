package replica

import (
	"errors"
	"io"
	"os"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/cairn-io/cairn/dataplane/internal/rawio"
	"github.com/cairn-io/cairn/dataplane/internal/uring"
)

// blockFile is a layer file. Opened for direct I/O (O_DIRECT, Options.
// DirectIO), reads and writes bypass the page cache, which needs offsets,
// lengths and memory aligned to the block size: aligned requests go
// straight to the file, the others through an aligned bounce buffer
// allocated for the request (a partial block is read, patched and written
// whole; the engine sends writes in whole aligned blocks, so this is the
// rare path). Callers already
// serialize writes to the same block (writePartial's block locks, the
// engine's range locks), so the read-patch-write cannot lose an update.
//
// Direct reads and writes go through the process's io_uring when there is
// one (see package uring: a direct pread or pwrite blocks in the kernel,
// and the Go runtime pays two thread wake-ups for each).
type blockFile struct {
	*os.File
	direct bool
	raw    *rawio.File // buffered writes: raw pwrite calls (see rawio)
	ring   *uring.File // direct I/O through io_uring; nil: plain system calls
}

// alignment is what O_DIRECT needs on any device we expect (4 KiB logical
// blocks at most).
const alignment = BlockSize

func openBlockFile(path string, direct bool) (*blockFile, error) {
	flags := os.O_RDWR
	if direct {
		flags |= syscall.O_DIRECT
	}
	f, err := os.OpenFile(path, flags, 0)
	if err != nil {
		return nil, err
	}
	if !direct {
		// No readahead: it fills the page cache with large folios, which
		// make later small writes there slow (see bufferedWriteChunk;
		// random 4 KiB writes after a sequential read of 1 GiB: 27-30k/s
		// with readahead, 350-430k/s without). The engine's clients read
		// ahead themselves (a block device's readahead on /dev/nbdN), and
		// rebuild reads in large pieces. An error only loses the hint.
		_ = unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_RANDOM)
	}
	bf := &blockFile{File: f, direct: direct}
	if !direct {
		if bf.raw, err = rawio.NewFile(f); err != nil {
			f.Close()
			return nil, err
		}
	} else if r, rerr := uring.Shared(); rerr == nil {
		if bf.ring, err = r.NewFile(f); err != nil {
			f.Close()
			return nil, err
		}
	}
	return bf, nil
}

// startWriteback starts writing [off, off+n) of a buffered file to its
// disk and returns without waiting (sync_file_range, WRITE only). A bulk
// writer that ends with a sync (a rebuild's layers, SyncLayers) calls it
// as it goes, so the disk works while the copy goes on and the sync at
// the end has little left to write; the dirty-page thresholds are far
// above a volume's size on a node with memory, so the kernel would not
// start before that sync. An error only loses the head start. Direct I/O
// has nothing to write back.
func (f *blockFile) startWriteback(off, n int64) {
	if !f.direct && n > 0 {
		_ = unix.SyncFileRange(int(f.Fd()), off, n, unix.SYNC_FILE_RANGE_WRITE)
	}
}

// DirectIOPath says how a replica opened with Options.DirectIO reads and
// writes: through io_uring, or with plain system calls and why.
func DirectIOPath() string {
	if _, err := uring.Shared(); err != nil {
		return "plain system calls (" + err.Error() + ")"
	}
	return "io_uring"
}

// readDirect and writeDirect move aligned blocks of a direct file.
func (f *blockFile) readDirect(p []byte, off int64) (int, error) {
	if f.ring != nil {
		return f.ring.ReadAt(p, off)
	}
	return f.File.ReadAt(p, off)
}

func (f *blockFile) writeDirect(p []byte, off int64) (int, error) {
	if f.ring != nil {
		return f.ring.WriteAt(p, off)
	}
	return f.File.WriteAt(p, off)
}

func aligned(p []byte, off int64) bool {
	return off%alignment == 0 && len(p)%alignment == 0 &&
		(len(p) == 0 || uintptr(unsafe.Pointer(unsafe.SliceData(p)))%alignment == 0)
}

// alignedBuf allocates n bytes (a multiple of the alignment) at an aligned
// address.
func alignedBuf(n int) []byte {
	raw := make([]byte, n+alignment)
	skip := 0
	if r := uintptr(unsafe.Pointer(unsafe.SliceData(raw))) % alignment; r != 0 {
		skip = int(alignment - r)
	}
	return raw[skip : skip+n : skip+n]
}

// span is the block-aligned range covering n bytes at off.
func span(off int64, n int) (lo, hi int64) {
	lo = off &^ (alignment - 1)
	hi = (off + int64(n) + alignment - 1) &^ (alignment - 1)
	return lo, hi
}

func (f *blockFile) ReadAt(p []byte, off int64) (int, error) {
	if !f.direct {
		return f.File.ReadAt(p, off)
	}
	if aligned(p, off) {
		return f.readDirect(p, off)
	}
	lo, hi := span(off, len(p))
	buf := alignedBuf(int(hi - lo))
	n, err := f.readDirect(buf, lo)
	if err != nil && !errors.Is(err, io.EOF) {
		return 0, err
	}
	// What the caller asked for, of what the file had.
	got := max(0, min(int64(len(p)), int64(n)-(off-lo)))
	copy(p, buf[off-lo:off-lo+got])
	if got < int64(len(p)) {
		return int(got), io.EOF
	}
	return len(p), nil
}

// bufferedWriteChunk bounds one buffered pwrite. The kernel sizes the
// page-cache folios a write creates by the write's length, and on kernels
// with large folios for ext4 (6.x) a later 4 KiB write into a folio made by
// a 1 MiB write costs about ten times more (18-21 µs against 1.8 µs per
// pwrite here): every random overwrite of data written sequentially pays
// that. Writing in 16 KiB pieces keeps folios small; it costs a few more
// syscalls on large writes (sequential writes within noise in make bench,
// random writes after them +40 to +65 %, see docs/performance.md).
const bufferedWriteChunk = 16 << 10

func (f *blockFile) WriteAt(p []byte, off int64) (int, error) {
	if !f.direct {
		done := 0
		for done < len(p) {
			n := min(len(p)-done, bufferedWriteChunk)
			if _, err := f.raw.WriteAt(p[done:done+n], off+int64(done)); err != nil {
				return done, err
			}
			done += n
		}
		return done, nil
	}
	if aligned(p, off) {
		return f.writeDirect(p, off)
	}
	lo, hi := span(off, len(p))
	buf := alignedBuf(int(hi - lo))
	if lo != off || hi != off+int64(len(p)) {
		// Partial blocks at the edges: keep the bytes around p.
		clear(buf)
		if _, err := f.readDirect(buf, lo); err != nil && !errors.Is(err, io.EOF) {
			return 0, err
		}
	}
	copy(buf[off-lo:], p)
	if _, err := f.writeDirect(buf, lo); err != nil {
		return 0, err
	}
	return len(p), nil
}
