package engine

import (
	"context"
	"fmt"
	"sync"
)

// markFailedWrite has the writable replicas mark, durably and with the
// set degraded, the write-intent bits of a write (or unmap) that failed
// on some replica, before the write is acknowledged. The replicas that
// took it may have cleared its bits already: a write in flight to a
// replica that hangs completes on the others, and their flushes may clear
// its region before the engine gives up on the hung one and tells them
// the set is degraded. The engine's own record (awayMap) covers that
// only while this engine lives; marked on the survivors, the region is
// in a bitmap that their DirtyKeptSince marker vouches for, so a
// returning replica resyncs it even after the engine restarted.
// A replica that cannot mark is failed, as one that refuses an epoch is.
// The writes failed by one replica's failure (all those in flight to it)
// are marked together: each call queues its range, and whichever gets
// I/O paused first marks every range queued; a call that finds its range
// taken returns once that marking is done (it held the pause meanwhile).
// Called with I/O not paused (it pauses it, as afterFailure does).
func (e *Engine) markFailedWrite(ctx context.Context, off, n int64) {
	e.marks.add(ByteRange{Off: off, N: n})
	e.pause()
	defer e.resume()
	marks := e.marks.take()
	e.mu.Lock()
	closed, degraded := e.closed, e.degradedLocked()
	bump := !closed && e.needBump.Swap(false)
	e.mu.Unlock()
	if closed || (len(marks) == 0 && !bump) || (!bump && !degraded) {
		return // marked by another call, or a set that is not degraded (it clears bits anyway)
	}
	if err := e.publishEpochMarking(ctx, bump, marks); err != nil {
		e.log.Error(err, "marking writes that failed on a replica")
	}
}

// pendingMarks queues the ranges markFailedWrite is to mark.
type pendingMarks struct {
	mu     sync.Mutex
	ranges []ByteRange
}

func (p *pendingMarks) add(r ByteRange) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.ranges = append(p.ranges, r)
}

func (p *pendingMarks) take() []ByteRange {
	p.mu.Lock()
	defer p.mu.Unlock()
	r := p.ranges
	p.ranges = nil
	return r
}

// keptFor reports whether a returning replica, last a member at its
// epoch, may copy only the regions dirty in its own and src's bitmaps
// (and the engine's away record): src has cleared no write-intent bit
// since the epoch that fenced the returning replica out, or earlier, so
// every write it missed is marked on src (see
// replica.FenceOptions.Mark for the writes in flight when it left). If
// not, it says why.
func keptFor(src, back ReplicaInfo) (ok bool, why string) {
	switch {
	case src.DirtyKeptSince == 0:
		return false, "the source's write-intent bits may have been cleared since (it keeps no record of when it last cleared one: the set was healthy, or its metadata predates the record)"
	case src.DirtyKeptSince > back.Epoch+1:
		return false, fmt.Sprintf("the source has kept its write-intent bits only since epoch %d, and the replica was last a member at epoch %d: bits of writes it missed may have been cleared before", src.DirtyKeptSince, back.Epoch)
	default:
		return true, ""
	}
}
