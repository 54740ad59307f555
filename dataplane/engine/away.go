package engine

import (
	"sync"
	"sync/atomic"
)

// awayRegion is the granularity of the engine's record of the writes made
// while a replica is away: the replicas' default write-intent region.
const awayRegion = 1 << 20

// awayMap records, in memory, the regions written (or unmapped) since a
// member that may come back failed: every write made while one is away,
// and every write that failed on a replica (in flight when it failed).
// A returning replica's dirty-only resync copies these regions as well
// as the ones marked in the write-intent bitmaps. The bitmaps alone have
// a gap: a survivor may clear the bit of a write that was still in
// flight to a replica that then failed (the write completed on the
// survivor, the region went quiet for the bitmap's clear delay, and a
// flush cleared it before the engine, still waiting for the hung replica,
// told the survivor that the set is degraded). The engine knows that
// write: it is in this record.
//
// It is kept while Engine.failed is not empty and reset with it; an
// engine that restarts loses it. The replicas' bitmaps then stand alone:
// the writes that failed on a replica were marked on the others before
// being acknowledged (markFailedWrite), and a source's DirtyKeptSince
// marker says since when it cleared no bit (keptFor).
type awayMap struct {
	on   atomic.Bool // set while a failed replica may come back
	mu   sync.Mutex
	bits []uint64 // bit r%64 of word r/64: region r (awayRegion bytes)
}

// start turns recording on; writes from now on are recorded.
func (a *awayMap) start() { a.on.Store(true) }

// reset forgets everything and stops recording.
func (a *awayMap) reset() {
	a.on.Store(false)
	a.mu.Lock()
	a.bits = nil
	a.mu.Unlock()
}

// note records [off, off+n) if recording is on, or unconditionally with
// force (a write that failed on some replica).
func (a *awayMap) note(off, n int64, force bool) {
	if n <= 0 || (!force && !a.on.Load()) {
		return
	}
	first, last := off/awayRegion, (off+n-1)/awayRegion
	a.mu.Lock()
	defer a.mu.Unlock()
	if need := int(last/64) + 1; need > len(a.bits) {
		a.bits = append(a.bits, make([]uint64, need-len(a.bits))...)
	}
	for r := first; r <= last; r++ {
		a.bits[r/64] |= 1 << (r % 64)
	}
}

// overlaps reports whether any recorded region meets [off, off+n).
func (a *awayMap) overlaps(off, n int64) bool {
	if n <= 0 {
		return false
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	for r := off / awayRegion; r <= (off+n-1)/awayRegion; r++ {
		if int(r/64) < len(a.bits) && a.bits[r/64]&(1<<(r%64)) != 0 {
			return true
		}
	}
	return false
}
