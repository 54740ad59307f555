package csi

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	. "github.com/onsi/gomega"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// TestGetCapacityIsTheSchedulersRoom: GetCapacity reports what the replica
// scheduler still gives, not the disks' free space. One node's only disk
// is a 64 MiB tmpfs carrying a tag the StorageClass asks for; volumes
// are created through CreateVolume (their replicas placed by the real
// Volume reconciler) but never attached, so nothing is written and the
// disk's free space stays what it was. After each volume the largest
// volume and the available capacity reported shrink by its size, a
// volume of the largest size reported is placed, and one a block larger
// is refused (ResourceExhausted).
func TestGetCapacityIsTheSchedulersRoom(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("mounting a tmpfs of a chosen size needs root")
	}
	g := NewWithT(t)
	const (
		node = "cap-tmpfs"
		tag  = "cap-tmpfs"
		size = int64(64 << 20)
	)
	// The node's data directory becomes the tmpfs (its instance manager
	// reads the filesystem's size when asked), listed as the node's one
	// disk, with the tag.
	n := cluster.AddNode(t, node)
	g.Expect(unix.Mount("tmpfs", n.DataDir, "tmpfs", 0, fmt.Sprintf("size=%d", size))).To(Succeed())
	t.Cleanup(func() { _ = unix.Unmount(n.DataDir, unix.MNT_DETACH) })
	// Runs after the volumes' DeleteVolume (cleanups run last registered
	// first) and before the tmpfs and the node go: a replica's data is
	// deleted by the node's instance manager, so the volumes must be gone
	// while it runs, or they stay behind for the tests after this one.
	t.Cleanup(func() {
		g.Eventually(func() []string {
			var left []string
			var vs v1.VolumeList
			var rs v1.ReplicaList
			g.Expect(cluster.Client.List(context.Background(), &vs, client.InNamespace(testNamespace))).To(Succeed())
			g.Expect(cluster.Client.List(context.Background(), &rs, client.InNamespace(testNamespace))).To(Succeed())
			for _, v := range vs.Items {
				if strings.HasPrefix(v.Name, "cap-") {
					left = append(left, "volume "+v.Name)
				}
			}
			for _, r := range rs.Items {
				if r.Spec.NodeName == node {
					left = append(left, "replica "+r.Name)
				}
			}
			return left
		}, deadline.Scale(2*time.Minute), 200*time.Millisecond).Should(BeEmpty(), "the test's volumes deleted while the node serves")
	})
	ctx := callCtx(t)
	sn := &v1.StorageNode{}
	g.Expect(cluster.Client.Get(ctx, client.ObjectKey{Namespace: testNamespace, Name: node}, sn)).To(Succeed())
	before := sn.DeepCopy()
	sn.Spec.Disks = []v1.DiskSpec{{Name: "small", Path: n.DataDir, Tags: []string{tag}}}
	g.Expect(cluster.Client.Patch(ctx, sn, client.MergeFrom(before))).To(Succeed())
	d := serveDriver(t, Options{Mode: ModeController})
	params := map[string]string{ParamNumberOfReplicas: "1", ParamDiskSelector: tag}
	capacity := func() (available, largest int64) {
		r, err := d.controller.GetCapacity(ctx, &csipb.GetCapacityRequest{Parameters: params})
		g.Expect(err).NotTo(HaveOccurred())
		return r.GetAvailableCapacity(), r.GetMaximumVolumeSize().GetValue()
	}
	create := func(name string, bytes int64) error {
		_, err := d.controller.CreateVolume(ctx, &csipb.CreateVolumeRequest{Name: name, CapacityRange: &csipb.CapacityRange{RequiredBytes: bytes, LimitBytes: bytes},
			VolumeCapabilities: []*csipb.VolumeCapability{volCap("ext4", false)}, Parameters: params})
		t.Cleanup(func() {
			_, _ = d.controller.DeleteVolume(context.Background(), &csipb.DeleteVolumeRequest{VolumeId: name})
		})
		return err
	}

	// The empty disk: all of it, once its StorageNode reports it.
	g.Eventually(func() []int64 { a, l := capacity(); return []int64{a, l} }, deadline.Scale(60*time.Second), 100*time.Millisecond).Should(Equal([]int64{size, size}))

	// The manager's cache sees a new volume's replicas a moment after
	// CreateVolume returns: poll.
	g.Expect(create("cap-40", 40<<20)).To(Succeed())
	g.Eventually(func() []int64 { a, l := capacity(); return []int64{a, l} }, deadline.Scale(30*time.Second), 100*time.Millisecond).
		Should(Equal([]int64{24 << 20, 24 << 20}), "what is scheduled is gone, though nothing is written")
	_, l := capacity()
	got := &v1.StorageNode{}
	g.Expect(cluster.Client.Get(ctx, client.ObjectKeyFromObject(sn), got)).To(Succeed())
	g.Expect(got.Status.Disks).To(HaveLen(1))
	g.Expect(got.Status.Disks[0].Available.Value()).To(BeNumerically(">", 60<<20), "the disk's free space is still nearly all of it")

	err := create("cap-over", l+4096)
	g.Expect(status.Code(err)).To(Equal(codes.ResourceExhausted), "a block more than the largest reported: %v", err)
	g.Eventually(func() bool {
		return apierrors.IsNotFound(cluster.Client.Get(ctx, client.ObjectKey{Namespace: testNamespace, Name: "cap-over"}, &v1.Volume{}))
	}, deadline.Scale(60*time.Second), 100*time.Millisecond).Should(BeTrue(), "the refused CreateVolume's Volume is deleted, not left to be placed later")
	g.Expect(create("cap-24", l)).To(Succeed(), "the largest reported")
	g.Eventually(func() []int64 { a, l := capacity(); return []int64{a, l} }, deadline.Scale(30*time.Second), 100*time.Millisecond).Should(Equal([]int64{0, 0}))
}
