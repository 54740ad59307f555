package replica

import (
	"fmt"
	"time"

	"golang.org/x/sys/unix"
)

// FlushClean is Flush for an engine that is stopping: it has no write in
// flight, every write it completed is on every replica of a set that is
// not degraded, and it flushed them all. The regions then agree, so the
// write-intent bits of every region without a write in flight here are
// cleared, not only those of regions quiet for two clear windows, and
// the clear is made durable. Without it the bits of the writes of the
// last seconds before a clean stop (a whole volume's, after an mkfs)
// stay set, and the next engine copies those regions between the
// replicas before it serves. In a degraded set it is a plain Flush: the
// bits stay for the missing member's resync.
func (r *Replica) FlushClean() error { return r.locked(nil, r.flushClean) }

// FlushCleanEpoch is FlushClean for a request of the given epoch.
func (r *Replica) FlushCleanEpoch(epoch uint64) error { return r.locked(&epoch, r.flushClean) }

func (r *Replica) flushClean() error {
	r.dirty.flushMu.Lock()
	defer r.dirty.flushMu.Unlock()
	keep := r.dirty.cleanBegin()
	if err := unix.Fdatasync(int(r.head().f.Fd())); err != nil {
		return fmt.Errorf("flush head: %w", err)
	}
	if err := r.dirty.flushEnd(keep); err != nil {
		r.log.Error(err, "clearing write-intent bits failed; they stay set")
		return nil
	}
	if err := r.dirty.sync(); err != nil {
		r.log.Error(err, "syncing cleared write-intent bits failed; some may come back set")
	}
	return nil
}

// cleanBegin is flushBegin for a clean flush: only the regions with a
// write in flight keep their bit. The current window is merged into the
// older one and a new one starts, so flushEnd keeps the bits of writes
// that begin during the flush (what recent holds then), and the windows
// still hold every region written before for the plain flushes after
// (each at least a clear delay more, as lastRotate starts again): a
// clean flush that clears nothing (a degraded set) shortens no region's
// wait.
func (d *dirtyMap) cleanBegin() []uint64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	for i := range d.older {
		d.older[i] |= d.recent[i]
	}
	clear(d.recent)
	d.lastRotate = time.Now()
	keep := make([]uint64, len(d.persisted))
	for r := range d.inflight {
		keep[r/64] |= 1 << (r % 64)
	}
	return keep
}

// sync makes the bitmap file durable.
func (d *dirtyMap) sync() error {
	d.persistMu.Lock()
	defer d.persistMu.Unlock()
	if err := unix.Fdatasync(int(d.f.Fd())); err != nil {
		return fmt.Errorf("sync write-intent bitmap: %w", err)
	}
	return nil
}
