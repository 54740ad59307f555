package engine

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
)

// reconcileInFlight is how many regions reconcile copies at once: the
// copy of one region is a read from the source and a write to each other
// replica, each a round trip on its own; several in flight keep the
// connections and disks busy instead of waiting on one at a time when the
// replicas are across a network. Where the copy is bound by CPU (all
// processes on one loaded 2-core machine, BenchmarkOpenReconcile) it
// gains nothing and costs nothing.
const reconcileInFlight = 4

// reconcile copies, from src to the other usable replicas, every region
// any of them marks dirty: a previous engine may have died with writes
// applied on some replicas only, and readers must not see two versions.
// A replica whose write fails is failed (ERR); a failed read from src
// fails the open.
func (e *Engine) reconcile(ctx context.Context, src *member, usable []cand) error {
	ctx = detach(ctx)
	if len(usable) < 2 || src.mode != ModeRW {
		return nil
	}
	regions, regionSize := dirtyUnion(usable)
	if len(regions) == 0 || regionSize <= 0 {
		return nil
	}
	e.log.Info("reconciling regions a previous engine may have left different", "regions", len(regions), "regionSize", regionSize)
	var dsts []*reconcileDst
	for _, c := range usable {
		if c.m != src && c.m.mode == ModeRW {
			dsts = append(dsts, &reconcileDst{m: c.m})
		}
	}
	if err := e.copyRegions(ctx, src, dsts, regions, regionSize); err != nil {
		return err
	}
	// No copy runs any more: modes are read and changed here only.
	for _, c := range usable {
		if c.m.mode == ModeRW {
			if err := c.m.data.Flush(ctx); err != nil {
				_ = e.become(c.m, ModeERR, fmt.Errorf("reconcile: flush: %w", err))
			}
		}
	}
	return nil
}

// reconcileDst is a replica reconcile writes to; failed is set (once) by
// the copy that failed it.
type reconcileDst struct {
	m      *member
	failed atomic.Bool
}

// dirtyUnion lists, in order, the regions any candidate marks dirty.
func dirtyUnion(usable []cand) (regions []int64, regionSize int64) {
	union := map[int64]bool{}
	for _, c := range usable {
		regionSize = c.info.DirtyRegionSize
		for r := range c.info.DirtyCount {
			if c.info.Dirty[r/64]&(1<<(r%64)) != 0 {
				union[r] = true
			}
		}
	}
	return slices.Sorted(maps.Keys(union)), regionSize
}

// copyRegions copies each region from src to every dst not failed,
// reconcileInFlight regions at a time. It stops at the first failed read
// from src and returns it.
func (e *Engine) copyRegions(ctx context.Context, src *member, dsts []*reconcileDst, regions []int64, regionSize int64) error {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	size := e.size.Load()
	next := make(chan int64)
	var wg sync.WaitGroup
	for range min(reconcileInFlight, len(regions)) {
		wg.Go(func() {
			buf := make([]byte, regionSize)
			for r := range next {
				off := r * regionSize
				n := min(regionSize, size-off)
				if n <= 0 || ctx.Err() != nil {
					continue
				}
				if err := src.data.ReadAt(ctx, buf[:n], off); err != nil {
					cancel(fmt.Errorf("reconcile: read from %s: %w", src.addr, err))
					continue
				}
				for _, d := range dsts {
					if d.failed.Load() {
						continue
					}
					if err := d.m.data.WriteAt(ctx, buf[:n], off, false); err != nil && ctx.Err() == nil && d.failed.CompareAndSwap(false, true) {
						_ = e.become(d.m, ModeERR, fmt.Errorf("reconcile: %w", err))
					}
				}
			}
		})
	}
	for _, r := range regions {
		if ctx.Err() != nil {
			break
		}
		next <- r
	}
	close(next)
	wg.Wait()
	return context.Cause(ctx)
}
