package csi

import (
	"context"
	"fmt"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
)

// PublishContext keys: what the node service is told of the attachment.
const (
	// PublishEndpoint is the device the engine serves the volume on.
	PublishEndpoint = "storage.cairn.io/endpoint"
)

// ControllerPublishVolume attaches the volume to a node: it sets the
// Volume's spec.nodeName and waits until the engine runs there and reports
// its device.
func (s *ControllerServer) ControllerPublishVolume(ctx context.Context, req *csipb.ControllerPublishVolumeRequest) (*csipb.ControllerPublishVolumeResponse, error) {
	id, node := req.GetVolumeId(), req.GetNodeId()
	switch {
	case id == "":
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	case node == "":
		return nil, status.Error(codes.InvalidArgument, "node_id is required")
	case req.GetVolumeCapability() == nil:
		return nil, status.Error(codes.InvalidArgument, "volume_capability is required")
	}
	if err := checkCapability(req.GetVolumeCapability()); err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	unlock, err := s.locks.lock("volume " + id)
	if err != nil {
		return nil, err
	}
	defer unlock()
	v, err := s.getVolume(ctx, id)
	if err != nil {
		return nil, err
	}
	if err := s.checkNode(ctx, node); err != nil {
		return nil, err
	}
	if v.DeletionTimestamp != nil {
		return nil, status.Errorf(codes.FailedPrecondition, "volume %s is being deleted", id)
	}
	if err := checkPublishKey(v, req.GetSecrets()); err != nil {
		return nil, err
	}
	if v.Spec.NodeName != "" && v.Spec.NodeName != node {
		return nil, status.Errorf(codes.FailedPrecondition, "volume %s is attached to node %s; a Cairn volume is attached to one node at a time: stop the pod using it there first", id, v.Spec.NodeName)
	}
	if c := meta.FindStatusCondition(v.Status.Conditions, v1.VolumeConditionCloned); c != nil && c.Status != metav1.ConditionTrue && v1.IsCopyFailedReason(c.Reason) {
		return nil, status.Errorf(codes.FailedPrecondition, "volume %s cannot attach before its data is copied from its source, and the copy fails: %s", id, c.Message)
	}
	if v.Spec.NodeName == "" {
		// If we crash after this patch, the retried call finds the node set
		// and only waits.
		patch := client.MergeFrom(v.DeepCopy())
		v.Spec.NodeName = node
		if err := s.c.Patch(ctx, v, patch); err != nil {
			return nil, apiError(err)
		}
	}
	var endpoint string
	err = waitFor(ctx, fmt.Sprintf("volume %s to attach to node %s", id, node), func() (bool, string, error) {
		v, err := s.getVolume(ctx, id)
		if err != nil {
			return false, "", err
		}
		if v.Status.State == v1.VolumeStateAttached && v.Status.CurrentNodeName == node && v.Status.Endpoint != "" {
			endpoint = v.Status.Endpoint
			return true, "", nil
		}
		if msg := keyUnusable(v); msg != "" {
			return false, "", status.Error(codes.FailedPrecondition, msg)
		}
		return false, attachProgress(v), nil
	})
	if err != nil {
		return nil, err
	}
	return &csipb.ControllerPublishVolumeResponse{PublishContext: map[string]string{PublishEndpoint: endpoint}}, nil
}

// attachProgress says what an attaching volume waits for.
func attachProgress(v *v1.Volume) string {
	msg := fmt.Sprintf("it is %s (robustness %s)", orUnknown(string(v.Status.State)), v.Status.Robustness)
	for _, t := range []string{v1.VolumeConditionCloned, v1.VolumeConditionScheduled} {
		if c := meta.FindStatusCondition(v.Status.Conditions, t); c != nil && c.Status != metav1.ConditionTrue {
			msg += fmt.Sprintf("; %s: %s", t, c.Message)
		}
	}
	return msg
}

// checkNode fails with NotFound for a node without a Cairn instance manager:
// no engine can run there.
func (s *ControllerServer) checkNode(ctx context.Context, node string) error {
	var ims v1.InstanceManagerList
	if err := s.c.List(ctx, &ims, client.InNamespace(s.ns)); err != nil {
		return apiError(err)
	}
	for _, im := range ims.Items {
		if im.Spec.NodeName == node {
			return nil
		}
	}
	return status.Errorf(codes.NotFound, "node %s has no Cairn instance manager, so no engine can run there: check that the cairn instance-manager DaemonSet runs a pod on it", node)
}

// ControllerUnpublishVolume detaches the volume from the node: it clears
// spec.nodeName and waits until the engine there has stopped (which
// flushes every acknowledged write to the replicas). A volume that is gone
// or attached elsewhere is already unpublished from the node.
func (s *ControllerServer) ControllerUnpublishVolume(ctx context.Context, req *csipb.ControllerUnpublishVolumeRequest) (*csipb.ControllerUnpublishVolumeResponse, error) {
	id, node := req.GetVolumeId(), req.GetNodeId()
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
		return &csipb.ControllerUnpublishVolumeResponse{}, nil
	}
	if err != nil {
		return nil, err
	}
	if v.Spec.NodeName != "" && (node == "" || v.Spec.NodeName == node) {
		patch := client.MergeFrom(v.DeepCopy())
		v.Spec.NodeName = ""
		if err := s.c.Patch(ctx, v, patch); err != nil && !apierrors.IsNotFound(err) {
			return nil, apiError(err)
		}
	}
	err = waitFor(ctx, fmt.Sprintf("volume %s to detach from node %s", id, node), func() (bool, string, error) {
		v, err := s.getVolume(ctx, id)
		if status.Code(err) == codes.NotFound {
			return true, "", nil
		}
		if err != nil {
			return false, "", err
		}
		// Detached means the engine has stopped, which flushed every
		// acknowledged write to the replicas. A volume since published to
		// another node is detached from this one before it attaches there.
		if v.Status.State == v1.VolumeStateDetached || (v.Spec.NodeName != "" && v.Spec.NodeName != node && node != "") {
			return true, "", nil
		}
		return false, fmt.Sprintf("it is %s", orUnknown(string(v.Status.State))), nil
	})
	if err != nil {
		return nil, err
	}
	return &csipb.ControllerUnpublishVolumeResponse{}, nil
}

// ControllerExpandVolume grows the volume's spec.size. An attached volume
// grows online, and the call waits until the engine serves the new size; a
// detached one grows when it next attaches. Filesystem volumes then need
// NodeExpandVolume to grow the filesystem.
func (s *ControllerServer) ControllerExpandVolume(ctx context.Context, req *csipb.ControllerExpandVolumeRequest) (*csipb.ControllerExpandVolumeResponse, error) {
	id := req.GetVolumeId()
	if id == "" {
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	}
	if req.GetCapacityRange() == nil {
		return nil, status.Error(codes.InvalidArgument, "capacity_range is required")
	}
	if c := req.GetVolumeCapability(); c != nil {
		if err := checkCapability(c); err != nil {
			return nil, status.Error(codes.InvalidArgument, err.Error())
		}
	}
	size, err := volumeSize(req.GetCapacityRange(), 0)
	if err != nil {
		return nil, err
	}
	unlock, err := s.locks.lock("volume " + id)
	if err != nil {
		return nil, err
	}
	defer unlock()
	v, err := s.getVolume(ctx, id)
	if err != nil {
		return nil, err
	}
	nodeExpand := req.GetVolumeCapability().GetBlock() == nil
	if cur := v.Spec.Size.Value(); cur >= size {
		if l := req.GetCapacityRange().GetLimitBytes(); l > 0 && cur > l {
			return nil, status.Errorf(codes.OutOfRange, "volume %s is already %d bytes, more than limit_bytes %d: volumes never shrink", id, cur, l)
		}
		size = cur
	} else {
		patch := client.MergeFrom(v.DeepCopy())
		v.Spec.Size = *resource.NewQuantity(size, resource.BinarySI)
		if err := s.c.Patch(ctx, v, patch); err != nil {
			if apierrors.IsInvalid(err) {
				return nil, status.Errorf(codes.InvalidArgument, "the new size was refused: %v", err)
			}
			return nil, apiError(err)
		}
	}
	err = waitFor(ctx, fmt.Sprintf("volume %s to grow to %d bytes", id, size), func() (bool, string, error) {
		v, err := s.getVolume(ctx, id)
		if err != nil {
			return false, "", err
		}
		if v.Spec.NodeName == "" && v.Status.CurrentNodeName == "" {
			return true, "", nil // grows at its next attach
		}
		if v.Status.Size != nil && v.Status.Size.Value() >= size {
			return true, "", nil
		}
		return false, fmt.Sprintf("the engine serves %v", v.Status.Size), nil
	})
	if err != nil {
		return nil, err
	}
	return &csipb.ControllerExpandVolumeResponse{CapacityBytes: size, NodeExpansionRequired: nodeExpand}, nil
}
