package instancemanager

import (
	"context"
	"net"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/imclient"
	"github.com/cairn-io/cairn/controllers/internal/imtest"
	imv1 "github.com/cairn-io/cairn/dataplane/api/instancemanager/v1"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

var gateTimeout = deadline.Scale(60 * time.Second)

// TestPodGate runs the gate on a real Pod object and a real instance
// manager: a pod whose containers are ready but which is not Ready (its
// gate is not True yet) is discovered all the same; its gate is False,
// naming the replica it waits for, while that replica is not RW again in
// its volume's engine; True once it is, with the run of the containers
// recorded, and without touching the conditions kubelet writes; it stays
// True when the replica fails again later; and after a restart of the
// pod's container it is decided again.
func TestPodGate(t *testing.T) {
	g := NewWithT(t)
	ctx := context.Background()
	dir := t.TempDir()
	im := imtest.Start(t, "gate-1", "", dir)
	host, port, _ := net.SplitHostPort(im.Addr)
	p, _ := strconv.Atoi(port)

	// A replica process on the instance manager, as the Replica reconciler
	// would have created it.
	c := imclient.New(imclient.Options{})
	defer c.Close()
	conn, err := c.Get(im.Addr)
	g.Expect(err).NotTo(HaveOccurred())
	_, err = conn.Client.ProcessCreate(ctx, &imv1.ProcessCreateRequest{Name: "default/gv-r-1",
		Spec: &imv1.ProcessCreateRequest_Replica{Replica: &imv1.ReplicaSpec{DataDir: filepath.Join(dir, "gv-r-1"), SizeBytes: 16 << 20}}})
	g.Expect(err).NotTo(HaveOccurred())

	// Volume gv: replica gv-r-1 on gate-1, gv-r-2 elsewhere; its engine on
	// gate-2 still names gv-r-1's address from before the restart, ERR.
	here := v1.ReplicaAddress{Data: net.JoinHostPort(host, "10001"), Control: net.JoinHostPort(host, "10000")}
	before := v1.ReplicaAddress{Data: "10.9.9.9:10001", Control: "10.9.9.9:10000"}
	elsewhere := v1.ReplicaAddress{Data: "10.9.9.8:10001", Control: "10.9.9.8:10000"}
	r1 := &v1.Replica{ObjectMeta: metav1.ObjectMeta{Name: "gv-r-1", Namespace: "default"},
		Spec: v1.ReplicaSpec{VolumeName: "gv", NodeName: "gate-1", Size: resource.MustParse("16Mi"), DesiredState: v1.DesiredInstanceStateRunning}}
	g.Expect(k8sClient.Create(ctx, r1)).To(Succeed())
	r1.Status = v1.ReplicaStatus{InstanceState: v1.InstanceStateRunning, InstanceManagerName: InstanceManagerName("gate-1"), Address: here.Data, ControlAddress: here.Control}
	g.Expect(k8sClient.Status().Update(ctx, r1)).To(Succeed())
	r2 := &v1.Replica{ObjectMeta: metav1.ObjectMeta{Name: "gv-r-2", Namespace: "default"},
		Spec: v1.ReplicaSpec{VolumeName: "gv", NodeName: "gate-2", Size: resource.MustParse("16Mi"), DesiredState: v1.DesiredInstanceStateRunning}}
	g.Expect(k8sClient.Create(ctx, r2)).To(Succeed())
	e := &v1.Engine{ObjectMeta: metav1.ObjectMeta{Name: "gv-e", Namespace: "default"},
		Spec: v1.EngineSpec{VolumeName: "gv", NodeName: "gate-2", Size: resource.MustParse("16Mi"), DesiredState: v1.DesiredInstanceStateRunning,
			ReplicaAddresses: map[string]v1.ReplicaAddress{"gv-r-1": before, "gv-r-2": elsewhere}}}
	g.Expect(k8sClient.Create(ctx, e)).To(Succeed())
	setModes := func(modes map[string]v1.ReplicaMode) {
		g.Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(e), e)).To(Succeed())
		e.Status = v1.EngineStatus{InstanceState: v1.InstanceStateRunning, InstanceManagerName: InstanceManagerName("gate-2"), Address: "10.9.9.8:10020", ReplicaModeMap: modes}
		g.Expect(k8sClient.Status().Update(ctx, e)).To(Succeed())
	}
	setModes(map[string]v1.ReplicaMode{"gv-r-1": v1.ReplicaModeERR, "gv-r-2": v1.ReplicaModeRW})

	// The new instance-manager pod: containers ready, not Ready (the gate).
	labels := map[string]string{"app.kubernetes.io/name": "cairn", "app.kubernetes.io/component": "instance-manager"}
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "cairn-im-gate", Namespace: "default", Labels: labels},
		Spec: corev1.PodSpec{NodeName: "gate-1", ReadinessGates: []corev1.PodReadinessGate{{ConditionType: v1.PodConditionVolumesReady}},
			Containers: []corev1.Container{{Name: "im", Image: "cairn-data:dev", Ports: []corev1.ContainerPort{{Name: PortName, ContainerPort: int32(p)}}}}}}
	g.Expect(k8sClient.Create(ctx, pod)).To(Succeed())
	setRun := func(id string) {
		g.Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(pod), pod)).To(Succeed())
		pod.Status.PodIP = host
		pod.Status.Conditions = []corev1.PodCondition{{Type: corev1.ContainersReady, Status: corev1.ConditionTrue},
			{Type: corev1.PodReady, Status: corev1.ConditionFalse, Reason: "ReadinessGatesNotReady"}}
		for _, c := range pod.Status.Conditions {
			if string(c.Type) == v1.PodConditionVolumesReady {
				pod.Status.Conditions = append(pod.Status.Conditions, c)
			}
		}
		pod.Status.ContainerStatuses = []corev1.ContainerStatus{{Name: "im", Image: "cairn-data:dev", ContainerID: id, Ready: true}}
		g.Expect(k8sClient.Status().Update(ctx, pod)).To(Succeed())
	}
	setRun("containerd://one")
	gate := func() corev1.PodCondition {
		out := &corev1.Pod{}
		g.Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(pod), out)).To(Succeed())
		for _, c := range out.Status.Conditions {
			if string(c.Type) == v1.PodConditionVolumesReady {
				return c
			}
		}
		return corev1.PodCondition{}
	}

	// Discovered although not Ready; the gate waits for gv-r-1.
	g.Eventually(func() string {
		out := &v1.InstanceManager{}
		if err := k8sClient.Get(ctx, client.ObjectKey{Namespace: "default", Name: InstanceManagerName("gate-1")}, out); err != nil {
			return ""
		}
		return out.Spec.Address
	}, gateTimeout, 100*time.Millisecond).Should(Equal(im.Addr), "a pod with ready containers is discovered before it is Ready")
	g.Eventually(gate, gateTimeout, 100*time.Millisecond).Should(And(HaveField("Status", corev1.ConditionFalse),
		HaveField("Reason", v1.GateReasonWaitingForReplica), HaveField("Message", ContainSubstring("gv-r-1"))))

	// The engine is given gv-r-1 at its new address and rebuilds it: still waiting.
	g.Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(e), e)).To(Succeed())
	e.Spec.ReplicaAddresses["gv-r-1"] = here
	g.Expect(k8sClient.Update(ctx, e)).To(Succeed())
	setModes(map[string]v1.ReplicaMode{"gv-r-1": v1.ReplicaModeWO, "gv-r-2": v1.ReplicaModeRW})
	g.Eventually(gate, gateTimeout, 100*time.Millisecond).Should(HaveField("Message", ContainSubstring("being rebuilt")))
	g.Expect(gate().Status).To(Equal(corev1.ConditionFalse))

	// RW: the gate is True, for this run of the containers; kubelet's
	// conditions are as they were.
	setModes(map[string]v1.ReplicaMode{"gv-r-1": v1.ReplicaModeRW, "gv-r-2": v1.ReplicaModeRW})
	g.Eventually(gate, gateTimeout, 100*time.Millisecond).Should(And(HaveField("Status", corev1.ConditionTrue), HaveField("Reason", v1.GateReasonVolumesServed)))
	got := &corev1.Pod{}
	g.Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(pod), got)).To(Succeed())
	g.Expect(got.Annotations).To(HaveKeyWithValue(AnnotationVolumesReadyFor, "containerd://one"))
	g.Expect(got.Status.Conditions).To(ContainElements(
		And(HaveField("Type", corev1.ContainersReady), HaveField("Status", corev1.ConditionTrue)),
		And(HaveField("Type", corev1.PodReady), HaveField("Reason", "ReadinessGatesNotReady"))))

	// The replica fails again: the gate stays True (an old pod that went
	// unready would be replaced at once by a rolling update).
	setModes(map[string]v1.ReplicaMode{"gv-r-1": v1.ReplicaModeERR, "gv-r-2": v1.ReplicaModeRW})
	g.Consistently(func() corev1.ConditionStatus { return gate().Status }, 2*time.Second, 100*time.Millisecond).Should(Equal(corev1.ConditionTrue))

	// The container restarted: decided again, and the replica is not RW.
	setRun("containerd://two")
	g.Eventually(gate, gateTimeout, 100*time.Millisecond).Should(And(HaveField("Status", corev1.ConditionFalse), HaveField("Reason", v1.GateReasonWaitingForReplica)))
	setModes(map[string]v1.ReplicaMode{"gv-r-1": v1.ReplicaModeRW, "gv-r-2": v1.ReplicaModeRW})
	g.Eventually(gate, gateTimeout, 100*time.Millisecond).Should(HaveField("Status", corev1.ConditionTrue))
	g.Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(pod), got)).To(Succeed())
	g.Expect(got.Annotations).To(HaveKeyWithValue(AnnotationVolumesReadyFor, "containerd://two"))
}
