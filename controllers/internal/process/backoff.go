package process

import (
	"fmt"
	"sync"
	"time"

	"k8s.io/apimachinery/pkg/types"
)

// Policy is the back-off of a process that keeps failing: the first
// failure is started again at once (a process killed once, a node's
// instance manager restarted, is back as soon as possible); each further
// failure in a row doubles the wait from Initial up to Max. A process that
// ran for Stable before it failed starts a new count.
type Policy struct {
	Initial, Max, Stable time.Duration
}

// DefaultPolicy: 1 s, 2 s, 4 s ... up to 30 s between starts; a minute of
// running clears the count.
var DefaultPolicy = Policy{Initial: time.Second, Max: 30 * time.Second, Stable: time.Minute}

// orDefault fills the zero fields from DefaultPolicy.
func (p Policy) orDefault() Policy {
	if p.Initial <= 0 {
		p.Initial = DefaultPolicy.Initial
	}
	if p.Max <= 0 {
		p.Max = DefaultPolicy.Max
	}
	if p.Max < p.Initial {
		p.Max = p.Initial
	}
	if p.Stable <= 0 {
		p.Stable = DefaultPolicy.Stable
	}
	return p
}

// Delay is the wait before the start that follows the failures-th failure
// in a row: none after the first, then Initial, 2×Initial, ... at most Max.
func (p Policy) Delay(failures int) time.Duration {
	p = p.orDefault()
	if failures <= 1 {
		return 0
	}
	d := p.Initial
	for i := 2; i < failures && d < p.Max; i++ {
		d *= 2
	}
	return min(d, p.Max)
}

// Failure is what the back-off knows of a process's failures in a row.
type Failure struct {
	// Count of failures in a row; Cause the last one's (an exit code and
	// error, or the instance manager's refusal).
	Count int
	Cause string
	// Next is when the process may be started again.
	Next time.Time
	// Delay is Next minus the time of the last failure.
	Delay time.Duration
}

// Message says what a Ready condition says of a process in back-off:
// noun is what it is called ("engine process").
func (f Failure) Message(noun string) string {
	return fmt.Sprintf("the %s failed %d times in a row, last: %s; it is started again at %s (%s after that failure)",
		noun, f.Count, f.Cause, f.Next.UTC().Format(time.RFC3339), f.Delay)
}

// record is one object's failures in a row.
type record struct {
	Failure
	// id names the failed process ("" for a start the instance manager
	// refused), so one exit observed twice counts once.
	id string
	// runningSince is when the process was first seen running after the
	// last failure (zero: not seen).
	runningSince time.Time
}

// Backoff remembers, per object (its UID: a recreated object starts
// afresh), the failures in a row of its process. It lives in the
// manager's memory: a new manager starts every count at zero, which costs
// at most one immediate restart per failing process.
type Backoff struct {
	policy Policy
	now    func() time.Time

	mu sync.Mutex
	m  map[types.UID]*record
}

// NewBackoff returns an empty Backoff with policy (zero fields: the
// defaults) and clock now (nil: time.Now).
func NewBackoff(policy Policy, now func() time.Time) *Backoff {
	if now == nil {
		now = time.Now
	}
	return &Backoff{policy: policy.orDefault(), now: now, m: map[types.UID]*record{}}
}

// Failed records a failure of key's process, identified by id (its pid;
// "" for a start that was refused, which always counts), and returns the
// count and when the next start may come. The same id failing again is
// the same failure seen twice and is not counted again.
func (b *Backoff) Failed(key types.UID, id, cause string) Failure {
	b.mu.Lock()
	defer b.mu.Unlock()
	now := b.now()
	r := b.m[key]
	switch {
	case r == nil:
		r = &record{}
		b.m[key] = r
	case id != "" && r.id == id:
		return r.Failure
	case !r.runningSince.IsZero() && now.Sub(r.runningSince) >= b.policy.Stable:
		r.Count = 0 // it ran long enough: this failure starts a new count
	}
	r.Count++
	r.Cause, r.id, r.runningSince = cause, id, time.Time{}
	r.Delay = b.policy.Delay(r.Count)
	r.Next = now.Add(r.Delay)
	return r.Failure
}

// Wait returns key's failures and how long its next start must still
// wait (0: it may start now).
func (b *Backoff) Wait(key types.UID) (Failure, time.Duration) {
	b.mu.Lock()
	defer b.mu.Unlock()
	r := b.m[key]
	if r == nil {
		return Failure{}, 0
	}
	return r.Failure, max(0, r.Next.Sub(b.now()))
}

// Running notes that key's process runs; once it has run for the
// policy's Stable, its failures are forgotten.
func (b *Backoff) Running(key types.UID) {
	b.mu.Lock()
	defer b.mu.Unlock()
	r := b.m[key]
	if r == nil {
		return
	}
	now := b.now()
	if r.runningSince.IsZero() {
		r.runningSince = now
	}
	if now.Sub(r.runningSince) >= b.policy.Stable {
		delete(b.m, key)
	}
}

// Forget drops key's failures (its process is stopped on purpose, or the
// object is gone).
func (b *Backoff) Forget(key types.UID) {
	b.mu.Lock()
	defer b.mu.Unlock()
	delete(b.m, key)
}
