package engine

import (
	"context"
	"errors"
)

// errNoCleanFlush: the replica's client takes no clean flush.
var errNoCleanFlush = errors.New("the replica client takes no clean flush")

// CleanFlusher is implemented by replicas that can take a clean flush
// (dataconn.FlushOffsetClean): a flush after which the replica clears
// the write-intent bit of every region without a write in flight,
// because the engine says every write it completed is on every replica.
// A replica older than clean flushes takes it as a plain flush.
type CleanFlusher interface {
	FlushClean(ctx context.Context) error
}

// FinalFlush flushes the replicas of an engine whose frontend has
// stopped: no write will come from it any more (the device was left to
// the next engine or detached). It flushes as Flush does, then, with I/O
// paused so that no write is in flight, and only if the set is complete
// (every wanted replica RW, none failed or rebuilding), it sends every
// replica a clean flush: each replica agrees with the others on every
// region, so it may clear all its write-intent bits, not only those of
// regions quiet for two of its clear windows. Without it, a clean stop
// right after writes (a hand-over when the instance manager goes away,
// minutes after mkfs or a bulk load) leaves the bits of those writes set
// on every replica, and the next engine copies all those regions between
// the replicas before it serves (256 of 256 regions in the day-2 e2e
// test, 2 to 4 s of the application's pause).
//
// A replica whose clean flush fails keeps its bits (the next engine then
// reconciles them: copying more is always safe), and so does one in a
// set that is degraded by the time it is asked (the replica refuses to
// clear then). The error is Flush's; a failed clean flush is only
// logged.
func (e *Engine) FinalFlush(ctx context.Context) error {
	if err := e.Flush(ctx); err != nil {
		return err
	}
	e.pause()
	defer e.resume()
	ms, ok := e.completeSet()
	if !ok {
		e.log.Info("final flush: the set is not complete, write-intent bits kept for the next engine to reconcile")
		return nil
	}
	ctx = detach(ctx)
	errs := each(ms, func(_ int, m *member) error {
		c, ok := m.data.(CleanFlusher)
		if !ok {
			return errNoCleanFlush
		}
		return c.FlushClean(ctx)
	})
	cleaned := 0
	for i, err := range errs {
		if err != nil {
			e.log.Info("final flush: write-intent bits kept on a replica", "replica", ms[i].addr, "error", err.Error())
			continue
		}
		cleaned++
	}
	e.log.Info("final flush: write-intent bits cleared", "replicas", cleaned, "of", len(ms))
	return nil
}

// completeSet returns the RW members if the set is complete: not
// degraded, no member rebuilding, no epoch bump pending after a failure,
// the engine not closed.
func (e *Engine) completeSet() ([]*member, bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed || e.degradedLocked() || e.needBump.Load() {
		return nil, false
	}
	ms, modes := e.selectLocked(ModeRW, ModeWO)
	for _, md := range modes {
		if md != ModeRW {
			return nil, false
		}
	}
	return ms, len(ms) > 0
}
