package drain

import (
	"fmt"
	"slices"
	"strings"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
)

// MaxBlockers is how many blockers a StorageNode's status lists.
const MaxBlockers = 50

// Objects are a namespace's Volumes, Engines and Replicas, as read.
type Objects struct {
	Volumes  []v1.Volume
	Engines  []v1.Engine
	Replicas []v1.Replica
}

func (o *Objects) engineOf(vol string) *v1.Engine {
	for i := range o.Engines {
		if o.Engines[i].Spec.VolumeName == vol {
			return &o.Engines[i]
		}
	}
	return nil
}

func (o *Objects) replicasOf(vol string) []*v1.Replica {
	var out []*v1.Replica
	for i := range o.Replicas {
		if r := &o.Replicas[i]; r.Spec.VolumeName == vol && r.DeletionTimestamp.IsZero() {
			out = append(out, r)
		}
	}
	return out
}

// engineOn reports whether the volume's engine runs, or is asked to run,
// on node: a drain must wait for the volume to detach from there.
func engineOn(e *v1.Engine, node string) bool {
	if e == nil || e.Spec.NodeName != node {
		return false
	}
	switch e.Status.InstanceState {
	case v1.InstanceStateRunning, v1.InstanceStateStarting, v1.InstanceStateStopping, v1.InstanceStateUnknown:
		return true
	}
	return e.Spec.DesiredState == v1.DesiredInstanceStateRunning
}

// healthyReplicas are the replicas of the volume that hold its newest
// data: the ones its running engine holds RW; without a running engine
// (detached), the ones that were RW with the last engine and have not
// failed since.
func healthyReplicas(e *v1.Engine, reps []*v1.Replica) []*v1.Replica {
	var out []*v1.Replica
	if e != nil && e.Status.InstanceState == v1.InstanceStateRunning && len(e.Status.ReplicaModeMap) > 0 {
		for _, r := range reps {
			if e.Status.ReplicaModeMap[r.Name] == v1.ReplicaModeRW {
				out = append(out, r)
			}
		}
		return out
	}
	for _, r := range reps {
		if r.Spec.HealthyAt != nil && r.Spec.FailedAt == nil {
			out = append(out, r)
		}
	}
	return out
}

// lastHealthyOn returns the volume's healthy replicas if every one of them
// is on node (nil otherwise, and for a volume with none: it has no data to
// lose).
func lastHealthyOn(e *v1.Engine, reps []*v1.Replica, node string) []*v1.Replica {
	h := healthyReplicas(e, reps)
	if len(h) == 0 {
		return nil
	}
	for _, r := range h {
		if r.Spec.NodeName != node {
			return nil
		}
	}
	return h
}

// Blockers lists, by volume name, what holds a drain of node: an engine
// running there (the volume is attached there), and a volume whose every
// healthy replica is there, attached or not (taken away with the node, the
// volume would have no data to serve from, wherever its pod goes next). A
// volume with healthy replicas on other nodes does not block: it goes on
// degraded, and its replica here is given back (or replaced) as after any
// node outage.
func Blockers(node string, objs *Objects) []v1.DrainBlocker {
	var out []v1.DrainBlocker
	vols := slices.Clone(objs.Volumes)
	slices.SortFunc(vols, func(a, b v1.Volume) int { return strings.Compare(a.Name, b.Name) })
	for _, v := range vols {
		if !v.DeletionTimestamp.IsZero() {
			continue
		}
		e := objs.engineOf(v.Name)
		if engineOn(e, node) {
			what := "the volume is attached to this node"
			if e.Spec.Maintenance {
				what = "Cairn's own work on the volume (snapshots, a clone) runs there"
			}
			out = append(out, v1.DrainBlocker{Volume: v.Name, Reason: v1.DrainBlockEngineRunning,
				Message: fmt.Sprintf("engine %s runs on %s (%s); it stops once the pods using the volume are evicted and it detaches", e.Name, node, what)})
		}
		if h := lastHealthyOn(e, objs.replicasOf(v.Name), node); h != nil {
			names := make([]string, len(h))
			for i, r := range h {
				names[i] = r.Name
			}
			out = append(out, v1.DrainBlocker{Volume: v.Name, Reason: v1.DrainBlockLastHealthyReplica,
				Message: fmt.Sprintf("every healthy replica of the volume is on %s (%s): it is moved to another node first while the node is cordoned or evicting, which needs the volume attached",
					node, strings.Join(names, ", "))})
		}
	}
	return out
}

// ReplicasOn counts the replicas placed on node.
func ReplicasOn(node string, objs *Objects) int {
	n := 0
	for _, r := range objs.Replicas {
		if r.Spec.NodeName == node && r.DeletionTimestamp.IsZero() {
			n++
		}
	}
	return n
}
