package engine

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Defaults of the options that bound Open's connects.
const (
	// DefaultConnectTimeout bounds one attempt to reach a replica at open
	// (connect, handshake, Info).
	DefaultConnectTimeout = 10 * time.Second
	// DefaultWaitInterval is how often Open says what it waits for and,
	// while it cannot serve safely, tries the missing replicas again.
	DefaultWaitInterval = 3 * time.Second
)

// Errors of the open path.
var (
	// ErrReplicasMissing: Open gave up waiting for replicas that did not
	// answer and may hold writes the others lack: its context ended, or
	// every one of them refused the engine (ErrRefused).
	ErrReplicasMissing = errors.New("replicas that may hold the newest data do not answer")
	// ErrRefused: a replica refused the engine in a way that trying again
	// cannot change (another volume's replica, or the engine has the
	// wrong key). A Dialer wraps such errors with it; Open does not wait
	// for replicas that all refused.
	ErrRefused = errors.New("the replica refused the engine")
)

// Waiting is what Open waits for, given to Options.OnWait: the replicas
// it is still connecting to, or, once every attempt of a round has ended,
// the ones without which it cannot serve the volume safely.
type Waiting struct {
	// Unanswered are the replicas that have not answered.
	Unanswered []Unanswered
	// Reason says why Open waits for them.
	Reason string
}

// Unanswered is a replica that has not answered Open.
type Unanswered struct {
	Address string
	// Err is why its last attempt failed; nil while the attempt runs.
	Err error
}

func (w Waiting) String() string {
	parts := make([]string, len(w.Unanswered))
	for i, u := range w.Unanswered {
		if u.Err == nil {
			parts[i] = u.Address + " (no answer yet)"
		} else {
			parts[i] = fmt.Sprintf("%s (%v)", u.Address, u.Err)
		}
	}
	return fmt.Sprintf("waiting for replica %s: %s", strings.Join(parts, ", replica "), w.Reason)
}

// answer is what the latest attempt to reach one replica at open found.
type answer struct {
	r    Replica     // the connection; nil if the replica did not answer
	info ReplicaInfo // what it reported (r != nil)
	err  error       // why it did not answer (r == nil)
}

// ServesAtOnce reports whether an engine given exactly the replicas infos
// describe, every one of them answering, serves the volume at once
// (safeToOpen, without AcceptLostMembers), and when not, why. The chaos
// harness asks it before it restarts an engine.
func ServesAtOnce(infos []ReplicaInfo) (ok bool, why string) {
	v := safeToOpen(infos, 0, false)
	return v.ok, v.why
}

// verdict is safeToOpen's decision.
type verdict struct {
	ok bool
	// why names what is missing when !ok.
	why string
	// lost are the members recorded at the newest epoch that the volume
	// is served without, because the caller declared them lost
	// (Options.AcceptLostMembers).
	lost []string
}

// safeToOpen decides whether the volume may be served from the replicas
// that answered (their infos) while unanswered others of those the engine
// was given did not. The rule (docs/engine.md, "Opening with replicas
// that do not answer"): every epoch is published with the IDs of the
// replicas RW at it (EpochState.Members). Let E be the newest epoch of an
// answering replica that can serve (not rebuilding). It is safe when
// every replica named by the sets recorded at E or later, by any
// answering replica (a rebuilding one too: its fence recorded the set of
// the engine that was adding it), has answered, whether or not the
// engine was given its address. A replica that missed an acknowledged
// write was failed, and the epoch moved past it, before the write was
// acknowledged; so a replica holding writes that E's holders lack went
// on from E without them, and was RW at E: named in E's set. Without a
// recorded set (replicas at an epoch set by an older cairn-data, or never
// opened) nothing can be shown, and every replica given must answer.
//
// With acceptLost, members that are not among the replicas given (all
// given ones answered) are not waited for: the verdict is ok, and names
// them in lost.
func safeToOpen(infos []ReplicaInfo, unanswered int, acceptLost bool) verdict {
	var epoch uint64
	found := false
	for _, in := range infos {
		if !in.Rebuilding && (!found || in.Epoch > epoch) {
			epoch, found = in.Epoch, true
		}
	}
	switch {
	case !found && unanswered == 0:
		return verdict{ok: true} // waiting changes nothing: Open fails with each one's reason
	case !found:
		return verdict{why: "no replica that answered can serve the volume (none answered, or only replicas whose rebuild did not finish)"}
	}
	answered := map[string]bool{}
	for _, in := range infos {
		answered[in.ID] = true
	}
	var missing []string
	unknown := "" // a replica at E or later without a member list
	for _, in := range infos {
		if in.Epoch < epoch {
			continue
		}
		if len(in.EpochMembers) == 0 {
			unknown = in.ID
		}
		for _, id := range in.EpochMembers {
			if !answered[id] && !slices.Contains(missing, id) {
				missing = append(missing, id)
			}
		}
	}
	if len(missing) == 0 && (unknown == "" || unanswered == 0) {
		return verdict{ok: true}
	}
	if len(missing) == 0 {
		return verdict{why: fmt.Sprintf("replica %s has epoch %d without a record of the replicas RW at it "+
			"(set by an older cairn-data, or the volume was never opened), so any replica that did not answer may hold newer writes; every replica must answer",
			unknown, epoch)}
	}
	slices.Sort(missing)
	if acceptLost && unanswered == 0 {
		return verdict{ok: true, lost: missing}
	}
	where := "has not answered"
	if unanswered == 0 {
		where = "is not among the replicas given to this engine"
	}
	return verdict{why: fmt.Sprintf("the newest epoch of the replicas that answered is %d, and replica ID %s, RW at it, %s: "+
		"it may hold writes the others lack, so the volume is not served without it", epoch, strings.Join(missing, ", "), where)}
}

// connect reaches the replicas (all at once, each attempt bounded by
// ConnectTimeout) until the volume can be served safely from those that
// answered (safeToOpen), trying the others again every WaitInterval and
// saying what it waits for; it gives up with ErrReplicasMissing when ctx
// ends. It then makes a member of every replica, in the order given: one
// that did not answer is ERR with its reason, the others are returned
// with what they reported.
func (e *Engine) connect(ctx context.Context) ([]cand, error) {
	addrs := e.opts.Replicas
	as := make([]answer, len(addrs))
	e.log.Info("opening replicas", "replicas", addrs, "connectTimeout", e.opts.ConnectTimeout.String())
	for {
		e.reach(ctx, addrs, as)
		w, v := e.assess(addrs, as)
		if v.ok {
			if len(v.lost) > 0 {
				e.log.Info("serving the volume without replicas declared lost: they were RW at the newest epoch, and writes only they held are lost",
					"lostReplicaIDs", strings.Join(v.lost, ","))
			}
			if len(w.Unanswered) > 0 {
				e.log.Info("opening without replicas that did not answer: they cannot hold writes the others lack; they are ERR until given back",
					"unanswered", w.String())
			}
			break
		}
		if allRefused(w.Unanswered) {
			return nil, e.giveUp(addrs, as, w, nil)
		}
		e.log.Info("cannot serve the volume yet", "waiting", w.String(), "retryIn", e.opts.WaitInterval.String())
		e.onWait(w)
		select {
		case <-ctx.Done():
			return nil, e.giveUp(addrs, as, w, ctx.Err())
		case <-time.After(e.opts.WaitInterval):
		}
	}
	var got []cand
	for i, a := range as {
		m := &member{addr: addrs[i], since: time.Now()}
		e.members = append(e.members, m)
		if a.r == nil {
			_ = e.become(m, ModeERR, fmt.Errorf("open: %w", a.err))
			continue
		}
		m.attach(a.r, e.opts.ControlTimeout)
		got = append(got, cand{m, a.info})
	}
	return got, nil
}

// giveUp closes the connections Open made and returns its error: what it
// waited for, and each replica's cause (and cause, if not nil).
func (e *Engine) giveUp(addrs []string, as []answer, w Waiting, cause error) error {
	for _, a := range as {
		if a.r != nil {
			a.r.Close()
		}
	}
	return fmt.Errorf("%w: %w: %s: %w", ErrNoReplica, ErrReplicasMissing, w, errors.Join(cause, answerErrors(addrs, as)))
}

// allRefused reports whether every replica in us refused the engine for
// good (ErrRefused): waiting for them cannot help.
func allRefused(us []Unanswered) bool {
	for _, u := range us {
		if !errors.Is(u.Err, ErrRefused) {
			return false
		}
	}
	return len(us) > 0
}

// assess lists the replicas that have not answered and decides whether
// the volume can be served without them.
func (e *Engine) assess(addrs []string, as []answer) (Waiting, verdict) {
	var w Waiting
	var infos []ReplicaInfo
	for i, a := range as {
		if a.r == nil {
			w.Unanswered = append(w.Unanswered, Unanswered{Address: addrs[i], Err: a.err})
		} else {
			infos = append(infos, a.info)
		}
	}
	v := safeToOpen(infos, len(w.Unanswered), e.opts.AcceptLostMembers)
	w.Reason = v.why
	return w, v
}

func (e *Engine) onWait(w Waiting) {
	if e.opts.OnWait != nil {
		e.opts.OnWait(w)
	}
}

// reach tries every replica at once: it connects to those without a
// connection and asks all of them for their info again (it may have
// changed while Open waited). Each attempt is bounded by ConnectTimeout,
// so one address that never answers delays nothing but itself, and
// every WaitInterval while attempts run it logs (and reports to OnWait)
// the replicas it is still waiting for.
func (e *Engine) reach(ctx context.Context, addrs []string, as []answer) {
	done := make([]atomic.Bool, len(as))
	var wg sync.WaitGroup
	for i := range as {
		wg.Go(func() {
			e.reachOne(ctx, addrs[i], &as[i])
			done[i].Store(true)
		})
	}
	finished := make(chan struct{})
	go func() {
		wg.Wait()
		close(finished)
	}()
	began := time.Now()
	tick := time.NewTicker(e.opts.WaitInterval)
	defer tick.Stop()
	for {
		select {
		case <-finished:
			return
		case <-tick.C:
		}
		w := Waiting{Reason: fmt.Sprintf("connecting for %s (each attempt is given %s)",
			time.Since(began).Round(time.Second), e.opts.ConnectTimeout)}
		for i := range as {
			if !done[i].Load() {
				w.Unanswered = append(w.Unanswered, Unanswered{Address: addrs[i]})
			}
		}
		if len(w.Unanswered) > 0 {
			e.log.Info("still connecting to replicas", "waiting", w.String())
			e.onWait(w)
		}
	}
}

// reachOne makes one attempt at the replica at addr, bounded by
// ConnectTimeout, and records the outcome in a: a connection that failed
// meanwhile is replaced, one whose Info fails is closed. A dial cut short
// by ctx itself keeps the cause an earlier attempt found (say, connection
// refused): that the wait ended tells nothing of the replica.
func (e *Engine) reachOne(ctx context.Context, addr string, a *answer) {
	failed := func(err error) {
		if ctx.Err() == nil || a.err == nil {
			a.err = err
		}
	}
	actx, cancel := context.WithTimeout(ctx, e.opts.ConnectTimeout)
	defer cancel()
	if a.r != nil {
		select {
		case <-a.r.Failed():
			a.r.Close()
			a.r = nil
		default:
		}
	}
	if a.r == nil {
		r, err := e.opts.Dial(actx, addr)
		if err != nil {
			failed(err)
			return
		}
		a.r = r
	}
	info, err := a.r.Info(actx)
	if err != nil {
		a.r.Close()
		a.r, a.err = nil, err // it answered: this is the cause now
		return
	}
	a.info, a.err = info, nil
}

// answerErrors are the causes of the replicas that did not answer, each
// prefixed with its address (see memberErrors).
func answerErrors(addrs []string, as []answer) error {
	var errs memberErrors
	for i, a := range as {
		if a.r == nil && a.err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", addrs[i], a.err))
		}
	}
	return errs
}

// rwIDsLocked are the IDs of the RW members: the set an epoch records.
// Callers hold e.mu.
func (e *Engine) rwIDsLocked() []string {
	var ids []string
	for _, m := range e.members {
		if m.mode == ModeRW && m.id != "" {
			ids = append(ids, m.id)
		}
	}
	return ids
}
