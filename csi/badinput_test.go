package csi

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"testing"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	. "github.com/onsi/gomega"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
)

// TestBadInput sends malformed or contradictory requests to every RPC and
// checks each gets its code, a message, and changes nothing: no object
// created, changed or deleted, no process started on any node.
func TestBadInput(t *testing.T) {
	g := NewWithT(t)
	for _, n := range []string{"bad-a", "bad-b"} {
		cluster.AddNode(t, n)
	}
	d := startDriver(t, "bad-a")
	ctx := callCtx(t)
	mount := volCap("ext4", false)
	created, err := d.controller.CreateVolume(ctx, &csipb.CreateVolumeRequest{Name: "bad-input", VolumeCapabilities: []*csipb.VolumeCapability{mount},
		CapacityRange: &csipb.CapacityRange{RequiredBytes: 8 << 20}, Parameters: map[string]string{ParamNumberOfReplicas: "2"}})
	g.Expect(err).NotTo(HaveOccurred())
	id := created.GetVolume().GetVolumeId()
	t.Cleanup(func() {
		_, _ = d.controller.DeleteVolume(context.Background(), &csipb.DeleteVolumeRequest{VolumeId: id})
	})
	before := objectState(g)
	dir := t.TempDir()
	staging, target := filepath.Join(dir, "staging"), filepath.Join(dir, "target")
	caps := func(c ...*csipb.VolumeCapability) []*csipb.VolumeCapability { return c }
	multi := &csipb.VolumeCapability{AccessMode: &csipb.VolumeCapability_AccessMode{Mode: csipb.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER},
		AccessType: mount.AccessType}
	snapSource := func(s string) *csipb.VolumeContentSource {
		return &csipb.VolumeContentSource{Type: &csipb.VolumeContentSource_Snapshot{Snapshot: &csipb.VolumeContentSource_SnapshotSource{SnapshotId: s}}}
	}
	volSource := func(s string) *csipb.VolumeContentSource {
		return &csipb.VolumeContentSource{Type: &csipb.VolumeContentSource_Volume{Volume: &csipb.VolumeContentSource_VolumeSource{VolumeId: s}}}
	}
	cv := func(mod func(r *csipb.CreateVolumeRequest)) func() error {
		return func() error {
			r := &csipb.CreateVolumeRequest{Name: "bad-new", VolumeCapabilities: caps(mount), CapacityRange: &csipb.CapacityRange{RequiredBytes: 8 << 20}}
			mod(r)
			_, err := d.controller.CreateVolume(ctx, r)
			return err
		}
	}
	for _, tc := range []struct {
		name string
		call func() error
		code codes.Code
	}{
		{"CreateVolume without name", cv(func(r *csipb.CreateVolumeRequest) { r.Name = "" }), codes.InvalidArgument},
		{"CreateVolume without capabilities", cv(func(r *csipb.CreateVolumeRequest) { r.VolumeCapabilities = nil }), codes.InvalidArgument},
		{"CreateVolume multi-node", cv(func(r *csipb.CreateVolumeRequest) { r.VolumeCapabilities = caps(multi) }), codes.InvalidArgument},
		{"CreateVolume btrfs", cv(func(r *csipb.CreateVolumeRequest) { r.VolumeCapabilities = caps(volCap("btrfs", false)) }), codes.InvalidArgument},
		{"CreateVolume unknown parameter", cv(func(r *csipb.CreateVolumeRequest) { r.Parameters = map[string]string{"replicas": "3"} }), codes.InvalidArgument},
		{"CreateVolume 11 replicas", cv(func(r *csipb.CreateVolumeRequest) { r.Parameters = map[string]string{ParamNumberOfReplicas: "11"} }), codes.InvalidArgument},
		{"CreateVolume bad recurring job group", cv(func(r *csipb.CreateVolumeRequest) {
			r.Parameters = map[string]string{ParamRecurringJobGroups: "daily,not a label"}
		}), codes.InvalidArgument},
		{"CreateVolume fsType contradicts capability", cv(func(r *csipb.CreateVolumeRequest) {
			r.Parameters = map[string]string{ParamFSType: "xfs"}
		}), codes.InvalidArgument},
		{"CreateVolume limit below required", cv(func(r *csipb.CreateVolumeRequest) { r.CapacityRange.LimitBytes = 4 << 20 }), codes.InvalidArgument},
		{"CreateVolume limit not a block multiple", cv(func(r *csipb.CreateVolumeRequest) {
			r.CapacityRange = &csipb.CapacityRange{RequiredBytes: 8<<20 + 1, LimitBytes: 8<<20 + 2}
		}), codes.OutOfRange},
		{"CreateVolume from missing snapshot", cv(func(r *csipb.CreateVolumeRequest) { r.VolumeContentSource = snapSource("nope") }), codes.NotFound},
		{"CreateVolume from missing volume", cv(func(r *csipb.CreateVolumeRequest) { r.VolumeContentSource = volSource("nope") }), codes.NotFound},
		{"CreateVolume smaller than its source", cv(func(r *csipb.CreateVolumeRequest) {
			r.VolumeContentSource, r.CapacityRange = volSource(id), &csipb.CapacityRange{RequiredBytes: 4 << 20}
		}), codes.OutOfRange},
		{"CreateVolume encrypted without a passphrase", cv(func(r *csipb.CreateVolumeRequest) { r.Parameters = map[string]string{ParamEncrypted: "true"} }), codes.InvalidArgument},
		{"CreateVolume encrypted=maybe", cv(func(r *csipb.CreateVolumeRequest) { r.Parameters = map[string]string{ParamEncrypted: "maybe"} }), codes.InvalidArgument},
		{"CreateVolume encrypted with a short passphrase", cv(func(r *csipb.CreateVolumeRequest) {
			r.Parameters, r.Secrets = map[string]string{ParamEncrypted: "true"}, map[string]string{v1.EncryptionPassphraseKey: "short"}
		}), codes.InvalidArgument},
		{"CreateVolume encrypted clone of an unencrypted volume", cv(func(r *csipb.CreateVolumeRequest) {
			r.Parameters, r.Secrets = map[string]string{ParamEncrypted: "true"}, map[string]string{v1.EncryptionPassphraseKey: "a passphrase long enough"}
			r.VolumeContentSource = volSource(id)
		}), codes.InvalidArgument},
		{"CreateVolume same name, other size", cv(func(r *csipb.CreateVolumeRequest) {
			r.Name, r.CapacityRange = "bad-input", &csipb.CapacityRange{RequiredBytes: 16 << 20}
		}), codes.AlreadyExists},
		{"CreateVolume same name, other replicas", cv(func(r *csipb.CreateVolumeRequest) {
			r.Name, r.Parameters = "bad-input", map[string]string{ParamNumberOfReplicas: "3"}
		}), codes.AlreadyExists},
		{"DeleteVolume without id", func() error {
			_, err := d.controller.DeleteVolume(ctx, &csipb.DeleteVolumeRequest{})
			return err
		}, codes.InvalidArgument},
		{"ControllerPublishVolume without volume", func() error {
			_, err := d.controller.ControllerPublishVolume(ctx, &csipb.ControllerPublishVolumeRequest{NodeId: "bad-a", VolumeCapability: mount})
			return err
		}, codes.InvalidArgument},
		{"ControllerPublishVolume without node", func() error {
			_, err := d.controller.ControllerPublishVolume(ctx, &csipb.ControllerPublishVolumeRequest{VolumeId: id, VolumeCapability: mount})
			return err
		}, codes.InvalidArgument},
		{"ControllerPublishVolume without capability", func() error {
			_, err := d.controller.ControllerPublishVolume(ctx, &csipb.ControllerPublishVolumeRequest{VolumeId: id, NodeId: "bad-a"})
			return err
		}, codes.InvalidArgument},
		{"ControllerPublishVolume multi-node", func() error {
			_, err := d.controller.ControllerPublishVolume(ctx, &csipb.ControllerPublishVolumeRequest{VolumeId: id, NodeId: "bad-a", VolumeCapability: multi})
			return err
		}, codes.InvalidArgument},
		{"ControllerPublishVolume missing volume", func() error {
			_, err := d.controller.ControllerPublishVolume(ctx, &csipb.ControllerPublishVolumeRequest{VolumeId: "nope", NodeId: "bad-a", VolumeCapability: mount})
			return err
		}, codes.NotFound},
		{"ControllerPublishVolume node without instance manager", func() error {
			_, err := d.controller.ControllerPublishVolume(ctx, &csipb.ControllerPublishVolumeRequest{VolumeId: id, NodeId: "nowhere", VolumeCapability: mount})
			return err
		}, codes.NotFound},
		{"ControllerUnpublishVolume without volume", func() error {
			_, err := d.controller.ControllerUnpublishVolume(ctx, &csipb.ControllerUnpublishVolumeRequest{NodeId: "bad-a"})
			return err
		}, codes.InvalidArgument},
		{"ValidateVolumeCapabilities without volume", func() error {
			_, err := d.controller.ValidateVolumeCapabilities(ctx, &csipb.ValidateVolumeCapabilitiesRequest{VolumeCapabilities: caps(mount)})
			return err
		}, codes.InvalidArgument},
		{"ValidateVolumeCapabilities without capabilities", func() error {
			_, err := d.controller.ValidateVolumeCapabilities(ctx, &csipb.ValidateVolumeCapabilitiesRequest{VolumeId: id})
			return err
		}, codes.InvalidArgument},
		{"ValidateVolumeCapabilities missing volume", func() error {
			_, err := d.controller.ValidateVolumeCapabilities(ctx, &csipb.ValidateVolumeCapabilitiesRequest{VolumeId: "nope", VolumeCapabilities: caps(mount)})
			return err
		}, codes.NotFound},
		{"ListVolumes foreign token", func() error {
			_, err := d.controller.ListVolumes(ctx, &csipb.ListVolumesRequest{StartingToken: "42"})
			return err
		}, codes.Aborted},
		{"ListVolumes negative max", func() error {
			_, err := d.controller.ListVolumes(ctx, &csipb.ListVolumesRequest{MaxEntries: -1})
			return err
		}, codes.InvalidArgument},
		{"ControllerGetVolume without volume", func() error {
			_, err := d.controller.ControllerGetVolume(ctx, &csipb.ControllerGetVolumeRequest{})
			return err
		}, codes.InvalidArgument},
		{"ControllerGetVolume missing volume", func() error {
			_, err := d.controller.ControllerGetVolume(ctx, &csipb.ControllerGetVolumeRequest{VolumeId: "nope"})
			return err
		}, codes.NotFound},
		{"GetCapacity unknown parameter", func() error {
			_, err := d.controller.GetCapacity(ctx, &csipb.GetCapacityRequest{Parameters: map[string]string{"size": "1"}})
			return err
		}, codes.InvalidArgument},
		{"ControllerExpandVolume without volume", func() error {
			_, err := d.controller.ControllerExpandVolume(ctx, &csipb.ControllerExpandVolumeRequest{CapacityRange: &csipb.CapacityRange{RequiredBytes: 1 << 30}})
			return err
		}, codes.InvalidArgument},
		{"ControllerExpandVolume without range", func() error {
			_, err := d.controller.ControllerExpandVolume(ctx, &csipb.ControllerExpandVolumeRequest{VolumeId: id})
			return err
		}, codes.InvalidArgument},
		{"ControllerExpandVolume missing volume", func() error {
			_, err := d.controller.ControllerExpandVolume(ctx, &csipb.ControllerExpandVolumeRequest{VolumeId: "nope", CapacityRange: &csipb.CapacityRange{RequiredBytes: 1 << 30}})
			return err
		}, codes.NotFound},
		{"ControllerExpandVolume shrink below the limit", func() error {
			_, err := d.controller.ControllerExpandVolume(ctx, &csipb.ControllerExpandVolumeRequest{VolumeId: id, CapacityRange: &csipb.CapacityRange{RequiredBytes: 2 << 20, LimitBytes: 4 << 20}})
			return err
		}, codes.OutOfRange},
		{"CreateSnapshot without name", func() error {
			_, err := d.controller.CreateSnapshot(ctx, &csipb.CreateSnapshotRequest{SourceVolumeId: id})
			return err
		}, codes.InvalidArgument},
		{"CreateSnapshot without source", func() error {
			_, err := d.controller.CreateSnapshot(ctx, &csipb.CreateSnapshotRequest{Name: "s"})
			return err
		}, codes.InvalidArgument},
		{"CreateSnapshot with a parameter", func() error {
			_, err := d.controller.CreateSnapshot(ctx, &csipb.CreateSnapshotRequest{Name: "s", SourceVolumeId: id, Parameters: map[string]string{"type": "full"}})
			return err
		}, codes.InvalidArgument},
		{"CreateSnapshot of a missing volume", func() error {
			_, err := d.controller.CreateSnapshot(ctx, &csipb.CreateSnapshotRequest{Name: "s", SourceVolumeId: "nope"})
			return err
		}, codes.NotFound},
		{"DeleteSnapshot without id", func() error {
			_, err := d.controller.DeleteSnapshot(ctx, &csipb.DeleteSnapshotRequest{})
			return err
		}, codes.InvalidArgument},
		{"ListSnapshots foreign token", func() error {
			_, err := d.controller.ListSnapshots(ctx, &csipb.ListSnapshotsRequest{StartingToken: "x"})
			return err
		}, codes.Aborted},
		{"NodeStageVolume without volume", func() error {
			_, err := d.node.NodeStageVolume(ctx, &csipb.NodeStageVolumeRequest{StagingTargetPath: staging, VolumeCapability: mount})
			return err
		}, codes.InvalidArgument},
		{"NodeStageVolume without staging path", func() error {
			_, err := d.node.NodeStageVolume(ctx, &csipb.NodeStageVolumeRequest{VolumeId: id, VolumeCapability: mount})
			return err
		}, codes.InvalidArgument},
		{"NodeStageVolume without capability", func() error {
			_, err := d.node.NodeStageVolume(ctx, &csipb.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging})
			return err
		}, codes.InvalidArgument},
		{"NodeStageVolume btrfs", func() error {
			_, err := d.node.NodeStageVolume(ctx, &csipb.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: volCap("btrfs", false)})
			return err
		}, codes.InvalidArgument},
		{"NodeStageVolume missing volume", func() error {
			_, err := d.node.NodeStageVolume(ctx, &csipb.NodeStageVolumeRequest{VolumeId: "nope", StagingTargetPath: staging, VolumeCapability: mount})
			return err
		}, codes.NotFound},
		{"NodeStageVolume not attached here", func() error {
			_, err := d.node.NodeStageVolume(ctx, &csipb.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: mount})
			return err
		}, codes.FailedPrecondition},
		{"NodeUnstageVolume without volume", func() error {
			_, err := d.node.NodeUnstageVolume(ctx, &csipb.NodeUnstageVolumeRequest{StagingTargetPath: staging})
			return err
		}, codes.InvalidArgument},
		{"NodeUnstageVolume without path", func() error {
			_, err := d.node.NodeUnstageVolume(ctx, &csipb.NodeUnstageVolumeRequest{VolumeId: id})
			return err
		}, codes.InvalidArgument},
		{"NodePublishVolume without staging path", func() error {
			_, err := d.node.NodePublishVolume(ctx, &csipb.NodePublishVolumeRequest{VolumeId: id, TargetPath: target, VolumeCapability: mount})
			return err
		}, codes.InvalidArgument},
		{"NodePublishVolume without target", func() error {
			_, err := d.node.NodePublishVolume(ctx, &csipb.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: mount})
			return err
		}, codes.InvalidArgument},
		{"NodePublishVolume multi-node", func() error {
			_, err := d.node.NodePublishVolume(ctx, &csipb.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging, TargetPath: target, VolumeCapability: multi})
			return err
		}, codes.InvalidArgument},
		{"NodePublishVolume not attached here", func() error {
			_, err := d.node.NodePublishVolume(ctx, &csipb.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging, TargetPath: target, VolumeCapability: mount})
			return err
		}, codes.FailedPrecondition},
		{"NodeUnpublishVolume without target", func() error {
			_, err := d.node.NodeUnpublishVolume(ctx, &csipb.NodeUnpublishVolumeRequest{VolumeId: id})
			return err
		}, codes.InvalidArgument},
		{"NodeGetVolumeStats without path", func() error {
			_, err := d.node.NodeGetVolumeStats(ctx, &csipb.NodeGetVolumeStatsRequest{VolumeId: id})
			return err
		}, codes.InvalidArgument},
		{"NodeGetVolumeStats missing volume", func() error {
			_, err := d.node.NodeGetVolumeStats(ctx, &csipb.NodeGetVolumeStatsRequest{VolumeId: "nope", VolumePath: dir})
			return err
		}, codes.NotFound},
		{"NodeGetVolumeStats missing path", func() error {
			_, err := d.node.NodeGetVolumeStats(ctx, &csipb.NodeGetVolumeStatsRequest{VolumeId: id, VolumePath: filepath.Join(dir, "gone")})
			return err
		}, codes.NotFound},
		{"NodeExpandVolume without path", func() error {
			_, err := d.node.NodeExpandVolume(ctx, &csipb.NodeExpandVolumeRequest{VolumeId: id})
			return err
		}, codes.InvalidArgument},
		{"NodeExpandVolume not attached here", func() error {
			_, err := d.node.NodeExpandVolume(ctx, &csipb.NodeExpandVolumeRequest{VolumeId: id, VolumePath: dir})
			return err
		}, codes.FailedPrecondition},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			err := tc.call()
			g.Expect(status.Code(err)).To(Equal(tc.code), "%v", err)
			g.Expect(status.Convert(err).Message()).NotTo(BeEmpty())
		})
	}
	g.Expect(objectState(g)).To(Equal(before), "no object was created, changed or deleted")
	for _, p := range []string{staging, target} {
		_, err := os.Stat(p)
		g.Expect(os.IsNotExist(err)).To(BeTrue(), "%s was not created", p)
	}
}

// objectState lists every Cairn object of the test namespace with its
// resource version, and the processes every instance manager runs.
func objectState(g *WithT) []string {
	ctx := context.Background()
	var out []string
	var vs v1.VolumeList
	var es v1.EngineList
	var rs v1.ReplicaList
	var ss v1.SnapshotList
	for _, l := range []client.ObjectList{&vs, &es, &rs, &ss} {
		g.Expect(cluster.Client.List(ctx, l, client.InNamespace(testNamespace))).To(Succeed())
	}
	for _, o := range vs.Items {
		out = append(out, fmt.Sprintf("volume %s %s", o.Name, o.ResourceVersion))
	}
	for _, o := range es.Items {
		out = append(out, fmt.Sprintf("engine %s %s", o.Name, o.ResourceVersion))
	}
	for _, o := range rs.Items {
		out = append(out, fmt.Sprintf("replica %s %s", o.Name, o.ResourceVersion))
	}
	for _, o := range ss.Items {
		out = append(out, fmt.Sprintf("snapshot %s %s", o.Name, o.ResourceVersion))
	}
	var secrets corev1.SecretList
	g.Expect(cluster.Client.List(ctx, &secrets, client.InNamespace(testNamespace))).To(Succeed())
	for _, o := range secrets.Items {
		out = append(out, fmt.Sprintf("secret %s %s", o.Name, o.ResourceVersion))
	}
	var ims v1.InstanceManagerList
	g.Expect(cluster.Client.List(ctx, &ims, client.InNamespace(testNamespace))).To(Succeed())
	for _, im := range ims.Items {
		for _, p := range im.Status.Processes {
			out = append(out, fmt.Sprintf("process %s on %s", p.Name, im.Spec.NodeName))
		}
	}
	slices.Sort(out)
	return out
}
