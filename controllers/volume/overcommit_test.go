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
	t.Cleanup(func() { _ = unix.Unmount(dir, unix.MNT_DETACH) })
	im := imtest.Start(t, node, "", dir)
	imObj := &v1.InstanceManager{ObjectMeta: metav1.ObjectMeta{Name: "im-" + node, Namespace: "default"},
		Spec: v1.InstanceManagerSpec{NodeName: node, Address: im.Addr}}
	g.Expect(k8sClient.Create(ctx, imObj)).To(Succeed())
	sn := &v1.StorageNode{ObjectMeta: metav1.ObjectMeta{Name: node, Namespace: "default"}, Spec: v1.StorageNodeSpec{NodeName: node,
		Disks: []v1.DiskSpec{{Name: "small", Path: dir, Tags: []string{tag}}}}}
	g.Expect(k8sClient.Create(ctx, sn)).To(Succeed())
	t.Cleanup(func() {
		_ = k8sClient.Delete(ctx, sn)
		_ = k8sClient.Delete(ctx, imObj)
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

// TestConcurrentPlacementNeverOverCommits creates many one-replica
// volumes at once, each asking for a disk that has room for only some of
// them, and lets the real Volume reconciler (with its real number of
// workers) place them. Placement goes through the scheduler's Ledger, which
// counts the disk's scheduled bytes from the Replicas (not from
// StorageNode.status, which lags them) and lets one decision run at a
// time: the disk takes exactly as many as fit, never more, and every other
// volume says it is unplaced. (Placed from the status by concurrent
// workers, as before the Ledger, the disk took 11 replicas where 8 fit.)
func TestConcurrentPlacementNeverOverCommits(t *testing.T) {
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

	// settled counts the volumes whose replica is placed and those that
	// say it cannot be, and fails the test as soon as the disk holds more
	// than its capacity.
	settled := func() (placed, unplaced int) {
		var list v1.ReplicaList
		g.Expect(k8sClient.List(ctx, &list, client.InNamespace("default"))).To(Succeed())
		var sum int64
		on := map[string]bool{}
		for _, r := range list.Items {
			if r.Spec.NodeName == "oc1" && r.Spec.DiskName == "small" {
				sum += r.Spec.Size.Value()
				on[r.Spec.VolumeName] = true
			}
		}
		g.Expect(sum).To(BeNumerically("<=", capacity), "the disk is over-committed: %d replicas on it", len(on))
		for _, v := range vols {
			got := getVolume(g, client.ObjectKeyFromObject(v))
			c := meta.FindStatusCondition(got.Status.Conditions, v1.VolumeConditionScheduled)
			if c != nil && c.Status == metav1.ConditionFalse && c.Reason == v1.VolumeReasonReplicaSchedulingFailed {
				unplaced++
			}
		}
		return len(on), unplaced
	}
	g.Eventually(func() []int { p, u := settled(); return []int{p, u} }, timeout, 50*time.Millisecond).Should(Equal([]int{fits, volumes - fits}),
		"[placed, unplaced]: the disk takes exactly as many as fit")
	// The unplaced volumes are reconciled again whenever the disk's
	// StorageNode changes (every second here): none of those passes finds
	// room.
	g.Consistently(func() int { p, _ := settled(); return p }, 3*time.Second, 100*time.Millisecond).Should(Equal(fits))
}
