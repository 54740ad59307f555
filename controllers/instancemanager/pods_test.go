package instancemanager

import (
	"context"
	"net"
	"strconv"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/internal/imtest"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

var timeout = deadline.Scale(30 * time.Second)

// TestPodDiscovery: a ready pod of the instance-manager DaemonSet on a
// node gives that node an InstanceManager with the pod's IP and gRPC port
// (and a StorageNode); the InstanceManager is running when a real
// instance manager answers there; a pod that is not ready, or gone,
// leaves the InstanceManager without an address (unknown); pods of other
// apps are ignored; an InstanceManager written by hand is left alone.
func TestPodDiscovery(t *testing.T) {
	g := NewWithT(t)
	ctx := context.Background()
	im := imtest.Start(t, "disc-1", "", t.TempDir())
	host, port, _ := net.SplitHostPort(im.Addr)
	p, _ := strconv.Atoi(port)
	labels := map[string]string{"app.kubernetes.io/name": "cairn", "app.kubernetes.io/component": "instance-manager"}
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "cairn-im-abcde", Namespace: "default", Labels: labels},
		Spec: corev1.PodSpec{NodeName: "disc-1", Containers: []corev1.Container{{Name: "im", Image: "cairn-data:dev",
			Ports: []corev1.ContainerPort{{Name: PortName, ContainerPort: int32(p)}}}}}}
	g.Expect(k8sClient.Create(ctx, pod)).To(Succeed())
	other := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "someone-else", Namespace: "default", Labels: map[string]string{"app": "db"}},
		Spec: corev1.PodSpec{NodeName: "disc-2", Containers: []corev1.Container{{Name: "db", Image: "db"}}}}
	g.Expect(k8sClient.Create(ctx, other)).To(Succeed())
	setReady := func(p *corev1.Pod, ready corev1.ConditionStatus) {
		p.Status.PodIP = host
		p.Status.Conditions = []corev1.PodCondition{{Type: corev1.ContainersReady, Status: ready}, {Type: corev1.PodReady, Status: ready}}
		g.Expect(k8sClient.Status().Update(ctx, p)).To(Succeed())
	}
	getIM := func(node string) *v1.InstanceManager {
		out := &v1.InstanceManager{}
		if err := k8sClient.Get(ctx, client.ObjectKey{Namespace: "default", Name: InstanceManagerName(node)}, out); err != nil {
			return nil
		}
		return out
	}

	// Not ready yet: nothing.
	setReady(pod, corev1.ConditionFalse)
	setReady(other, corev1.ConditionTrue)
	g.Consistently(func() *v1.InstanceManager { return getIM("disc-1") }, time.Second, 100*time.Millisecond).Should(BeNil())

	// Ready: an InstanceManager at the pod's address, running; a StorageNode.
	g.Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(pod), pod)).To(Succeed())
	setReady(pod, corev1.ConditionTrue)
	g.Eventually(func() string {
		if x := getIM("disc-1"); x != nil {
			return x.Spec.Address
		}
		return ""
	}, timeout, 100*time.Millisecond).Should(Equal(im.Addr))
	g.Eventually(func() v1.InstanceManagerState { return getIM("disc-1").Status.State }, timeout, 100*time.Millisecond).Should(Equal(v1.InstanceManagerStateRunning))
	g.Expect(k8sClient.Get(ctx, client.ObjectKey{Namespace: "default", Name: "disc-1"}, &v1.StorageNode{})).To(Succeed())
	g.Expect(getIM("disc-2")).To(BeNil(), "pods of other apps are not instance managers")

	// The pod goes: no address, unknown.
	g.Expect(k8sClient.Delete(ctx, pod, client.GracePeriodSeconds(0))).To(Succeed())
	g.Eventually(func() string { return getIM("disc-1").Spec.Address }, timeout, 100*time.Millisecond).Should(BeEmpty())
	g.Eventually(func() v1.InstanceManagerState { return getIM("disc-1").Status.State }, timeout, 100*time.Millisecond).Should(Equal(v1.InstanceManagerStateUnknown))

	// One written by hand keeps its address whatever the pods do.
	manual := &v1.InstanceManager{ObjectMeta: metav1.ObjectMeta{Name: InstanceManagerName("disc-3"), Namespace: "default"},
		Spec: v1.InstanceManagerSpec{NodeName: "disc-3", Address: im.Addr}}
	g.Expect(k8sClient.Create(ctx, manual)).To(Succeed())
	pod3 := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "cairn-im-three", Namespace: "default", Labels: labels},
		Spec: corev1.PodSpec{NodeName: "disc-3", Containers: []corev1.Container{{Name: "im", Image: "cairn-data:dev"}}}}
	g.Expect(k8sClient.Create(ctx, pod3)).To(Succeed())
	setReady(pod3, corev1.ConditionTrue)
	g.Consistently(func() string { return getIM("disc-3").Spec.Address }, time.Second, 100*time.Millisecond).Should(Equal(im.Addr))
}
