package csi

import (
	"context"
	"fmt"
	"slices"
	"strings"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/scheduler"
)

// labelVolume is the label the Volume reconciler puts on a volume's
// Replicas (controllers/labelVolume; not imported, so the driver
// does not link the reconcilers).
const labelVolume = "storage.cairn.io/volume"

// ControllerServer is the CSI Controller service. It only reads and writes
// Volume and Snapshot objects; the reconcilers do the work, and each call
// waits for them, bounded by the call's context (a call that runs out of
// time fails with DeadlineExceeded and the CO retries it: every call is
// idempotent).
type ControllerServer struct {
	csipb.UnimplementedControllerServer
	c     client.Client
	ns    string
	locks *keyLocks
	// overProvisioning is the manager's over-provisioning percentage (0:
	// the scheduler's default), for GetCapacity.
	overProvisioning int
}

var controllerCaps = []csipb.ControllerServiceCapability_RPC_Type{
	csipb.ControllerServiceCapability_RPC_CREATE_DELETE_VOLUME,
	csipb.ControllerServiceCapability_RPC_PUBLISH_UNPUBLISH_VOLUME,
	csipb.ControllerServiceCapability_RPC_LIST_VOLUMES,
	csipb.ControllerServiceCapability_RPC_LIST_VOLUMES_PUBLISHED_NODES,
	csipb.ControllerServiceCapability_RPC_GET_CAPACITY,
	csipb.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT,
	csipb.ControllerServiceCapability_RPC_LIST_SNAPSHOTS,
	csipb.ControllerServiceCapability_RPC_CLONE_VOLUME,
	csipb.ControllerServiceCapability_RPC_EXPAND_VOLUME,
	csipb.ControllerServiceCapability_RPC_GET_VOLUME,
	csipb.ControllerServiceCapability_RPC_VOLUME_CONDITION,
	csipb.ControllerServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER,
}

// ready checks that the API server answers and serves Cairn's kinds.
func (s *ControllerServer) ready(ctx context.Context) error {
	var l v1.VolumeList
	if err := s.c.List(ctx, &l, client.InNamespace(s.ns), client.Limit(1)); err != nil {
		return fmt.Errorf("cannot list Volumes in namespace %s (is the API server reachable and are Cairn's CRDs installed?): %w", s.ns, err)
	}
	return nil
}

// ControllerGetCapabilities lists what the controller service does.
func (s *ControllerServer) ControllerGetCapabilities(context.Context, *csipb.ControllerGetCapabilitiesRequest) (*csipb.ControllerGetCapabilitiesResponse, error) {
	out := &csipb.ControllerGetCapabilitiesResponse{}
	for _, c := range controllerCaps {
		out.Capabilities = append(out.Capabilities, &csipb.ControllerServiceCapability{
			Type: &csipb.ControllerServiceCapability_Rpc{Rpc: &csipb.ControllerServiceCapability_RPC{Type: c}}})
	}
	return out, nil
}

// getVolume reads a Volume; a missing one is NotFound.
func (s *ControllerServer) getVolume(ctx context.Context, id string) (*v1.Volume, error) {
	v := &v1.Volume{}
	if err := s.c.Get(ctx, client.ObjectKey{Namespace: s.ns, Name: id}, v); err != nil {
		if apierrors.IsNotFound(err) {
			return nil, status.Errorf(codes.NotFound, "volume %s not found", id)
		}
		return nil, apiError(err)
	}
	return v, nil
}

// apiError wraps an API server failure: Unavailable, so the CO retries.
func apiError(err error) error {
	if st, ok := status.FromError(err); ok && st.Code() != codes.Unknown {
		return err
	}
	return status.Errorf(codes.Unavailable, "Kubernetes API server: %v", err)
}

// CreateVolume creates a Volume (or finds the one an earlier call with the
// same name created) and waits until its replicas are placed.
func (s *ControllerServer) CreateVolume(ctx context.Context, req *csipb.CreateVolumeRequest) (*csipb.CreateVolumeResponse, error) {
	params, err := checkCreateVolume(req)
	if err != nil {
		return nil, err
	}
	name := objectName("vol-", req.GetName())
	unlock, err := s.locks.lock("volume " + name)
	if err != nil {
		return nil, err
	}
	defer unlock()

	source, minSize, err := s.contentSource(ctx, req.GetVolumeContentSource())
	if err != nil {
		return nil, err
	}
	size, err := createSize(req.GetCapacityRange(), minSize)
	if err != nil {
		return nil, err
	}
	srcVolume, err := s.sourceVolume(ctx, source)
	if err != nil {
		return nil, err
	}
	enc, pass, err := encryption(name, params.encrypted, req.GetSecrets(), srcVolume)
	if err != nil {
		return nil, err
	}
	want := desiredVolume(req, name, s.ns, size, params, source, enc)
	if err := s.ensureVolume(ctx, want, req.GetCapacityRange(), pass); err != nil {
		return nil, err
	}
	v := &v1.Volume{}
	if err := s.c.Get(ctx, client.ObjectKeyFromObject(want), v); err != nil {
		return nil, apiError(err)
	}
	if v.Spec.Encryption != nil {
		if err := s.ownKeySecret(ctx, v); err != nil {
			return nil, err
		}
	}
	if err := s.waitScheduled(ctx, name); err != nil {
		if status.Code(err) == codes.ResourceExhausted {
			return nil, s.withdraw(ctx, v, err)
		}
		return nil, err
	}
	if err := s.c.Get(ctx, client.ObjectKeyFromObject(want), v); err != nil {
		return nil, apiError(err)
	}
	return &csipb.CreateVolumeResponse{Volume: &csipb.Volume{
		VolumeId:      v.Name,
		CapacityBytes: v.Spec.Size.Value(),
		VolumeContext: volumeContext(v, params.fsType),
		ContentSource: req.GetVolumeContentSource(),
	}}, nil
}

// checkCreateVolume checks what a CreateVolume asks for on its own (name,
// capabilities, StorageClass parameters and their agreement) and returns
// the parameters.
func checkCreateVolume(req *csipb.CreateVolumeRequest) (volumeParams, error) {
	if req.GetName() == "" {
		return volumeParams{}, status.Error(codes.InvalidArgument, "name is required")
	}
	if err := checkCapabilities(req.GetVolumeCapabilities()); err != nil {
		return volumeParams{}, err
	}
	p, err := parseParams(req.GetParameters())
	if err != nil {
		return volumeParams{}, err
	}
	for _, c := range req.GetVolumeCapabilities() {
		if fs := c.GetMount().GetFsType(); fs != "" && p.fsType != "" && fs != p.fsType {
			return volumeParams{}, status.Errorf(codes.InvalidArgument, "the volume capability asks for filesystem %s but StorageClass parameter %s is %s: make them agree", fs, ParamFSType, p.fsType)
		}
	}
	return p, nil
}

// sourceVolume is the Volume whose bytes a new volume copies, for the
// encryption check: a clone's or snapshot's source, or a backup's when it
// still exists in this cluster (else the restore checks the key against
// the backup's manifest).
func (s *ControllerServer) sourceVolume(ctx context.Context, source *v1.VolumeDataSource) (*v1.Volume, error) {
	switch {
	case source == nil:
		return nil, nil
	case source.Backup != nil:
		v, err := s.getVolume(ctx, source.Backup.Volume)
		if status.Code(err) == codes.NotFound {
			return nil, nil
		}
		return v, err
	}
	return s.getVolume(ctx, source.Volume)
}

// createSize is the size of a new volume whose content source holds
// minSize bytes (0 without one): OutOfRange when the range asks for less.
func createSize(r *csipb.CapacityRange, minSize int64) (int64, error) {
	if req := r.GetRequiredBytes(); req > 0 && req < minSize {
		return 0, status.Errorf(codes.OutOfRange, "required_bytes %d is smaller than the source's %d bytes: ask for at least the source's size", req, minSize)
	}
	if l := r.GetLimitBytes(); l > 0 && l < minSize {
		return 0, status.Errorf(codes.OutOfRange, "limit_bytes %d is smaller than the source's %d bytes: ask for at least the source's size", l, minSize)
	}
	return volumeSize(r, minSize)
}

// desiredVolume is the Volume a CreateVolume asks for.
func desiredVolume(req *csipb.CreateVolumeRequest, name, namespace string, size int64, p volumeParams, source *v1.VolumeDataSource, enc *v1.VolumeEncryption) *v1.Volume {
	accessMode := v1.VolumeAccessModeReadWriteOnce
	for _, c := range req.GetVolumeCapabilities() {
		if c.GetAccessMode().GetMode() == csipb.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER {
			accessMode = v1.VolumeAccessModeReadWriteOncePod
		}
	}
	want := &v1.Volume{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: namespace,
		Annotations: map[string]string{AnnotationCSIName: req.GetName()}},
		Spec: v1.VolumeSpec{Size: *resource.NewQuantity(size, resource.BinarySI), NumberOfReplicas: p.replicas,
			Frontend: p.frontend, DataSource: source, DiskSelector: p.diskSelector, AccessMode: accessMode, Encryption: enc,
			BackupTarget: p.backupTarget}}
	if p.pvc != "" {
		want.Annotations[AnnotationPVC] = p.pvc
	}
	if p.pv != "" {
		want.Annotations[AnnotationPV] = p.pv
	}
	for _, g := range p.recurringJobGroups {
		if want.Labels == nil {
			want.Labels = map[string]string{}
		}
		want.Labels[v1.RecurringJobGroupLabel(g)] = v1.RecurringJobGroupEnabled
	}
	return want
}

// ensureVolume creates want, with its key Secret (from pass) first when it
// is encrypted, or checks that the Volume an earlier call created answers
// this one (compatible).
func (s *ControllerServer) ensureVolume(ctx context.Context, want *v1.Volume, r *csipb.CapacityRange, pass string) error {
	have := &v1.Volume{}
	err := s.c.Get(ctx, client.ObjectKeyFromObject(want), have)
	switch {
	case apierrors.IsNotFound(err):
		// The key is in place before the engine could first start.
		if want.Spec.Encryption != nil {
			if err := s.ensureKeySecret(ctx, want.Name, pass); err != nil {
				return err
			}
		}
		// If we crash after this create, the CO's retry finds the Volume by
		// name and waits for it like this call would have.
		if err := s.c.Create(ctx, want); err != nil && !apierrors.IsAlreadyExists(err) {
			if apierrors.IsInvalid(err) {
				return status.Errorf(codes.InvalidArgument, "the Volume was refused: %v", err)
			}
			return apiError(err)
		}
		return nil
	case err != nil:
		return apiError(err)
	default:
		return compatible(have, want, r)
	}
}

func volumeContext(v *v1.Volume, fsType string) map[string]string {
	ctx := map[string]string{}
	if v.Spec.Frontend != "" {
		ctx[ctxFrontend] = string(v.Spec.Frontend)
	}
	if fsType != "" {
		ctx[ctxFSType] = fsType
	}
	return ctx
}

// compatible says whether an existing Volume answers a CreateVolume for the
// same name: AlreadyExists otherwise, naming the difference.
func compatible(have, want *v1.Volume, r *csipb.CapacityRange) error {
	if have.DeletionTimestamp != nil {
		return status.Errorf(codes.Aborted, "volume %s is being deleted; retry once it is gone", have.Name)
	}
	if n := have.Annotations[AnnotationCSIName]; n != "" && n != want.Annotations[AnnotationCSIName] {
		return status.Errorf(codes.AlreadyExists, "volume %s already exists for another name (%q)", have.Name, n)
	}
	size := have.Spec.Size.Value()
	if size < r.GetRequiredBytes() || (r.GetLimitBytes() > 0 && size > r.GetLimitBytes()) || (r.GetRequiredBytes() == 0 && size != want.Spec.Size.Value()) {
		return status.Errorf(codes.AlreadyExists, "volume %s already exists with %d bytes, which does not fit the requested capacity range (required %d, limit %d)",
			have.Name, size, r.GetRequiredBytes(), r.GetLimitBytes())
	}
	var diffs []string
	if want.Spec.NumberOfReplicas != 0 && have.Spec.NumberOfReplicas != want.Spec.NumberOfReplicas {
		diffs = append(diffs, fmt.Sprintf("numberOfReplicas %d, not %d", have.Spec.NumberOfReplicas, want.Spec.NumberOfReplicas))
	}
	if want.Spec.Frontend != "" && have.Spec.Frontend != want.Spec.Frontend {
		diffs = append(diffs, fmt.Sprintf("frontend %s, not %s", have.Spec.Frontend, want.Spec.Frontend))
	}
	hs, ws := have.Spec.DataSource, want.Spec.DataSource
	if !equality.Semantic.DeepEqual(hs, ws) {
		diffs = append(diffs, "another content source")
	}
	he, we := have.Spec.Encryption, want.Spec.Encryption
	switch {
	case he == nil && we != nil:
		diffs = append(diffs, "no encryption")
	case he != nil && we == nil:
		diffs = append(diffs, "encryption")
	case he != nil && he.KeyCheck != we.KeyCheck:
		diffs = append(diffs, "another encryption passphrase")
	}
	if !slices.Equal(have.Spec.DiskSelector, want.Spec.DiskSelector) {
		diffs = append(diffs, fmt.Sprintf("diskSelector %v, not %v", have.Spec.DiskSelector, want.Spec.DiskSelector))
	}
	if len(diffs) > 0 {
		return status.Errorf(codes.AlreadyExists, "volume %s already exists with %s: use another name or the same parameters", have.Name, strings.Join(diffs, ", "))
	}
	return nil
}

// contentSource resolves a CreateVolume's source to a Volume data source
// and the smallest size a volume made from it may have.
func (s *ControllerServer) contentSource(ctx context.Context, src *csipb.VolumeContentSource) (*v1.VolumeDataSource, int64, error) {
	switch {
	case src == nil:
		return nil, 0, nil
	case src.GetSnapshot() != nil:
		id := src.GetSnapshot().GetSnapshotId()
		if id == "" {
			return nil, 0, status.Error(codes.InvalidArgument, "volume_content_source.snapshot.snapshot_id is empty")
		}
		if name, ok := backupOfSnapshotID(id); ok {
			return s.backupSource(ctx, id, name)
		}
		snap := &v1.Snapshot{}
		if err := s.c.Get(ctx, client.ObjectKey{Namespace: s.ns, Name: id}, snap); err != nil {
			if apierrors.IsNotFound(err) {
				return nil, 0, status.Errorf(codes.NotFound, "source snapshot %s not found", id)
			}
			return nil, 0, apiError(err)
		}
		if !snap.Status.ReadyToUse || snap.Status.Size == nil {
			return nil, 0, status.Errorf(codes.Unavailable, "source snapshot %s is not ready to use yet; retry once it is", id)
		}
		return &v1.VolumeDataSource{Volume: snap.Spec.Volume, Snapshot: snap.Name}, snap.Status.Size.Value(), nil
	case src.GetVolume() != nil:
		id := src.GetVolume().GetVolumeId()
		if id == "" {
			return nil, 0, status.Error(codes.InvalidArgument, "volume_content_source.volume.volume_id is empty")
		}
		v, err := s.getVolume(ctx, id)
		if err != nil {
			if status.Code(err) == codes.NotFound {
				return nil, 0, status.Errorf(codes.NotFound, "source volume %s not found", id)
			}
			return nil, 0, err
		}
		return &v1.VolumeDataSource{Volume: v.Name}, v.Spec.Size.Value(), nil
	}
	return nil, 0, status.Error(codes.InvalidArgument, "volume_content_source has neither a snapshot nor a volume")
}

// waitScheduled waits until every replica of the volume has a disk, or
// fails with ResourceExhausted when none can be placed (a volume with some
// replicas placed is usable, degraded, and gets the rest when disks free
// up; its Scheduled condition says what is missing).
func (s *ControllerServer) waitScheduled(ctx context.Context, name string) error {
	return waitFor(ctx, "volume "+name+" to be scheduled", func() (bool, string, error) {
		v, err := s.getVolume(ctx, name)
		if err != nil {
			return false, "", err
		}
		c := meta.FindStatusCondition(v.Status.Conditions, v1.VolumeConditionScheduled)
		switch {
		case c == nil:
			return false, "the Volume reconciler has not looked at it yet (is cairn-manager running?)", nil
		case c.Status == metav1.ConditionTrue:
			return true, "", nil
		case c.Reason != v1.VolumeReasonReplicaSchedulingFailed:
			return false, c.Message, nil
		}
		var reps v1.ReplicaList
		if err := s.c.List(ctx, &reps, client.InNamespace(s.ns), client.MatchingLabels{labelVolume: name}); err != nil {
			return false, "", apiError(err)
		}
		for _, r := range reps.Items {
			if r.Spec.NodeName != "" {
				return true, "", nil
			}
		}
		return false, "", status.Errorf(codes.ResourceExhausted, "no replica of volume %s can be placed: %s. Add disks or nodes, free space, lower numberOfReplicas or loosen diskSelector in the StorageClass", name, c.Message)
	})
}

// withdraw deletes the Volume of a CreateVolume refused because none of
// its replicas can be placed (refused, the error it returns), with its
// key Secret, as a cloud disk that cannot be provisioned leaves nothing:
// no replica was placed, so no data exists, and a Volume left behind
// would be placed later, for a claim that may be gone by then, and hold
// disk room nobody asked for. The CO retries CreateVolume while the claim
// wants a volume, and a later call creates the Volume again.
func (s *ControllerServer) withdraw(ctx context.Context, v *v1.Volume, refused error) error {
	if err := s.c.Delete(ctx, v); err != nil && !apierrors.IsNotFound(err) {
		return status.Errorf(codes.Internal, "%v; deleting the Volume it created failed: %v", status.Convert(refused).Message(), err)
	}
	if v.Spec.Encryption != nil {
		if err := s.deleteKeySecret(ctx, v.Name); err != nil {
			return status.Errorf(codes.Internal, "%v; deleting the volume's key Secret failed: %v", status.Convert(refused).Message(), err)
		}
	}
	return refused
}

// DeleteVolume deletes the Volume and waits until its engine, replicas and
// their data are gone. A volume that still has snapshots is refused: they
// live in its replicas.
func (s *ControllerServer) DeleteVolume(ctx context.Context, req *csipb.DeleteVolumeRequest) (*csipb.DeleteVolumeResponse, error) {
	id := req.GetVolumeId()
	if id == "" {
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	}
	unlock, err := s.locks.lock("volume " + id)
	if err != nil {
		return nil, err
	}
	defer unlock()
	v, err := s.getVolume(ctx, id)
	if status.Code(err) == codes.NotFound {
		// A key Secret left by a CreateVolume that stopped early goes too.
		if err := s.deleteKeySecret(ctx, id); err != nil {
			return nil, err
		}
		return &csipb.DeleteVolumeResponse{}, nil
	}
	if err != nil {
		return nil, err
	}
	if v.DeletionTimestamp == nil {
		if v.Spec.NodeName != "" {
			return nil, status.Errorf(codes.FailedPrecondition, "volume %s is attached to node %s: it must be unpublished (its pod stopped) before it is deleted", id, v.Spec.NodeName)
		}
		// A whole-volume clone of this volume copies from a snapshot the
		// Volume reconciler takes and deletes once the copy is done: wait
		// for those to go. The user's own snapshots refuse the deletion.
		// A completed backup's Snapshot only serves as the base of the
		// volume's next backup: it goes with the volume.
		err := waitFor(ctx, "the snapshots clones of volume "+id+" copy from to be deleted", func() (bool, string, error) {
			user, internal, err := s.snapshotsOf(ctx, id)
			switch {
			case err != nil:
				return false, "", err
			case len(user) > 0:
				return false, "", status.Errorf(codes.FailedPrecondition, "volume %s has %d snapshot(s) (%s), which live in its replicas: delete them (their VolumeSnapshots) first", id, len(user), strings.Join(user, ", "))
			case len(internal) > 0:
				return false, fmt.Sprintf("a clone is being copied from it, or its snapshot %s is being deleted", strings.Join(internal, ", ")), nil
			}
			return s.releaseBackupSnapshots(ctx, id)
		})
		if err != nil {
			return nil, err
		}
		if err := s.c.Delete(ctx, v); err != nil && !apierrors.IsNotFound(err) {
			return nil, apiError(err)
		}
	}
	err = waitFor(ctx, "volume "+id+" to be deleted", func() (bool, string, error) {
		v, err := s.getVolume(ctx, id)
		if status.Code(err) == codes.NotFound {
			return true, "", nil
		}
		if err != nil {
			return false, "", err
		}
		return false, fmt.Sprintf("it is %s", v.Status.State), nil
	})
	if err != nil {
		return nil, err
	}
	if v.Spec.Encryption != nil {
		if err := s.deleteKeySecret(ctx, id); err != nil {
			return nil, err
		}
	}
	return &csipb.DeleteVolumeResponse{}, nil
}

// snapshotsOf names the Snapshots of a volume: the CO's, and those the
// Volume reconciler takes for whole-volume clones (not those Backups take:
// releaseBackupSnapshots).
func (s *ControllerServer) snapshotsOf(ctx context.Context, volumeID string) (user, internal []string, err error) {
	var l v1.SnapshotList
	if err := s.c.List(ctx, &l, client.InNamespace(s.ns)); err != nil {
		return nil, nil, apiError(err)
	}
	for _, sn := range l.Items {
		switch {
		case sn.Spec.Volume != volumeID:
		case ownedByBackup(&sn):
		case sn.Labels[labelCloneFor] != "":
			internal = append(internal, sn.Name)
		default:
			user = append(user, sn.Name)
		}
	}
	slices.Sort(user)
	slices.Sort(internal)
	return user, internal, nil
}

// ValidateVolumeCapabilities confirms the capabilities Cairn supports.
func (s *ControllerServer) ValidateVolumeCapabilities(ctx context.Context, req *csipb.ValidateVolumeCapabilitiesRequest) (*csipb.ValidateVolumeCapabilitiesResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	}
	if len(req.GetVolumeCapabilities()) == 0 {
		return nil, status.Error(codes.InvalidArgument, "volume_capabilities are required")
	}
	if _, err := s.getVolume(ctx, req.GetVolumeId()); err != nil {
		return nil, err
	}
	if err := checkCapabilities(req.GetVolumeCapabilities()); err != nil {
		return &csipb.ValidateVolumeCapabilitiesResponse{Message: status.Convert(err).Message()}, nil
	}
	if _, err := parseParams(req.GetParameters()); err != nil {
		return &csipb.ValidateVolumeCapabilitiesResponse{Message: status.Convert(err).Message()}, nil
	}
	return &csipb.ValidateVolumeCapabilitiesResponse{Confirmed: &csipb.ValidateVolumeCapabilitiesResponse_Confirmed{
		VolumeContext: req.GetVolumeContext(), VolumeCapabilities: req.GetVolumeCapabilities(), Parameters: req.GetParameters()}}, nil
}

// tokenPrefix marks the pagination tokens List* hand out: the name of the
// last entry returned. Names sort stably, so an entry deleted between pages
// does not shift the next page.
const tokenPrefix = "after:"

// page returns names[...] after token, at most max (0: all), and the next
// token.
func page(names []string, token string, max int32) ([]string, string, error) {
	slices.Sort(names)
	start := 0
	if token != "" {
		after, ok := strings.CutPrefix(token, tokenPrefix)
		if !ok {
			return nil, "", status.Errorf(codes.Aborted, "starting_token %q was not handed out by this driver: list again without it", token)
		}
		start, _ = slices.BinarySearch(names, after)
		if start < len(names) && names[start] == after {
			start++
		}
	}
	if max < 0 {
		return nil, "", status.Errorf(codes.InvalidArgument, "max_entries %d must not be negative", max)
	}
	names = names[start:]
	if max == 0 || int(max) >= len(names) {
		return names, "", nil
	}
	return names[:max], tokenPrefix + names[max-1], nil
}

// ListVolumes lists the driver's volumes (not those being deleted) with the
// node each is published on and its condition.
func (s *ControllerServer) ListVolumes(ctx context.Context, req *csipb.ListVolumesRequest) (*csipb.ListVolumesResponse, error) {
	var l v1.VolumeList
	if err := s.c.List(ctx, &l, client.InNamespace(s.ns)); err != nil {
		return nil, apiError(err)
	}
	byName := map[string]*v1.Volume{}
	var names []string
	for i := range l.Items {
		if v := &l.Items[i]; v.DeletionTimestamp == nil {
			byName[v.Name] = v
			names = append(names, v.Name)
		}
	}
	names, next, err := page(names, req.GetStartingToken(), req.GetMaxEntries())
	if err != nil {
		return nil, err
	}
	out := &csipb.ListVolumesResponse{NextToken: next}
	for _, n := range names {
		v := byName[n]
		out.Entries = append(out.Entries, &csipb.ListVolumesResponse_Entry{
			Volume: &csipb.Volume{VolumeId: v.Name, CapacityBytes: v.Spec.Size.Value(), VolumeContext: volumeContext(v, "")},
			Status: volumeStatus(v)})
	}
	return out, nil
}

// volumeStatus reports where a volume is published and whether it is
// healthy.
func volumeStatus(v *v1.Volume) *csipb.ListVolumesResponse_VolumeStatus {
	st := &csipb.ListVolumesResponse_VolumeStatus{VolumeCondition: volumeCondition(v)}
	if v.Spec.NodeName != "" {
		st.PublishedNodeIds = []string{v.Spec.NodeName}
	}
	return st
}

// volumeCondition is abnormal when the volume is faulted (no usable
// replica), degraded, or cannot place its replicas.
func volumeCondition(v *v1.Volume) *csipb.VolumeCondition {
	switch v.Status.Robustness {
	case v1.VolumeRobustnessFaulted:
		return &csipb.VolumeCondition{Abnormal: true, Message: "volume is faulted: no replica is usable; see `kubectl describe volume " + v.Name + "` (its replicas' disks and nodes), or salvage it (docs/control-plane.md)"}
	case v1.VolumeRobustnessDegraded:
		return &csipb.VolumeCondition{Abnormal: true, Message: "volume is degraded: fewer healthy replicas than asked for; a replacement is being built if a disk can take one"}
	}
	if c := meta.FindStatusCondition(v.Status.Conditions, v1.VolumeConditionScheduled); c != nil && c.Status == metav1.ConditionFalse && c.Reason == v1.VolumeReasonReplicaSchedulingFailed {
		return &csipb.VolumeCondition{Abnormal: true, Message: "replicas cannot all be placed: " + c.Message}
	}
	return &csipb.VolumeCondition{Message: fmt.Sprintf("volume is %s", orUnknown(string(v.Status.State)))}
}

func orUnknown(s string) string {
	if s == "" {
		return "being created"
	}
	return s
}

// ControllerGetVolume reports one volume with its condition.
func (s *ControllerServer) ControllerGetVolume(ctx context.Context, req *csipb.ControllerGetVolumeRequest) (*csipb.ControllerGetVolumeResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	}
	v, err := s.getVolume(ctx, req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	st := volumeStatus(v)
	return &csipb.ControllerGetVolumeResponse{
		Volume: &csipb.Volume{VolumeId: v.Name, CapacityBytes: v.Spec.Size.Value(), VolumeContext: volumeContext(v, "")},
		Status: &csipb.ControllerGetVolumeResponse_VolumeStatus{PublishedNodeIds: st.PublishedNodeIds, VolumeCondition: st.VolumeCondition}}, nil
}

// GetCapacity reports what the replica scheduler (controllers/scheduler)
// would still give volumes with these parameters: as the largest volume,
// the largest size whose replicas all find a disk now; as available, the
// room on every disk such a volume may use divided by its replica count
// (each replica takes the volume's size). A disk's room is counted as the
// scheduler counts it: (capacity − reserved) × over-provisioning, less
// the sizes of the Replicas placed there, on a disk that is ready,
// allowed, carries the StorageClass's diskSelector tags and has space
// free beyond its reserve. Cairn volumes have no topology (any node can
// attach any volume), so the answer is for the whole cluster and a
// request's accessible_topology is not read.
func (s *ControllerServer) GetCapacity(ctx context.Context, req *csipb.GetCapacityRequest) (*csipb.GetCapacityResponse, error) {
	for _, c := range req.GetVolumeCapabilities() {
		if err := checkCapability(c); err != nil {
			return &csipb.GetCapacityResponse{}, nil
		}
	}
	params, err := parseParams(req.GetParameters())
	if err != nil {
		return nil, err
	}
	replicas := int(params.replicas)
	if replicas == 0 {
		replicas = v1.DefaultNumberOfReplicas
	}
	disks, err := s.disks(ctx)
	if err != nil {
		return nil, err
	}
	available, largest := scheduler.Capacity(scheduler.Request{Tags: params.diskSelector, OverProvisioningPercent: s.overProvisioning}, disks, replicas)
	return &csipb.GetCapacityResponse{AvailableCapacity: available, MaximumVolumeSize: wrapperspb.Int64(largestVolume(largest))}, nil
}

// largestVolume is the size of the largest volume CreateVolume would make
// in room bytes: sizes are multiples of blockSize, at least minVolumeSize
// and at most maxVolumeSize, so room beyond 64 TiB does not raise it and
// room below the smallest volume is none.
func largestVolume(room int64) int64 {
	size := min(room, maxVolumeSize) / blockSize * blockSize
	if size < minVolumeSize {
		return 0
	}
	return size
}

// disks are the StorageNodes' disks as the scheduler sees them, with the
// bytes scheduled on each counted from the Replicas placed there (the
// StorageNodes' status.disks[].scheduled lags them).
func (s *ControllerServer) disks(ctx context.Context) ([]scheduler.Disk, error) {
	var nodes v1.StorageNodeList
	if err := s.c.List(ctx, &nodes, client.InNamespace(s.ns)); err != nil {
		return nil, apiError(err)
	}
	var reps v1.ReplicaList
	if err := s.c.List(ctx, &reps, client.InNamespace(s.ns)); err != nil {
		return nil, apiError(err)
	}
	scheduled := scheduler.ScheduledBytes(reps.Items)
	disks := scheduler.FromStorageNodes(nodes.Items)
	for i := range disks {
		disks[i].Scheduled = scheduled[disks[i].Key()]
	}
	return disks, nil
}
