package volume

import (
	"cmp"
	"slices"
	"strings"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
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
// the engine's view of them.
type repairInput struct {
	want     int
	replicas []*v1.Replica
	// modes are the engine's replica modes by Replica name while its
	// process runs, as its status stream reported them; a replica it does
	// not hold has none. Nil while the engine does not run (or has not
	// reported): nothing serves, and the plan is faulted.
	modes map[string]v1.ReplicaMode
	// engineAddrs is the engine's current spec.replicaAddresses, and
	// engineNode the node it runs on.
	engineAddrs  map[string]v1.ReplicaAddress
	engineNode   string
	rebuildLimit int
	wait         time.Duration
	now          time.Time
}

// repairPlan is what the Volume reconciler does about its replicas:
// ensureReplicas creates the replacements, repair and salvage act on the
// rest while the engine serves.
type repairPlan struct {
	// addresses is the replica set the engine should serve.
	addresses map[string]v1.ReplicaAddress
	// failed are replicas that stopped serving (to mark failedAt);
	// healthy are replicas RW again or for the first time (to mark
	// healthyAt and clear failedAt).
	failed, healthy []string
	// replace is how many Replicas to create so that
	// spec.numberOfReplicas of them count. A replica being deleted never
	// counts. One failed for longer than the wait stops counting only
	// while the engine has an RW replica to rebuild a replacement from
	// (not faulted) and does not hold it RW or WO (being rebuilt). On a
	// faulted or stopped engine it keeps counting: a replacement could
	// not be rebuilt, and would be an empty replica an attach waits for.
	replace int
	// remove are failed replicas past the wait whose replacement is RW,
	// and replacements that turned out surplus: delete them (and their
	// data).
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

// runningAddress is where a running replica serves for anyone (its TCP
// data and control addresses), and whether it runs.
func runningAddress(r *v1.Replica) (v1.ReplicaAddress, bool) {
	ok := r.DeletionTimestamp.IsZero() && r.Status.InstanceState == v1.InstanceStateRunning && r.Status.Address != "" && r.Status.ControlAddress != ""
	return v1.ReplicaAddress{Data: r.Status.Address, Control: r.Status.ControlAddress}, ok
}

// engineAddress is where an engine on engineNode reaches a running
// replica: through the replica's unix socket when both run on that node
// (shared memory, no network stack), at its TCP address otherwise.
func engineAddress(r *v1.Replica, engineNode string) (v1.ReplicaAddress, bool) {
	_, ok := runningAddress(r)
	return r.Status.EngineAddress(r.Spec.NodeName, engineNode), ok
}

// heldMode reports whether an engine holding a replica in mode m serves
// from it (RW) or is rebuilding it (WO).
func heldMode(m v1.ReplicaMode) bool { return m == v1.ReplicaModeRW || m == v1.ReplicaModeWO }

// planRepair decides, from observed facts only, which replicas the engine
// serves, what to do about failed ones and how many to create:
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
//     engine has spec.numberOfReplicas RW replicas again; not while the
//     volume is faulted or its engine stopped, nor while the engine
//     rebuilds it (repairPlan.replace);
//   - but while the engine has fewer RW and WO replicas than wanted (the
//     replacement could not be placed, say: three nodes, three replicas),
//     a given-up replica that runs again is given back all the same, with
//     its delta resync; once the engine has enough RW replicas, a
//     replacement that never held data is deleted as surplus.
func planRepair(in repairInput) repairPlan {
	pl := newPlanner(in)
	for _, r := range pl.reps {
		pl.replica(r)
	}
	pl.p.replace = max(0, in.want-pl.counted)
	pl.surplus()
	if pl.p.rw < in.want {
		pl.p.remove = nil // the replacements are not RW yet: keep what might still be salvaged
	}
	slices.Sort(pl.p.remove)
	return pl.p
}

// planner holds planRepair's work in progress.
type planner struct {
	in   repairInput
	p    repairPlan
	reps []*v1.Replica // in repairOrder
	// moving maps a replica being moved off its node to its replacement.
	moving map[string]string
	wo     int
	// budget is how many more replicas may be given to the engine to
	// rebuild.
	budget int
	// active counts replicas neither given up nor being deleted; counted
	// those that count toward numberOfReplicas (repairPlan.replace).
	active, counted int
}

func newPlanner(in repairInput) *planner {
	pl := &planner{in: in, p: repairPlan{addresses: map[string]v1.ReplicaAddress{}}}
	for _, m := range in.modes {
		switch m {
		case v1.ReplicaModeRW:
			pl.p.rw++
		case v1.ReplicaModeWO:
			pl.wo++
		}
	}
	pl.p.faulted = pl.p.rw == 0
	pl.reps = repairOrder(in.replicas, in.engineAddrs)
	pl.budget = in.rebuildLimit - pl.wo
	pl.moving = moves(pl.reps)
	return pl
}

// repairOrder sorts the replicas as planRepair visits them: the engine's
// current set first (a candidate it was given keeps its rebuild slot from
// one reconcile to the next), then older failures first (they were
// waiting longest), then by name: the same facts always give the same set.
func repairOrder(replicas []*v1.Replica, engineAddrs map[string]v1.ReplicaAddress) []*v1.Replica {
	reps := slices.Clone(replicas)
	slices.SortFunc(reps, func(a, b *v1.Replica) int {
		_, ina := engineAddrs[a.Name]
		_, inb := engineAddrs[b.Name]
		if ina != inb {
			if ina {
				return -1
			}
			return 1
		}
		return cmp.Or(compareTimes(a.Spec.FailedAt, b.Spec.FailedAt), strings.Compare(a.Name, b.Name))
	})
	return reps
}

// replica plans for one replica: its health, whether it counts, and
// whether the engine is given it.
func (pl *planner) replica(r *v1.Replica) {
	mode, held := pl.in.modes[r.Name]
	failedAt := pl.health(r, mode, held)
	gone := failedAt != nil && pl.in.now.Sub(failedAt.Time) >= pl.in.wait
	pl.count(r, mode, failedAt, gone)
	pl.give(r, mode, gone)
}

// health marks r healthy (RW) or failed (ERR, or gone from the engine
// after serving) and returns since when it has failed (nil: it has not).
// A replica being moved off its node is leaving, not failed.
func (pl *planner) health(r *v1.Replica, mode v1.ReplicaMode, held bool) *metav1.Time {
	failedAt := r.Spec.FailedAt
	_, moved := pl.moving[r.Name]
	moved = moved && !r.DeletionTimestamp.IsZero()
	switch {
	case mode == v1.ReplicaModeRW:
		if failedAt != nil || r.Spec.HealthyAt == nil {
			pl.p.healthy = append(pl.p.healthy, r.Name)
		}
		return nil
	case moved:
		// Deleted once its replacement is RW: leaving, not failed.
	case mode == v1.ReplicaModeERR || (!held && r.Spec.HealthyAt != nil):
		if failedAt == nil {
			pl.p.failed = append(pl.p.failed, r.Name)
			return &metav1.Time{Time: pl.in.now}
		}
	}
	return failedAt
}

// count counts r toward numberOfReplicas (repairPlan.replace), notes when
// its wait ends, and removes it once given up (planRepair keeps it while
// the engine has too few RW replicas).
func (pl *planner) count(r *v1.Replica, mode v1.ReplicaMode, failedAt *metav1.Time, gone bool) {
	deleting := !r.DeletionTimestamp.IsZero()
	if !gone && !deleting {
		pl.active++
	}
	if !deleting && (!gone || pl.p.faulted || heldMode(mode)) {
		pl.counted++
	}
	if failedAt != nil && !gone {
		if d := failedAt.Add(pl.in.wait).Sub(pl.in.now); pl.p.recheckAfter == 0 || d < pl.p.recheckAfter {
			pl.p.recheckAfter = d
		}
	}
	if gone && !deleting {
		pl.p.remove = append(pl.p.remove, r.Name)
	}
}

// give puts r in the engine's set: always if the engine holds it, at the
// address it knows; every running replica while faulted; otherwise a
// running one while the rebuild budget lasts, a given-up one only while
// the engine has fewer RW and WO replicas than wanted.
func (pl *planner) give(r *v1.Replica, mode v1.ReplicaMode, gone bool) {
	addr, running := engineAddress(r, pl.in.engineNode)
	switch {
	case heldMode(mode):
		if a, ok := pl.in.engineAddrs[r.Name]; ok {
			addr = a
		}
		pl.p.addresses[r.Name] = addr
	case pl.p.faulted && running:
		pl.p.addresses[r.Name] = addr
	case running && pl.budget > 0 && (!gone || pl.p.rw+pl.wo < pl.in.want):
		pl.p.addresses[r.Name] = addr
		pl.budget--
	}
}

// surplus removes, once the engine has numberOfReplicas RW replicas, the
// replicas beyond that number that never held data and that the engine
// does not hold (a replacement made while a given-up replica was away,
// which came back and is RW again), the last in repairOrder first.
func (pl *planner) surplus() {
	if pl.p.rw < pl.in.want {
		return
	}
	extra := pl.active - pl.in.want
	for i := len(pl.reps) - 1; i >= 0 && extra > 0; i-- {
		r := pl.reps[i]
		if _, held := pl.in.modes[r.Name]; held || r.Spec.HealthyAt != nil || r.Spec.FailedAt != nil || !r.DeletionTimestamp.IsZero() || isReplacement(r, pl.moving) {
			continue
		}
		pl.p.remove = append(pl.p.remove, r.Name)
		extra--
	}
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
