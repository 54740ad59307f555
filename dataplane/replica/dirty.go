package replica

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/bits"
	"os"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// The write-intent bitmap records, one bit per region (1 MiB by default),
// which regions of this replica may differ from the other replicas. A bit
// is made durable before the first write to its region after a clean point,
// so after any crash the set bits cover every write that might be partial
// or missing elsewhere. Bits are cleared lazily after a successful flush,
// and only while the replica set is complete (not degraded): while a peer
// is missing, every region written stays marked, so the peer can later
// resync by copying only the marked regions (union with its own bitmap).
// An engine whose client stops flushing (an idle application) flushes
// the replicas itself a few times (engine Options.IdleFlush), so the bits
// of its last writes clear anyway: otherwise they would stay set for good
// and make the next resync copy regions written long before an outage.
// The replica never clears on its own: only a flush from an engine, which
// has every write it completed on all its replicas, says the regions
// agree (after an engine's crash, the bits of its last writes must stay
// for the next engine to reconcile).
//
// File layout (dirty.bitmap), little-endian:
//
//	0  8  magic "CRNDIRTY"
//	8  4  format version (1)
//	12 4  reserved (0)
//	16 8  region size in bytes
//	24 8  number of regions
//	32 .. bits, as 64-bit words; bit r%64 of word r/64 is region r
const (
	dirtyMagic      = "CRNDIRTY"
	dirtyVersion    = 1
	dirtyHeaderSize = 32
	dirtyFileName   = "dirty.bitmap"
)

// DefaultRegionSize is the write-intent bitmap's granularity: 1 MiB, so a
// 1 TiB volume has a 128 KiB bitmap.
const DefaultRegionSize = 1 << 20

// DefaultClearDelay is how long a region must go unwritten before a flush
// may clear its bit, so hot regions do not pay a bitmap sync per flush.
const DefaultClearDelay = 5 * time.Second

type dirtyMap struct {
	f          *os.File
	regionSize int64
	clearDelay time.Duration

	persistMu sync.Mutex // serialises every write to the bitmap file
	flushMu   sync.Mutex // one flush at a time

	mu         sync.Mutex
	regions    int64
	persisted  []uint64 // bits set in the file
	recent     []uint64 // regions written since the last rotation
	older      []uint64 // regions written in the window before that
	inflight   map[int64]int
	degraded   bool
	lastRotate time.Time
}

func words(regions int64) int { return int((regions + 63) / 64) }

// openDirty opens or creates the bitmap in dir for a volume of size bytes.
// A missing or unreadable bitmap on an existing replica (existing=true)
// marks every region dirty: without it we cannot know what is in sync.
func openDirty(dir string, size, regionSize int64, existing bool, clearDelay time.Duration) (*dirtyMap, error) {
	path := dir + "/" + dirtyFileName
	regions := (size + regionSize - 1) / regionSize
	d := &dirtyMap{
		regionSize: regionSize, clearDelay: clearDelay, regions: regions,
		persisted: make([]uint64, words(regions)), recent: make([]uint64, words(regions)),
		older: make([]uint64, words(regions)), inflight: map[int64]int{}, degraded: true,
		lastRotate: time.Now(),
	}
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open write-intent bitmap: %w", err)
	}
	d.f = f
	allDirty := false
	if err := d.load(); err != nil {
		if existing {
			allDirty = true // unknown state: assume everything differs
		}
		if err := d.writeAll(allDirty); err != nil {
			f.Close()
			return nil, err
		}
	}
	return d, nil
}

// load reads the bitmap file; an error means it is missing or damaged.
func (d *dirtyMap) load() error {
	hdr := make([]byte, dirtyHeaderSize)
	if _, err := d.f.ReadAt(hdr, 0); err != nil {
		return err
	}
	if string(hdr[:8]) != dirtyMagic || binary.LittleEndian.Uint32(hdr[8:]) != dirtyVersion {
		return errors.New("bad write-intent bitmap header")
	}
	if int64(binary.LittleEndian.Uint64(hdr[16:])) != d.regionSize {
		return errors.New("write-intent bitmap region size changed")
	}
	n := int64(binary.LittleEndian.Uint64(hdr[24:]))
	// A crash during an expansion can leave the bitmap grown and the
	// metadata not: read what the volume covers.
	n = min(n, d.regions)
	buf := make([]byte, 8*words(n))
	if _, err := d.f.ReadAt(buf, dirtyHeaderSize); err != nil && !errors.Is(err, io.EOF) {
		return err
	}
	for i := range words(n) {
		d.persisted[i] = binary.LittleEndian.Uint64(buf[8*i:])
	}
	if n < d.regions { // the volume grew while the bitmap was not updated
		return d.writeAll(false)
	}
	return nil
}

// writeAll rewrites the whole file (header and bits) durably; with all,
// every region is marked first.
func (d *dirtyMap) writeAll(all bool) error {
	if all {
		for r := range d.regions {
			d.persisted[r/64] |= 1 << (r % 64)
		}
	}
	buf := make([]byte, dirtyHeaderSize+8*len(d.persisted))
	copy(buf, dirtyMagic)
	binary.LittleEndian.PutUint32(buf[8:], dirtyVersion)
	binary.LittleEndian.PutUint64(buf[16:], uint64(d.regionSize))
	binary.LittleEndian.PutUint64(buf[24:], uint64(d.regions))
	for i, w := range d.persisted {
		binary.LittleEndian.PutUint64(buf[dirtyHeaderSize+8*i:], w)
	}
	if _, err := d.f.WriteAt(buf, 0); err != nil {
		return fmt.Errorf("write write-intent bitmap: %w", err)
	}
	if err := unix.Fdatasync(int(d.f.Fd())); err != nil {
		return fmt.Errorf("sync write-intent bitmap: %w", err)
	}
	return nil
}

func (d *dirtyMap) regionsOf(off, length int64) (first, last int64) {
	if length <= 0 {
		length = 1
	}
	return off / d.regionSize, (off + length - 1) / d.regionSize
}

// begin records a write to [off, off+length) and returns once the bits of
// its regions are durable. Every successful begin needs an end.
func (d *dirtyMap) begin(off, length int64) error {
	first, last := d.regionsOf(off, length)
	d.mu.Lock()
	need := false
	for r := first; r <= last; r++ {
		d.inflight[r]++
		d.recent[r/64] |= 1 << (r % 64)
		if d.persisted[r/64]&(1<<(r%64)) == 0 {
			need = true
		}
	}
	d.mu.Unlock()
	if !need {
		return nil
	}
	if err := d.persist(first, last); err != nil {
		d.end(off, length)
		return err
	}
	return nil
}

// persist makes the bits of regions first..last durable.
func (d *dirtyMap) persist(first, last int64) error {
	d.persistMu.Lock()
	defer d.persistMu.Unlock()
	d.mu.Lock()
	w0, w1 := int(first/64), int(last/64)
	ws := make([]uint64, w1-w0+1)
	changed := false
	for r := first; r <= last; r++ {
		if d.persisted[r/64]&(1<<(r%64)) == 0 {
			changed = true
		}
	}
	copy(ws, d.persisted[w0:w1+1])
	d.mu.Unlock()
	if !changed { // another writer persisted them while we waited
		return nil
	}
	for r := first; r <= last; r++ {
		ws[int(r/64)-w0] |= 1 << (r % 64)
	}
	buf := make([]byte, 8*len(ws))
	for i, w := range ws {
		binary.LittleEndian.PutUint64(buf[8*i:], w)
	}
	if _, err := d.f.WriteAt(buf, int64(dirtyHeaderSize+8*w0)); err != nil {
		return fmt.Errorf("mark region dirty: %w", err)
	}
	if err := unix.Fdatasync(int(d.f.Fd())); err != nil {
		return fmt.Errorf("sync write-intent bitmap: %w", err)
	}
	d.mu.Lock()
	copy(d.persisted[w0:w1+1], ws)
	d.mu.Unlock()
	return nil
}

// end records that a write begun with begin has completed (or failed).
func (d *dirtyMap) end(off, length int64) {
	first, last := d.regionsOf(off, length)
	d.mu.Lock()
	defer d.mu.Unlock()
	for r := first; r <= last; r++ {
		if d.inflight[r]--; d.inflight[r] <= 0 {
			delete(d.inflight, r)
		}
	}
}

// flushBegin is called before the data file is synced. It returns the
// regions that must keep their bit whatever the sync does: those written
// recently and those with writes in flight (which the sync may not cover).
func (d *dirtyMap) flushBegin() []uint64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	if time.Since(d.lastRotate) >= d.clearDelay {
		d.older, d.recent = d.recent, d.older
		clear(d.recent)
		d.lastRotate = time.Now()
	}
	keep := make([]uint64, len(d.persisted))
	for i := range keep {
		keep[i] = d.recent[i] | d.older[i]
	}
	for r := range d.inflight {
		keep[r/64] |= 1 << (r % 64)
	}
	return keep
}

// flushEnd clears, after a successful sync, the bits of regions outside
// keep that have not been written since, unless the set is degraded. The
// clear is written without a sync: losing it only makes a resync copy more.
func (d *dirtyMap) flushEnd(keep []uint64) error {
	d.persistMu.Lock()
	defer d.persistMu.Unlock()
	d.mu.Lock()
	if d.degraded {
		d.mu.Unlock()
		return nil
	}
	for r := range d.inflight {
		keep[r/64] |= 1 << (r % 64)
	}
	type change struct {
		i int
		w uint64
	}
	var changes []change
	for i := range d.persisted {
		w := d.persisted[i] & (keep[i] | d.recent[i]) // keep only what must stay
		if w != d.persisted[i] {
			d.persisted[i] = w
			changes = append(changes, change{i, w})
		}
	}
	d.mu.Unlock()
	var b [8]byte
	for _, c := range changes {
		binary.LittleEndian.PutUint64(b[:], c.w)
		if _, err := d.f.WriteAt(b[:], int64(dirtyHeaderSize+8*c.i)); err != nil {
			return fmt.Errorf("clear dirty regions: %w", err)
		}
	}
	return nil
}

// mark makes the bits of [off, off+length) durable, as a write's begin
// does, with no write in flight.
func (d *dirtyMap) mark(off, length int64) error {
	first, last := d.regionsOf(off, length)
	return d.persist(first, last)
}

// setDegraded says whether the replica set is missing a member.
func (d *dirtyMap) setDegraded(v bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.degraded = v
}

// markAll marks every region dirty, durably (after a revert).
func (d *dirtyMap) markAll() error {
	d.persistMu.Lock()
	defer d.persistMu.Unlock()
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.writeAll(true)
}

// grow extends the bitmap for a larger volume; new regions start clean.
func (d *dirtyMap) grow(size int64) error {
	d.persistMu.Lock()
	defer d.persistMu.Unlock()
	d.mu.Lock()
	defer d.mu.Unlock()
	regions := (size + d.regionSize - 1) / d.regionSize
	if regions <= d.regions {
		return nil
	}
	n := words(regions)
	for _, p := range []*[]uint64{&d.persisted, &d.recent, &d.older} {
		*p = append(*p, make([]uint64, n-len(*p))...)
	}
	d.regions = regions
	return d.writeAll(false)
}

// DirtyRegions is a copy of the write-intent bitmap.
type DirtyRegions struct {
	// RegionSize is the bytes each bit covers.
	RegionSize int64
	// Count is the number of regions (the last may be partial).
	Count int64
	// Bits holds bit r%64 of word r/64 for region r.
	Bits []uint64
}

// IsDirty reports whether region r is marked.
func (d DirtyRegions) IsDirty(r int64) bool {
	return r >= 0 && r < d.Count && d.Bits[r/64]&(1<<(r%64)) != 0
}

// Dirty returns the number of marked regions.
func (d DirtyRegions) Dirty() int64 {
	var n int
	for _, w := range d.Bits {
		n += bits.OnesCount64(w)
	}
	return int64(n)
}

func (d *dirtyMap) snapshot() DirtyRegions {
	d.mu.Lock()
	defer d.mu.Unlock()
	return DirtyRegions{RegionSize: d.regionSize, Count: d.regions, Bits: append([]uint64(nil), d.persisted...)}
}

func (d *dirtyMap) close() error { return d.f.Close() }
