package engine

import "sync"

// rangeLock serialises overlapping writes, and reads with overlapping
// writes (reads share). Without it two concurrent writes to the same block
// could reach two replicas in opposite orders and leave them holding
// different data, and a read racing a write on a replica could return a
// torn block (part old, part new), which no write ever produced.
type rangeLock struct {
	mu     sync.Mutex
	active map[*lockedRange]struct{}
}

type lockedRange struct {
	off, end int64
	write    bool
	done     chan struct{}
}

// lock takes [off, off+n) for a write (exclusive) or a read (shared).
func (l *rangeLock) lock(off, n int64, write bool) *lockedRange {
	r := &lockedRange{off: off, end: off + n, write: write, done: make(chan struct{})}
	for {
		l.mu.Lock()
		var wait chan struct{}
		for a := range l.active {
			if a.off < r.end && r.off < a.end && (a.write || r.write) {
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
