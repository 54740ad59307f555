package drain

import (
	"context"
	"fmt"
	"strings"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/rand"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/internal/objects"
	"github.com/cairn-io/cairn/controllers/internal/volumes"
	"github.com/cairn-io/cairn/controllers/scheduler"
	"github.com/cairn-io/cairn/controllers/volume"
)

// Volume event reasons.
const (
	EventMoveStarted = "ReplicaMoveStarted"
	EventMoved       = "ReplicaMoved"
)

// inProgress finds a move off node under way: a replica labelled
// volume.LabelReplaces with the name of a replica on node. It returns the
// replica moved and its replacement.
func inProgress(node string, objs *Objects) (from, to *v1.Replica) {
	byName := map[string]*v1.Replica{}
	for i := range objs.Replicas {
		byName[objs.Replicas[i].Name] = &objs.Replicas[i]
	}
	for i := range objs.Replicas {
		r := &objs.Replicas[i]
		old := byName[r.Labels[volume.LabelReplaces]]
		if old != nil && old.Spec.NodeName == node && r.DeletionTimestamp.IsZero() && r.Spec.VolumeName == old.Spec.VolumeName {
			return old, r
		}
	}
	return nil, nil
}

// candidates are the replicas to move off node, volume by volume in name
// order: every one when all is true (eviction requested), else those
// holding a volume's last healthy copy (a cordoned node).
func candidates(node string, all bool, objs *Objects) []*v1.Replica {
	var out []*v1.Replica
	for _, b := range Blockers(node, objs) {
		if b.Reason == v1.DrainBlockLastHealthyReplica && !all {
			out = append(out, lastHealthyOn(objs.engineOf(b.Volume), objs.replicasOf(b.Volume), node)...)
		}
	}
	if all {
		for i := range objs.Replicas {
			if r := &objs.Replicas[i]; r.Spec.NodeName == node && r.DeletionTimestamp.IsZero() {
				out = append(out, r)
			}
		}
	}
	// Stable: by volume, then by name.
	slicesSortReplicas(out)
	return out
}

// movable reports whether the volume can copy a replica now: its engine
// runs (a user's, not Cairn's own maintenance engine) with an RW replica
// to copy from. A detached volume's replica is moved at its next attach.
func movable(e *v1.Engine) bool {
	if e == nil || e.Status.InstanceState != v1.InstanceStateRunning || e.Spec.Maintenance {
		return false
	}
	for _, m := range e.Status.ReplicaModeMap {
		if m == v1.ReplicaModeRW {
			return true
		}
	}
	return false
}

// move advances the move of replicas off the node by one step and says
// what it is doing (for status.drain.moving): it finishes the move under
// way (its replacement RW: the moved replica is deleted), or starts the
// next one (a replacement placed on another node; the Volume reconciler
// starts it and its engine rebuilds it). One volume at a time: every
// rebuild reads from the volume's RW replicas and crosses the network.
func (r *Reconciler) move(ctx context.Context, s *scope) (string, error) {
	if from, to := inProgress(s.node, s.objs); from != nil {
		e := s.objs.engineOf(from.Spec.VolumeName)
		if e == nil || e.Status.ReplicaModeMap[to.Name] != v1.ReplicaModeRW {
			return fmt.Sprintf("moving replica %s of volume %s: its replacement %s on %s is being rebuilt", from.Name, from.Spec.VolumeName, to.Name, to.Spec.NodeName), nil
		}
		// Its finalizer stops its process and deletes its data; a crash
		// after this call finds it being deleted and the next move starts.
		if err := r.Delete(ctx, from, client.Preconditions{UID: &from.UID}); client.IgnoreNotFound(err) != nil {
			return "", err
		}
		if v := s.volume(from.Spec.VolumeName); v != nil {
			objects.Event(r.Recorder, v, false, EventMoved, "Move", "replica %s moved off node %s: %s on %s is RW; %s is deleted with its data",
				from.Name, s.node, to.Name, to.Spec.NodeName, from.Name)
		}
		return fmt.Sprintf("moved replica %s of volume %s to %s", from.Name, from.Spec.VolumeName, to.Spec.NodeName), nil
	}
	var waiting []string
	for _, from := range candidates(s.node, s.sn.Spec.EvictionRequested, s.objs) {
		v := s.volume(from.Spec.VolumeName)
		if v == nil || !v.DeletionTimestamp.IsZero() {
			continue
		}
		if !movable(s.objs.engineOf(v.Name)) {
			waiting = append(waiting, v.Name)
			continue
		}
		return r.startMove(ctx, s, v, from)
	}
	if len(waiting) > 0 {
		return fmt.Sprintf("replicas of %s wait: a replica is copied by its volume's engine, so it is moved while the volume is attached", strings.Join(waiting, ", ")), nil
	}
	return "", nil
}

// startMove places a replacement for from on a disk of another node that
// is neither cordoned nor evicting, and creates it.
func (r *Reconciler) startMove(ctx context.Context, s *scope, v *v1.Volume, from *v1.Replica) (string, error) {
	var placed []scheduler.Placed
	for _, rep := range s.objs.replicasOf(v.Name) {
		if rep.Spec.NodeName != "" {
			placed = append(placed, scheduler.Placed{Node: rep.Spec.NodeName, Disk: rep.Spec.DiskName})
		}
	}
	var disks []scheduler.Disk
	for _, d := range scheduler.FromStorageNodes(s.storageNodes) {
		if !s.leaving[d.Node] {
			disks = append(disks, d)
		}
	}
	name := v.Name + "-r-" + rand.String(8)
	// The Ledger decides and creates the replacement under its lock, so
	// no Volume worker takes the same room meanwhile.
	res, err := r.Ledger.Place(ctx, scheduler.PlaceOptions{Namespace: v.Namespace, Volume: v.Name,
		Request: scheduler.Request{Size: v.Spec.Size.Value(), Tags: v.Spec.DiskSelector, OverProvisioningPercent: r.OverProvisioningPercent},
		Disks:   disks, Placed: placed, N: 1,
		Write: func(ctx context.Context, _ int, p scheduler.Placement) (client.ObjectKey, error) {
			to := &v1.Replica{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: v.Namespace,
				Labels: map[string]string{volumes.LabelVolume: v.Name, volume.LabelReplaces: from.Name}},
				Spec: v1.ReplicaSpec{VolumeName: v.Name, Size: v.Spec.Size, DesiredState: v1.DesiredInstanceStateStopped,
					NodeName: p.Node, DiskName: p.Disk, DiskPath: p.Path, DataDirectoryName: name}}
			if err := controllerutil.SetControllerReference(v, to, r.Scheme()); err != nil {
				return client.ObjectKey{}, err
			}
			// A crash after the create: the next reconcile finds it by
			// its label (inProgress) and waits for it.
			return client.ObjectKeyFromObject(to), r.Create(ctx, to)
		}})
	if err != nil {
		return "", err
	}
	if len(res.Placements) == 0 {
		s.retryAfter = res.RetryAfter
		return fmt.Sprintf("replica %s of volume %s cannot be moved: no other node can take it (%s)", from.Name, v.Name, res.Reason), nil
	}
	p := res.Placements[0]
	objects.Event(r.Recorder, v, false, EventMoveStarted, "Move", "replica %s is moved off node %s (%s): replacement %s placed on %s, rebuilt by the engine",
		from.Name, s.node, s.why(), name, p.Node)
	return fmt.Sprintf("moving replica %s of volume %s: its replacement %s on %s is being rebuilt", from.Name, v.Name, name, p.Node), nil
}

// leavingNodes are the nodes replicas must not be moved to: cordoned, or
// whose StorageNode asks for eviction.
func leavingNodes(nodes []corev1.Node, sns []v1.StorageNode) map[string]bool {
	out := map[string]bool{}
	for _, n := range nodes {
		if n.Spec.Unschedulable {
			out[n.Name] = true
		}
	}
	for _, sn := range sns {
		if sn.Spec.EvictionRequested {
			out[sn.Spec.NodeName] = true
		}
	}
	return out
}
