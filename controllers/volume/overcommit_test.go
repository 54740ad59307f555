package volume

import (
	"context"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"golang.org/x/sys/unix"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/internal/imtest"
)

// smallDisk mounts a tmpfs of size bytes (so its capacity is exactly
// that), runs an instance manager for node with it as its data directory,
// and registers the node with one disk on it carrying tag. It returns the
// disk's capacity as the StorageNode reports it.
func smallDisk(t *testing.T, g *WithT, node, tag string, size int64) int64 {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("mounting a tmpfs of a chosen size needs root")
	}
	ctx := context.Background()
	dir := t.TempDir()
	if err := unix.Mount("tmpfs", dir, "tmpfs", 0, fmt.Sprintf("size=%d", size)); err != nil {
		t.Fatalf("mount a tmpfs at %s: %v", dir, err)
	}
	t.Cleanup(func() { unix.Unmount(dir, unix.MNT_DETACH) })
	im := imtest.Start(t, node, "", dir)
	imObj := &v1.InstanceManager{ObjectMeta: metav1.ObjectMeta{Name: "im-" + node, Namespace: "default"},
		Spec: v1.InstanceManagerSpec{NodeName: node, Address: im.Addr}}
	g.Expect(k8sClient.Create(ctx, imObj)).To(Succeed())
	sn := &v1.StorageNode{ObjectMeta: metav1.ObjectMeta{Name: node, Namespace: "default"}, Spec: v1.StorageNodeSpec{NodeName: node,
		Disks: []v1.DiskSpec{{Name: "small", Path: dir, Tags: []string{tag}}}}}
	g.Expect(k8sClient.Create(ctx, sn)).To(Succeed())
	t.Cleanup(func() {
		k8sClient.Delete(ctx, sn)
		k8sClient.Delete(ctx, imObj)
	})
	var capacity int64
	g.Eventually(func() int64 {
		got := &v1.StorageNode{}
		g.Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(sn), got)).To(Succeed())
		for _, d := range got.Status.Disks {
			if d.Capacity != nil && meta.IsStatusConditionTrue(d.Conditions, v1.ConditionReady) {
				capacity = d.Capacity.Value()
			}
		}
		return capacity
	}, timeout, 100*time.Millisecond).Should(BeNumerically(">", 0))
	return capacity
}

// TestConcurrentPlacementOverCommits creates many one-replica volumes at
// once, each asking for a disk that has room for only some of them, and
// lets the real Volume reconciler (with its real number of workers) place
// them. The disk's scheduled bytes come from StorageNode.status, which
// lags the Replicas: workers placing at the same time all see the same
// free room, so the disk ends up with more scheduled than it may hold.
func TestConcurrentPlacementOverCommits(t *testing.T) {
	g := NewWithT(t)
	ctx := context.Background()
	const (
		tag     = "overcommit"
		size    = 8 << 20
		volumes = 24
	)
	capacity := smallDisk(t, g, "oc1", tag, 64<<20)
	fits := int(capacity / size)
	g.Expect(fits).To(BeNumerically("<", volumes), "the disk must not take every volume")

	vols := make([]*v1.Volume, volumes)
	for i := range vols {
		vols[i] = &v1.Volume{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("oc-%02d", i), Namespace: "default"}, Spec: v1.VolumeSpec{
			Size: *resource.NewQuantity(size, resource.BinarySI), NumberOfReplicas: 1, DiskSelector: []string{tag}}}
		cleanupVolume(t, vols[i])
	}
	var wg sync.WaitGroup
	errs := make(chan error, volumes)
	for _, v := range vols {
		wg.Go(func() { errs <- k8sClient.Create(ctx, v) })
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		g.Expect(err).NotTo(HaveOccurred())
	}

	// scheduledOnDisk sums the sizes of the test's replicas on the disk.
	scheduledOnDisk := func() (int64, int) {
		var list v1.ReplicaList
		g.Expect(k8sClient.List(ctx, &list, client.InNamespace("default"))).To(Succeed())
		var sum int64
		n := 0
		for _, r := range list.Items {
			if r.Spec.NodeName == "oc1" && r.Spec.DiskName == "small" {
				sum += r.Spec.Size.Value()
				n++
			}
		}
		return sum, n
	}
	g.Eventually(func() int64 { s, _ := scheduledOnDisk(); return s }, timeout, 50*time.Millisecond).Should(BeNumerically(">", capacity),
		"on the code this test was written against, concurrent workers over-commit the disk")
	_, n := scheduledOnDisk()
	t.Logf("%d replicas of %d bytes placed on a disk of %d bytes that fits %d", n, int64(size), capacity, fits)
}
