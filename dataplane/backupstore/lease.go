package backupstore

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"sync"
	"time"
)

// Lease kinds: the first element of a lease object's name.
const (
	leaseBackup  = "backup"
	leaseRestore = "restore"
	leaseGC      = "gc"
)

// lease is an object on the target that says "an operation on this volume
// is running": backups and restores hold one so that CollectGarbage does
// not run beside them, and CollectGarbage holds one so that they wait for
// it. Its holder re-writes it every LeaseDuration/4; others treat it as
// live while its modification time (the target's clock) is less than
// LeaseDuration old. A holder that could not renew for LeaseDuration/2 (by
// its own monotonic clock) stops relying on it (ErrLeaseLost).
type lease struct {
	s   *Store
	key string
	// body is the lease object's content: who holds it, for operators.
	body []byte

	mu        sync.Mutex
	lastRenew time.Time // local, monotonic: start of the last successful write

	stop chan struct{}
	done chan struct{}
}

type leaseBody struct {
	Kind    string    `json:"kind"`
	ID      string    `json:"id"`
	Host    string    `json:"host"`
	PID     int       `json:"pid"`
	Started time.Time `json:"started"`
}

func randomID() string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// takeLease writes a lease and starts renewing it.
func (s *Store) takeLease(ctx context.Context, vol, kind, id string) (*lease, error) {
	host, _ := os.Hostname()
	body, _ := json.Marshal(leaseBody{Kind: kind, ID: id, Host: host, PID: os.Getpid(), Started: time.Now().UTC()})
	l := &lease{s: s, key: leaseKey(vol, kind, id), body: body, stop: make(chan struct{}), done: make(chan struct{})}
	start := time.Now()
	if err := s.put(ctx, l.key, body); err != nil {
		return nil, err
	}
	l.lastRenew = start
	go l.renew()
	return l, nil
}

func (l *lease) renew() {
	defer close(l.done)
	t := time.NewTicker(l.s.opts.LeaseDuration / 4)
	defer t.Stop()
	for {
		select {
		case <-l.stop:
			return
		case <-t.C:
		}
		// One attempt per tick, bounded by the call timeout: a renewal
		// that keeps failing lets check fail, which is the point.
		start := time.Now()
		ctx, cancel := context.WithTimeout(context.Background(), l.s.opts.CallTimeout)
		err := l.s.target.Put(ctx, l.key, l.body)
		cancel()
		if err != nil {
			l.s.log.Info("lease renewal failed", "lease", l.key, "error", err.Error())
			continue
		}
		l.mu.Lock()
		l.lastRenew = start
		l.mu.Unlock()
	}
}

// check fails with ErrLeaseLost when the lease may have looked expired to
// others: call it before anything that relies on the lease's protection.
func (l *lease) check() error {
	l.mu.Lock()
	age := time.Since(l.lastRenew)
	l.mu.Unlock()
	if age > l.s.opts.LeaseDuration/2 {
		return fmt.Errorf("%w: %s not renewed for %v", ErrLeaseLost, l.key, age.Round(time.Second))
	}
	return nil
}

// release stops renewing and deletes the lease (best effort: a lease left
// behind expires after LeaseDuration).
func (l *lease) release() {
	close(l.stop)
	<-l.done
	ctx, cancel := context.WithTimeout(context.Background(), l.s.opts.CallTimeout)
	defer cancel()
	if err := l.s.target.Delete(ctx, l.key); err != nil {
		l.s.log.Info("could not delete lease; it expires by itself", "lease", l.key, "error", err.Error())
	}
}

// leaseState is the volume's leases as one listing saw them.
type leaseState struct {
	now     time.Time // the target's clock: our own lease's write time
	live    []Object  // others' live leases
	expired []Object
}

// leases lists the volume's leases and sorts the others' into live and
// expired by the modification time of own (the target's "now").
func (s *Store) leases(ctx context.Context, vol string, own *lease) (leaseState, error) {
	objs, err := s.list(ctx, leasePrefix(vol))
	if err != nil {
		return leaseState{}, err
	}
	var st leaseState
	for _, o := range objs {
		if o.Key == own.key {
			st.now = o.ModTime
		}
	}
	if st.now.IsZero() {
		return st, fmt.Errorf("%w: own lease %s not listed", ErrLeaseLost, own.key)
	}
	for _, o := range objs {
		switch {
		case o.Key == own.key:
		case st.now.Sub(o.ModTime) < s.opts.LeaseDuration:
			st.live = append(st.live, o)
		default:
			st.expired = append(st.expired, o)
		}
	}
	return st, nil
}

func isGCLease(vol string, o Object) bool {
	return strings.HasPrefix(o.Key, leasePrefix(vol)+leaseGC+"-")
}

// takeWorkLease takes the lease of a backup or restore and waits while a
// garbage collection of the volume holds a live lease. Both sides write
// their lease before looking at the other's, so at least one sees the
// other: a collection that sees ours gives up; we wait for one that
// started first to finish.
func (s *Store) takeWorkLease(ctx context.Context, vol, kind, id string) (*lease, error) {
	l, err := s.takeLease(ctx, vol, kind, id)
	if err != nil {
		return nil, err
	}
	poll := min(max(s.opts.LeaseDuration/20, 100*time.Millisecond), 5*time.Second)
	for {
		st, err := s.leases(ctx, vol, l)
		if err != nil {
			l.release()
			return nil, err
		}
		gc := false
		for _, o := range st.live {
			gc = gc || isGCLease(vol, o)
		}
		if !gc {
			return l, nil
		}
		s.log.Info("waiting for a garbage collection of the volume to finish", "volume", vol, "lease", l.key)
		select {
		case <-time.After(poll):
		case <-ctx.Done():
			l.release()
			return nil, ctx.Err()
		}
	}
}
