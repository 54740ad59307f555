package engine

import (
	"errors"
	"sync/atomic"
	"testing"
)

// TestFanoutMixesStartedAndSynchronous runs a fan-out over members of
// which some are started (sent, then waited for) and the others run
// synchronously, and checks every member ran exactly once, its error
// landed in its own slot, and its stats counted it.
func TestFanoutMixesStartedAndSynchronous(t *testing.T) {
	ms := make([]*member, 5)
	for i := range ms {
		ms[i] = &member{}
	}
	var ran [5]atomic.Int32
	boom := errors.New("boom")
	errFor := func(i int) error {
		if i%2 == 1 {
			return boom
		}
		return nil
	}
	index := func(m *member) int {
		for i := range ms {
			if ms[i] == m {
				return i
			}
		}
		t.Fatal("unknown member")
		return -1
	}
	fn := func(m *member) error { i := index(m); ran[i].Add(1); return errFor(i) }
	start := func(m *member) func() error {
		i := index(m)
		if i < 3 { // members 0..2 can be started
			ran[i].Add(1)
			return func() error { return errFor(i) }
		}
		return nil
	}
	for _, st := range []func(*member) func() error{start, nil} {
		for i := range ran {
			ran[i].Store(0)
		}
		errs := fanout(ms, opWrite, 4096, fn, st)
		for i := range ms {
			if ran[i].Load() != 1 || !errors.Is(errs[i], errFor(i)) {
				t.Fatalf("start=%v member %d: ran %d times, err %v", st != nil, i, ran[i].Load(), errs[i])
			}
		}
	}
	for i, m := range ms {
		if got := m.stats.byOp[opWrite].ops.Load(); got != 2 {
			t.Fatalf("member %d: stats counted %d writes, want 2", i, got)
		}
	}
}
