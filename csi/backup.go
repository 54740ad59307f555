package csi

import (
	"context"
	"sort"
	"strings"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
)

// VolumeSnapshotClass parameters. A class with type: backup makes each
// VolumeSnapshot a Backup of the volume on a backup target (outside the
// cluster); without type, or with type: snapshot, a VolumeSnapshot is a
// Snapshot on the volume's replicas.
const (
	ParamSnapshotType   = "type"
	ParamBackupTarget   = "backupTarget"
	ParamBackupMode     = "backupMode"
	SnapshotTypeLocal   = "snapshot"
	SnapshotTypeBackup  = "backup"
	backupSnapshotIDTag = "backup:"
)

// snapshotClass is what a VolumeSnapshotClass asks of CreateSnapshot.
type snapshotClass struct {
	backup bool
	// target is the class's backupTarget; empty: the volume's
	// spec.backupTarget (from its StorageClass).
	target string
	// mode is the class's backupMode: the Backups' spec.mode.
	mode v1.BackupMode
}

// parseSnapshotParams checks VolumeSnapshotClass parameters: unknown keys
// and a backup class without a target are InvalidArgument.
func parseSnapshotParams(p map[string]string) (snapshotClass, error) {
	var out snapshotClass
	for k, val := range p {
		switch k {
		case ParamSnapshotType:
			switch val {
			case "", SnapshotTypeLocal:
			case SnapshotTypeBackup:
				out.backup = true
			default:
				return out, status.Errorf(codes.InvalidArgument, "VolumeSnapshotClass parameter %s=%q: must be %q (on the volume's replicas, the default) or %q (on a backup target)", k, val, SnapshotTypeLocal, SnapshotTypeBackup)
			}
		case ParamBackupTarget:
			out.target = val
		case ParamBackupMode:
			switch m := v1.BackupMode(val); m {
			case "", v1.BackupModeIncremental, v1.BackupModeFull:
				out.mode = m
			default:
				return out, status.Errorf(codes.InvalidArgument, "VolumeSnapshotClass parameter %s=%q: must be %q (the default) or %q", k, val, v1.BackupModeIncremental, v1.BackupModeFull)
			}
		default:
			return out, status.Errorf(codes.InvalidArgument, "unknown VolumeSnapshotClass parameter %q: remove it; known parameters are %s, %s and %s", k, ParamSnapshotType, ParamBackupTarget, ParamBackupMode)
		}
	}
	switch {
	case !out.backup && out.target != "":
		return out, status.Errorf(codes.InvalidArgument, "VolumeSnapshotClass parameter %s is only for %s: %s; remove it or set the type", ParamBackupTarget, ParamSnapshotType, SnapshotTypeBackup)
	case !out.backup && out.mode != "":
		return out, status.Errorf(codes.InvalidArgument, "VolumeSnapshotClass parameter %s is only for %s: %s; remove it or set the type", ParamBackupMode, ParamSnapshotType, SnapshotTypeBackup)
	}
	return out, nil
}

// backupSnapshotID is the CSI snapshot id of a Backup. The colon cannot be
// in an object name, so an id never means both a Snapshot and a Backup.
func backupSnapshotID(name string) string { return backupSnapshotIDTag + name }

// backupOfSnapshotID returns the Backup name a CSI snapshot id denotes.
func backupOfSnapshotID(id string) (string, bool) {
	return strings.CutPrefix(id, backupSnapshotIDTag)
}

// createBackup creates the Backup of the volume for CreateSnapshot (or
// finds the one an earlier call with the same name created) and waits
// until its Snapshot is taken: from then on the data it holds is fixed and
// the application may go on. The answer is ready_to_use once the upload
// is complete; the CO calls again until it is.
func (s *ControllerServer) createBackup(ctx context.Context, req *csipb.CreateSnapshotRequest, class snapshotClass) (*csipb.CreateSnapshotResponse, error) {
	name := objectName("backup-", req.GetName())
	unlock, err := s.locks.lock("snapshot " + name)
	if err != nil {
		return nil, err
	}
	defer unlock()
	b := &v1.Backup{}
	err = s.c.Get(ctx, client.ObjectKey{Namespace: s.ns, Name: name}, b)
	switch {
	case apierrors.IsNotFound(err):
		v, err := s.getVolume(ctx, req.GetSourceVolumeId())
		if err != nil {
			return nil, err
		}
		if v.DeletionTimestamp != nil {
			return nil, status.Errorf(codes.FailedPrecondition, "volume %s is being deleted", v.Name)
		}
		target := class.target
		if target == "" {
			target = v.Spec.BackupTarget
		}
		if target == "" {
			return nil, status.Errorf(codes.InvalidArgument, "VolumeSnapshotClass with %s: %s names no %s, and volume %s has no default target: set parameter %s in the VolumeSnapshotClass or in the volume's StorageClass (kubectl get backuptargets)",
				ParamSnapshotType, SnapshotTypeBackup, ParamBackupTarget, v.Name, ParamBackupTarget)
		}
		b = &v1.Backup{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: s.ns,
			Annotations: map[string]string{AnnotationCSIName: req.GetName()}},
			Spec: v1.BackupSpec{Volume: v.Name, Target: target, Mode: class.mode}}
		if err := s.c.Create(ctx, b); err != nil && !apierrors.IsAlreadyExists(err) {
			if apierrors.IsInvalid(err) {
				return nil, status.Errorf(codes.InvalidArgument, "the Backup was refused: %v", err)
			}
			return nil, apiError(err)
		}
	case err != nil:
		return nil, apiError(err)
	case b.Spec.Volume != req.GetSourceVolumeId() || (class.target != "" && b.Spec.Target != class.target):
		return nil, status.Errorf(codes.AlreadyExists, "backup %s already exists for volume %s on target %s, not volume %s on %s: use another name",
			name, b.Spec.Volume, b.Spec.Target, req.GetSourceVolumeId(), class.target)
	case b.DeletionTimestamp != nil:
		return nil, status.Errorf(codes.Aborted, "backup %s is being deleted; retry once it is gone", name)
	}
	if err := s.waitBackupCut(ctx, b); err != nil {
		return nil, err
	}
	return &csipb.CreateSnapshotResponse{Snapshot: backupSnapshotOf(b)}, nil
}

// waitBackupCut waits until the Backup's Snapshot is taken (its status
// names it, or it is already uploading or complete).
func (s *ControllerServer) waitBackupCut(ctx context.Context, b *v1.Backup) error {
	return waitFor(ctx, "backup "+b.Name+"'s snapshot to be taken", func() (bool, string, error) {
		if err := s.c.Get(ctx, client.ObjectKeyFromObject(b), b); err != nil {
			return false, "", apiError(err)
		}
		if b.Status.State == v1.BackupStateInProgress || b.Status.State == v1.BackupStateCompleted {
			return true, "", nil
		}
		if b.Status.Snapshot != "" {
			sn := &v1.Snapshot{}
			err := s.c.Get(ctx, client.ObjectKey{Namespace: b.Namespace, Name: b.Status.Snapshot}, sn)
			if err == nil && sn.Status.ReadyToUse {
				return true, "", nil
			}
		}
		if b.Status.Message != "" {
			return false, b.Status.Message, nil
		}
		return false, "the Backup reconciler has not looked at it yet (is cairn-manager running?)", nil
	})
}

func backupSnapshotOf(b *v1.Backup) *csipb.Snapshot {
	out := &csipb.Snapshot{SnapshotId: backupSnapshotID(b.Name), SourceVolumeId: b.Spec.Volume,
		ReadyToUse: b.Status.State == v1.BackupStateCompleted, CreationTime: timestamppb.New(b.CreationTimestamp.Time)}
	if b.Status.VolumeSize != nil {
		out.SizeBytes = b.Status.VolumeSize.Value()
	}
	if t := b.Status.StartTime; t != nil {
		out.CreationTime = timestamppb.New(t.Time)
	}
	return out
}

// deleteBackup deletes the Backup a snapshot id names and waits until the
// Backup reconciler has removed it from the target.
func (s *ControllerServer) deleteBackup(ctx context.Context, id, name string) (*csipb.DeleteSnapshotResponse, error) {
	unlock, err := s.locks.lock("snapshot " + id)
	if err != nil {
		return nil, err
	}
	defer unlock()
	key := client.ObjectKey{Namespace: s.ns, Name: name}
	b := &v1.Backup{}
	if err := s.c.Get(ctx, key, b); err != nil {
		if apierrors.IsNotFound(err) {
			return &csipb.DeleteSnapshotResponse{}, nil
		}
		return nil, apiError(err)
	}
	if b.DeletionTimestamp == nil {
		if err := s.c.Delete(ctx, b); err != nil && !apierrors.IsNotFound(err) {
			return nil, apiError(err)
		}
	}
	err = waitFor(ctx, "backup "+name+" to be deleted from its target", func() (bool, string, error) {
		if err := s.c.Get(ctx, key, b); err != nil {
			if apierrors.IsNotFound(err) {
				return true, "", nil
			}
			return false, "", apiError(err)
		}
		if c := meta.FindStatusCondition(b.Status.Conditions, v1.BackupConditionCompleted); c != nil && b.Status.State != v1.BackupStateCompleted {
			return false, c.Message, nil
		}
		return false, "it is still on the target", nil
	})
	if err != nil {
		return nil, err
	}
	return &csipb.DeleteSnapshotResponse{}, nil
}

// backupSource resolves a CreateVolume from a backup's snapshot id: the
// Backup must be complete; the new volume is filled from the target.
func (s *ControllerServer) backupSource(ctx context.Context, id, name string) (*v1.VolumeDataSource, int64, error) {
	b := &v1.Backup{}
	if err := s.c.Get(ctx, client.ObjectKey{Namespace: s.ns, Name: name}, b); err != nil {
		if apierrors.IsNotFound(err) {
			return nil, 0, status.Errorf(codes.NotFound, "source snapshot %s not found (no Backup %s)", id, name)
		}
		return nil, 0, apiError(err)
	}
	if b.Status.State != v1.BackupStateCompleted || b.Status.BackupName == "" || b.Status.VolumeSize == nil {
		return nil, 0, status.Errorf(codes.Unavailable, "source snapshot %s: backup %s is %s, not completed yet (%s); retry once it is", id, name, orPending(b.Status.State), b.Status.Message)
	}
	src := &v1.VolumeDataSource{Backup: &v1.VolumeBackupSource{Target: b.Spec.Target, Volume: b.Spec.Volume, Name: b.Status.BackupName}}
	return src, b.Status.VolumeSize.Value(), nil
}

func orPending(s v1.BackupState) v1.BackupState {
	if s == "" {
		return v1.BackupStatePending
	}
	return s
}

// listBackups adds the Backups that CSI ids would name to a listing (by
// id or source volume when asked).
func (s *ControllerServer) listBackups(ctx context.Context, req *csipb.ListSnapshotsRequest, byID map[string]*csipb.Snapshot) error {
	if id := req.GetSnapshotId(); id != "" {
		if _, ok := backupOfSnapshotID(id); !ok {
			return nil
		}
	}
	var l v1.BackupList
	if err := s.c.List(ctx, &l, client.InNamespace(s.ns)); err != nil {
		return apiError(err)
	}
	for i := range l.Items {
		b := &l.Items[i]
		id := backupSnapshotID(b.Name)
		if b.DeletionTimestamp != nil || (req.GetSnapshotId() != "" && id != req.GetSnapshotId()) ||
			(req.GetSourceVolumeId() != "" && b.Spec.Volume != req.GetSourceVolumeId()) {
			continue
		}
		byID[id] = backupSnapshotOf(b)
	}
	return nil
}

// sortedIDs are the keys of a listing in order, for paging.
func sortedIDs(byID map[string]*csipb.Snapshot) []string {
	ids := make([]string, 0, len(byID))
	for id := range byID {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	return ids
}

// ownedByBackup is whether a Snapshot was taken by a Backup for itself:
// not the CO's, not listed as a CSI snapshot.
func ownedByBackup(sn *v1.Snapshot) bool { return backupOwner(sn) != "" }

// releaseBackupSnapshots deletes the Snapshots of a volume being deleted
// that its completed Backups took (the backups are on their targets; the
// Snapshots only serve as bases of later backups of this volume), and
// says whether none is left. A Backup uploading refuses the deletion
// (FailedPrecondition); a pending or failed one does not.
func (s *ControllerServer) releaseBackupSnapshots(ctx context.Context, volumeID string) (bool, string, error) {
	var l v1.SnapshotList
	if err := s.c.List(ctx, &l, client.InNamespace(s.ns)); err != nil {
		return false, "", apiError(err)
	}
	var left []string
	for i := range l.Items {
		sn := &l.Items[i]
		owner := backupOwner(sn)
		if sn.Spec.Volume != volumeID || owner == "" {
			continue
		}
		left = append(left, sn.Name)
		if sn.DeletionTimestamp != nil {
			continue
		}
		b := &v1.Backup{}
		err := s.c.Get(ctx, client.ObjectKey{Namespace: s.ns, Name: owner}, b)
		switch {
		case apierrors.IsNotFound(err):
		case err != nil:
			return false, "", apiError(err)
		case b.Status.State == v1.BackupStateInProgress && b.DeletionTimestamp == nil:
			// A pending or failed one waits for the volume (attached, a
			// replica running) and would wait for good: its Snapshot goes.
			return false, "", status.Errorf(codes.FailedPrecondition, "volume %s is being backed up (backup %s is uploading): wait until it completes, or delete its VolumeSnapshot", volumeID, owner)
		}
		if err := s.c.Delete(ctx, sn); err != nil && !apierrors.IsNotFound(err) {
			return false, "", apiError(err)
		}
	}
	if len(left) > 0 {
		return false, "the snapshots its backups took are being deleted: " + strings.Join(left, ", "), nil
	}
	return true, "", nil
}

// backupOwner is the name of the Backup that took a Snapshot for itself,
// or "".
func backupOwner(sn *v1.Snapshot) string {
	for _, o := range sn.OwnerReferences {
		if o.Kind == "Backup" && strings.HasPrefix(o.APIVersion, v1.GroupVersion.Group+"/") {
			return o.Name
		}
	}
	return ""
}
