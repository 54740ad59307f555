package volume

import (
	"context"
	"fmt"
	"slices"
	"strings"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/internal/volumes"
)

// LabelCloneFor marks the Snapshot a whole-volume clone takes of its
// source with the clone's name.
const LabelCloneFor = volumes.LabelCloneFor

// Cloned: see volumes.Cloned.
func Cloned(v *v1.Volume) bool { return volumes.Cloned(v) }

// CloneSnapshotName: see volumes.CloneSnapshotName.
func CloneSnapshotName(v *v1.Volume) string { return volumes.CloneSnapshotName(v) }

// ClonesFrom: see volumes.ClonesFrom.
func ClonesFrom(v *v1.Volume, source, snapshot string) bool {
	return volumes.ClonesFrom(v, source, snapshot)
}

// sameEncryption reports whether a clone and its source are encrypted
// alike: both not, or both with the same key.
func sameEncryption(a, b *v1.Volume) bool {
	ae, be := a.Spec.Encryption, b.Spec.Encryption
	return (ae == nil) == (be == nil) && (ae == nil || ae.KeyCheck == be.KeyCheck)
}

// failClone records in st a copy that cannot go on, with the cause and
// the fix.
func failClone(st *v1.CloneStatus, format string, args ...any) {
	st.State, st.Message = v1.CloneStateFailed, fmt.Sprintf(format, args...)
}

// planClone works out this volume's copy from spec.dataSource while it is
// not done: the source's snapshot (a whole-volume clone takes one first),
// its size, and a replica of the source that serves it. The outcome is in
// s.clone (for the status) and s.cloneFrom (for the engine, once a source
// replica is known). It writes two things: the Snapshot a whole-volume
// clone takes of its source (created once, found by name after a crash),
// and, when the maintenance engine reports the copy complete and verified,
// the Volume's cloned annotation, the fact that no engine copies again.
func (r *Reconciler) planClone(ctx context.Context, s *scope) error {
	v := s.v
	if v.Spec.DataSource == nil || v.Spec.DataSource.Backup != nil {
		return nil // none, or a restore (planRestore)
	}
	if Cloned(v) {
		s.clone = clonedStatus(v)
		return nil
	}
	st := &v1.CloneStatus{State: v1.CloneStatePending, SourceVolume: v.Spec.DataSource.Volume, Snapshot: CloneSnapshotName(v)}
	s.clone = st
	src, err := r.cloneSourceVolume(ctx, v, st)
	if err != nil || src == nil {
		return err
	}
	if ready, err := r.cloneSnapshot(ctx, v, st); err != nil || !ready {
		return err
	}
	if err := r.cloneSourceReplica(ctx, s, src); err != nil {
		return err
	}
	if s.cloneFrom == nil {
		st.Message = fmt.Sprintf("waiting for a replica of volume %s that its engine holds RW to read snapshot %s from (a detached source is started for the copy)", st.SourceVolume, st.Snapshot)
		return nil
	}
	st.State, st.Message = v1.CloneStateCopying, fmt.Sprintf("copying snapshot %s of volume %s from replica %s", st.Snapshot, st.SourceVolume, s.cloneFrom.Replica)
	return r.cloneProgress(ctx, s, st)
}

// clonedStatus is the status of a copy recorded as done: as it was last
// written, or, if the annotation was written and the status lost (a crash
// in between, a restore), from the annotation, which is the fact.
func clonedStatus(v *v1.Volume) *v1.CloneStatus {
	if c := v.Status.Clone; c != nil && c.State == v1.CloneStateCompleted {
		return c.DeepCopy()
	}
	src, snap, _ := strings.Cut(v.Annotations[volumes.AnnotationCloned], "/")
	return &v1.CloneStatus{State: v1.CloneStateCompleted, SourceVolume: src, Snapshot: snap, Progress: 100,
		Message: fmt.Sprintf("copied snapshot %s of volume %s and verified it", snap, src)}
}

// cloneSourceVolume reads the source volume; nil when the copy cannot be
// made from it (st says why).
func (r *Reconciler) cloneSourceVolume(ctx context.Context, v *v1.Volume, st *v1.CloneStatus) (*v1.Volume, error) {
	name := v.Spec.DataSource.Volume
	if name == v.Name {
		failClone(st, "spec.dataSource.volume names this volume itself: a volume cannot be cloned from itself; delete it and create it from another volume")
		return nil, nil
	}
	src := &v1.Volume{}
	if err := r.Get(ctx, client.ObjectKey{Namespace: v.Namespace, Name: name}, src); err != nil {
		if apierrors.IsNotFound(err) {
			failClone(st, "source volume %s does not exist in namespace %s: create it, or delete this volume and create it from an existing volume or snapshot", name, v.Namespace)
			return nil, nil
		}
		return nil, err
	}
	if !src.DeletionTimestamp.IsZero() {
		failClone(st, "source volume %s is being deleted: the copy cannot be made; delete this volume", name)
		return nil, nil
	}
	// A clone holds its source's bytes as they are: ciphertext of the
	// source's key, or plaintext.
	if !sameEncryption(v, src) {
		failClone(st, "source volume %s and this volume are not encrypted with the same key (a clone copies the source's bytes as they are, so it must be encrypted exactly when the source is, with the source's key check): delete this volume and create it with the source's spec.encryption", name)
		return nil, nil
	}
	return src, nil
}

// cloneSnapshot reports whether the snapshot to copy is taken and fits
// this volume; otherwise st says what the copy waits for or why it
// cannot be made. A whole-volume clone creates its snapshot of the
// source first.
func (r *Reconciler) cloneSnapshot(ctx context.Context, v *v1.Volume, st *v1.CloneStatus) (bool, error) {
	ds, snapName := v.Spec.DataSource, st.Snapshot
	sn := &v1.Snapshot{}
	err := r.Get(ctx, client.ObjectKey{Namespace: v.Namespace, Name: snapName}, sn)
	switch {
	case apierrors.IsNotFound(err) && ds.Snapshot == "":
		// A whole-volume clone copies a snapshot it takes of the source
		// first. If we crash after the create, the next reconcile finds it
		// by name; it is deleted once the copy is done or this volume is.
		sn = &v1.Snapshot{ObjectMeta: metav1.ObjectMeta{Name: snapName, Namespace: v.Namespace, Labels: map[string]string{LabelCloneFor: v.Name}},
			Spec: v1.SnapshotSpec{Volume: ds.Volume}}
		if err := r.Create(ctx, sn); err != nil && !apierrors.IsAlreadyExists(err) {
			return false, err
		}
		st.Message = fmt.Sprintf("taking snapshot %s of volume %s to copy", snapName, ds.Volume)
		return false, nil // its reconciler's changes bring us back
	case apierrors.IsNotFound(err):
		failClone(st, "snapshot %s does not exist in namespace %s: create the volume from an existing Snapshot of volume %s, or delete this volume", snapName, v.Namespace, ds.Volume)
		return false, nil
	case err != nil:
		return false, err
	}
	switch {
	case sn.Spec.Volume != ds.Volume:
		failClone(st, "snapshot %s captures volume %s, not %s: name the snapshot's own volume in spec.dataSource (delete this volume and create it again)", snapName, sn.Spec.Volume, ds.Volume)
	case !sn.DeletionTimestamp.IsZero() && !sn.Status.ReadyToUse:
		failClone(st, "snapshot %s is being deleted and was never taken: the copy cannot be made; delete this volume", snapName)
	// A taken snapshot being deleted is still copied: its deletion waits
	// for the clones copying it (the Snapshot reconciler), so it stays on
	// the source's replicas until this copy is done.
	case !sn.Status.ReadyToUse:
		msg := "it is being taken"
		if c := meta.FindStatusCondition(sn.Status.Conditions, v1.SnapshotConditionReady); c != nil {
			msg = c.Message
		}
		st.Message = fmt.Sprintf("waiting for snapshot %s of volume %s: %s", snapName, ds.Volume, msg)
	case sn.Status.Size != nil && sn.Status.Size.Cmp(v.Spec.Size) > 0:
		failClone(st, "snapshot %s holds %s, more than this volume's size %s: a clone must be at least as big as its source; delete this volume and create it with a size of at least %s",
			snapName, sn.Status.Size.String(), v.Spec.Size.String(), sn.Status.Size.String())
	default:
		return true, nil
	}
	return false, nil
}

// cloneSourceReplica sets s.cloneFrom to a replica of the source that the
// source's engine holds RW (it has every snapshot the engine took; an ERR
// one may have missed it), the one this volume's engine already reads
// from first, then by name: a change of source restarts the copy. None
// found: s.cloneFrom stays nil.
func (r *Reconciler) cloneSourceReplica(ctx context.Context, s *scope, src *v1.Volume) error {
	var reps v1.ReplicaList
	if err := r.List(ctx, &reps, client.InNamespace(src.Namespace), client.MatchingLabels{LabelVolume: src.Name}); err != nil {
		return err
	}
	se := &v1.Engine{}
	if err := r.Get(ctx, client.ObjectKey{Namespace: src.Namespace, Name: EngineName(src)}, se); client.IgnoreNotFound(err) != nil {
		return err
	}
	keep := ""
	if s.engine != nil && s.engine.Spec.CloneFrom != nil {
		keep = s.engine.Spec.CloneFrom.Replica
	}
	slices.SortFunc(reps.Items, func(a, b v1.Replica) int {
		if (a.Name == keep) != (b.Name == keep) {
			if a.Name == keep {
				return -1
			}
			return 1
		}
		return strings.Compare(a.Name, b.Name)
	})
	for i := range reps.Items {
		rep := &reps.Items[i]
		a, ok := runningAddress(rep)
		if !ok || !metav1.IsControlledBy(rep, src) || se.Status.InstanceState != v1.InstanceStateRunning || se.Status.ReplicaModeMap[rep.Name] != v1.ReplicaModeRW {
			continue
		}
		s.cloneFrom = &v1.EngineCloneSource{Replica: rep.Name, Address: a.Control, Snapshot: CloneSnapshotName(s.v)}
		return nil
	}
	return nil
}

// cloneProgress reports the maintenance engine's copy from s.cloneFrom in
// st, and records a copy complete and verified in the Volume's cloned
// annotation.
func (r *Reconciler) cloneProgress(ctx context.Context, s *scope, st *v1.CloneStatus) error {
	e := s.engine
	if e == nil || !e.Spec.Maintenance || e.Status.InstanceState != v1.InstanceStateRunning {
		st.Message += ": starting this volume's engine (without a device) to copy"
		return nil
	}
	c := e.Status.Clone
	if c == nil || c.Address != s.cloneFrom.Address || c.Snapshot != st.Snapshot {
		return nil
	}
	st.Progress = c.Progress
	switch c.State {
	case v1.RebuildStateComplete:
		// Copied and verified by the engine now running. Recorded first
		// in the annotation, then in the status at the end of this
		// reconcile; from then on no engine of this volume copies again,
		// and only then may a user's engine start. A crash before the
		// annotation: the next reconcile finds the copy complete again
		// (or, the engine restarted, copies again: no user has written
		// the volume, so that overwrites nothing but the same data).
		v := s.v
		before := v.DeepCopy()
		if v.Annotations == nil {
			v.Annotations = map[string]string{}
		}
		v.Annotations[volumes.AnnotationCloned] = st.SourceVolume + "/" + st.Snapshot
		if err := r.Patch(ctx, v, client.MergeFrom(before)); err != nil {
			return err
		}
		st.State, st.Progress, st.Message = v1.CloneStateCompleted, 100, fmt.Sprintf("copied snapshot %s of volume %s from replica %s and verified every replica by checksum", st.Snapshot, st.SourceVolume, s.cloneFrom.Replica)
	case v1.RebuildStateFailed:
		st.State, st.Message = v1.CloneStateFailed, fmt.Sprintf("copying snapshot %s of volume %s from replica %s failed (it is retried): %s", st.Snapshot, st.SourceVolume, s.cloneFrom.Replica, c.Error)
	default:
		st.Message += fmt.Sprintf(": %d%%", c.Progress)
	}
	return nil
}

// finishClone runs once the copy is recorded as done: the engine is told
// to copy no more, and the snapshot a whole-volume clone took of its
// source is deleted (its finalizer deletes it from the source's replicas).
func (r *Reconciler) finishClone(ctx context.Context, s *scope) error {
	if s.v.Spec.DataSource == nil || !Cloned(s.v) {
		return nil
	}
	if s.engine != nil && s.engine.Spec.CloneFrom != nil {
		if err := r.setEngine(ctx, s.engine, func(e *v1.Engine) { e.Spec.CloneFrom = nil }); err != nil {
			return err
		}
	}
	return r.deleteCloneSnapshots(ctx, s.v)
}

// deleteCloneSnapshots deletes the Snapshots v's clone took of its source.
func (r *Reconciler) deleteCloneSnapshots(ctx context.Context, v *v1.Volume) error {
	var snaps v1.SnapshotList
	if err := r.List(ctx, &snaps, client.InNamespace(v.Namespace), client.MatchingLabels{LabelCloneFor: v.Name}); err != nil {
		return err
	}
	for i := range snaps.Items {
		if snaps.Items[i].DeletionTimestamp.IsZero() {
			if err := r.Delete(ctx, &snaps.Items[i]); client.IgnoreNotFound(err) != nil {
				return err
			}
		}
	}
	return nil
}

// wantCloneFrom is what the engine's spec.cloneFrom must be: the source
// while this volume's copy is not done and its engine is a maintenance
// one, nothing otherwise. A user's engine never has it.
func (s *scope) wantCloneFrom() *v1.EngineCloneSource {
	if Cloned(s.v) || !s.maintenance || s.cloneFrom == nil {
		return nil
	}
	return s.cloneFrom.DeepCopy()
}
