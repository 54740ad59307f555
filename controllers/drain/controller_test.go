package drain

import (
	"context"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/rand"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/internal/volumes"
	"github.com/cairn-io/cairn/controllers/volume"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// Deadlines are generous (and scaled by CAIRN_TEST_DEADLINE_SCALE): the
// suite must pass on a loaded 2-core machine.
var within = deadline.Scale(60 * time.Second)

const (
	poll = 100 * time.Millisecond
	ns   = "cairn-system"
)

var ctx = context.Background()

// world creates Nodes and their StorageNodes (one ready 100 GiB disk
// each), with names made unique by a suffix.
type world struct {
	g      Gomega
	suffix string
}

func newWorld(g Gomega) *world {
	err := k8sClient.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}})
	g.Expect(client.IgnoreAlreadyExists(err)).To(Succeed())
	return &world{g: g, suffix: rand.String(4)}
}

func (w *world) name(n string) string { return n + "-" + w.suffix }

func (w *world) node(n string) *v1.StorageNode {
	w.g.Expect(k8sClient.Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: w.name(n)}})).To(Succeed())
	sn := &v1.StorageNode{ObjectMeta: metav1.ObjectMeta{Name: w.name(n), Namespace: ns}, Spec: v1.StorageNodeSpec{NodeName: w.name(n)}}
	w.g.Expect(k8sClient.Create(ctx, sn)).To(Succeed())
	before := sn.DeepCopy()
	ds := v1.DiskStatus{Name: "default", Path: "/var/lib/cairn", Capacity: ptrQ("100Gi"), Available: ptrQ("100Gi"), Scheduled: ptrQ("0")}
	meta.SetStatusCondition(&ds.Conditions, metav1.Condition{Type: v1.ConditionReady, Status: metav1.ConditionTrue, Reason: v1.ReasonAsExpected})
	sn.Status.Disks = []v1.DiskStatus{ds}
	w.g.Expect(k8sClient.Status().Patch(ctx, sn, client.MergeFrom(before))).To(Succeed())
	return sn
}

func ptrQ(s string) *resource.Quantity { q := resource.MustParse(s); return &q }

// volume creates a Volume with its Engine running on engineNode and a
// healthy replica on each of replicaNodes, all RW in the engine.
func (w *world) volume(n, engineNode string, replicaNodes ...string) (*v1.Volume, *v1.Engine) {
	size := resource.MustParse("1Gi")
	v := &v1.Volume{ObjectMeta: metav1.ObjectMeta{Name: w.name(n), Namespace: ns},
		Spec: v1.VolumeSpec{Size: size, NumberOfReplicas: int32(len(replicaNodes)), NodeName: w.name(engineNode)}}
	w.g.Expect(k8sClient.Create(ctx, v)).To(Succeed())
	modes := map[string]v1.ReplicaMode{}
	for i, rn := range replicaNodes {
		r := &v1.Replica{ObjectMeta: metav1.ObjectMeta{Name: v.Name + "-r-" + string(rune('a'+i)), Namespace: ns, Labels: map[string]string{volumes.LabelVolume: v.Name}},
			Spec: v1.ReplicaSpec{VolumeName: v.Name, Size: size, NodeName: w.name(rn), DiskName: "default", DiskPath: "/var/lib/cairn",
				DesiredState: v1.DesiredInstanceStateRunning, HealthyAt: &metav1.Time{Time: time.Now()}}}
		w.g.Expect(controllerutil.SetControllerReference(v, r, k8sClient.Scheme())).To(Succeed())
		w.g.Expect(k8sClient.Create(ctx, r)).To(Succeed())
		modes[r.Name] = v1.ReplicaModeRW
	}
	e := &v1.Engine{ObjectMeta: metav1.ObjectMeta{Name: volumes.EngineName(v), Namespace: ns, Labels: map[string]string{volumes.LabelVolume: v.Name}},
		Spec: v1.EngineSpec{VolumeName: v.Name, NodeName: w.name(engineNode), Size: size, DesiredState: v1.DesiredInstanceStateRunning}}
	w.g.Expect(k8sClient.Create(ctx, e)).To(Succeed())
	w.setModes(e, modes)
	return v, e
}

// setModes reports the engine running with modes, as the Engine
// reconciler does from the engine's status stream.
func (w *world) setModes(e *v1.Engine, modes map[string]v1.ReplicaMode) {
	w.g.Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(e), e)).To(Succeed())
	before := e.DeepCopy()
	e.Status.InstanceState, e.Status.ReplicaModeMap = v1.InstanceStateRunning, modes
	w.g.Expect(k8sClient.Status().Patch(ctx, e, client.MergeFrom(before))).To(Succeed())
}

func drainOf(g Gomega, sn *v1.StorageNode) *v1.DrainStatus {
	got := &v1.StorageNode{}
	g.Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(sn), got)).To(Succeed())
	if got.Status.Drain == nil {
		return &v1.DrainStatus{}
	}
	return got.Status.Drain
}

// evict asks the eviction API (what kubectl drain calls) to evict the
// node's guard.
func evict(sn *v1.StorageNode) error {
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: GuardName(sn), Namespace: ns}}
	return k8sClient.SubResource("eviction").Create(ctx, pod, &policyv1.Eviction{ObjectMeta: metav1.ObjectMeta{Name: pod.Name, Namespace: ns}})
}

func replacements(g Gomega, vol string) []v1.Replica {
	var list v1.ReplicaList
	g.Expect(k8sClient.List(ctx, &list, client.InNamespace(ns), client.MatchingLabels{volumes.LabelVolume: vol}, client.HasLabels{volume.LabelReplaces})).To(Succeed())
	return list.Items
}

// A node holding a volume's only healthy replica: the guard's budget
// refuses the eviction a drain asks for. Cordoned, the replica is moved
// (a replacement on the other node, rebuilt by the engine); once it is
// RW the replica on the node is deleted, the budget goes and the
// eviction is allowed. The engine's node stays blocked by the engine.
func TestDrainGuard(t *testing.T) {
	g := NewWithT(t)
	w := newWorld(g)
	n1, n2 := w.node("n1"), w.node("n2")
	v, e := w.volume("v", "n2", "n1")

	g.Eventually(func(g Gomega) []v1.DrainBlocker { return drainOf(g, n1).Blockers }, within, poll).Should(ConsistOf(
		And(HaveField("Volume", v.Name), HaveField("Reason", v1.DrainBlockLastHealthyReplica))))
	g.Eventually(func(g Gomega) []v1.DrainBlocker { return drainOf(g, n2).Blockers }, within, poll).Should(ConsistOf(
		And(HaveField("Volume", v.Name), HaveField("Reason", v1.DrainBlockEngineRunning))))
	guard := &corev1.Pod{}
	g.Eventually(func() error {
		return k8sClient.Get(ctx, client.ObjectKey{Namespace: ns, Name: GuardName(n1)}, guard)
	}, within, poll).Should(Succeed())
	// The kubelet would run it: the eviction API lets a pending pod go
	// whatever its budget says.
	running(g, guard)
	g.Expect(guard.Spec.NodeName).To(Equal(n1.Spec.NodeName))
	g.Expect(guard.Spec.Containers[0].Image).To(Equal(guardImage))
	g.Expect(metav1.GetControllerOf(guard)).NotTo(BeNil()) // kubectl drain evicts only pods something manages
	budget := &policyv1.PodDisruptionBudget{}
	g.Eventually(func() error {
		return k8sClient.Get(ctx, client.ObjectKey{Namespace: ns, Name: GuardName(n1)}, budget)
	}, within, poll).Should(Succeed())
	g.Expect(budget.Spec.MaxUnavailable.IntValue()).To(BeZero())
	disruptionController(g, budget)
	err := evict(n1)
	g.Expect(apierrors.IsTooManyRequests(err)).To(BeTrue(), "eviction of a guard whose node holds a last healthy replica: %v", err)

	// kubectl drain cordons first.
	node := &corev1.Node{}
	g.Expect(k8sClient.Get(ctx, client.ObjectKey{Name: n1.Spec.NodeName}, node)).To(Succeed())
	before := node.DeepCopy()
	node.Spec.Unschedulable = true
	g.Expect(k8sClient.Patch(ctx, node, client.MergeFrom(before))).To(Succeed())
	var repl []v1.Replica
	g.Eventually(func(g Gomega) []v1.Replica { repl = replacements(g, v.Name); return repl }, within, poll).Should(HaveLen(1))
	g.Expect(repl[0].Spec.NodeName).NotTo(Equal(n1.Spec.NodeName))
	g.Expect(repl[0].Labels[volume.LabelReplaces]).To(Equal(v.Name + "-r-a"))
	g.Expect(metav1.IsControlledBy(&repl[0], v)).To(BeTrue())
	g.Eventually(func(g Gomega) string { return drainOf(g, n1).Moving }, within, poll).Should(ContainSubstring(repl[0].Name + " on " + repl[0].Spec.NodeName + " is being rebuilt"))
	g.Expect(apierrors.IsTooManyRequests(evict(n1))).To(BeTrue(), "evicted while the replacement is rebuilt")

	// The engine rebuilt it: RW.
	w.setModes(e, map[string]v1.ReplicaMode{v.Name + "-r-a": v1.ReplicaModeRW, repl[0].Name: v1.ReplicaModeRW})
	g.Eventually(func() bool {
		return apierrors.IsNotFound(k8sClient.Get(ctx, client.ObjectKey{Namespace: ns, Name: v.Name + "-r-a"}, &v1.Replica{}))
	}, within, poll).Should(BeTrue())
	g.Eventually(func(g Gomega) bool { return drainOf(g, n1).Safe }, within, poll).Should(BeTrue())
	g.Eventually(func() bool {
		return apierrors.IsNotFound(k8sClient.Get(ctx, client.ObjectKey{Namespace: ns, Name: GuardName(n1)}, &policyv1.PodDisruptionBudget{}))
	}, within, poll).Should(BeTrue())
	g.Expect(evict(n1)).To(Succeed())
	g.Eventually(func(g Gomega) int32 { return drainOf(g, n1).Replicas }, within, poll).Should(BeZero())
	g.Expect(drainOf(g, n2).Safe).To(BeFalse())
	guard2 := &corev1.Pod{}
	g.Expect(k8sClient.Get(ctx, client.ObjectKey{Namespace: ns, Name: GuardName(n2)}, guard2)).To(Succeed())
	running(g, guard2)
	budget2 := &policyv1.PodDisruptionBudget{}
	g.Expect(k8sClient.Get(ctx, client.ObjectKey{Namespace: ns, Name: GuardName(n2)}, budget2)).To(Succeed())
	disruptionController(g, budget2)
	g.Expect(apierrors.IsTooManyRequests(evict(n2))).To(BeTrue())
}

// With eviction requested, every replica on the node is moved, one volume
// at a time: the next replacement is made only once the one before is RW
// and the replica it replaces deleted.
func TestEvictionRequested(t *testing.T) {
	g := NewWithT(t)
	w := newWorld(g)
	n3, n4 := w.node("n3"), w.node("n4")
	w.node("n5")
	va, ea := w.volume("a", "n4", "n3", "n4")
	vb, eb := w.volume("b", "n4", "n3", "n4")
	g.Eventually(func(g Gomega) bool { return drainOf(g, n3).Safe }, within, poll).Should(BeTrue()) // each has a healthy replica on n4
	g.Eventually(func(g Gomega) int32 { return drainOf(g, n3).Replicas }, within, poll).Should(BeEquivalentTo(2))

	before := n3.DeepCopy()
	n3.Spec.EvictionRequested = true
	g.Expect(k8sClient.Patch(ctx, n3, client.MergeFrom(before))).To(Succeed())
	for _, step := range []struct {
		v     *v1.Volume
		e     *v1.Engine
		other *v1.Volume
	}{{va, ea, vb}, {vb, eb, va}} {
		var repl []v1.Replica
		g.Eventually(func(g Gomega) []v1.Replica { repl = replacements(g, step.v.Name); return repl }, within, poll).Should(HaveLen(1))
		// Neither the node left nor one holding a replica of the volume.
		g.Expect(repl[0].Spec.NodeName).NotTo(BeElementOf(n3.Spec.NodeName, n4.Spec.NodeName))
		g.Eventually(func(g Gomega) string { return drainOf(g, n3).Moving }, within, poll).Should(ContainSubstring(repl[0].Name))
		// Until it is RW, the other volume's replica stays put, however
		// often the reconciler is woken (the StorageNode changed).
		g.Consistently(func(g Gomega) {
			poke(g, n3)
			g.Expect(drainOf(g, n3).Moving).To(ContainSubstring(repl[0].Name))
			g.Expect(replacements(g, step.v.Name)).To(HaveLen(1))
			if step.v == va {
				g.Expect(replacements(g, step.other.Name)).To(BeEmpty())
			}
		}, 3*time.Second, 300*time.Millisecond).Should(Succeed())
		modes := map[string]v1.ReplicaMode{step.v.Name + "-r-a": v1.ReplicaModeRW, step.v.Name + "-r-b": v1.ReplicaModeRW, repl[0].Name: v1.ReplicaModeRW}
		w.setModes(step.e, modes)
		g.Eventually(func() bool {
			return apierrors.IsNotFound(k8sClient.Get(ctx, client.ObjectKey{Namespace: ns, Name: step.v.Name + "-r-a"}, &v1.Replica{}))
		}, within, poll).Should(BeTrue())
	}
	g.Eventually(func(g Gomega) int32 { return drainOf(g, n3).Replicas }, within, poll).Should(BeZero())
	g.Expect(drainOf(g, n3).Safe).To(BeTrue())
}

// running reports the pod running and ready, as its kubelet would.
func running(g Gomega, p *corev1.Pod) {
	before := p.DeepCopy()
	p.Status.Phase = corev1.PodRunning
	p.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue, LastTransitionTime: metav1.Now()}}
	g.Expect(k8sClient.Status().Patch(ctx, p, client.MergeFrom(before))).To(Succeed())
}

// disruptionController reports the budget as Kubernetes' disruption
// controller does for a guard that runs: one pod expected and healthy,
// maxUnavailable 0, so no disruption allowed. (Without it, the eviction
// API holds a request about a budget not yet observed for a long while
// before refusing it.)
func disruptionController(g Gomega, pdb *policyv1.PodDisruptionBudget) {
	before := pdb.DeepCopy()
	pdb.Status = policyv1.PodDisruptionBudgetStatus{ObservedGeneration: pdb.Generation, DisruptionsAllowed: 0, CurrentHealthy: 1, DesiredHealthy: 1, ExpectedPods: 1}
	g.Expect(k8sClient.Status().Patch(ctx, pdb, client.MergeFrom(before))).To(Succeed())
}

// poke changes an annotation of the StorageNode, which wakes the
// reconciler.
func poke(g Gomega, sn *v1.StorageNode) {
	got := &v1.StorageNode{}
	g.Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(sn), got)).To(Succeed())
	before := got.DeepCopy()
	if got.Annotations == nil {
		got.Annotations = map[string]string{}
	}
	got.Annotations["test/poke"] = rand.String(6)
	g.Expect(k8sClient.Patch(ctx, got, client.MergeFrom(before))).To(Succeed())
}
