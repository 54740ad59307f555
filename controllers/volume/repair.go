package volume

import (
	"cmp"
	"context"
	"slices"
	"strings"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/internal/objects"
)

// Defaults of the repair settings.
const (
	// DefaultReplenishmentWait is how long a failed replica may take to
	// come back before a replacement is built elsewhere. Coming back costs
	// a copy of the regions written meanwhile; a replacement costs a copy
	// of the whole volume, so a node rebooting is worth waiting for.
	DefaultReplenishmentWait = 60 * time.Second
	// DefaultConcurrentRebuildLimit is how many replicas of one volume are
	// rebuilt at a time: every rebuild reads from the same RW replicas as
	// the volume's own I/O.
	DefaultConcurrentRebuildLimit = 1
)

// repairInput is what planRepair decides from: the volume's replicas and
// the running engine's view of them.
type repairInput struct {
	want     int
	replicas []*v1.Replica
	// modes are the engine's replica modes by Replica name, as its status
	// stream reported them; a replica it does not hold has none.
	modes map[string]v1.ReplicaMode
	// engineAddrs is the engine's current spec.replicaAddresses.
	engineAddrs  map[string]v1.ReplicaAddress
	rebuildLimit int
	wait         time.Duration
	now          time.Time
}

// repairPlan is what the Volume reconciler does about its replicas while
// the engine runs.
type repairPlan struct {
	// addresses is the replica set the engine should serve.
	addresses map[string]v1.ReplicaAddress
	// failed are replicas that stopped serving (to mark failedAt);
	// healthy are replicas RW again or for the first time (to mark
	// healthyAt and clear failedAt).
	failed, healthy []string
	// replace is how many replacement replicas to create: failed ones
	// past the wait no longer count toward spec.numberOfReplicas.
	replace int
	// remove are failed replicas past the wait whose replacement is RW:
	// delete them (and their data).
	remove []string
	// recheckAfter is when the next failed replica's wait ends (0: none).
	recheckAfter time.Duration
	// rw counts the engine's RW replicas; faulted is true when it has
	// none: every running replica is given to the engine, which is
	// restarted and reopens the ones with the newest epoch.
	rw      int
	faulted bool
}

func expired(r *v1.Replica, wait time.Duration, now time.Time) bool {
	return r.Spec.FailedAt != nil && now.Sub(r.Spec.FailedAt.Time) >= wait
}

func runningAddress(r *v1.Replica) (v1.ReplicaAddress, bool) {
	ok := r.DeletionTimestamp.IsZero() && r.Status.InstanceState == v1.InstanceStateRunning && r.Status.Address != "" && r.Status.ControlAddress != ""
	return v1.ReplicaAddress{Data: r.Status.Address, Control: r.Status.ControlAddress}, ok
}

// planRepair decides, from observed facts only, which replicas the engine
// serves and what to do about failed ones:
//   - a replica the engine holds RW or WO stays, at the address the engine
//     knows it by (a lost instance-manager watch never takes it away);
//   - a failed replica (ERR, or gone from the engine after serving) is
//     marked failed, and given back as soon as its process runs again:
//     the engine recognises it and copies only the regions written while
//     it was away;
//   - at most rebuildLimit replicas are rebuilt at once;
//   - a replica failed for longer than the wait is given up: a
//     replacement is created (the scheduler puts it on a node without a
//     replica of the volume), and the failed one is deleted once the
//     engine has spec.numberOfReplicas RW replicas again;
//   - but while the engine has fewer RW and WO replicas than wanted (the
//     replacement could not be placed, say: three nodes, three replicas),
//     a given-up replica that runs again is given back all the same, with
//     its delta resync; once the engine has enough RW replicas, a
//     replacement that never held data is deleted as surplus.
func planRepair(in repairInput) repairPlan {
	p := repairPlan{addresses: map[string]v1.ReplicaAddress{}}
	wo := 0
	for _, m := range in.modes {
		switch m {
		case v1.ReplicaModeRW:
			p.rw++
		case v1.ReplicaModeWO:
			wo++
		}
	}
	p.faulted = p.rw == 0
	reps := slices.Clone(in.replicas)
	slices.SortFunc(reps, func(a, b *v1.Replica) int {
		// The engine's current set first (a candidate it was given keeps
		// its rebuild slot from one reconcile to the next), then older
		// failures first (they were waiting longest), then by name: the
		// same facts always give the same set.
		_, ina := in.engineAddrs[a.Name]
		_, inb := in.engineAddrs[b.Name]
		if ina != inb {
			if ina {
				return -1
			}
			return 1
		}
		return cmp.Or(compareTimes(a.Spec.FailedAt, b.Spec.FailedAt), strings.Compare(a.Name, b.Name))
	})
	budget := in.rebuildLimit - wo
	active := 0
	moving := moves(reps)
	for _, r := range reps {
		mode, held := in.modes[r.Name]
		failedAt := r.Spec.FailedAt
		_, moved := moving[r.Name]
		moved = moved && !r.DeletionTimestamp.IsZero()
		switch {
		case mode == v1.ReplicaModeRW:
			if failedAt != nil || r.Spec.HealthyAt == nil {
				p.healthy = append(p.healthy, r.Name)
			}
			failedAt = nil
		case moved:
			// Deleted once its replacement is RW: leaving, not failed.
		case mode == v1.ReplicaModeERR || (!held && r.Spec.HealthyAt != nil):
			if failedAt == nil {
				p.failed = append(p.failed, r.Name)
				failedAt = &metav1.Time{Time: in.now}
			}
		}
		gone := failedAt != nil && in.now.Sub(failedAt.Time) >= in.wait
		if !gone && r.DeletionTimestamp.IsZero() {
			active++
		}
		if failedAt != nil && !gone {
			if d := failedAt.Add(in.wait).Sub(in.now); p.recheckAfter == 0 || d < p.recheckAfter {
				p.recheckAfter = d
			}
		}
		if gone && r.DeletionTimestamp.IsZero() {
			p.remove = append(p.remove, r.Name)
		}
		addr, running := runningAddress(r)
		switch {
		case mode == v1.ReplicaModeRW || mode == v1.ReplicaModeWO:
			if a, ok := in.engineAddrs[r.Name]; ok {
				addr = a
			}
			p.addresses[r.Name] = addr
		case p.faulted && running:
			p.addresses[r.Name] = addr
		case running && budget > 0 && (!gone || p.rw+wo < in.want):
			p.addresses[r.Name] = addr
			budget--
		}
	}
	p.replace = max(0, in.want-active)
	if p.rw >= in.want {
		// Surplus: replicas that never held data and the engine does not
		// hold (a replacement made while a given-up replica was away,
		// which came back and is RW again).
		extra := active - in.want
		for i := len(reps) - 1; i >= 0 && extra > 0; i-- {
			r := reps[i]
			if _, held := in.modes[r.Name]; held || r.Spec.HealthyAt != nil || r.Spec.FailedAt != nil || !r.DeletionTimestamp.IsZero() || isReplacement(r, moving) {
				continue
			}
			p.remove = append(p.remove, r.Name)
			extra--
		}
	}
	if p.rw < in.want {
		p.remove = nil // the replacements are not RW yet: keep what might still be salvaged
	}
	slices.Sort(p.remove)
	return p
}

// isReplacement reports whether r takes over from a replica being moved
// off its node (moves): it is not surplus while that one is there.
func isReplacement(r *v1.Replica, moving map[string]string) bool {
	old := r.Labels[LabelReplaces]
	return old != "" && moving[old] == r.Name
}

// compareTimes orders nil last.
func compareTimes(a, b *metav1.Time) int {
	switch {
	case a == nil && b == nil:
		return 0
	case a == nil:
		return 1
	case b == nil:
		return -1
	}
	return a.Compare(b.Time)
}

// engineNotServing reports whether the engine's process is known not to
// serve: it exited, the instance manager that ran it is gone and the new
// one has no such process, or it is still starting (the Engine reconciler
// starts a starting engine again when it is given other replicas). An
// engine whose state is unknown (its instance manager does not answer)
// may still run and serve, and is left as it is.
func engineNotServing(e *v1.Engine) bool {
	switch e.Status.InstanceState {
	case v1.InstanceStateStopped, v1.InstanceStateError, v1.InstanceStateStarting:
		return true
	}
	return false
}

// startSet asks every scheduled replica to run and returns the ones an
// engine is (re)started with now: each replica that runs, at the address
// its Replica reports now (never one an earlier start was given), and how
// many replicas the start must wait for.
//
// A replica that does not run is waited for if it is being salvaged
// (every one that may hold the newest data must be there), and not if it
// has failed for longer than the replenishment wait. Otherwise it is not
// waited for when a running replica was RW with the last engine and never
// failed since (the engine's open then serves from the newest epoch among
// those given, and repair gives the missing one back with a delta resync
// once it runs): on a restart (the engine's process died under an
// attached volume), and at an attach for a replica on a node that is out
// of service (shut down, the operator says), which runs again only when
// the node is back. Without such a replica, a missing one may hold the
// only copy of the newest writes, and the start waits for it. A first
// attach waits for every other replica, as a detached volume's replicas
// all stopped together and come back together.
func (r *Reconciler) startSet(ctx context.Context, s *scope, restart bool) (map[string]v1.ReplicaAddress, int, error) {
	now := r.clock()
	salvaging := map[string]bool{}
	if list := s.v.Annotations[AnnotationSalvage]; list != "" {
		for _, n := range strings.Split(list, ",") {
			salvaging[n] = true
		}
	}
	addrs := map[string]v1.ReplicaAddress{}
	waiting, away, inSync := 0, 0, false
	for _, rep := range s.replicas {
		if rep.Spec.NodeName == "" || !rep.DeletionTimestamp.IsZero() {
			continue
		}
		if err := r.setReplica(ctx, rep, v1.DesiredInstanceStateRunning); err != nil {
			return nil, 0, err
		}
		if a, ok := runningAddress(rep); ok {
			addrs[rep.Name] = a
			inSync = inSync || (rep.Spec.HealthyAt != nil && rep.Spec.FailedAt == nil)
			continue
		}
		switch {
		case salvaging[rep.Name]:
			waiting++
			continue
		case expired(rep, r.wait(), now):
			continue
		case restart:
			away++
			continue
		}
		out, err := objects.OutOfService(ctx, r.Client, rep.Spec.NodeName)
		if err != nil {
			return nil, 0, err
		}
		if out {
			away++
		} else {
			waiting++
		}
	}
	if !inSync {
		waiting += away
	}
	return addrs, waiting, nil
}

// restartEngine gives an engine whose process does not serve (engineNotServing)
// the replicas startSet chose, at their current addresses, so that the
// Engine reconciler starts it again on them; the Engine reconciler starts
// nothing until every replica named runs at the address given
// (ReasonWaitingForReplicas), so an address gone stale since this patch
// is caught there and refreshed here on the Replica's next change. A
// restart that must wait for a replica goes back through attach (desired
// state stopped), which starts the engine once the replicas it waits for
// run, as at a first attach.
func (r *Reconciler) restartEngine(ctx context.Context, s *scope, addrs map[string]v1.ReplicaAddress, waiting int) error {
	if waiting > 0 || len(addrs) == 0 {
		return r.setEngine(ctx, s.engine, func(e *v1.Engine) { e.Spec.DesiredState = v1.DesiredInstanceStateStopped })
	}
	return r.setEngine(ctx, s.engine, func(e *v1.Engine) {
		e.Spec.ReplicaAddresses, e.Spec.Size, e.Spec.CloneFrom = addrs, s.v.Spec.Size, s.wantCloneFrom()
	})
}
