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

// runInput is what decides where the volume's engine runs, and how.
type runInput struct {
	// userNode is spec.nodeName: where a user wants the volume.
	userNode string
	// work says why processes must run for Cairn's own work ("" none):
	// snapshots to take or delete, a clone reading from this volume.
	work string
	// cloned is false while this volume's own clone copy is not done;
	// cloneReady is true once it knows the source replica to copy from.
	cloned, cloneReady bool
	// engineNode and engineMaintenance are the engine's current spec.
	engineNode        string
	engineMaintenance bool
	// replicaNodes are the nodes of the scheduled replicas that have not
	// failed, the ones whose process runs first, each group by replica name.
	replicaNodes []string
}

// runTarget decides where the engine runs (node "": nowhere) and whether
// as a maintenance engine (no device). A user's attach is honoured as
// soon as the volume's clone is done; until then the engine on the user's
// node copies without a device, so nobody sees a partial copy. Without a
// user, pending work runs a maintenance engine on the node it already
// runs on if that holds a replica, else on the first replica's node.
func runTarget(in runInput) (node string, maintenance bool) {
	pick := func() string {
		if in.userNode != "" {
			return in.userNode
		}
		if in.engineNode != "" && in.engineMaintenance && slices.Contains(in.replicaNodes, in.engineNode) {
			return in.engineNode
		}
		if len(in.replicaNodes) > 0 {
			return in.replicaNodes[0]
		}
		return ""
	}
	switch {
	case !in.cloned && (in.cloneReady || in.work != ""):
		if n := pick(); n != "" {
			return n, true
		}
		return "", false
	case !in.cloned:
		return "", false // nothing to copy yet, and no user may have it
	case in.userNode != "":
		return in.userNode, false
	case in.work != "":
		if n := pick(); n != "" {
			return n, true
		}
	}
	return "", false
}

// observeWork lists what this volume's processes must run for: its
// Snapshots not yet taken or being deleted, and Volumes cloning from it.
func (r *Reconciler) observeWork(ctx context.Context, s *scope) error {
	var snaps v1.SnapshotList
	if err := r.List(ctx, &snaps, client.InNamespace(s.v.Namespace), client.MatchingLabels{LabelVolume: s.v.Name}); err != nil {
		return err
	}
	// A volume not yet filled from its data source has taken no
	// snapshot (the Snapshot reconciler waits for the copy): nothing to
	// take or delete until then.
	var take, del []string
	ready := map[string]*v1.Snapshot{}
	for _, sn := range snaps.Items {
		switch {
		case !Cloned(s.v):
		case !sn.DeletionTimestamp.IsZero() && slices.Contains(sn.Finalizers, volumes.SnapshotFinalizer):
			del = append(del, sn.Name)
		case sn.DeletionTimestamp.IsZero() && !sn.Status.ReadyToUse:
			take = append(take, sn.Name)
		case sn.DeletionTimestamp.IsZero():
			ready[sn.Name] = &sn
		}
	}
	var vols v1.VolumeList
	if err := r.List(ctx, &vols, client.InNamespace(s.v.Namespace), client.MatchingFields{IndexDataSourceVolume: s.v.Name}); err != nil {
		return err
	}
	var clones []string
	for i := range vols.Items {
		// A clone needs a replica of this volume only once the snapshot it
		// copies is taken (until then the snapshot is the work); one whose
		// snapshot does not exist, or is too big for it, fails without it.
		c := &vols.Items[i]
		sn := ready[CloneSnapshotName(c)]
		if ClonesFrom(c, s.v.Name, "") && sn != nil && (sn.Status.Size == nil || sn.Status.Size.Cmp(c.Spec.Size) <= 0) && sameEncryption(c, s.v) {
			clones = append(clones, c.Name)
		}
	}
	var parts []string
	if len(take) > 0 {
		parts = append(parts, "taking snapshot "+strings.Join(take, ", "))
	}
	if len(del) > 0 {
		parts = append(parts, "deleting snapshot "+strings.Join(del, ", "))
	}
	if len(clones) > 0 {
		parts = append(parts, "volume "+strings.Join(clones, ", ")+" copying from it")
	}
	s.work = strings.Join(parts, "; ")
	return nil
}

// sameEncryption reports whether a clone and its source are encrypted
// alike: both not, or both with the same key.
func sameEncryption(a, b *v1.Volume) bool {
	ae, be := a.Spec.Encryption, b.Spec.Encryption
	return (ae == nil) == (be == nil) && (ae == nil || ae.KeyCheck == be.KeyCheck)
}

// target fills s.node and s.maintenance (runTarget).
func (s *scope) target() {
	var running, other []string
	for _, rep := range s.replicas {
		if rep.Spec.NodeName == "" || !rep.DeletionTimestamp.IsZero() || rep.Spec.FailedAt != nil {
			continue
		}
		if _, ok := runningAddress(rep); ok {
			running = append(running, rep.Spec.NodeName)
		} else {
			other = append(other, rep.Spec.NodeName)
		}
	}
	in := runInput{userNode: s.v.Spec.NodeName, work: s.work, cloned: Cloned(s.v), cloneReady: s.cloneFrom != nil,
		replicaNodes: append(running, other...)}
	if s.engine != nil {
		in.engineNode, in.engineMaintenance = s.engine.Spec.NodeName, s.engine.Spec.Maintenance
	}
	s.node, s.maintenance = runTarget(in)
	s.targeted = true
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
	ds := v.Spec.DataSource
	if ds == nil {
		return nil
	}
	if Cloned(v) {
		s.clone = v.Status.Clone.DeepCopy()
		if s.clone == nil || s.clone.State != v1.CloneStateCompleted {
			// The annotation was written and the status lost (a crash in
			// between, a restore): the annotation is the fact.
			src, snap, _ := strings.Cut(v.Annotations[volumes.AnnotationCloned], "/")
			s.clone = &v1.CloneStatus{State: v1.CloneStateCompleted, SourceVolume: src, Snapshot: snap, Progress: 100,
				Message: fmt.Sprintf("copied snapshot %s of volume %s and verified it", snap, src)}
		}
		return nil
	}
	snapName := CloneSnapshotName(v)
	st := &v1.CloneStatus{State: v1.CloneStatePending, SourceVolume: ds.Volume, Snapshot: snapName}
	s.clone = st
	fail := func(format string, args ...any) error {
		st.State, st.Message = v1.CloneStateFailed, fmt.Sprintf(format, args...)
		return nil
	}
	if ds.Volume == v.Name {
		return fail("spec.dataSource.volume names this volume itself: a volume cannot be cloned from itself; delete it and create it from another volume")
	}
	src := &v1.Volume{}
	if err := r.Get(ctx, client.ObjectKey{Namespace: v.Namespace, Name: ds.Volume}, src); err != nil {
		if apierrors.IsNotFound(err) {
			return fail("source volume %s does not exist in namespace %s: create it, or delete this volume and create it from an existing volume or snapshot", ds.Volume, v.Namespace)
		}
		return err
	}
	if !src.DeletionTimestamp.IsZero() {
		return fail("source volume %s is being deleted: the copy cannot be made; delete this volume", ds.Volume)
	}
	// A clone holds its source's bytes as they are: ciphertext of the
	// source's key, or plaintext.
	if !sameEncryption(v, src) {
		return fail("source volume %s and this volume are not encrypted with the same key (a clone copies the source's bytes as they are, so it must be encrypted exactly when the source is, with the source's key check): delete this volume and create it with the source's spec.encryption", ds.Volume)
	}
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
			return err
		}
		st.Message = fmt.Sprintf("taking snapshot %s of volume %s to copy", snapName, ds.Volume)
		return nil // its reconciler's changes bring us back
	case apierrors.IsNotFound(err):
		return fail("snapshot %s does not exist in namespace %s: create the volume from an existing Snapshot of volume %s, or delete this volume", snapName, v.Namespace, ds.Volume)
	case err != nil:
		return err
	}
	switch {
	case sn.Spec.Volume != ds.Volume:
		return fail("snapshot %s captures volume %s, not %s: name the snapshot's own volume in spec.dataSource (delete this volume and create it again)", snapName, sn.Spec.Volume, ds.Volume)
	case !sn.DeletionTimestamp.IsZero() && !sn.Status.ReadyToUse:
		return fail("snapshot %s is being deleted and was never taken: the copy cannot be made; delete this volume", snapName)
	// A taken snapshot being deleted is still copied: its deletion waits
	// for the clones copying it (the Snapshot reconciler), so it stays on
	// the source's replicas until this copy is done.
	case !sn.Status.ReadyToUse:
		msg := "it is being taken"
		if c := meta.FindStatusCondition(sn.Status.Conditions, v1.SnapshotConditionReady); c != nil {
			msg = c.Message
		}
		st.Message = fmt.Sprintf("waiting for snapshot %s of volume %s: %s", snapName, ds.Volume, msg)
		return nil
	case sn.Status.Size != nil && sn.Status.Size.Cmp(v.Spec.Size) > 0:
		return fail("snapshot %s holds %s, more than this volume's size %s: a clone must be at least as big as its source; delete this volume and create it with a size of at least %s",
			snapName, sn.Status.Size.String(), v.Spec.Size.String(), sn.Status.Size.String())
	}
	// A replica of the source that the source's engine holds RW: it has
	// every snapshot the engine took (an ERR one may have missed it).
	var reps v1.ReplicaList
	if err := r.List(ctx, &reps, client.InNamespace(v.Namespace), client.MatchingLabels{LabelVolume: src.Name}); err != nil {
		return err
	}
	se := &v1.Engine{}
	if err := r.Get(ctx, client.ObjectKey{Namespace: v.Namespace, Name: EngineName(src)}, se); client.IgnoreNotFound(err) != nil {
		return err
	}
	// The replica the engine already reads from first, then by name: a
	// change of source restarts the copy.
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
		s.cloneFrom = &v1.EngineCloneSource{Replica: rep.Name, Address: a.Control, Snapshot: snapName}
		break
	}
	if s.cloneFrom == nil {
		st.Message = fmt.Sprintf("waiting for a replica of volume %s that its engine holds RW to read snapshot %s from (a detached source is started for the copy)", ds.Volume, snapName)
		return nil
	}
	st.State, st.Message = v1.CloneStateCopying, fmt.Sprintf("copying snapshot %s of volume %s from replica %s", snapName, ds.Volume, s.cloneFrom.Replica)
	e := s.engine
	if e == nil || !e.Spec.Maintenance || e.Status.InstanceState != v1.InstanceStateRunning {
		st.Message += ": starting this volume's engine (without a device) to copy"
		return nil
	}
	c := e.Status.Clone
	if c == nil || c.Address != s.cloneFrom.Address || c.Snapshot != snapName {
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
		before := v.DeepCopy()
		if v.Annotations == nil {
			v.Annotations = map[string]string{}
		}
		v.Annotations[volumes.AnnotationCloned] = ds.Volume + "/" + snapName
		if err := r.Patch(ctx, v, client.MergeFrom(before)); err != nil {
			return err
		}
		st.State, st.Progress, st.Message = v1.CloneStateCompleted, 100, fmt.Sprintf("copied snapshot %s of volume %s from replica %s and verified every replica by checksum", snapName, ds.Volume, s.cloneFrom.Replica)
	case v1.RebuildStateFailed:
		st.State, st.Message = v1.CloneStateFailed, fmt.Sprintf("copying snapshot %s of volume %s from replica %s failed (it is retried): %s", snapName, ds.Volume, s.cloneFrom.Replica, c.Error)
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
