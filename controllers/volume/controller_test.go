package volume

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/internal/imtest"
	"github.com/cairn-io/cairn/controllers/replica"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// timeout bounds every wait of the package's tests (scaled by
// CAIRN_TEST_DEADLINE_SCALE).
var timeout = deadline.Scale(90 * time.Second)

// nodes starts an instance manager per node, with its InstanceManager and
// StorageNode objects, and returns each node's data directory.
func nodes(t *testing.T, g *WithT, names ...string) map[string]string {
	dirs, _ := startNodes(t, g, names...)
	return dirs
}

// startNodes starts an instance manager per node, registers its
// InstanceManager and StorageNode, and returns the data directories and
// instance managers. When the test ends the objects are deleted before
// the instance managers stop, so no later test schedules onto its nodes.
func startNodes(t *testing.T, g *WithT, names ...string) (map[string]string, map[string]*imtest.IM) {
	ctx := context.Background()
	dirs, ims := map[string]string{}, map[string]*imtest.IM{}
	for _, n := range names {
		dir := t.TempDir()
		im := imtest.Start(t, n, "", dir)
		imObj := &v1.InstanceManager{ObjectMeta: metav1.ObjectMeta{Name: "im-" + n, Namespace: "default"},
			Spec: v1.InstanceManagerSpec{NodeName: n, Address: im.Addr}}
		g.Expect(k8sClient.Create(ctx, imObj)).To(Succeed())
		sn := &v1.StorageNode{ObjectMeta: metav1.ObjectMeta{Name: n, Namespace: "default"}, Spec: v1.StorageNodeSpec{NodeName: n}}
		g.Expect(k8sClient.Create(ctx, sn)).To(Succeed())
		t.Cleanup(func() {
			_ = k8sClient.Delete(ctx, sn)
			_ = k8sClient.Delete(ctx, imObj)
		})
		dirs[n], ims[n] = dir, im
	}
	// A volume created before a node reports its disk leaves a replica
	// unplaced until the next reconcile; the tests start from placed ones.
	for _, n := range names {
		g.Eventually(func() bool {
			sn := &v1.StorageNode{}
			if k8sClient.Get(ctx, client.ObjectKey{Namespace: "default", Name: n}, sn) != nil {
				return false
			}
			return meta.IsStatusConditionTrue(sn.Status.Conditions, v1.StorageNodeConditionSchedulable)
		}, timeout, 50*time.Millisecond).Should(BeTrue(), "node %s reports a schedulable disk", n)
	}
	return dirs, ims
}

// getEngine reads a test volume's Engine.
func getEngine(g *WithT, vol *v1.Volume) *v1.Engine {
	e := &v1.Engine{}
	g.Expect(k8sClient.Get(context.Background(), client.ObjectKey{Namespace: vol.Namespace, Name: EngineName(vol)}, e)).To(Succeed())
	return e
}

// rwReplicas counts the replicas a test volume's engine reports RW.
func rwReplicas(g *WithT, vol *v1.Volume) int {
	rw := 0
	for _, m := range getEngine(g, vol).Status.ReplicaModeMap {
		if m == v1.ReplicaModeRW {
			rw++
		}
	}
	return rw
}

// getVolume reads a test's Volume.
func getVolume(g *WithT, key client.ObjectKey) *v1.Volume {
	out := &v1.Volume{}
	g.Expect(k8sClient.Get(context.Background(), key, out)).To(Succeed())
	return out
}

// listReplicas lists a test volume's Replicas.
func listReplicas(g *WithT, vol *v1.Volume) []v1.Replica {
	var list v1.ReplicaList
	g.Expect(k8sClient.List(context.Background(), &list, client.InNamespace(vol.Namespace), client.MatchingLabels{LabelVolume: vol.Name})).To(Succeed())
	return list.Items
}

// TestVolumeLifecycle drives a volume through the whole life cycle on
// three simulated nodes: created and scheduled one replica per node,
// attached (replicas, then the engine, with a device endpoint), detached,
// and deleted with every replica's data.
func TestVolumeLifecycle(t *testing.T) {
	g := NewWithT(t)
	ctx := context.Background()
	dirs := nodes(t, g, "n1", "n2", "n3")
	vol := &v1.Volume{ObjectMeta: metav1.ObjectMeta{Name: "pvc-1", Namespace: "default"}, Spec: v1.VolumeSpec{
		Size: resource.MustParse("16Mi"), NumberOfReplicas: 3, Frontend: v1.FrontendNBD}}
	g.Expect(k8sClient.Create(ctx, vol)).To(Succeed())
	get := func() *v1.Volume { return getVolume(g, client.ObjectKeyFromObject(vol)) }
	replicas := func() []v1.Replica { return listReplicas(g, vol) }

	// Created: detached, one replica on each node.
	g.Eventually(func() v1.VolumeState { return get().Status.State }, timeout, 100*time.Millisecond).Should(Equal(v1.VolumeStateDetached))
	// Detached comes as soon as the replica objects exist; they are placed
	// once the StorageNodes report their disks, which under load can be
	// later (Scheduled was checked once here and failed then).
	g.Eventually(func() bool { return meta.IsStatusConditionTrue(get().Status.Conditions, v1.VolumeConditionScheduled) }, timeout, 100*time.Millisecond).Should(BeTrue())
	g.Expect(get().Status.Robustness).To(Equal(v1.VolumeRobustnessUnknown))
	seen := map[string]bool{}
	for _, r := range replicas() {
		seen[r.Spec.NodeName] = true
		g.Expect(r.Spec.DiskPath).To(Equal(dirs[r.Spec.NodeName]))
		g.Expect(metav1.IsControlledBy(&r, get())).To(BeTrue())
	}
	g.Expect(seen).To(HaveLen(3), "one replica per node")

	// Attach to n2.
	setNode(g, client.ObjectKeyFromObject(vol), "n2")
	g.Eventually(func() v1.VolumeState { return get().Status.State }, timeout, 100*time.Millisecond).Should(Equal(v1.VolumeStateAttached))
	got := get()
	g.Expect(got.Status.CurrentNodeName).To(Equal("n2"))
	g.Expect(got.Status.Robustness).To(Equal(v1.VolumeRobustnessHealthy))
	g.Expect(got.Status.Endpoint).NotTo(BeEmpty())
	_, err := os.Stat(got.Status.Endpoint)
	g.Expect(err).NotTo(HaveOccurred(), "the endpoint the engine reports exists on the node")
	e := &v1.Engine{}
	g.Expect(k8sClient.Get(ctx, client.ObjectKey{Namespace: "default", Name: EngineName(got)}, e)).To(Succeed())
	g.Expect(e.Spec.ReplicaAddresses).To(HaveLen(3))
	g.Expect(e.Status.Size.Value()).To(Equal(int64(16 << 20)))

	// Detach: the engine stops, then the replicas.
	setNode(g, client.ObjectKeyFromObject(vol), "")
	g.Eventually(func() v1.VolumeState { return get().Status.State }, timeout, 100*time.Millisecond).Should(Equal(v1.VolumeStateDetached))
	for _, r := range replicas() {
		g.Expect(r.Status.InstanceState).To(Equal(v1.InstanceStateStopped))
		g.Expect(filepath.Join(replica.DataDir(&r), "volume.meta")).To(BeAnExistingFile(), "detaching keeps the data")
	}

	// Delete: engine, replicas and data go, then the volume.
	reps := replicas()
	g.Expect(k8sClient.Delete(ctx, get())).To(Succeed())
	g.Eventually(func() bool {
		return apierrors.IsNotFound(k8sClient.Get(ctx, client.ObjectKeyFromObject(vol), &v1.Volume{}))
	}, timeout, 100*time.Millisecond).Should(BeTrue())
	for _, r := range reps {
		_, err := os.Stat(replica.DataDir(&r))
		g.Expect(errors.Is(err, os.ErrNotExist)).To(BeTrue(), fmt.Sprintf("replica %s data: %v", r.Name, err))
	}
	g.Expect(replicas()).To(BeEmpty())
}

// TestVolumeUnschedulable: a volume asking for more space than any disk
// has says how many replicas are unplaced and why.
func TestVolumeUnschedulable(t *testing.T) {
	g := NewWithT(t)
	ctx := context.Background()
	nodes(t, g, "u1")
	vol := &v1.Volume{ObjectMeta: metav1.ObjectMeta{Name: "huge", Namespace: "default"}, Spec: v1.VolumeSpec{
		Size: resource.MustParse("10Ti"), NumberOfReplicas: 2}}
	g.Expect(k8sClient.Create(ctx, vol)).To(Succeed())
	g.Eventually(func() string {
		out := &v1.Volume{}
		g.Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(vol), out)).To(Succeed())
		if c := meta.FindStatusCondition(out.Status.Conditions, v1.VolumeConditionScheduled); c != nil && c.Reason == v1.VolumeReasonReplicaSchedulingFailed {
			return c.Message
		}
		return ""
	}, timeout, 100*time.Millisecond).Should(ContainSubstring("2 of 2 replicas unplaced"))
}

// TestVolumeSchedulesWhenANodeJoins: three replicas on two nodes leave one
// unplaced (never two on one disk), said in the Scheduled condition; a
// third node joining places it, and the volume attaches healthy.
func TestVolumeSchedulesWhenANodeJoins(t *testing.T) {
	g := NewWithT(t)
	ctx := context.Background()
	nodes(t, g, "j1", "j2")
	vol := &v1.Volume{ObjectMeta: metav1.ObjectMeta{Name: "joins", Namespace: "default"}, Spec: v1.VolumeSpec{
		Size: resource.MustParse("8Mi"), NumberOfReplicas: 3, Frontend: v1.FrontendNBD}}
	g.Expect(k8sClient.Create(ctx, vol)).To(Succeed())
	get := func() *v1.Volume { return getVolume(g, client.ObjectKeyFromObject(vol)) }
	scheduled := func() *metav1.Condition {
		return meta.FindStatusCondition(get().Status.Conditions, v1.VolumeConditionScheduled)
	}
	g.Eventually(func() string {
		if c := scheduled(); c != nil && c.Reason == v1.VolumeReasonReplicaSchedulingFailed {
			return c.Message
		}
		return ""
	}, timeout, 100*time.Millisecond).Should(ContainSubstring("1 of 3 replicas unplaced"))
	nodes(t, g, "j3")
	g.Eventually(func() bool { c := scheduled(); return c != nil && c.Status == metav1.ConditionTrue }, timeout, 100*time.Millisecond).Should(BeTrue())
	setNode(g, client.ObjectKeyFromObject(vol), "j3")
	g.Eventually(func() v1.VolumeRobustness { return get().Status.Robustness }, timeout, 100*time.Millisecond).Should(Equal(v1.VolumeRobustnessHealthy))
	g.Expect(k8sClient.Delete(ctx, get())).To(Succeed())
	g.Eventually(func() bool {
		return apierrors.IsNotFound(k8sClient.Get(ctx, client.ObjectKeyFromObject(vol), &v1.Volume{}))
	}, timeout, 100*time.Millisecond).Should(BeTrue())
}

// TestVolumeDiskSelector: a volume asking for disks tagged ssd is not
// placed on untagged disks, and says so; tagging two nodes' disks places
// its two replicas there and nowhere else.
func TestVolumeDiskSelector(t *testing.T) {
	g := NewWithT(t)
	ctx := context.Background()
	dirs := nodes(t, g, "t1", "t2", "t3")
	vol := &v1.Volume{ObjectMeta: metav1.ObjectMeta{Name: "tagged", Namespace: "default"}, Spec: v1.VolumeSpec{
		Size: resource.MustParse("8Mi"), NumberOfReplicas: 2, DiskSelector: []string{"ssd"}}}
	g.Expect(k8sClient.Create(ctx, vol)).To(Succeed())
	message := func() string {
		out := &v1.Volume{}
		g.Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(vol), out)).To(Succeed())
		if c := meta.FindStatusCondition(out.Status.Conditions, v1.VolumeConditionScheduled); c != nil {
			return c.Message
		}
		return ""
	}
	g.Eventually(message, timeout, 100*time.Millisecond).Should(And(ContainSubstring("2 of 2 replicas unplaced"), ContainSubstring("missing a required tag")))
	for _, n := range []string{"t1", "t3"} {
		sn := &v1.StorageNode{}
		g.Expect(k8sClient.Get(ctx, client.ObjectKey{Namespace: "default", Name: n}, sn)).To(Succeed())
		before := sn.DeepCopy()
		sn.Spec.Disks = []v1.DiskSpec{{Name: "default", Path: dirs[n], Tags: []string{"ssd"}}}
		g.Expect(k8sClient.Patch(ctx, sn, client.MergeFrom(before))).To(Succeed())
	}
	g.Eventually(message, timeout, 100*time.Millisecond).Should(Equal("2 replicas placed"))
	var reps v1.ReplicaList
	g.Expect(k8sClient.List(ctx, &reps, client.InNamespace("default"), client.MatchingLabels{LabelVolume: vol.Name})).To(Succeed())
	var on []string
	for _, r := range reps.Items {
		on = append(on, r.Spec.NodeName)
	}
	g.Expect(on).To(ConsistOf("t1", "t3"))
	g.Expect(k8sClient.Delete(ctx, vol)).To(Succeed())
	g.Eventually(func() bool {
		return apierrors.IsNotFound(k8sClient.Get(ctx, client.ObjectKeyFromObject(vol), &v1.Volume{}))
	}, timeout, 100*time.Millisecond).Should(BeTrue())
}
