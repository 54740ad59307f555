//go:build cairn_unsafe

// The deliberately broken write path of Options.UnsafeAckEarly, compiled
// in only with -tags cairn_unsafe: the chaos harness builds its cairn-data
// so, to prove it catches lost writes (TestChaosCatchesBrokenEngine, make
// chaos UNSAFE=1). A normal build has unsafe_ackearly_stub.go instead,
// and Open refuses UnsafeAckEarly.

package engine

import (
	"context"
	"fmt"
	"sync"
	"time"
)

// unsafeAckEarlyBuilt: this build has mutateEarly.
const unsafeAckEarlyBuilt = true

// mutateEarly is the deliberately broken write path of UnsafeAckEarly:
// the write is acknowledged, and its range unlocked, as soon as the first
// RW replica has it; the others get it unsafeLag later, as replicas on a
// slower link would, and their failures are ignored. A read that follows
// the acknowledgement can then come from a replica without the write; the
// harness must see that. (Without the lag and the early unlock the window
// is a few microseconds and a slow machine can miss it for many
// schedules.)
func (e *Engine) mutateEarly(ctx context.Context, lr *lockedRange, ms []*member, modes []Mode, fn func(*member) error) error {
	first := -1
	for i := range ms {
		if modes[i] == ModeRW {
			first = i
			break
		}
	}
	var once sync.Once
	unlock := func() { once.Do(func() { e.ranges.unlock(lr) }) }
	var wg sync.WaitGroup
	if first >= 0 {
		wg.Add(1) // done when the first has answered
	}
	for i, m := range ms {
		if i == first {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			time.Sleep(unsafeLag)
			_ = fn(m)
		}()
	}
	go func() { // the I/O lock is held until all have answered
		wg.Wait()
		unlock()
		e.io.RUnlock()
	}()
	if first < 0 {
		return fmt.Errorf("%w: no RW replica", ErrNoReplica)
	}
	err := fn(ms[first])
	unlock()
	wg.Done()
	return err
}

// unsafeLag is how late the other replicas get a write in UnsafeAckEarly.
const unsafeLag = 2 * time.Millisecond
