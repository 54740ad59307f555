package csi

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/go-logr/logr"
	. "github.com/onsi/gomega"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/proto"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// TestNodePluginRestart restarts the node plugin while a volume is staged
// and published: the new one reports its stats, treats a repeated publish
// as done, and unpublishes and unstages it, from the mount table and the
// Volume alone.
func TestNodePluginRestart(t *testing.T) {
	needRoot(t)
	g := NewWithT(t)
	addNodes(t, "restart-a")
	first := startDriver(t, "restart-a")
	ctx := callCtx(t)
	vc := volCap("ext4", false)
	created, err := first.controller.CreateVolume(ctx, &csipb.CreateVolumeRequest{Name: "restart", VolumeCapabilities: []*csipb.VolumeCapability{vc},
		CapacityRange: &csipb.CapacityRange{RequiredBytes: 64 << 20}, Parameters: map[string]string{ParamNumberOfReplicas: "1"}})
	g.Expect(err).NotTo(HaveOccurred())
	vol := created.GetVolume()
	p := mountOn(t, g, first, first, vol, vc)
	files := writeData(t, g, p, "kept")

	second := startDriver(t, "restart-a") // the restarted plugin: nothing carried over but the node
	p.node = second
	stats, err := second.node.NodeGetVolumeStats(ctx, &csipb.NodeGetVolumeStatsRequest{VolumeId: vol.GetVolumeId(), VolumePath: p.target})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(stats.GetVolumeCondition().GetAbnormal()).To(BeFalse(), stats.GetVolumeCondition().GetMessage())
	g.Expect(stats.GetUsage()).To(HaveLen(2))
	g.Expect(stats.GetUsage()[0].GetUsed()).To(BeNumerically(">", 4<<20), "the files written count")
	_, err = second.node.NodeStageVolume(ctx, &csipb.NodeStageVolumeRequest{VolumeId: vol.GetVolumeId(), StagingTargetPath: p.staging, VolumeCapability: vc})
	g.Expect(err).NotTo(HaveOccurred(), "staging again is done already")
	_, err = second.node.NodePublishVolume(ctx, &csipb.NodePublishVolumeRequest{VolumeId: vol.GetVolumeId(), StagingTargetPath: p.staging,
		TargetPath: p.target, VolumeCapability: vc})
	g.Expect(err).NotTo(HaveOccurred(), "publishing again is done already")
	g.Expect(readData(t, g, p, files)).To(Succeed())

	// A path with nothing mounted: the volume's mount is gone.
	gone := t.TempDir()
	stats, err = second.node.NodeGetVolumeStats(ctx, &csipb.NodeGetVolumeStatsRequest{VolumeId: vol.GetVolumeId(), VolumePath: gone})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(stats.GetVolumeCondition().GetAbnormal()).To(BeTrue())
	g.Expect(stats.GetVolumeCondition().GetMessage()).To(ContainSubstring("nothing is mounted"))

	unmountFrom(t, g, first, p, vol.GetVolumeId())
	for i := 0; i < 2; i++ { // idempotent
		_, err = second.node.NodeUnpublishVolume(ctx, &csipb.NodeUnpublishVolumeRequest{VolumeId: vol.GetVolumeId(), TargetPath: p.target})
		g.Expect(err).NotTo(HaveOccurred())
		_, err = second.node.NodeUnstageVolume(ctx, &csipb.NodeUnstageVolumeRequest{VolumeId: vol.GetVolumeId(), StagingTargetPath: p.staging})
		g.Expect(err).NotTo(HaveOccurred())
	}
	_, err = first.controller.DeleteVolume(ctx, &csipb.DeleteVolumeRequest{VolumeId: vol.GetVolumeId()})
	g.Expect(err).NotTo(HaveOccurred())
}

// TestProbe: the node service is ready only once its node's instance
// manager runs; the controller service once the API server answers.
func TestProbe(t *testing.T) {
	g := NewWithT(t)
	d := startDriver(t, "probe-a")
	ctx := callCtx(t)
	r, err := d.identity.Probe(ctx, &csipb.ProbeRequest{})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(r.GetReady().GetValue()).To(BeFalse(), "no instance manager on probe-a yet")
	g.Expect(d.Probe(ctx)).To(MatchError(ContainSubstring("has no InstanceManager")))
	cluster.AddNode(t, "probe-a")
	g.Eventually(func() bool {
		r, err := d.identity.Probe(ctx, &csipb.ProbeRequest{})
		return err == nil && r.GetReady().GetValue()
	}, deadline.Scale(30*time.Second), 100*time.Millisecond).Should(BeTrue())

	ctrlOnly, err := New(Options{Mode: ModeController, Client: cluster.Client, Namespace: testNamespace, Logger: logr.Discard()})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(ctrlOnly.Probe(ctx)).To(Succeed())
	info, err := d.identity.GetPluginInfo(ctx, &csipb.GetPluginInfoRequest{})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(info.GetName()).To(Equal(DriverName))
	g.Expect(info.GetVendorVersion()).To(Equal("test"))
	_, err = New(Options{Mode: ModeNode, Client: cluster.Client, Namespace: testNamespace})
	g.Expect(err).To(MatchError(ContainSubstring("NodeID is required")))
}

// TestRegistration plays kubelet's plugin watcher against the node
// plugin's registration socket.
func TestRegistration(t *testing.T) {
	g := NewWithT(t)
	dir, err := os.MkdirTemp("", "cairn-reg-")
	g.Expect(err).NotTo(HaveOccurred())
	t.Cleanup(func() { os.RemoveAll(dir) })
	reg := &Registration{Endpoint: "/var/lib/kubelet/plugins/storage.cairn.io/csi.sock", Logger: logr.Discard()}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	go func() { _ = reg.Serve(ctx, dir) }() // a failure shows as the socket never answering
	sock := SocketPath(dir)
	g.Expect(filepath.Base(sock)).To(Equal("storage.cairn.io-reg.sock"))
	g.Eventually(func() error { _, err := os.Stat(sock); return err }, deadline.Scale(10*time.Second), 20*time.Millisecond).Should(Succeed())
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	g.Expect(err).NotTo(HaveOccurred())
	defer conn.Close()
	kubelet := registerapi.NewRegistrationClient(conn)
	info, err := kubelet.GetInfo(ctx, &registerapi.InfoRequest{})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(info.GetType()).To(Equal(registerapi.CSIPlugin))
	g.Expect(info.GetName()).To(Equal(DriverName))
	g.Expect(info.GetEndpoint()).To(Equal(reg.Endpoint))
	g.Expect(info.GetSupportedVersions()).To(ContainElement("1.0.0"))
	g.Expect(reg.Registered()).To(Succeed(), "nothing refused yet")
	_, err = kubelet.NotifyRegistrationStatus(ctx, &registerapi.RegistrationStatus{PluginRegistered: false, Error: "version mismatch"})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(reg.Registered()).To(MatchError(ContainSubstring("version mismatch")))
	_, err = kubelet.NotifyRegistrationStatus(ctx, &registerapi.RegistrationStatus{PluginRegistered: true})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(reg.Registered()).To(Succeed())
}

func TestVolumeCondition(t *testing.T) {
	g := NewWithT(t)
	v := &v1.Volume{}
	v.Name = "v"
	v.Status.State, v.Status.Robustness = v1.VolumeStateAttached, v1.VolumeRobustnessHealthy
	g.Expect(volumeCondition(v).GetAbnormal()).To(BeFalse())
	v.Status.Robustness = v1.VolumeRobustnessDegraded
	g.Expect(volumeCondition(v).GetAbnormal()).To(BeTrue())
	v.Status.Robustness = v1.VolumeRobustnessFaulted
	g.Expect(volumeCondition(v).GetMessage()).To(ContainSubstring("faulted"))
	v.Status.Robustness = v1.VolumeRobustnessUnknown
	v.Status.Conditions = []metav1.Condition{{Type: v1.VolumeConditionScheduled, Status: metav1.ConditionFalse,
		Reason: v1.VolumeReasonReplicaSchedulingFailed, Message: "no disk with tag ssd"}}
	g.Expect(volumeCondition(v).GetAbnormal()).To(BeTrue())
	g.Expect(volumeCondition(v).GetMessage()).To(ContainSubstring("no disk with tag ssd"))
}

// TestGetCapacity: the free space of the disks a StorageClass allows,
// shared by the replicas; none for a tag no disk carries.
func TestGetCapacity(t *testing.T) {
	g := NewWithT(t)
	for _, n := range []string{"cap-a", "cap-b"} {
		cluster.AddNode(t, n)
	}
	d := startDriver(t, "cap-a")
	ctx := callCtx(t)
	capacity := func(replicas string) *csipb.GetCapacityResponse {
		r, err := d.controller.GetCapacity(ctx, &csipb.GetCapacityRequest{Parameters: map[string]string{ParamNumberOfReplicas: replicas}})
		g.Expect(err).NotTo(HaveOccurred())
		return r
	}
	// Both nodes' disks reported: a two-replica volume fits somewhere.
	g.Eventually(func() int64 { return capacity("2").GetMaximumVolumeSize().GetValue() },
		deadline.Scale(30*time.Second), 100*time.Millisecond).Should(BeNumerically(">", 0), "the disks report their space")
	one, two := capacity("1").GetAvailableCapacity(), capacity("2").GetAvailableCapacity()
	g.Expect(two).To(BeNumerically("<", one), "two replicas take twice the space")
	g.Expect(capacity("3").GetMaximumVolumeSize().GetValue()).To(BeZero(), "three replicas need three disks; there are two")
	r, err := d.controller.GetCapacity(ctx, &csipb.GetCapacityRequest{Parameters: map[string]string{ParamDiskSelector: "no-disk-has-this"}})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(r.GetAvailableCapacity()).To(BeZero())
	g.Expect(r.GetMaximumVolumeSize().GetValue()).To(BeZero())
}

// TestPluginCapabilities: the node plugin and the controller plugin give
// the same answer, the plugin's as a whole: a client of the node socket
// alone (kubelet, csi-sanity against the split deployment) learns there
// is a controller service, so volumes are controller-published before
// they are staged.
func TestPluginCapabilities(t *testing.T) {
	g := NewWithT(t)
	ctx := callCtx(t)
	answers := map[Mode]*csipb.GetPluginCapabilitiesResponse{}
	for _, m := range []Mode{ModeNode, ModeController, ModeAll} {
		d := serveDriver(t, Options{Mode: m, NodeID: "caps-a"})
		r, err := d.identity.GetPluginCapabilities(ctx, &csipb.GetPluginCapabilitiesRequest{})
		g.Expect(err).NotTo(HaveOccurred())
		answers[m] = r
	}
	var services []csipb.PluginCapability_Service_Type
	var expansion []csipb.PluginCapability_VolumeExpansion_Type
	for _, c := range answers[ModeNode].GetCapabilities() {
		if s := c.GetService(); s != nil {
			services = append(services, s.GetType())
		}
		if e := c.GetVolumeExpansion(); e != nil {
			expansion = append(expansion, e.GetType())
		}
	}
	g.Expect(services).To(ConsistOf(csipb.PluginCapability_Service_CONTROLLER_SERVICE), "no topology: any node can attach any volume")
	g.Expect(expansion).To(ConsistOf(csipb.PluginCapability_VolumeExpansion_ONLINE))
	for _, m := range []Mode{ModeController, ModeAll} {
		g.Expect(proto.Equal(answers[m], answers[ModeNode])).To(BeTrue(), "mode %s answers %v, node mode %v", m, answers[m], answers[ModeNode])
	}
}
