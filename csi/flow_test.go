package csi

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"testing"
	"time"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	. "github.com/onsi/gomega"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/harness"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// pod is what kubelet sets up for one pod using a volume on one node.
type pod struct {
	node    *driver
	staging string
	target  string
	block   bool
}

// TestSeedFlow makes the calls the external-provisioner, -attacher,
// -snapshotter, -resizer and kubelet make, in their order, over the real
// unix sockets of a controller plugin and two node plugins: create →
// publish on node-a → stage → publish → write files and checksums →
// unpublish → unstage → controller-unpublish → publish on node-b → stage →
// read back → snapshot → write more → clone from the snapshot → mount the
// clone and see the old data → expand online and see it grow → delete
// everything and find nothing left on any node. Once per filesystem and
// in raw block mode.
func TestSeedFlow(t *testing.T) {
	needRoot(t)
	nodes := []*harness.Node{cluster.AddNode(t, "flow-a"), cluster.AddNode(t, "flow-b"), cluster.AddNode(t, "flow-c")}
	ctrl := startDriver(t, "flow-c")
	nodeA, nodeB := startDriver(t, "flow-a"), startDriver(t, "flow-b")
	for _, tc := range []struct {
		name  string
		fs    string
		block bool
	}{
		{name: "ext4", fs: "ext4"},
		{name: "xfs", fs: "xfs"},
		{name: "block", block: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			ctx := callCtx(t)
			vc := volCap(tc.fs, tc.block)
			const size = 300 << 20 // xfs wants at least 300 MiB

			t.Log("CreateVolume")
			created, err := ctrl.controller.CreateVolume(ctx, &csipb.CreateVolumeRequest{Name: "pvc-flow-" + tc.name,
				CapacityRange:      &csipb.CapacityRange{RequiredBytes: size},
				VolumeCapabilities: []*csipb.VolumeCapability{vc},
				Parameters:         map[string]string{ParamNumberOfReplicas: "3", ParamFSType: tc.fs}})
			g.Expect(err).NotTo(HaveOccurred())
			vol := created.GetVolume()
			g.Expect(vol.GetCapacityBytes()).To(Equal(int64(size)))

			a := mountOn(t, g, ctrl, nodeA, vol, vc)
			_, err = ctrl.controller.ControllerPublishVolume(ctx, &csipb.ControllerPublishVolumeRequest{VolumeId: vol.GetVolumeId(),
				NodeId: "flow-b", VolumeCapability: vc})
			g.Expect(status.Code(err)).To(Equal(codes.FailedPrecondition), "a second node while attached elsewhere: %v", err)
			files := writeData(t, g, a, "before")
			unmountFrom(t, g, ctrl, a, vol.GetVolumeId())

			b := mountOn(t, g, ctrl, nodeB, vol, vc)
			g.Expect(readData(t, g, b, files)).To(Succeed(), "data written on node-a reads back on node-b")

			t.Log("CreateSnapshot of the attached volume")
			snap, err := ctrl.controller.CreateSnapshot(ctx, &csipb.CreateSnapshotRequest{Name: "snapshot-flow-" + tc.name, SourceVolumeId: vol.GetVolumeId()})
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(snap.GetSnapshot().GetReadyToUse()).To(BeTrue())
			g.Expect(snap.GetSnapshot().GetSizeBytes()).To(Equal(int64(size)))
			later := writeData(t, g, b, "after")

			t.Log("CreateVolume from the snapshot")
			cloned, err := ctrl.controller.CreateVolume(ctx, &csipb.CreateVolumeRequest{Name: "pvc-flow-clone-" + tc.name,
				CapacityRange:      &csipb.CapacityRange{RequiredBytes: size},
				VolumeCapabilities: []*csipb.VolumeCapability{vc},
				Parameters:         map[string]string{ParamNumberOfReplicas: "2", ParamFSType: tc.fs},
				VolumeContentSource: &csipb.VolumeContentSource{Type: &csipb.VolumeContentSource_Snapshot{
					Snapshot: &csipb.VolumeContentSource_SnapshotSource{SnapshotId: snap.GetSnapshot().GetSnapshotId()}}}})
			g.Expect(err).NotTo(HaveOccurred())
			clone := cloned.GetVolume()
			c := mountOn(t, g, ctrl, nodeA, clone, vc)
			g.Expect(readData(t, g, c, files)).To(Succeed(), "the clone has the data of the snapshot")
			g.Expect(readData(t, g, c, later)).NotTo(Succeed(), "and not what was written after it")

			t.Log("expand online")
			before := usableBytes(g, b)
			grown := int64(size + 128<<20)
			ex, err := ctrl.controller.ControllerExpandVolume(ctx, &csipb.ControllerExpandVolumeRequest{VolumeId: vol.GetVolumeId(),
				CapacityRange: &csipb.CapacityRange{RequiredBytes: grown}, VolumeCapability: vc})
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(ex.GetCapacityBytes()).To(Equal(grown))
			g.Expect(ex.GetNodeExpansionRequired()).To(Equal(!tc.block))
			_, err = b.node.node.NodeExpandVolume(ctx, &csipb.NodeExpandVolumeRequest{VolumeId: vol.GetVolumeId(), VolumePath: b.target,
				StagingTargetPath: b.staging, CapacityRange: &csipb.CapacityRange{RequiredBytes: grown}, VolumeCapability: vc})
			if tc.fs == "ext4" && !hasCapSysResource() {
				t.Log("this process lacks CAP_SYS_RESOURCE, which the kernel wants to grow a mounted ext4: the node says so, and the filesystem grows when the volume is staged again")
				g.Expect(status.Code(err)).To(Equal(codes.FailedPrecondition), "%v", err)
				g.Expect(status.Convert(err).Message()).To(ContainSubstring("CAP_SYS_RESOURCE"), "the message names what is missing")
				g.Expect(usableBytes(g, b)).To(Equal(before), "nothing changed")
				unmountFrom(t, g, ctrl, b, vol.GetVolumeId())
				b = mountOn(t, g, ctrl, nodeB, vol, vc)
			} else {
				g.Expect(err).NotTo(HaveOccurred())
			}
			g.Expect(usableBytes(g, b)).To(BeNumerically(">=", before+100<<20), "the volume grew by at least 100 MiB as the pod sees it")
			// Staged again, a replica may still be resyncing for a moment
			// on a loaded machine (the volume degraded, which the
			// condition reports): wait for it to be healthy.
			var why string
			g.Eventually(func() bool {
				stats, err := b.node.node.NodeGetVolumeStats(ctx, &csipb.NodeGetVolumeStatsRequest{VolumeId: vol.GetVolumeId(), VolumePath: b.target})
				g.Expect(err).NotTo(HaveOccurred())
				why = stats.GetVolumeCondition().GetMessage()
				return stats.GetVolumeCondition().GetAbnormal()
			}, deadline.Scale(time.Minute), 200*time.Millisecond).Should(BeFalse(), func() string { return why })
			g.Expect(readData(t, g, b, later)).To(Succeed(), "the data is intact after the expansion")

			t.Log("delete everything")
			unmountFrom(t, g, ctrl, c, clone.GetVolumeId())
			unmountFrom(t, g, ctrl, b, vol.GetVolumeId())
			_, err = ctrl.controller.DeleteVolume(ctx, &csipb.DeleteVolumeRequest{VolumeId: clone.GetVolumeId()})
			g.Expect(err).NotTo(HaveOccurred())
			_, err = ctrl.controller.DeleteVolume(ctx, &csipb.DeleteVolumeRequest{VolumeId: vol.GetVolumeId()})
			g.Expect(err).To(MatchError(ContainSubstring("snapshot")), "a volume with snapshots is not deleted")
			_, err = ctrl.controller.DeleteSnapshot(ctx, &csipb.DeleteSnapshotRequest{SnapshotId: snap.GetSnapshot().GetSnapshotId()})
			g.Expect(err).NotTo(HaveOccurred())
			_, err = ctrl.controller.DeleteVolume(ctx, &csipb.DeleteVolumeRequest{VolumeId: vol.GetVolumeId()})
			g.Expect(err).NotTo(HaveOccurred())
			expectNothingLeft(g, nodes)
		})
	}
}

func volCap(fs string, block bool) *csipb.VolumeCapability {
	c := &csipb.VolumeCapability{AccessMode: &csipb.VolumeCapability_AccessMode{Mode: csipb.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}
	if block {
		c.AccessType = &csipb.VolumeCapability_Block{Block: &csipb.VolumeCapability_BlockVolume{}}
	} else {
		c.AccessType = &csipb.VolumeCapability_Mount{Mount: &csipb.VolumeCapability_MountVolume{FsType: fs}}
	}
	return c
}

// mountOn does what the external-attacher and kubelet do to start a pod
// using vol on node: ControllerPublishVolume, NodeStageVolume and
// NodePublishVolume, at kubelet-like paths.
func mountOn(t *testing.T, g *WithT, ctrl, node *driver, vol *csipb.Volume, vc *csipb.VolumeCapability) *pod {
	t.Helper()
	ctx := callCtx(t)
	nodeID := node.opts.NodeID
	t.Logf("publish %s on %s", vol.GetVolumeId(), nodeID)
	pub, err := ctrl.controller.ControllerPublishVolume(ctx, &csipb.ControllerPublishVolumeRequest{VolumeId: vol.GetVolumeId(),
		NodeId: nodeID, VolumeCapability: vc, VolumeContext: vol.GetVolumeContext()})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(pub.GetPublishContext()).To(HaveKey(PublishEndpoint))
	dir := t.TempDir()
	p := &pod{node: node, staging: filepath.Join(dir, "globalmount"), target: filepath.Join(dir, "pods", "uid", "mount"), block: vc.GetBlock() != nil}
	if p.block {
		p.target = filepath.Join(dir, "pods", "uid", "dev")
	}
	_, err = node.node.NodeStageVolume(ctx, &csipb.NodeStageVolumeRequest{VolumeId: vol.GetVolumeId(), StagingTargetPath: p.staging,
		VolumeCapability: vc, PublishContext: pub.GetPublishContext(), VolumeContext: vol.GetVolumeContext()})
	g.Expect(err).NotTo(HaveOccurred())
	_, err = node.node.NodePublishVolume(ctx, &csipb.NodePublishVolumeRequest{VolumeId: vol.GetVolumeId(), StagingTargetPath: p.staging,
		TargetPath: p.target, VolumeCapability: vc, PublishContext: pub.GetPublishContext(), VolumeContext: vol.GetVolumeContext()})
	g.Expect(err).NotTo(HaveOccurred())
	t.Cleanup(func() { // a failed test leaves no mount behind
		_ = unix.Unmount(p.target, unix.MNT_DETACH) // not mounted once the test unmounted it
		_ = unix.Unmount(p.staging, unix.MNT_DETACH)
	})
	return p
}

// unmountFrom does what kubelet and the external-attacher do when the pod
// is gone: NodeUnpublishVolume, NodeUnstageVolume, ControllerUnpublishVolume.
func unmountFrom(t *testing.T, g *WithT, ctrl *driver, p *pod, id string) {
	t.Helper()
	ctx := callCtx(t)
	t.Logf("unpublish %s from %s", id, p.node.opts.NodeID)
	_, err := p.node.node.NodeUnpublishVolume(ctx, &csipb.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: p.target})
	g.Expect(err).NotTo(HaveOccurred())
	_, err = p.node.node.NodeUnstageVolume(ctx, &csipb.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: p.staging})
	g.Expect(err).NotTo(HaveOccurred())
	_, err = ctrl.controller.ControllerUnpublishVolume(ctx, &csipb.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: p.node.opts.NodeID})
	g.Expect(err).NotTo(HaveOccurred())
	_, err = os.Stat(p.target)
	g.Expect(os.IsNotExist(err)).To(BeTrue(), "the target path is removed")
}

// chunk is data written at a place: a file of a filesystem volume or an
// offset of a block volume.
type chunk struct {
	name   string
	offset int64
	sum    [32]byte
	n      int
}

// writeData writes three chunks of random data and makes them durable.
func writeData(t *testing.T, g *WithT, p *pod, tag string) []chunk {
	t.Helper()
	var out []chunk
	for i, n := range []int{4096, 1 << 20, 3<<20 + 512} {
		buf := make([]byte, n)
		rand.Read(buf)
		c := chunk{name: fmt.Sprintf("%s-%d", tag, i), sum: sha256.Sum256(buf), n: n}
		if p.block {
			c.offset = int64(len(tag)*16+i*4) << 20
			f, err := os.OpenFile(p.target, os.O_RDWR, 0)
			g.Expect(err).NotTo(HaveOccurred())
			_, err = f.WriteAt(buf, c.offset)
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(f.Sync()).To(Succeed())
			g.Expect(f.Close()).To(Succeed())
		} else {
			f, err := os.Create(filepath.Join(p.target, c.name))
			g.Expect(err).NotTo(HaveOccurred())
			_, err = f.Write(buf)
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(f.Sync()).To(Succeed())
			g.Expect(f.Close()).To(Succeed())
		}
		out = append(out, c)
	}
	return out
}

// readData checks every chunk reads back with its checksum.
func readData(t *testing.T, g *WithT, p *pod, chunks []chunk) error {
	t.Helper()
	for _, c := range chunks {
		buf := make([]byte, c.n)
		if p.block {
			f, err := os.Open(p.target)
			g.Expect(err).NotTo(HaveOccurred())
			_, err = f.ReadAt(buf, c.offset)
			f.Close()
			if err != nil && !errors.Is(err, io.EOF) {
				return err
			}
		} else {
			b, err := os.ReadFile(filepath.Join(p.target, c.name))
			if err != nil {
				return err
			}
			buf = b
		}
		if sum := sha256.Sum256(buf); !bytes.Equal(sum[:], c.sum[:]) {
			return fmt.Errorf("%s reads back different", c.name)
		}
	}
	return nil
}

// usableBytes is the size the pod sees: the filesystem's or the device's.
func usableBytes(g *WithT, p *pod) int64 {
	if p.block {
		n, err := NewSystemMounter().DeviceSize(p.target)
		g.Expect(err).NotTo(HaveOccurred())
		return n
	}
	var st unix.Statfs_t
	g.Expect(unix.Statfs(p.target, &st)).To(Succeed())
	return int64(st.Blocks) * int64(st.Bsize)
}

// expectNothingLeft checks that no Cairn object of a volume and no replica
// data is left on any node.
func expectNothingLeft(g *WithT, nodes []*harness.Node) {
	ctx := context.Background()
	g.Eventually(func() []string {
		var vs v1.VolumeList
		var es v1.EngineList
		var rs v1.ReplicaList
		var ss v1.SnapshotList
		for _, l := range []client.ObjectList{&vs, &es, &rs, &ss} {
			g.Expect(cluster.Client.List(ctx, l, client.InNamespace(testNamespace))).To(Succeed())
		}
		var left []string
		for _, v := range vs.Items {
			left = append(left, "volume "+v.Name)
		}
		for _, e := range es.Items {
			left = append(left, "engine "+e.Name)
		}
		for _, r := range rs.Items {
			left = append(left, "replica "+r.Name+" on "+r.Spec.NodeName)
		}
		for _, s := range ss.Items {
			left = append(left, "snapshot "+s.Name)
		}
		return left
	}, deadline.Scale(2*time.Minute), 200*time.Millisecond).Should(BeEmpty(), "no Volume, Engine, Replica or Snapshot left")
	for _, n := range nodes {
		entries, err := os.ReadDir(n.DataDir)
		g.Expect(err).NotTo(HaveOccurred())
		var left []string
		for _, e := range entries {
			if e.Name() != ".logs" {
				left = append(left, e.Name())
			}
		}
		g.Expect(left).To(BeEmpty(), "no replica data left on node %s", n.Name)
	}
}
