package volume

import (
	"context"

	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
)

// indexDataSourceVolume is the IndexDataSourceVolume index: the volume a
// Volume is cloned from.
func indexDataSourceVolume(o client.Object) []string {
	if ds := o.(*v1.Volume).Spec.DataSource; ds != nil && ds.Volume != "" {
		return []string{ds.Volume}
	}
	return nil
}

// watchMaps are the Volumes each watched object's change brings back,
// besides the Volume's own Engine and Replicas (Owns).
type watchMaps struct {
	c client.Client
}

// clonesOf are the Volumes still copying from volume name.
func (m watchMaps) clonesOf(ctx context.Context, ns, name string) []reconcile.Request {
	var vs v1.VolumeList
	if err := m.c.List(ctx, &vs, client.InNamespace(ns), client.MatchingFields{IndexDataSourceVolume: name}); err != nil {
		return nil
	}
	var out []reconcile.Request
	for i := range vs.Items {
		if !Cloned(&vs.Items[i]) {
			out = append(out, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(&vs.Items[i])})
		}
	}
	return out
}

// snapshot: a Snapshot to take or delete runs its volume's processes; one
// taken lets the clones copying it go on.
func (m watchMaps) snapshot(ctx context.Context, o client.Object) []reconcile.Request {
	sn := o.(*v1.Snapshot)
	out := append([]reconcile.Request{{NamespacedName: client.ObjectKey{Namespace: sn.Namespace, Name: sn.Spec.Volume}}},
		m.clonesOf(ctx, sn.Namespace, sn.Spec.Volume)...)
	if n := sn.Labels[LabelCloneFor]; n != "" {
		out = append(out, reconcile.Request{NamespacedName: client.ObjectKey{Namespace: sn.Namespace, Name: n}})
	}
	return out
}

// backup: a detached volume runs its processes while a Backup reads from
// it (observeWork).
func (m watchMaps) backup(_ context.Context, o client.Object) []reconcile.Request {
	b := o.(*v1.Backup)
	return []reconcile.Request{{NamespacedName: client.ObjectKey{Namespace: b.Namespace, Name: b.Spec.Volume}}}
}

// cloneOrSource: a clone's source learns it is read from, and that it is
// no more.
func (m watchMaps) cloneOrSource(ctx context.Context, o client.Object) []reconcile.Request {
	v := o.(*v1.Volume)
	out := m.clonesOf(ctx, v.Namespace, v.Name)
	if v.Spec.DataSource != nil && v.Spec.DataSource.Volume != "" {
		out = append(out, reconcile.Request{NamespacedName: client.ObjectKey{Namespace: v.Namespace, Name: v.Spec.DataSource.Volume}})
	}
	return out
}

// engineOfSource and replicaOfSource: a source's engine and replicas say
// which replica a clone reads.
func (m watchMaps) engineOfSource(ctx context.Context, o client.Object) []reconcile.Request {
	return m.clonesOf(ctx, o.GetNamespace(), o.(*v1.Engine).Spec.VolumeName)
}

func (m watchMaps) replicaOfSource(ctx context.Context, o client.Object) []reconcile.Request {
	return m.clonesOf(ctx, o.GetNamespace(), o.(*v1.Replica).Spec.VolumeName)
}

// unscheduled: disks appearing or changing may let unplaced replicas be
// placed, so every Volume not yet Scheduled comes back.
func (m watchMaps) unscheduled(ctx context.Context, o client.Object) []reconcile.Request {
	var vs v1.VolumeList
	if err := m.c.List(ctx, &vs, client.InNamespace(o.GetNamespace())); err != nil {
		return nil
	}
	var out []reconcile.Request
	for _, v := range vs.Items {
		if c := meta.FindStatusCondition(v.Status.Conditions, v1.VolumeConditionScheduled); c == nil || c.Status != metav1.ConditionTrue {
			out = append(out, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(&v)})
		}
	}
	return out
}
