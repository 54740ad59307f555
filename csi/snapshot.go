package csi

import (
	"context"

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

// CreateSnapshot creates a Snapshot of the volume (or finds the one an
// earlier call with the same name created) and waits until it is on every
// replica. The volume may be attached or detached.
func (s *ControllerServer) CreateSnapshot(ctx context.Context, req *csipb.CreateSnapshotRequest) (*csipb.CreateSnapshotResponse, error) {
	if req.GetName() == "" {
		return nil, status.Error(codes.InvalidArgument, "name is required")
	}
	if req.GetSourceVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "source_volume_id is required")
	}
	class, err := parseSnapshotParams(req.GetParameters())
	if err != nil {
		return nil, err
	}
	if class.backup {
		return s.createBackup(ctx, req, class)
	}
	name := objectName("snap-", req.GetName())
	unlock, err := s.locks.lock("snapshot " + name)
	if err != nil {
		return nil, err
	}
	defer unlock()
	snap := &v1.Snapshot{}
	err = s.c.Get(ctx, client.ObjectKey{Namespace: s.ns, Name: name}, snap)
	switch {
	case apierrors.IsNotFound(err):
		v, err := s.getVolume(ctx, req.GetSourceVolumeId())
		if err != nil {
			return nil, err
		}
		if v.DeletionTimestamp != nil {
			return nil, status.Errorf(codes.FailedPrecondition, "volume %s is being deleted", v.Name)
		}
		snap = &v1.Snapshot{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: s.ns,
			Annotations: map[string]string{AnnotationCSIName: req.GetName()}}, Spec: v1.SnapshotSpec{Volume: v.Name}}
		// If we crash after this create, the retried call finds the
		// Snapshot by name and waits for it.
		if err := s.c.Create(ctx, snap); err != nil && !apierrors.IsAlreadyExists(err) {
			return nil, apiError(err)
		}
	case err != nil:
		return nil, apiError(err)
	case snap.Spec.Volume != req.GetSourceVolumeId():
		return nil, status.Errorf(codes.AlreadyExists, "snapshot %s already exists for volume %s, not %s: use another name", name, snap.Spec.Volume, req.GetSourceVolumeId())
	case snap.DeletionTimestamp != nil:
		return nil, status.Errorf(codes.Aborted, "snapshot %s is being deleted; retry once it is gone", name)
	}
	err = waitFor(ctx, "snapshot "+name+" to be taken", func() (bool, string, error) {
		if err := s.c.Get(ctx, client.ObjectKeyFromObject(snap), snap); err != nil {
			return false, "", apiError(err)
		}
		if snap.Status.ReadyToUse {
			return true, "", nil
		}
		if c := meta.FindStatusCondition(snap.Status.Conditions, v1.SnapshotConditionReady); c != nil {
			return false, c.Message, nil
		}
		return false, "the Snapshot reconciler has not looked at it yet (is cairn-manager running?)", nil
	})
	if err != nil {
		return nil, err
	}
	return &csipb.CreateSnapshotResponse{Snapshot: snapshotOf(snap)}, nil
}

func snapshotOf(sn *v1.Snapshot) *csipb.Snapshot {
	out := &csipb.Snapshot{SnapshotId: sn.Name, SourceVolumeId: sn.Spec.Volume, ReadyToUse: sn.Status.ReadyToUse}
	if sn.Status.Size != nil {
		out.SizeBytes = sn.Status.Size.Value()
	}
	if t := sn.Status.CreationTime; t != nil {
		out.CreationTime = timestamppb.New(t.Time)
	} else {
		out.CreationTime = timestamppb.New(sn.CreationTimestamp.Time)
	}
	return out
}

// DeleteSnapshot deletes the Snapshot and waits until it is gone from every
// replica.
func (s *ControllerServer) DeleteSnapshot(ctx context.Context, req *csipb.DeleteSnapshotRequest) (*csipb.DeleteSnapshotResponse, error) {
	id := req.GetSnapshotId()
	if id == "" {
		return nil, status.Error(codes.InvalidArgument, "snapshot_id is required")
	}
	if name, ok := backupOfSnapshotID(id); ok {
		return s.deleteBackup(ctx, id, name)
	}
	unlock, err := s.locks.lock("snapshot " + id)
	if err != nil {
		return nil, err
	}
	defer unlock()
	key := client.ObjectKey{Namespace: s.ns, Name: id}
	snap := &v1.Snapshot{}
	if err := s.c.Get(ctx, key, snap); err != nil {
		if apierrors.IsNotFound(err) {
			return &csipb.DeleteSnapshotResponse{}, nil
		}
		return nil, apiError(err)
	}
	if snap.DeletionTimestamp == nil {
		if err := s.c.Delete(ctx, snap); err != nil && !apierrors.IsNotFound(err) {
			return nil, apiError(err)
		}
	}
	err = waitFor(ctx, "snapshot "+id+" to be deleted", func() (bool, string, error) {
		if err := s.c.Get(ctx, key, snap); err != nil {
			if apierrors.IsNotFound(err) {
				return true, "", nil
			}
			return false, "", apiError(err)
		}
		if c := meta.FindStatusCondition(snap.Status.Conditions, v1.SnapshotConditionReady); c != nil {
			return false, c.Message, nil
		}
		return false, "it is still on the replicas", nil
	})
	if err != nil {
		return nil, err
	}
	return &csipb.DeleteSnapshotResponse{}, nil
}

// ListSnapshots lists snapshots and backups, all or by id or source
// volume.
func (s *ControllerServer) ListSnapshots(ctx context.Context, req *csipb.ListSnapshotsRequest) (*csipb.ListSnapshotsResponse, error) {
	byID := map[string]*csipb.Snapshot{}
	if err := s.listLocalSnapshots(ctx, req, byID); err != nil {
		return nil, err
	}
	if err := s.listBackups(ctx, req, byID); err != nil {
		return nil, err
	}
	ids, next, err := page(sortedIDs(byID), req.GetStartingToken(), req.GetMaxEntries())
	if err != nil {
		return nil, err
	}
	out := &csipb.ListSnapshotsResponse{NextToken: next}
	for _, id := range ids {
		out.Entries = append(out.Entries, &csipb.ListSnapshotsResponse_Entry{Snapshot: byID[id]})
	}
	return out, nil
}

// listLocalSnapshots adds the CO's Snapshots to a listing: not those a
// clone or a Backup took for itself.
func (s *ControllerServer) listLocalSnapshots(ctx context.Context, req *csipb.ListSnapshotsRequest, byID map[string]*csipb.Snapshot) error {
	var l v1.SnapshotList
	if err := s.c.List(ctx, &l, client.InNamespace(s.ns)); err != nil {
		return apiError(err)
	}
	for i := range l.Items {
		sn := &l.Items[i]
		if _, internal := sn.Labels[labelCloneFor]; internal || ownedByBackup(sn) || sn.DeletionTimestamp != nil ||
			(req.GetSnapshotId() != "" && sn.Name != req.GetSnapshotId()) ||
			(req.GetSourceVolumeId() != "" && sn.Spec.Volume != req.GetSourceVolumeId()) {
			continue
		}
		byID[sn.Name] = snapshotOf(sn)
	}
	return nil
}

// labelCloneFor marks the Snapshots the Volume reconciler takes for a
// whole-volume clone and deletes after the copy: not the CO's, not listed.
const labelCloneFor = "storage.cairn.io/clone-for"
