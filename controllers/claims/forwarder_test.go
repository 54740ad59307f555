package claims

import (
	"context"
	"strings"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/rand"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// Deadlines are generous (the suite must pass on a loaded 2-core
// machine) and scaled by CAIRN_TEST_DEADLINE_SCALE.
var waitFor = deadline.Scale(60 * time.Second)

const poll = 100 * time.Millisecond

// fixture is a Volume provisioned for a claim in its own namespace: the
// PersistentVolume of Cairn's driver with the Volume's name as handle,
// bound to the claim.
type fixture struct {
	ns, claim string
	vol       *v1.Volume
}

func newFixture(t *testing.T, g Gomega) *fixture {
	t.Helper()
	ctx := context.Background()
	f := &fixture{ns: "app-" + rand.String(5), claim: "data"}
	for _, ns := range []string{volumeNamespace, f.ns} {
		g.Expect(client.IgnoreAlreadyExists(k8sClient.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}))).To(Succeed())
	}
	name := "pvc-" + rand.String(8)
	size := resource.MustParse("1Gi")
	pvc := &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: f.claim, Namespace: f.ns}, Spec: corev1.PersistentVolumeClaimSpec{
		AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce}, VolumeName: name,
		Resources: corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: size}}}}
	g.Expect(k8sClient.Create(ctx, pvc)).To(Succeed())
	pvc.Status.Phase = corev1.ClaimBound
	g.Expect(k8sClient.Status().Update(ctx, pvc)).To(Succeed())
	pv := &corev1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: corev1.PersistentVolumeSpec{
		Capacity: corev1.ResourceList{corev1.ResourceStorage: size}, AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
		PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{Driver: DriverName, VolumeHandle: name}},
		ClaimRef:               &corev1.ObjectReference{Kind: "PersistentVolumeClaim", Namespace: f.ns, Name: f.claim, UID: pvc.UID}}}
	g.Expect(k8sClient.Create(ctx, pv)).To(Succeed())
	f.vol = &v1.Volume{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: volumeNamespace},
		Spec: v1.VolumeSpec{Size: size, NumberOfReplicas: 3}}
	g.Expect(k8sClient.Create(ctx, f.vol)).To(Succeed())
	f.status(g, func(s *v1.VolumeStatus) { s.State, s.Robustness = v1.VolumeStateDetached, v1.VolumeRobustnessUnknown })
	return f
}

// status changes the Volume's status as the Volume reconciler would.
func (f *fixture) status(g Gomega, change func(*v1.VolumeStatus)) {
	before := f.vol.DeepCopy()
	change(&f.vol.Status)
	g.Expect(k8sClient.Status().Patch(context.Background(), f.vol, client.MergeFrom(before))).To(Succeed())
}

// attach sets the node the volume should be attached to, as the CSI
// driver's ControllerPublishVolume does.
func (f *fixture) attach(g Gomega, node string) {
	before := f.vol.DeepCopy()
	f.vol.Spec.NodeName = node
	g.Expect(k8sClient.Patch(context.Background(), f.vol, client.MergeFrom(before))).To(Succeed())
}

// pod creates a pod on node that mounts the claim, in phase.
func (f *fixture) pod(g Gomega, name, node string, phase corev1.PodPhase) {
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: f.ns}, Spec: corev1.PodSpec{
		NodeName:   node,
		Containers: []corev1.Container{{Name: "app", Image: "busybox"}},
		Volumes: []corev1.Volume{{Name: "data", VolumeSource: corev1.VolumeSource{
			PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: f.claim}}}}}}
	g.Expect(k8sClient.Create(context.Background(), p)).To(Succeed())
	p.Status.Phase = phase
	g.Expect(k8sClient.Status().Update(context.Background(), p)).To(Succeed())
}

// events returns "Type Reason: note" of the Events about the object of
// kind named name in the fixture's namespace.
func (f *fixture) events(g Gomega, kind, name string) []string {
	var list eventsv1.EventList
	g.Expect(k8sClient.List(context.Background(), &list, client.InNamespace(f.ns))).To(Succeed())
	var out []string
	for _, e := range list.Items {
		if e.Regarding.Kind == kind && e.Regarding.Name == name {
			out = append(out, e.Type+" "+e.Reason+": "+e.Note)
		}
	}
	return out
}

func (f *fixture) count(g Gomega, kind, name, reason string) int {
	n := 0
	for _, e := range f.events(g, kind, name) {
		if strings.Contains(e, " "+reason+": ") {
			n++
		}
	}
	return n
}

func setCond(s *v1.VolumeStatus, typ string, ok bool, reason, msg string) {
	st := metav1.ConditionFalse
	if ok {
		st = metav1.ConditionTrue
	}
	meta.SetStatusCondition(&s.Conditions, metav1.Condition{Type: typ, Status: st, Reason: reason, Message: msg})
}

// TestDegradedAndHealthy: a volume that goes degraded is a Warning on its
// claim, with the volume's own words and the doctor command; the pod using
// it hears nothing (its I/O goes on); back to healthy is a Normal Event.
func TestDegradedAndHealthy(t *testing.T) {
	g := NewWithT(t)
	f := newFixture(t, g)
	f.pod(g, "web-0", "node-a", corev1.PodRunning)
	f.status(g, func(s *v1.VolumeStatus) {
		s.State, s.Robustness, s.CurrentNodeName = v1.VolumeStateAttached, v1.VolumeRobustnessHealthy, "node-a"
	})
	f.status(g, func(s *v1.VolumeStatus) {
		s.Robustness = v1.VolumeRobustnessDegraded
		setCond(s, v1.ConditionReady, false, v1.ReasonReconciling, "replica r-2 on node-c failed: connection refused")
	})
	g.Eventually(func(g Gomega) []string { return f.events(g, "PersistentVolumeClaim", f.claim) }, waitFor, poll).Should(ContainElement(And(
		HavePrefix("Warning "+v1.EventReasonVolumeDegraded+": volume "+f.vol.Name+" is degraded"),
		ContainSubstring("replica r-2 on node-c failed: connection refused"),
		ContainSubstring("kubectl cairn doctor "+f.ns+"/"+f.claim))))
	f.status(g, func(s *v1.VolumeStatus) {
		s.Robustness = v1.VolumeRobustnessHealthy
		setCond(s, v1.ConditionReady, true, v1.ReasonAsExpected, "attached to node-a")
	})
	g.Eventually(func(g Gomega) []string { return f.events(g, "PersistentVolumeClaim", f.claim) }, waitFor, poll).Should(ContainElement(
		HavePrefix("Normal " + v1.EventReasonVolumeHealthy + ": volume " + f.vol.Name + " is healthy again")))
	g.Expect(f.events(g, "Pod", "web-0")).To(BeEmpty(), "a degraded volume still serves its pods")
	g.Expect(f.count(g, "PersistentVolumeClaim", f.claim, v1.EventReasonVolumeDegraded)).To(Equal(1))
}

// TestFaulted: a faulted volume is a Warning on its claim and on each
// running pod that uses it; a finished pod is left alone.
func TestFaulted(t *testing.T) {
	g := NewWithT(t)
	f := newFixture(t, g)
	f.pod(g, "web-0", "node-a", corev1.PodRunning)
	f.pod(g, "job-done", "node-a", corev1.PodSucceeded)
	f.status(g, func(s *v1.VolumeStatus) {
		s.State, s.Robustness = v1.VolumeStateAttached, v1.VolumeRobustnessFaulted
		setCond(s, v1.ConditionReady, false, v1.VolumeReasonFaulted, "no replica is RW; salvage waits for r-1")
	})
	faulted := And(HavePrefix("Warning "+v1.EventReasonVolumeFaulted+": "), ContainSubstring("salvage waits for r-1"))
	g.Eventually(func(g Gomega) []string { return f.events(g, "PersistentVolumeClaim", f.claim) }, waitFor, poll).Should(ContainElement(faulted))
	g.Eventually(func(g Gomega) []string { return f.events(g, "Pod", "web-0") }, waitFor, poll).Should(ContainElement(And(faulted,
		ContainSubstring("claim "+f.claim+": volume "+f.vol.Name+" is faulted"))))
	g.Expect(f.events(g, "Pod", "job-done")).To(BeEmpty())
}

// TestUnschedulable: a replica without a disk is a Warning on the claim
// with the scheduler's message.
func TestUnschedulable(t *testing.T) {
	g := NewWithT(t)
	f := newFixture(t, g)
	f.status(g, func(s *v1.VolumeStatus) {
		setCond(s, v1.VolumeConditionScheduled, false, v1.VolumeReasonReplicaSchedulingFailed, "1 of 3 replicas unplaced: no disk has 1Gi free")
	})
	g.Eventually(func(g Gomega) []string { return f.events(g, "PersistentVolumeClaim", f.claim) }, waitFor, poll).Should(ContainElement(And(
		HavePrefix("Warning "+v1.EventReasonReplicaUnschedulable+": a replica of volume "+f.vol.Name+" has no disk"),
		ContainSubstring("1 of 3 replicas unplaced: no disk has 1Gi free"), ContainSubstring("lower numberOfReplicas"))))
}

// TestAttachWaiting: an attach still not done after the attach wait is a
// Warning on the claim and on the pods on that node using it (not on a
// pod elsewhere); an attach done in time is no Event.
func TestAttachWaiting(t *testing.T) {
	g := NewWithT(t)
	f := newFixture(t, g)
	f.pod(g, "web-0", "node-a", corev1.PodPending)
	f.pod(g, "other", "node-b", corev1.PodRunning)
	f.attach(g, "node-a")
	f.status(g, func(s *v1.VolumeStatus) {
		s.State = v1.VolumeStateAttaching
		setCond(s, v1.ConditionReady, false, v1.ReasonReconciling, "waiting for replica r-1 on node-c: its instance manager does not answer")
	})
	waiting := And(HavePrefix("Warning "+v1.EventReasonAttachWaiting+": "), ContainSubstring("not attached to node node-a after "+testAttachWait.String()),
		ContainSubstring("its instance manager does not answer"))
	g.Eventually(func(g Gomega) []string { return f.events(g, "PersistentVolumeClaim", f.claim) }, waitFor, poll).Should(ContainElement(waiting))
	g.Eventually(func(g Gomega) []string { return f.events(g, "Pod", "web-0") }, waitFor, poll).Should(ContainElement(waiting))
	g.Expect(f.events(g, "Pod", "other")).To(BeEmpty(), "a pod on another node does not wait for this attach")

	quick := newFixture(t, g)
	quick.attach(g, "node-a")
	quick.status(g, func(s *v1.VolumeStatus) {
		s.State, s.CurrentNodeName, s.Robustness = v1.VolumeStateAttached, "node-a", v1.VolumeRobustnessHealthy
	})
	g.Consistently(func(g Gomega) []string { return quick.events(g, "PersistentVolumeClaim", quick.claim) }, 3*testAttachWait, poll).Should(BeEmpty())
}

// TestVolumeWithoutClaim: a Volume made by hand (no PersistentVolume)
// going faulted records nothing and breaks nothing.
func TestVolumeWithoutClaim(t *testing.T) {
	g := NewWithT(t)
	ctx := context.Background()
	vol := &v1.Volume{ObjectMeta: metav1.ObjectMeta{Name: "by-hand-" + rand.String(5), Namespace: volumeNamespace},
		Spec: v1.VolumeSpec{Size: resource.MustParse("1Gi"), NumberOfReplicas: 1}}
	g.Expect(k8sClient.Create(ctx, vol)).To(Succeed())
	vol.Status.Robustness = v1.VolumeRobustnessFaulted
	g.Expect(k8sClient.Status().Update(ctx, vol)).To(Succeed())
	// A claimed volume changed after it is still served: the forwarder
	// went on.
	f := newFixture(t, g)
	f.status(g, func(s *v1.VolumeStatus) { s.Robustness = v1.VolumeRobustnessDegraded })
	g.Eventually(func(g Gomega) int { return f.count(g, "PersistentVolumeClaim", f.claim, v1.EventReasonVolumeDegraded) }, waitFor, poll).Should(Equal(1))
}
