package volume

import (
	"context"
	"os/exec"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/internal/imtest"
)

// TestVolumeNodeOutOfService: the node of an attached volume's engine
// fails (its instance manager, and the engine and replica under it,
// killed) and the volume is moved to another node, as Kubernetes does
// for a pod rescheduled from a dead node. While nothing says the node is
// off, the volume cannot move: its engine's state is unknown, and a node
// that is only cut off could still be running it. Once the node carries
// the out-of-service taint (an operator's word, as for Kubernetes'
// non-graceful node shutdown), the engine and the replica there count as
// stopped: the volume detaches and attaches on the other node with the
// two other replicas, degraded, and every byte flushed before is there.
// The node back and the taint lifted, its replica is given back and the
// volume is healthy.
func TestVolumeNodeOutOfService(t *testing.T) {
	if _, err := exec.LookPath("qemu-io"); err != nil {
		t.Skip("qemu-io is not installed (make test-tools installs it)")
	}
	g := NewWithT(t)
	ctx := context.Background()
	names := []string{"oos-a", "oos-b", "oos-c"}
	dirs, ims := startNodes(t, g, names...)
	vol := &v1.Volume{ObjectMeta: metav1.ObjectMeta{Name: "oos", Namespace: "default"}, Spec: v1.VolumeSpec{
		Size: *resource.NewQuantity(32<<20, resource.BinarySI), NumberOfReplicas: 3, Frontend: v1.FrontendNBD}}
	g.Expect(k8sClient.Create(ctx, vol)).To(Succeed())
	key := client.ObjectKeyFromObject(vol)
	get := func() *v1.Volume { return getVolume(g, key) }
	state := func() v1.VolumeState { return get().Status.State }
	robustness := func() v1.VolumeRobustness { return get().Status.Robustness }
	g.Eventually(state, timeout, 100*time.Millisecond).Should(Equal(v1.VolumeStateDetached))
	setNode(g, key, "oos-a")
	g.Eventually(state, timeout, 100*time.Millisecond).Should(Equal(v1.VolumeStateAttached))
	g.Eventually(robustness, timeout, 100*time.Millisecond).Should(Equal(v1.VolumeRobustnessHealthy))
	qemuIO(t, vol.Name, get().Status.Endpoint, "write -P 0x44 0 4M", "write -P 0x55 12M 1M", "flush")

	// The node fails; the volume is wanted on another node.
	ims["oos-a"].Kill()
	setNode(g, key, "oos-b")
	g.Eventually(state, timeout, 100*time.Millisecond).ShouldNot(Equal(v1.VolumeStateAttached))
	g.Consistently(state, 3*time.Second, 100*time.Millisecond).ShouldNot(Equal(v1.VolumeStateAttached),
		"no attach elsewhere while the engine's node may still run it")

	// The operator says the node is off.
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "oos-a"}, Spec: corev1.NodeSpec{Taints: []corev1.Taint{
		{Key: corev1.TaintNodeOutOfService, Value: "nodeshutdown", Effect: corev1.TaintEffectNoExecute}}}}
	g.Expect(k8sClient.Create(ctx, node)).To(Succeed())
	t.Cleanup(func() { _ = k8sClient.Delete(ctx, node) })
	g.Eventually(func() string { v := get(); return string(v.Status.State) + " on " + v.Status.CurrentNodeName }, timeout, 100*time.Millisecond).
		Should(Equal("attached on oos-b"))
	g.Eventually(robustness, timeout, 100*time.Millisecond).Should(Equal(v1.VolumeRobustnessDegraded))
	// Robustness comes from the running replicas until the engine's status
	// stream reports their modes: wait for those.
	g.Eventually(func() map[string]v1.ReplicaMode { return getEngine(g, vol).Status.ReplicaModeMap }, timeout, 100*time.Millisecond).
		Should(HaveLen(2), "the engine serves from the two replicas that run")
	for _, rep := range listReplicas(g, vol) {
		if rep.Spec.NodeName == "oos-a" {
			g.Expect(rep.Status.InstanceState).To(Equal(v1.InstanceStateStopped))
			g.Expect(rep.Status.Conditions).To(ContainElement(HaveField("Reason", v1.ReasonNodeOutOfService)))
		}
	}
	qemuIO(t, vol.Name, get().Status.Endpoint, "read -P 0x44 0 4M", "read -P 0x55 12M 1M", "write -P 0x66 20M 1M", "flush")

	// The node is back and the taint lifted: its replica is given back.
	ims["oos-a"] = imtest.Start(t, "oos-a", ims["oos-a"].Addr, dirs["oos-a"])
	g.Expect(retry.RetryOnConflict(retry.DefaultRetry, func() error {
		if err := k8sClient.Get(ctx, client.ObjectKeyFromObject(node), node); err != nil {
			return err
		}
		node.Spec.Taints = nil
		return k8sClient.Update(ctx, node)
	})).To(Succeed())
	g.Eventually(func() int { return rwReplicas(g, vol) }, timeout+replenishmentWait, 100*time.Millisecond).Should(Equal(3))
	qemuIO(t, vol.Name, get().Status.Endpoint, "read -P 0x44 0 4M", "read -P 0x55 12M 1M", "read -P 0x66 20M 1M")

	g.Expect(k8sClient.Delete(ctx, get())).To(Succeed())
	g.Eventually(func() bool {
		return apierrors.IsNotFound(k8sClient.Get(ctx, key, &v1.Volume{}))
	}, timeout, 100*time.Millisecond).Should(BeTrue())
}
