package engine

import "sync"

// rangeLock serialises overlapping writes. Without it two concurrent writes
// to the same block could reach two replicas in opposite orders and leave
// them holding different data.
type rangeLock struct {
	mu     sync.Mutex
	active map[*lockedRange]struct{}
}

type lockedRange struct {
	off, end int64
	done     chan struct{}
}

func (l *rangeLock) lock(off, n int64) *lockedRange {
	r := &lockedRange{off: off, end: off + n, done: make(chan struct{})}
	for {
		l.mu.Lock()
		var wait chan struct{}
		for a := range l.active {
			if a.off < r.end && r.off < a.end {
				wait = a.done
				break
			}
		}
		if wait == nil {
			if l.active == nil {
				l.active = map[*lockedRange]struct{}{}
			}
			l.active[r] = struct{}{}
			l.mu.Unlock()
			return r
		}
		l.mu.Unlock()
		<-wait
	}
}

func (l *rangeLock) unlock(r *lockedRange) {
	l.mu.Lock()
	delete(l.active, r)
	l.mu.Unlock()
	close(r.done)
}
