package engine

import (
	"sync/atomic"
	"time"
)

// DefaultIdleFlush is Options.IdleFlush's default: a little more than the
// replicas' default clear delay (5 s), so that each idle flush finds the
// previous window of a replica's write-intent bitmap old enough to move on.
const DefaultIdleFlush = 6 * time.Second

// idleFlushes is how many flushes the engine sends by itself after the
// last write: a replica clears the bit of a region once two flushes, each
// at least its clear delay after the one before, have passed since the
// region was last written; the third allows for one that came too soon.
const idleFlushes = 3

// idleFlusher flushes the replicas when the client wrote and then stopped
// without flushing for a while (an idle application): a replica clears
// its write-intent bits only on a flush, so without these flushes the
// bits of the last writes before the volume went quiet would stay set for
// good, and a replica returning from an outage would copy those regions
// as well as the ones written while it was away (make demo: mkfs, 64 MiB,
// sync, then idle: 512 of 512 MiB copied). Only an engine may cause the
// clear: a flush it sends comes after every write it completed reached
// all its replicas. After an engine dies, the bits of its last writes stay
// for the next engine to reconcile.
type idleFlusher struct {
	// pending is how many idle flushes are still to send; every write
	// sets it to idleFlushes.
	pending atomic.Int32
	// lastWrite is when the last write or unmap began (unix nanoseconds).
	lastWrite atomic.Int64
	// kick wakes flushWhenIdle, which sleeps on it while no flush is
	// pending (an idle volume's engine has no timer for it).
	kick chan struct{}
}

// wrote records a write or unmap.
func (f *idleFlusher) wrote() {
	f.lastWrite.Store(time.Now().UnixNano())
	if f.pending.Swap(idleFlushes) <= 0 && f.kick != nil {
		select {
		case f.kick <- struct{}{}:
		default: // a wake-up is pending already
		}
	}
}

// due reports whether an idle flush should be sent now, counting it.
func (f *idleFlusher) due(interval time.Duration) bool {
	if f.pending.Load() <= 0 || time.Since(time.Unix(0, f.lastWrite.Load())) < interval {
		return false
	}
	return f.pending.Add(-1) >= 0
}

// flushWhenIdle sends the idle flushes until the engine is closed. A
// flush that fails fails replicas as a client's would. They count in the
// volume's flush metrics.
func (e *Engine) flushWhenIdle(interval time.Duration) {
	defer e.bg.Done()
	t := time.NewTimer(interval)
	defer t.Stop()
	for {
		if e.idle.pending.Load() <= 0 {
			select {
			case <-e.stop.Done():
				return
			case <-e.idle.kick:
			}
		}
		t.Reset(interval)
		select {
		case <-e.stop.Done():
			return
		case <-t.C:
		}
		if e.idle.due(interval) {
			if err := e.Flush(e.stop); err != nil && e.stop.Err() == nil {
				e.log.Info("idle flush failed", "error", err.Error())
			}
		}
	}
}
