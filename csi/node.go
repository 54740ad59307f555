package csi

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
)

// NodeServer is the CSI Node service. It keeps no state of its own: what is
// staged and published is read from the node's mount table and the Volume
// objects, so a restarted node plugin carries on where the last one was.
type NodeServer struct {
	csipb.UnimplementedNodeServer
	c       client.Client
	ns      string
	nodeID  string
	mounter Mounter
	locks   *keyLocks
}

// ready checks that this node's instance manager runs: without it no
// engine, so no device, can come up here.
func (s *NodeServer) ready(ctx context.Context) error {
	var ims v1.InstanceManagerList
	if err := s.c.List(ctx, &ims, client.InNamespace(s.ns)); err != nil {
		return fmt.Errorf("cannot list InstanceManagers in namespace %s (is the API server reachable?): %w", s.ns, err)
	}
	for _, im := range ims.Items {
		if im.Spec.NodeName == s.nodeID {
			if im.Status.State != v1.InstanceManagerStateRunning {
				return fmt.Errorf("the instance manager of node %s is %s, not running", s.nodeID, im.Status.State)
			}
			return nil
		}
	}
	return fmt.Errorf("node %s has no InstanceManager: is the cairn instance-manager DaemonSet running a pod on it?", s.nodeID)
}

// TopologyKeyNodePlugin is the one topology key the node plugin reports,
// with the value NodePluginTopologyValue on every node. kubelet records it
// in the node's CSINode and labels the node with it; the
// external-provisioner's capacity controller then has one non-empty
// topology segment, which it publishes CSIStorageCapacity objects for
// (with no key at all it cannot keep them: docs/csi.md, Storage capacity).
// It does not restrict volumes: the plugin does not advertise
// VOLUME_ACCESSIBILITY_CONSTRAINTS, so CreateVolume gets no accessibility
// requirements and PersistentVolumes no node affinity.
const TopologyKeyNodePlugin = "topology.storage.cairn.io/node-plugin"

// NodePluginTopologyValue is TopologyKeyNodePlugin's value, the same on
// every node: any node with an instance manager can attach any volume.
const NodePluginTopologyValue = "present"

// NodeGetInfo reports the node's ID (the Kubernetes node name) and the
// TopologyKeyNodePlugin segment, the same on every node.
func (s *NodeServer) NodeGetInfo(context.Context, *csipb.NodeGetInfoRequest) (*csipb.NodeGetInfoResponse, error) {
	return &csipb.NodeGetInfoResponse{
		NodeId: s.nodeID,
		AccessibleTopology: &csipb.Topology{
			Segments: map[string]string{TopologyKeyNodePlugin: NodePluginTopologyValue},
		},
	}, nil
}

// NodeGetCapabilities lists what the node service does.
func (s *NodeServer) NodeGetCapabilities(context.Context, *csipb.NodeGetCapabilitiesRequest) (*csipb.NodeGetCapabilitiesResponse, error) {
	out := &csipb.NodeGetCapabilitiesResponse{}
	for _, c := range []csipb.NodeServiceCapability_RPC_Type{
		csipb.NodeServiceCapability_RPC_STAGE_UNSTAGE_VOLUME,
		csipb.NodeServiceCapability_RPC_GET_VOLUME_STATS,
		csipb.NodeServiceCapability_RPC_EXPAND_VOLUME,
		csipb.NodeServiceCapability_RPC_VOLUME_CONDITION,
		csipb.NodeServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER,
	} {
		out.Capabilities = append(out.Capabilities, &csipb.NodeServiceCapability{
			Type: &csipb.NodeServiceCapability_Rpc{Rpc: &csipb.NodeServiceCapability_RPC{Type: c}}})
	}
	return out, nil
}

// device returns the block device a volume attached to this node is served
// on, or FailedPrecondition saying why there is none.
func (s *NodeServer) device(ctx context.Context, id string) (string, error) {
	v := &v1.Volume{}
	if err := s.c.Get(ctx, client.ObjectKey{Namespace: s.ns, Name: id}, v); err != nil {
		if client.IgnoreNotFound(err) == nil {
			return "", status.Errorf(codes.NotFound, "volume %s not found", id)
		}
		return "", apiError(err)
	}
	if v.Status.CurrentNodeName != s.nodeID || v.Status.State != v1.VolumeStateAttached || v.Status.Endpoint == "" {
		where := v.Status.CurrentNodeName
		if where == "" {
			where = "no node"
		}
		return "", status.Errorf(codes.FailedPrecondition, "volume %s is not attached to node %s (it is %s on %s): ControllerPublishVolume must attach it here first", id, s.nodeID, orUnknown(string(v.Status.State)), where)
	}
	dev := v.Status.Endpoint
	if _, err := s.mounter.DeviceSize(dev); err != nil {
		return "", status.Errorf(codes.FailedPrecondition, "volume %s is served at %s, which is not a block device on this node (%v): the nbd frontend without the nbd kernel module serves only a socket; load the module (modprobe nbd) or use frontend fuse in the StorageClass", id, dev, err)
	}
	return dev, nil
}

func fsTypeOf(c *csipb.VolumeCapability, volCtx map[string]string) string {
	if fs := c.GetMount().GetFsType(); fs != "" {
		return fs
	}
	if fs := volCtx[ctxFSType]; fs != "" {
		return fs
	}
	return defaultFSType
}

// NodeStageVolume mounts a filesystem volume's device at the staging path,
// creating the filesystem only on a blank device and growing one smaller
// than its device (a volume expanded while detached, or restored or cloned
// into a larger one). Block volumes need nothing here.
func (s *NodeServer) NodeStageVolume(ctx context.Context, req *csipb.NodeStageVolumeRequest) (*csipb.NodeStageVolumeResponse, error) {
	id, staging, c := req.GetVolumeId(), req.GetStagingTargetPath(), req.GetVolumeCapability()
	switch {
	case id == "":
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	case staging == "":
		return nil, status.Error(codes.InvalidArgument, "staging_target_path is required")
	case c == nil:
		return nil, status.Error(codes.InvalidArgument, "volume_capability is required")
	}
	if err := checkCapability(c); err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	fsType := fsTypeOf(c, req.GetVolumeContext())
	if err := checkFSType(fsType); err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	unlock, err := s.locks.lock("volume " + id)
	if err != nil {
		return nil, err
	}
	defer unlock()
	dev, err := s.device(ctx, id)
	if err != nil {
		return nil, err
	}
	if c.GetBlock() != nil {
		return &csipb.NodeStageVolumeResponse{}, nil
	}
	mounted, err := s.mounter.IsMountPoint(staging)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "check staging path %s: %v", staging, err)
	}
	if mounted {
		if err := s.restage(ctx, id, dev, staging); err != nil {
			return nil, err
		}
		return &csipb.NodeStageVolumeResponse{}, nil
	}
	if err := os.MkdirAll(staging, 0o750); err != nil {
		return nil, status.Errorf(codes.Internal, "create staging path %s: %v", staging, err)
	}
	opts := c.GetMount().GetMountFlags()
	if fsType == fsXFS {
		// A clone or a restored snapshot carries its source's XFS UUID,
		// and XFS refuses to mount a second filesystem with a UUID already
		// mounted on the node.
		opts = append(opts, "nouuid")
	}
	if err := s.stage(stageRequest{id: id, dev: dev, staging: staging, fsType: fsType, opts: opts}); err != nil {
		return nil, err
	}
	return &csipb.NodeStageVolumeResponse{}, nil
}

// stageRequest is one filesystem volume to mount at its staging path.
type stageRequest struct {
	id, dev, staging, fsType string
	opts                     []string
}

// stage formats a blank device, grows a filesystem smaller than its device
// and mounts it. An ext4 grows before it is mounted, where growing needs
// no capability beyond writing the device; an xfs grows only mounted.
// If we crash after formatting or growing but before mounting, the retry
// finds the filesystem at its size and mounts it; if we crash after
// mounting an xfs but before growing it, the retry finds it mounted and
// restage grows it.
func (s *NodeServer) stage(r stageRequest) error {
	fs, err := s.mounter.Filesystem(r.dev)
	if err != nil {
		return status.Errorf(codes.Internal, "read the filesystem on volume %s's device %s: %v", r.id, r.dev, err)
	}
	grow := fs.Type == r.fsType && fs.CanGrow()
	if grow && isExt(fs.Type) {
		if err := s.mounter.Grow(r.dev, "", fs); err != nil {
			return status.Errorf(codes.Internal, "grow the %s filesystem on volume %s's device %s from %d to %d bytes: %v", fs.Type, r.id, r.dev, fs.Size, fs.GrowsTo, err)
		}
		grow = false
	}
	if err := s.mounter.FormatAndMount(r.dev, r.staging, r.fsType, r.opts); err != nil {
		return status.Errorf(codes.Internal, "mount volume %s (%s) at %s as %s: %v; a device holding another filesystem is never reformatted: use that filesystem's fsType", r.id, r.dev, r.staging, r.fsType, err)
	}
	if !grow {
		return nil
	}
	if err := s.mounter.Grow(r.dev, r.staging, fs); err != nil {
		// Unmounted again, so that the retry grows it rather than find
		// it staged.
		if uerr := s.mounter.Unmount(r.staging); uerr != nil {
			return status.Errorf(codes.Internal, "grow the %s filesystem of volume %s at %s: %v; and unmount it again: %v", fs.Type, r.id, r.staging, err, uerr)
		}
		return status.Errorf(codes.Internal, "grow the %s filesystem of volume %s at %s: %v", fs.Type, r.id, r.staging, err)
	}
	return nil
}

// restage answers a NodeStageVolume for a volume mounted at the staging
// path already: done if it is this volume's device, grown first if its
// filesystem is smaller than the device and can grow mounted here. A
// mounted ext4 the node plugin may not grow (no CAP_SYS_RESOURCE) stays
// as it is: the volume is usable, and NodeExpandVolume says why it does
// not grow.
func (s *NodeServer) restage(ctx context.Context, id, dev, staging string) error {
	have, err := s.mounter.DeviceOf(staging)
	if err != nil {
		return status.Errorf(codes.Internal, "find the device mounted at staging path %s: %v", staging, err)
	}
	if have != dev {
		return status.Errorf(codes.AlreadyExists, "staging path %s has %s mounted, not volume %s's device %s: unstage it first", staging, have, id, dev)
	}
	err = s.growMounted(id, dev, staging)
	if errors.Is(err, ErrNeedCapSysResource) {
		logFrom(ctx).Info("volume staged already; its filesystem is smaller than its device and stays so", "volume", id, "reason", err.Error())
		return nil
	}
	return err
}

// growMounted grows the filesystem of dev, mounted at path, if it is
// smaller than the device.
func (s *NodeServer) growMounted(id, dev, path string) error {
	fs, err := s.mounter.Filesystem(dev)
	if err != nil {
		return status.Errorf(codes.Internal, "read the filesystem on volume %s's device %s: %v", id, dev, err)
	}
	if !fs.CanGrow() {
		return nil
	}
	err = s.mounter.Grow(dev, path, fs)
	switch {
	case errors.Is(err, ErrNeedCapSysResource):
		return growError{code: codes.FailedPrecondition, err: fmt.Errorf("volume %s: %w: give the node plugin CAP_SYS_RESOURCE (a privileged container has it, as config/csi deploys it); an ext4 that is not mounted grows without it, so restarting the pod using the volume (which unstages and stages it) grows it too", id, err)}
	case err != nil:
		return growError{code: codes.Internal, err: fmt.Errorf("grow the %s filesystem of volume %s at %s from %d to %d bytes: %w", fs.Type, id, path, fs.Size, fs.GrowsTo, err)}
	}
	return nil
}

// growError is a gRPC status that keeps its cause for errors.Is.
type growError struct {
	code codes.Code
	err  error
}

func (e growError) Error() string              { return e.err.Error() }
func (e growError) Unwrap() error              { return e.err }
func (e growError) GRPCStatus() *status.Status { return status.New(e.code, e.err.Error()) }

// NodeUnstageVolume unmounts the staging path (the unmount writes the
// filesystem's dirty data to the device) and flushes the device, so every
// write reaches the replicas before the controller detaches the volume.
func (s *NodeServer) NodeUnstageVolume(ctx context.Context, req *csipb.NodeUnstageVolumeRequest) (*csipb.NodeUnstageVolumeResponse, error) {
	id, staging := req.GetVolumeId(), req.GetStagingTargetPath()
	switch {
	case id == "":
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	case staging == "":
		return nil, status.Error(codes.InvalidArgument, "staging_target_path is required")
	}
	unlock, err := s.locks.lock("volume " + id)
	if err != nil {
		return nil, err
	}
	defer unlock()
	dev := ""
	if mounted, err := s.mounter.IsMountPoint(staging); err != nil {
		return nil, status.Errorf(codes.Internal, "check staging path %s: %v", staging, err)
	} else if mounted {
		dev, _ = s.mounter.DeviceOf(staging)
		if err := s.mounter.Unmount(staging); err != nil {
			return nil, status.Errorf(codes.Internal, "unmount %s: %v", staging, err)
		}
	}
	if dev == "" {
		if d, err := s.device(ctx, id); err == nil {
			dev = d
		}
	}
	if dev != "" {
		// The device's cached pages go to the engine, which flushes them
		// to every replica.
		if err := s.mounter.Flush(dev); err != nil {
			return nil, status.Errorf(codes.Internal, "flush %s: %v", dev, err)
		}
	}
	return &csipb.NodeUnstageVolumeResponse{}, nil
}

// NodePublishVolume bind-mounts the staged filesystem (or, for a block
// volume, the device) at the pod's target path, read-only when asked.
func (s *NodeServer) NodePublishVolume(ctx context.Context, req *csipb.NodePublishVolumeRequest) (*csipb.NodePublishVolumeResponse, error) {
	id, staging, target, c := req.GetVolumeId(), req.GetStagingTargetPath(), req.GetTargetPath(), req.GetVolumeCapability()
	switch {
	case id == "":
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	case target == "":
		return nil, status.Error(codes.InvalidArgument, "target_path is required")
	case staging == "":
		return nil, status.Error(codes.InvalidArgument, "staging_target_path is required (the driver stages volumes)")
	case c == nil:
		return nil, status.Error(codes.InvalidArgument, "volume_capability is required")
	}
	if err := checkCapability(c); err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	unlock, err := s.locks.lock("volume " + id)
	if err != nil {
		return nil, err
	}
	defer unlock()
	opts := []string{"bind"}
	if req.GetReadonly() {
		opts = append(opts, "ro")
	}
	if mounted, err := s.mounter.IsMountPoint(target); err != nil {
		return nil, status.Errorf(codes.Internal, "check target path %s: %v", target, err)
	} else if mounted {
		return &csipb.NodePublishVolumeResponse{}, nil
	}
	var source string
	if c.GetBlock() != nil {
		dev, err := s.device(ctx, id)
		if err != nil {
			return nil, err
		}
		source = dev
		if err := os.MkdirAll(filepath.Dir(target), 0o750); err != nil {
			return nil, status.Errorf(codes.Internal, "create %s: %v", filepath.Dir(target), err)
		}
		f, err := os.OpenFile(target, os.O_CREATE, 0o640)
		if err != nil {
			return nil, status.Errorf(codes.Internal, "create block target %s: %v", target, err)
		}
		f.Close()
	} else {
		if _, err := s.device(ctx, id); err != nil {
			return nil, err
		}
		staged, err := s.mounter.IsMountPoint(staging)
		if err != nil {
			return nil, status.Errorf(codes.Internal, "check staging path %s: %v", staging, err)
		}
		if !staged {
			return nil, status.Errorf(codes.FailedPrecondition, "volume %s is not staged at %s: NodeStageVolume first", id, staging)
		}
		source = staging
		opts = append(opts, c.GetMount().GetMountFlags()...)
		if err := os.MkdirAll(target, 0o750); err != nil {
			return nil, status.Errorf(codes.Internal, "create target path %s: %v", target, err)
		}
	}
	if err := s.mounter.Mount(source, target, "", opts); err != nil {
		return nil, status.Errorf(codes.Internal, "bind-mount %s at %s: %v", source, target, err)
	}
	return &csipb.NodePublishVolumeResponse{}, nil
}

// NodeUnpublishVolume unmounts and removes the target path; done if it is
// already gone.
func (s *NodeServer) NodeUnpublishVolume(_ context.Context, req *csipb.NodeUnpublishVolumeRequest) (*csipb.NodeUnpublishVolumeResponse, error) {
	id, target := req.GetVolumeId(), req.GetTargetPath()
	switch {
	case id == "":
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	case target == "":
		return nil, status.Error(codes.InvalidArgument, "target_path is required")
	}
	unlock, err := s.locks.lock("volume " + id)
	if err != nil {
		return nil, err
	}
	defer unlock()
	for {
		mounted, err := s.mounter.IsMountPoint(target)
		if err != nil {
			return nil, status.Errorf(codes.Internal, "check target path %s: %v", target, err)
		}
		if !mounted {
			break
		}
		if err := s.mounter.Unmount(target); err != nil {
			return nil, status.Errorf(codes.Internal, "unmount %s: %v", target, err)
		}
	}
	if err := os.Remove(target); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, status.Errorf(codes.Internal, "remove %s: %v", target, err)
	}
	return &csipb.NodeUnpublishVolumeResponse{}, nil
}

// NodeGetVolumeStats reports a published or staged volume's bytes and
// inodes (bytes only for a block volume) and its condition: abnormal when
// the volume is faulted or degraded, or the mount is gone.
func (s *NodeServer) NodeGetVolumeStats(ctx context.Context, req *csipb.NodeGetVolumeStatsRequest) (*csipb.NodeGetVolumeStatsResponse, error) {
	id, path := req.GetVolumeId(), req.GetVolumePath()
	switch {
	case id == "":
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	case path == "":
		return nil, status.Error(codes.InvalidArgument, "volume_path is required")
	}
	v := &v1.Volume{}
	if err := s.c.Get(ctx, client.ObjectKey{Namespace: s.ns, Name: id}, v); err != nil {
		if client.IgnoreNotFound(err) == nil {
			return nil, status.Errorf(codes.NotFound, "volume %s not found", id)
		}
		return nil, apiError(err)
	}
	if _, err := os.Stat(path); errors.Is(err, os.ErrNotExist) {
		return nil, status.Errorf(codes.NotFound, "volume path %s does not exist", path)
	} else if err != nil {
		return nil, status.Errorf(codes.Internal, "stat %s: %v", path, err)
	}
	cond := volumeCondition(v)
	if size, err := s.mounter.DeviceSize(path); err == nil {
		return &csipb.NodeGetVolumeStatsResponse{Usage: []*csipb.VolumeUsage{{Unit: csipb.VolumeUsage_BYTES, Total: size}},
			VolumeCondition: cond}, nil
	}
	if mounted, err := s.mounter.IsMountPoint(path); err == nil && !mounted {
		cond = &csipb.VolumeCondition{Abnormal: true, Message: fmt.Sprintf("nothing is mounted at %s: the volume's mount is gone; restart the pod to mount it again", path)}
	}
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return nil, status.Errorf(codes.Internal, "statfs %s: %v", path, err)
	}
	bs := int64(st.Bsize)
	return &csipb.NodeGetVolumeStatsResponse{Usage: []*csipb.VolumeUsage{
		{Unit: csipb.VolumeUsage_BYTES, Total: int64(st.Blocks) * bs, Available: int64(st.Bavail) * bs, Used: int64(st.Blocks-st.Bfree) * bs},
		{Unit: csipb.VolumeUsage_INODES, Total: int64(st.Files), Available: int64(st.Ffree), Used: int64(st.Files - st.Ffree)},
	}, VolumeCondition: cond}, nil
}

// NodeExpandVolume grows the filesystem on a published volume to fill its
// device (online: resize2fs or xfs_growfs). Block volumes need nothing.
func (s *NodeServer) NodeExpandVolume(ctx context.Context, req *csipb.NodeExpandVolumeRequest) (*csipb.NodeExpandVolumeResponse, error) {
	id, path := req.GetVolumeId(), req.GetVolumePath()
	switch {
	case id == "":
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	case path == "":
		return nil, status.Error(codes.InvalidArgument, "volume_path is required")
	}
	if c := req.GetVolumeCapability(); c != nil {
		if err := checkCapability(c); err != nil {
			return nil, status.Error(codes.InvalidArgument, err.Error())
		}
	}
	unlock, err := s.locks.lock("volume " + id)
	if err != nil {
		return nil, err
	}
	defer unlock()
	dev, err := s.device(ctx, id)
	if err != nil {
		return nil, err
	}
	if _, err := os.Stat(path); errors.Is(err, os.ErrNotExist) {
		return nil, status.Errorf(codes.NotFound, "volume path %s does not exist", path)
	} else if err != nil {
		return nil, status.Errorf(codes.Internal, "stat %s: %v", path, err)
	}
	size, err := s.mounter.DeviceSize(dev)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "size of %s: %v", dev, err)
	}
	if want := req.GetCapacityRange().GetRequiredBytes(); want > size {
		return nil, status.Errorf(codes.FailedPrecondition, "the device %s is %d bytes, less than the %d asked for: ControllerExpandVolume must grow the volume first", dev, size, want)
	}
	if req.GetVolumeCapability().GetBlock() != nil {
		return &csipb.NodeExpandVolumeResponse{CapacityBytes: size}, nil
	}
	if _, err := s.mounter.DeviceSize(path); err == nil { // a block volume's published device
		return &csipb.NodeExpandVolumeResponse{CapacityBytes: size}, nil
	}
	mdev, err := s.mounter.DeviceOf(path)
	if err != nil {
		return nil, status.Errorf(codes.FailedPrecondition, "volume %s is not mounted at %s: %v", id, path, err)
	}
	if err := s.growMounted(id, mdev, path); err != nil {
		return nil, err
	}
	return &csipb.NodeExpandVolumeResponse{CapacityBytes: size}, nil
}
