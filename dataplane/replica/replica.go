// Package replica stores one copy of a volume's data: a sparse head file on
// top of a chain of immutable snapshot files, with atomically replaced
// metadata, a staleness epoch and a write-intent bitmap. It is a library:
// it does no networking; dataconn and gRPC servers wrap it (cairn-data
// replica). docs/replica-format.md describes the on-disk format.
package replica

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"golang.org/x/sys/unix"
)

// Errors. Callers test them with errors.Is.
var (
	ErrStaleEpoch       = errors.New("stale epoch")
	ErrOutOfRange       = errors.New("out of range")
	ErrClosed           = errors.New("replica closed")
	ErrCorrupt          = errors.New("replica metadata is damaged")
	ErrNotReplica       = errors.New("not a replica directory")
	ErrSizeMismatch     = errors.New("size does not match the existing replica")
	ErrInvalidSize      = errors.New("invalid size")
	ErrSnapshotExists   = errors.New("snapshot already exists")
	ErrSnapshotNotFound = errors.New("snapshot not found")
	ErrInvalidName      = errors.New("invalid snapshot name")
	ErrNotRebuilding    = errors.New("replica is not marked rebuilding")
)

// Options configure Open. Zero values take the defaults.
type Options struct {
	// Size is the volume size in bytes, a multiple of 4096. Required to
	// create a replica; when opening an existing one it must be 0 or equal
	// to the stored size.
	Size int64
	// RegionSize is the write-intent bitmap's granularity for a new
	// replica. Default DefaultRegionSize.
	RegionSize int64
	// ClearDelay: see DefaultClearDelay. Negative means 0.
	ClearDelay time.Duration
	// Logger receives life-cycle events. Default: discard.
	Logger logr.Logger
	// DirectIO opens the layer files with O_DIRECT: data bypasses this
	// node's page cache (the filesystem on the volume caches it already)
	// and every write reaches the device before it is acknowledged, as
	// for a raw disk opened with O_DIRECT. Flush still makes the device
	// cache durable. It can be switched between opens.
	DirectIO bool
}

type layer struct {
	name string // snapshot name; "" for the head
	file string
	f    *blockFile
	idx  *blockIndex
}

// Replica is one replica directory opened for I/O. I/O methods are safe for
// concurrent use; snapshot, revert and expand wait for I/O in progress.
type Replica struct {
	dir    string
	log    logr.Logger
	direct bool // layer files opened with O_DIRECT

	// chainMu is held by every change to the chain (snapshot, delete,
	// revert, expand, replace) for its whole duration: a deletion copies
	// data without holding mu exclusively.
	chainMu sync.Mutex
	// mu: I/O holds it shared; changes to the chain, size and metadata hold
	// it exclusively.
	mu sync.RWMutex
	// merge is set while a snapshot deletion copies data (changed with mu
	// held exclusively); writes then go through fence.
	merge *mergeState
	// afterMergeChunk, if set (tests), runs between a deletion's chunks.
	afterMergeChunk func()
	meta            metadata
	layers          []*layer // snapshots oldest first, then the head
	closed          bool

	epoch atomic.Uint64
	size  atomic.Int64
	dirty *dirtyMap
	rmw   [64]sync.Mutex // read-modify-write of partial blocks, striped by block
	// sums answers a rebuild's checksum of a chunk it just read.
	sums sumCache
}

// Open opens the replica in dir, creating it (and dir) when dir holds no
// replica and opts.Size is set.
func Open(dir string, opts Options) (*Replica, error) {
	if opts.RegionSize <= 0 {
		opts.RegionSize = DefaultRegionSize
	}
	if opts.ClearDelay == 0 {
		opts.ClearDelay = DefaultClearDelay
	} else if opts.ClearDelay < 0 {
		opts.ClearDelay = 0
	}
	if opts.Size < 0 || opts.Size%BlockSize != 0 {
		return nil, fmt.Errorf("%w: %d bytes is not a positive multiple of %d", ErrInvalidSize, opts.Size, BlockSize)
	}
	if fi, err := os.Stat(dir); err == nil && !fi.IsDir() {
		return nil, fmt.Errorf("%w: %s is a file, not a directory", ErrNotReplica, dir)
	}
	m, err := readMeta(dir)
	existing := true
	switch {
	case errors.Is(err, os.ErrNotExist):
		if m, err = create(dir, opts); err != nil {
			return nil, err
		}
		existing = false
	case err != nil:
		return nil, fmt.Errorf("open replica %s: %w", dir, err)
	case opts.Size != 0 && opts.Size != m.Size:
		return nil, fmt.Errorf("%w: %s holds a replica of %d bytes, but %d were asked for; pass the existing size (or expand the replica to grow it)",
			ErrSizeMismatch, dir, m.Size, opts.Size)
	}
	if err := removeDebris(dir, m); err != nil {
		return nil, fmt.Errorf("open replica %s: clean up after a crash: %w", dir, err)
	}
	r := &Replica{dir: dir, log: opts.Logger, meta: m, direct: opts.DirectIO}
	r.epoch.Store(m.Epoch)
	r.size.Store(m.Size)
	for _, s := range m.Snapshots {
		l, err := openLayer(dir, s.File, s.Name, r.direct)
		if err != nil {
			_ = r.closeLayers() // the open failed: its error is the one to report
			return nil, fmt.Errorf("open replica %s: snapshot %s: %w", dir, s.Name, err)
		}
		r.layers = append(r.layers, l)
	}
	head, err := openLayer(dir, m.Head, "", r.direct)
	if err != nil {
		_ = r.closeLayers() // the open failed: its error is the one to report
		return nil, fmt.Errorf("open replica %s: head: %w", dir, err)
	}
	r.layers = append(r.layers, head)
	// A crash during an expansion can leave the head larger than the
	// metadata says; nothing was written past the old size, so trim it.
	if err := head.f.Truncate(m.Size); err != nil {
		_ = r.closeLayers() // the open failed: its error is the one to report
		return nil, fmt.Errorf("open replica %s: size the head: %w", dir, err)
	}
	head.idx.grow(m.Size / BlockSize)
	if r.dirty, err = openDirty(dir, m.Size, m.RegionSize, existing, opts.ClearDelay); err != nil {
		_ = r.closeLayers() // the open failed: its error is the one to report
		return nil, err
	}
	// Finish any deletion a crash interrupted.
	for i := 0; i < len(r.meta.Snapshots); i++ {
		if r.meta.Snapshots[i].Deleting {
			r.log.Info("finishing an interrupted snapshot deletion", "name", r.meta.Snapshots[i].Name)
			r.mu.Lock()
			err := r.deleteSnapshot(i)
			r.mu.Unlock()
			if err != nil {
				r.Close()
				return nil, fmt.Errorf("open replica %s: finish deleting snapshot %s: %w", dir, r.meta.Snapshots[i].Name, err)
			}
			i--
		}
	}
	r.log.Info("replica opened", "dir", dir, "size", m.Size, "epoch", m.Epoch, "snapshots", len(m.Snapshots), "created", !existing)
	return r, nil
}

// create initialises an empty replica in dir.
func create(dir string, opts Options) (metadata, error) {
	if opts.Size == 0 {
		return metadata{}, fmt.Errorf("%w: %s holds no replica (%s is missing); give a size to create one", ErrNotReplica, dir, metaFileName)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return metadata{}, fmt.Errorf("create replica directory: %w", err)
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		return metadata{}, err
	}
	for _, e := range entries {
		if filepath.Ext(e.Name()) != ".tmp" && e.Name() != dirtyFileName && !layerFilePattern.MatchString(e.Name()) {
			return metadata{}, fmt.Errorf("%w: %s is not empty (found %s) and holds no %s; refusing to create a replica over other data",
				ErrNotReplica, dir, e.Name(), metaFileName)
		}
	}
	id := make([]byte, 8)
	if _, err := rand.Read(id); err != nil {
		return metadata{}, err
	}
	m := metadata{FormatVersion: formatVersion, ID: hex.EncodeToString(id), Size: opts.Size, RegionSize: opts.RegionSize, NextLayer: 2, Head: layerFile(1)}
	if err := newLayerFile(dir, m.Head, m.Size); err != nil {
		return metadata{}, err
	}
	if err := writeMeta(dir, m); err != nil {
		return metadata{}, fmt.Errorf("create replica: %w", err)
	}
	return m, nil
}

// newLayerFile creates an empty sparse layer of size bytes, durably.
func newLayerFile(dir, name string, size int64) error {
	f, err := os.OpenFile(filepath.Join(dir, name), os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return fmt.Errorf("create layer: %w", err)
	}
	defer f.Close()
	if err := f.Truncate(size); err != nil {
		return fmt.Errorf("size layer: %w", err)
	}
	if err := f.Sync(); err != nil {
		return err
	}
	return syncDir(dir)
}

// openLayer opens a layer file the metadata names and indexes it. An
// error opening it keeps its cause (a missing file, a permission, an I/O
// error) and is not ErrCorrupt: nothing was decoded.
func openLayer(dir, file, name string, direct bool) (*layer, error) {
	f, err := openBlockFile(filepath.Join(dir, file), direct)
	if err != nil {
		return nil, fmt.Errorf("layer %s: %w", file, err)
	}
	idx, err := scanExtents(f.File)
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("index layer %s: %w", file, err)
	}
	return &layer{name: name, file: file, f: f, idx: idx}, nil
}

// scanExtents builds a layer's block index from the file's allocated
// extents, found with SEEK_DATA/SEEK_HOLE.
func scanExtents(f *os.File) (*blockIndex, error) {
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	size := fi.Size()
	idx := newBlockIndex((size + BlockSize - 1) / BlockSize)
	fd := int(f.Fd())
	for off := int64(0); off < size; {
		data, err := unix.Seek(fd, off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			break // no data after off
		}
		if err != nil {
			return nil, fmt.Errorf("SEEK_DATA: %w", err)
		}
		hole, err := unix.Seek(fd, data, unix.SEEK_HOLE)
		if err != nil {
			return nil, fmt.Errorf("SEEK_HOLE: %w", err)
		}
		first := data / BlockSize
		idx.set(first, (hole+BlockSize-1)/BlockSize-first)
		off = hole
	}
	return idx, nil
}

func (r *Replica) head() *layer { return r.layers[len(r.layers)-1] }

// Size returns the volume size in bytes.
func (r *Replica) Size() int64 { return r.size.Load() }

// Epoch returns the current epoch.
func (r *Replica) Epoch() uint64 { return r.epoch.Load() }

// StaleEpochError is the error for a request, or a Fence, refused for
// its epoch. It wraps ErrStaleEpoch.
type StaleEpochError struct {
	// Request is the epoch the request carried; Current the replica's.
	Request, Current uint64
	// OtherOwner: a Fence of the current epoch by another owner.
	OtherOwner bool
}

func (e *StaleEpochError) Error() string {
	switch {
	case e.OtherOwner:
		return fmt.Sprintf("%v: epoch %d is the replica's already, set by another engine", ErrStaleEpoch, e.Request)
	case e.Request == 0:
		return fmt.Sprintf("%v: request epoch 0 (the request carries none), replica epoch %d", ErrStaleEpoch, e.Current)
	case e.Request < e.Current:
		return fmt.Sprintf("%v: request epoch %d, replica epoch %d (a newer engine has taken the replica over)", ErrStaleEpoch, e.Request, e.Current)
	}
	return fmt.Sprintf("%v: request epoch %d, replica epoch %d (the replica has not been given it)", ErrStaleEpoch, e.Request, e.Current)
}

func (e *StaleEpochError) Unwrap() error { return ErrStaleEpoch }

// CheckEpoch returns a *StaleEpochError unless e is the replica's epoch.
func (r *Replica) CheckEpoch(e uint64) error {
	if cur := r.epoch.Load(); e != cur {
		return &StaleEpochError{Request: e, Current: cur}
	}
	return nil
}

// FenceOptions are what Fence persists.
type FenceOptions struct {
	// Epoch becomes the replica's epoch. It never goes back.
	Epoch uint64
	// Owner identifies the engine setting it (empty: not checked, for
	// tools and tests). The current epoch is accepted again only from the
	// owner that set it.
	Owner string
	// Degraded: the replica set is missing a member, so write-intent bits
	// are kept (not cleared) for it to resync from.
	Degraded bool
	// Rebuilding: this replica's data is incomplete until its rebuild
	// ends; persisted, so that no later engine trusts it.
	Rebuilding bool
	// Members are the IDs of the replicas that are RW in the set at
	// Epoch; persisted with it (see metadata.EpochMembers).
	Members []string
	// Mark are byte ranges whose write-intent bits are set, durably,
	// before Fence returns: the engine names the writes that failed on
	// another replica, which this one took and may have cleared the bits
	// of before it was told the set is degraded.
	Mark []Range
}

// keptSince is the DirtyKeptSince marker after a fence at o (see
// metadata.DirtyKeptSince): bits clear only in a set that is not
// degraded, so such a fence resets it; a replica being rebuilt has bits
// only for the writes that reach it from its rebuild on, so its marker
// is the fence's epoch; otherwise a degraded fence keeps the marker, or
// starts it at its epoch.
func keptSince(cur uint64, o FenceOptions) uint64 {
	switch {
	case !o.Degraded:
		return 0
	case o.Rebuilding || cur == 0:
		return o.Epoch
	default:
		return cur
	}
}

// Fence makes o.Epoch the replica's epoch, persisted with its owner and
// the rebuilding flag: from then on data requests and changes to the
// chain (At) carrying another epoch are refused. The engine calls it on
// open and on every change of the set, with I/O paused, and before any
// flush that follows a member's failure.
//
// An epoch lower than the current one is refused with a *StaleEpochError:
// it comes from an engine that a newer one has fenced out. So is the
// current epoch from another owner: two engines can reach the same number
// (a fenced-out engine bumping its own epoch after a newer engine took
// over), and only one of them may hold it. The same epoch from the same
// owner (or with no owner given) is accepted again, with new flags.
func (r *Replica) Fence(o FenceOptions) error {
	if err := r.checkMarks(o); err != nil {
		return err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return ErrClosed
	}
	m := r.meta
	switch {
	case o.Epoch < m.Epoch:
		return &StaleEpochError{Request: o.Epoch, Current: m.Epoch}
	case o.Epoch == m.Epoch && o.Owner != "" && m.EpochOwner != "" && o.Owner != m.EpochOwner:
		return &StaleEpochError{Request: o.Epoch, Current: m.Epoch, OtherOwner: true}
	case o.Epoch > m.Epoch || o.Owner != "":
		m.EpochOwner = o.Owner
	}
	m.Epoch = o.Epoch
	m.Rebuilding = o.Rebuilding
	m.EpochMembers = slices.Clone(o.Members)
	m.DirtyKeptSince = keptSince(m.DirtyKeptSince, o)
	if err := r.markForFence(o); err != nil {
		return fmt.Errorf("set epoch: %w", err)
	}
	if err := writeMeta(r.dir, m); err != nil {
		return fmt.Errorf("set epoch: %w", err)
	}
	r.meta = m
	r.epoch.Store(o.Epoch)
	r.dirty.setDegraded(o.Degraded)
	return nil
}

// checkMarks refuses, before anything changes, regions to mark that
// are out of the volume or given with a set that is not degraded (whose
// bits would clear again).
func (r *Replica) checkMarks(o FenceOptions) error {
	if len(o.Mark) > 0 && !o.Degraded {
		return fmt.Errorf("%w: write-intent regions to mark in a set that is not degraded", ErrOutOfRange)
	}
	for _, rg := range o.Mark {
		if err := r.checkRange(rg.Offset, rg.Length); err != nil {
			return fmt.Errorf("write-intent regions to mark: %w", err)
		}
	}
	return nil
}

// markForFence marks o.Mark durably in a degraded set, the set made
// degraded first so that no flush clears a bit from then on: the marks
// stay, and so do the bits the DirtyKeptSince marker promises.
func (r *Replica) markForFence(o FenceOptions) error {
	if !o.Degraded {
		return nil
	}
	r.dirty.setDegraded(true)
	for _, rg := range o.Mark {
		if err := r.dirty.mark(rg.Offset, rg.Length); err != nil {
			return err
		}
	}
	return nil
}

func (r *Replica) checkRange(off, n int64) error {
	if size := r.size.Load(); off < 0 || n < 0 || off > size || n > size-off {
		return fmt.Errorf("%w: %d bytes at offset %d, volume size %d", ErrOutOfRange, n, off, size)
	}
	return nil
}

// resolve finds which layer serves block b and for how many blocks (at most
// limit) that stays so: the newest layer holding data, or -1 for zeros.
// Only layers[:top] are considered.
func (r *Replica) resolve(b, limit int64, top int) (int, int64) {
	n := limit
	for i := top - 1; i >= 0; i-- {
		rn, data := r.layers[i].idx.run(b, n)
		if data {
			return i, rn
		}
		n = rn
	}
	return -1, n
}

// readChain reads p at off through layers[:top].
func (r *Replica) readChain(p []byte, off int64, top int) error {
	for len(p) > 0 {
		b := off / BlockSize
		inBlock := off % BlockSize
		blocks := (inBlock + int64(len(p)) + BlockSize - 1) / BlockSize
		li, n := r.resolve(b, blocks, top)
		span := min(n*BlockSize-inBlock, int64(len(p)))
		if li < 0 {
			clear(p[:span])
		} else if _, err := r.layers[li].f.ReadAt(p[:span], off); err != nil && !errors.Is(err, io.EOF) {
			return fmt.Errorf("read %s: %w", r.layers[li].file, err)
		} else if errors.Is(err, io.EOF) {
			return fmt.Errorf("%w: layer %s is shorter than its index", ErrCorrupt, r.layers[li].file)
		}
		p = p[span:]
		off += span
	}
	return nil
}

// ReadAt reads len(p) bytes at off, resolving each block through the chain.
func (r *Replica) ReadAt(p []byte, off int64) (int, error) {
	return count(p, r.locked(nil, func() error { return r.readAt(p, off) }))
}

// ReadAtEpoch is ReadAt for a request of the given epoch: it fails with
// ErrStaleEpoch unless the epoch is current, atomically with the read.
func (r *Replica) ReadAtEpoch(p []byte, off int64, epoch uint64) (int, error) {
	return count(p, r.locked(&epoch, func() error { return r.readAt(p, off) }))
}

func count(p []byte, err error) (int, error) {
	if err != nil {
		return 0, err
	}
	return len(p), nil
}

// locked runs fn holding the I/O lock, once the replica is known open and
// (when epoch is given) the epoch current. Fence takes the lock
// exclusively, so a request that passed the check cannot land after the
// epoch changed.
func (r *Replica) locked(epoch *uint64, fn func() error) error {
	r.mu.RLock()
	defer r.mu.RUnlock()
	if r.closed {
		return ErrClosed
	}
	if epoch != nil {
		if err := r.CheckEpoch(*epoch); err != nil {
			return err
		}
	}
	return fn()
}

func (r *Replica) readAt(p []byte, off int64) error {
	if err := r.checkRange(off, int64(len(p))); err != nil {
		return err
	}
	return r.readChain(p, off, len(r.layers))
}

// WriteAt writes p at off into the head. A partial block whose older data
// lives in a snapshot is merged with it first (read-modify-write), so the
// rest of the block keeps its contents.
func (r *Replica) WriteAt(p []byte, off int64) (int, error) {
	return count(p, r.locked(nil, func() error { return r.writeAt(p, off) }))
}

// WriteAtEpoch is WriteAt for a request of the given epoch (see ReadAtEpoch).
func (r *Replica) WriteAtEpoch(p []byte, off int64, epoch uint64) (int, error) {
	return count(p, r.locked(&epoch, func() error { return r.writeAt(p, off) }))
}

func (r *Replica) writeAt(p []byte, off int64) error {
	if err := r.checkRange(off, int64(len(p))); err != nil {
		return err
	}
	if len(p) == 0 {
		return nil
	}
	if err := r.dirty.begin(off, int64(len(p))); err != nil {
		return err
	}
	defer r.dirty.end(off, int64(len(p)))
	defer r.fence(off, int64(len(p)))()
	return r.writeHead(p, off)
}

// writeHead writes p at off into the head and records its blocks. Callers
// hold mu (shared or exclusive).
func (r *Replica) writeHead(p []byte, off int64) error {
	head := r.head()
	end := off + int64(len(p))
	first, last := off/BlockSize, (end-1)/BlockSize
	// Partial first and last blocks.
	for _, b := range uniq(first, last) {
		bs, be := b*BlockSize, (b+1)*BlockSize
		if off <= bs && end >= be {
			continue // covered completely
		}
		lo, hi := max(off, bs), min(end, be)
		if err := r.writePartial(b, p[lo-off:hi-off], lo); err != nil {
			return err
		}
	}
	// Whole blocks in between, in one write.
	ws, we := first*BlockSize, (last+1)*BlockSize
	if off > ws {
		ws += BlockSize
	}
	if end < we {
		we -= BlockSize
	}
	if we > ws {
		if _, err := head.f.WriteAt(p[ws-off:we-off], ws); err != nil {
			return fmt.Errorf("write head: %w", err)
		}
		head.idx.set(ws/BlockSize, (we-ws)/BlockSize)
	}
	return nil
}

func uniq(a, b int64) []int64 {
	if a == b {
		return []int64{a}
	}
	return []int64{a, b}
}

// ErrUnalignedWhileRebuilding: a partial-block write reached a replica
// being rebuilt. It cannot be merged correctly (the older data below is
// still being copied in), so the engine sends whole blocks only.
var ErrUnalignedWhileRebuilding = errors.New("partial-block write to a replica being rebuilt")

// writePartial writes part of block b (data at off, inside the block).
func (r *Replica) writePartial(b int64, data []byte, off int64) error {
	head := r.head()
	if r.meta.Rebuilding && !head.idx.has(b) {
		return fmt.Errorf("%w: block %d", ErrUnalignedWhileRebuilding, b)
	}
	mu := &r.rmw[b%int64(len(r.rmw))]
	mu.Lock()
	defer mu.Unlock()
	if !head.idx.has(b) {
		if li, _ := r.resolve(b, 1, len(r.layers)-1); li >= 0 {
			// Older data below: write the whole merged block.
			blk := make([]byte, BlockSize)
			if err := r.readChain(blk, b*BlockSize, len(r.layers)-1); err != nil {
				return err
			}
			copy(blk[off-b*BlockSize:], data)
			if _, err := head.f.WriteAt(blk, b*BlockSize); err != nil {
				return fmt.Errorf("write head: %w", err)
			}
			head.idx.set(b, 1)
			return nil
		}
	}
	if _, err := head.f.WriteAt(data, off); err != nil {
		return fmt.Errorf("write head: %w", err)
	}
	head.idx.set(b, 1)
	return nil
}

// Flush makes every completed write durable (fdatasync of the head), then
// lets the write-intent bitmap clear regions that have gone quiet.
func (r *Replica) Flush() error { return r.locked(nil, r.flush) }

// FlushEpoch is Flush for a request of the given epoch (see ReadAtEpoch).
func (r *Replica) FlushEpoch(epoch uint64) error { return r.locked(&epoch, r.flush) }

func (r *Replica) flush() error {
	r.dirty.flushMu.Lock()
	defer r.dirty.flushMu.Unlock()
	keep := r.dirty.flushBegin()
	if err := unix.Fdatasync(int(r.head().f.Fd())); err != nil {
		return fmt.Errorf("flush head: %w", err)
	}
	if err := r.dirty.flushEnd(keep); err != nil {
		r.log.Error(err, "clearing write-intent bits failed; they stay set")
	}
	return nil
}

var zeroBlocks = make([]byte, 256*BlockSize)

// Unmap discards [off, off+length): afterwards the range reads as zeros.
// Where no snapshot holds older data for a block, the head's block is
// punched out (space is freed); where one does, punching would expose that
// older data, so zeros are written into the head instead. Partial blocks
// at the edges are zeroed in place.
func (r *Replica) Unmap(off, length int64) error {
	return r.locked(nil, func() error { return r.unmap(off, length) })
}

// UnmapEpoch is Unmap for a request of the given epoch (see ReadAtEpoch).
func (r *Replica) UnmapEpoch(off, length int64, epoch uint64) error {
	return r.locked(&epoch, func() error { return r.unmap(off, length) })
}

func (r *Replica) unmap(off, length int64) error {
	if err := r.checkRange(off, length); err != nil {
		return err
	}
	if length == 0 {
		return nil
	}
	if err := r.dirty.begin(off, length); err != nil {
		return err
	}
	defer r.dirty.end(off, length)
	defer r.fence(off, length)()
	end := off + length
	first := (off + BlockSize - 1) / BlockSize // first whole block
	last := end / BlockSize                    // one past the last whole block
	if first >= last {                         // no whole block: zero the bytes
		return r.writeHead(make([]byte, length), off)
	}
	if off < first*BlockSize {
		if err := r.writeHead(make([]byte, first*BlockSize-off), off); err != nil {
			return err
		}
	}
	if end > last*BlockSize {
		if err := r.writeHead(make([]byte, end-last*BlockSize), last*BlockSize); err != nil {
			return err
		}
	}
	head := r.head()
	below := len(r.layers) - 1
	for b := first; b < last; {
		li, n := r.resolve(b, last-b, below)
		// While rebuilding, the layers below are still being filled: a
		// hole punched now could later expose data copied in under it.
		if li < 0 && !r.meta.Rebuilding {
			if err := unix.Fallocate(int(head.f.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, b*BlockSize, n*BlockSize); err != nil {
				return fmt.Errorf("punch hole: %w", err)
			}
			head.idx.clear(b, n)
		} else {
			for done := int64(0); done < n; {
				k := min(n-done, int64(len(zeroBlocks)/BlockSize))
				if _, err := head.f.WriteAt(zeroBlocks[:k*BlockSize], (b+done)*BlockSize); err != nil {
					return fmt.Errorf("zero head: %w", err)
				}
				done += k
			}
			head.idx.set(b, n)
		}
		b += n
	}
	return nil
}

// Close flushes nothing (callers flush first) and closes the files.
func (r *Replica) Close() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return nil
	}
	r.closed = true
	err := r.closeLayers()
	if r.dirty != nil {
		err = errors.Join(err, r.dirty.close())
	}
	r.log.Info("replica closed", "dir", r.dir)
	return err
}

func (r *Replica) closeLayers() error {
	var err error
	for _, l := range r.layers {
		err = errors.Join(err, l.f.Close())
	}
	return err
}
