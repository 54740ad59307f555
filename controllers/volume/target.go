package volume

import (
	"context"
	"slices"
	"strings"

	"k8s.io/apimachinery/pkg/api/meta"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/internal/volumes"
)

// runInput is what decides where the volume's engine runs, and how.
type runInput struct {
	// userNode is spec.nodeName: where a user wants the volume.
	userNode string
	// work says why processes must run for Cairn's own work ("" none):
	// snapshots to take or delete, a clone reading from this volume, a
	// backup reading from one of its replicas.
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

// observeWork lists what this volume's processes must run for: its
// Snapshots not yet taken or being deleted, Volumes cloning from it, and
// Backups uploading from it or waiting for a replica to upload from.
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
	backups, err := r.backupsReading(ctx, s.v)
	if err != nil {
		return err
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
	if len(backups) > 0 {
		parts = append(parts, "backup "+strings.Join(backups, ", "))
	}
	s.work = strings.Join(parts, "; ")
	return nil
}

// backupsReading names the volume's Backups that read from its replicas
// now (inProgress), wait for a running one (WaitingForReplica), or wait
// for their snapshot or an upload slot (Pending): those a detached
// volume's replicas and a maintenance engine are run for. Counting the
// last keeps the processes up from the moment the Backup's snapshot is
// taken until its upload starts, rather than stopping them in between
// and failing the upload that starts on them. One waiting for its
// target, or failed and waiting to retry, runs nothing until it is
// ready to read.
func (r *Reconciler) backupsReading(ctx context.Context, v *v1.Volume) ([]string, error) {
	if !Cloned(v) {
		return nil, nil
	}
	var bs v1.BackupList
	if err := r.List(ctx, &bs, client.InNamespace(v.Namespace)); err != nil {
		return nil, err
	}
	var out []string
	for _, b := range bs.Items {
		if b.Spec.Volume != v.Name || !b.DeletionTimestamp.IsZero() {
			continue
		}
		c := meta.FindStatusCondition(b.Status.Conditions, v1.BackupConditionCompleted)
		if b.Status.State == v1.BackupStateInProgress || (b.Status.State == v1.BackupStatePending && c != nil &&
			(c.Reason == v1.BackupReasonWaitingForReplica || c.Reason == v1.BackupReasonPending)) {
			out = append(out, b.Name)
		}
	}
	slices.Sort(out)
	return out, nil
}
