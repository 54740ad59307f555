package volume

import (
	"context"

	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
)

// reconcileDelete deletes the engine and the replicas (whose finalizers
// stop their processes and delete their data) and lets the Volume go once
// they are gone.
func (r *Reconciler) reconcileDelete(ctx context.Context, v *v1.Volume) (ctrl.Result, error) {
	if !controllerutil.ContainsFinalizer(v, Finalizer) {
		return ctrl.Result{}, nil
	}
	r.restores.forget(v.UID) // a restore into it stops
	s := &scope{v: v}
	if err := r.observe(ctx, s); err != nil {
		return ctrl.Result{}, err
	}
	if err := r.deleteSnapshots(ctx, v); err != nil {
		return ctrl.Result{}, err
	}
	// The engine first: it must not run on replicas being deleted.
	if s.engine != nil {
		if s.engine.DeletionTimestamp.IsZero() {
			if err := r.Delete(ctx, s.engine); client.IgnoreNotFound(err) != nil {
				return ctrl.Result{}, err
			}
		}
		return ctrl.Result{}, nil // its deletion brings us back (Owns)
	}
	for _, rep := range s.replicas {
		if rep.DeletionTimestamp.IsZero() {
			if err := r.Delete(ctx, rep); client.IgnoreNotFound(err) != nil {
				return ctrl.Result{}, err
			}
		}
	}
	if len(s.replicas) > 0 {
		before := v.DeepCopy()
		v.Status.State = v1.VolumeStateDeleting
		return ctrl.Result{}, r.Status().Patch(ctx, v, client.MergeFrom(before))
	}
	controllerutil.RemoveFinalizer(v, Finalizer)
	return ctrl.Result{}, r.Update(ctx, v)
}

// deleteSnapshots deletes the volume's Snapshots: their data is on the
// replicas deleted with it, so their finalizers just go (the Snapshot
// reconciler sees the volume deleting). The snapshot a whole-volume clone
// took of its source is the source's and is deleted from the source's
// replicas. Deleting them is not waited for.
func (r *Reconciler) deleteSnapshots(ctx context.Context, v *v1.Volume) error {
	var snaps v1.SnapshotList
	if err := r.List(ctx, &snaps, client.InNamespace(v.Namespace), client.MatchingLabels{LabelVolume: v.Name}); err != nil {
		return err
	}
	for i := range snaps.Items {
		if snaps.Items[i].DeletionTimestamp.IsZero() {
			if err := r.Delete(ctx, &snaps.Items[i]); client.IgnoreNotFound(err) != nil {
				return err
			}
		}
	}
	return r.deleteCloneSnapshots(ctx, v)
}
