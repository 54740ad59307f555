package volume

import (
	"context"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/internal/objects"
	"github.com/cairn-io/cairn/controllers/scheduler"
)

func wantReplicas(v *v1.Volume) int { return v.Spec.Replicas() }

// ensureReplicas creates the Replicas (unscheduled, stopped) the repair
// plan asks for: at first numberOfReplicas of them, then a replacement
// for each one being deleted or given up (planRepair, repairPlan.replace).
func (r *Reconciler) ensureReplicas(ctx context.Context, s *scope) error {
	for range s.plan.replace {
		replacing := len(s.replicas) >= wantReplicas(s.v)
		rep := &v1.Replica{ObjectMeta: metav1.ObjectMeta{GenerateName: s.v.Name + "-r-", Namespace: s.v.Namespace, Labels: map[string]string{LabelVolume: s.v.Name}},
			Spec: v1.ReplicaSpec{VolumeName: s.v.Name, Size: s.v.Spec.Size, DesiredState: v1.DesiredInstanceStateStopped}}
		if err := controllerutil.SetControllerReference(s.v, rep, r.Scheme()); err != nil {
			return err
		}
		// A crash after the create: the next reconcile lists it by label.
		if err := r.Create(ctx, rep); err != nil {
			return err
		}
		if replacing {
			objects.Event(r.Recorder, s.v, false, EventReplicaReplaced, "Replenish",
				"replica %s created to replace a replica failed for longer than %s", rep.Name, r.wait())
		}
		s.replicas = append(s.replicas, rep)
	}
	return nil
}

// schedule places every unscheduled replica on a disk, through the
// Ledger, which counts each disk's scheduled bytes from the Replicas and
// lets one placement decision run at a time. Each placement is a patch
// with the Replica's resourceVersion: if another reconcile placed it
// first (from a cache that did not show it placed yet), the patch
// conflicts and this reconcile is retried, rather than moving it.
func (r *Reconciler) schedule(ctx context.Context, s *scope) error {
	var pending []*v1.Replica
	var placed []scheduler.Placed
	for _, rep := range s.replicas {
		if rep.Spec.NodeName == "" {
			pending = append(pending, rep)
		} else {
			placed = append(placed, scheduler.Placed{Node: rep.Spec.NodeName, Disk: rep.Spec.DiskName})
		}
	}
	if len(pending) == 0 {
		return nil
	}
	var sns v1.StorageNodeList
	if err := r.List(ctx, &sns, client.InNamespace(s.v.Namespace)); err != nil {
		return err
	}
	res, err := r.Ledger.Place(ctx, scheduler.PlaceOptions{Namespace: s.v.Namespace, Volume: s.v.Name,
		Request: scheduler.Request{Size: s.v.Spec.Size.Value(), Tags: s.v.Spec.DiskSelector, OverProvisioningPercent: r.OverProvisioningPercent},
		Disks:   scheduler.FromStorageNodes(sns.Items), Placed: placed, N: len(pending),
		Write: func(ctx context.Context, i int, p scheduler.Placement) (client.ObjectKey, error) {
			rep := pending[i]
			before := rep.DeepCopy()
			rep.Spec.NodeName, rep.Spec.DiskName, rep.Spec.DiskPath = p.Node, p.Disk, p.Path
			rep.Spec.DataDirectoryName = rep.Name
			err := r.Patch(ctx, rep, client.MergeFromWithOptions(before, client.MergeFromWithOptimisticLock{}))
			if err != nil {
				// Not placed: the status written after this reconcile
				// must not count it.
				rep.Spec = before.Spec
			}
			return client.ObjectKeyFromObject(rep), err
		}})
	if err != nil {
		return err
	}
	s.unplaced, s.reason = res.Unplaced, res.Reason
	s.requeueWithin(res.RetryAfter)
	return nil
}

func (r *Reconciler) patchReplica(ctx context.Context, rep *v1.Replica, mutate func(*v1.Replica)) error {
	before := rep.DeepCopy()
	mutate(rep)
	return r.Patch(ctx, rep, client.MergeFrom(before))
}

func (r *Reconciler) setReplica(ctx context.Context, rep *v1.Replica, want v1.DesiredInstanceState) error {
	if rep.Spec.DesiredState == want {
		return nil
	}
	before := rep.DeepCopy()
	rep.Spec.DesiredState = want
	return r.Patch(ctx, rep, client.MergeFrom(before))
}
