package workload

import (
	"context"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/rand"
	"k8s.io/client-go/tools/events"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// Deadlines are generous (and scaled by CAIRN_TEST_DEADLINE_SCALE): the
// suite must pass on a loaded 2-core machine.
var within = deadline.Scale(60 * time.Second)

const (
	poll = 100 * time.Millisecond
)

// volumeNamespace is where the suite's reconciler looks for Engines;
// otherNamespace holds Engines only a test's own reconciler sees.
const (
	volumeNamespace = "cairn-system"
	otherNamespace  = "cairn-other"
)

// fixture is one volume used through a PersistentVolume and a claim in
// its own namespace, with pods on node "node-a".
type fixture struct {
	ns, volume, claim string
	engine            *v1.Engine
}

func newFixture(t *testing.T, g Gomega) *fixture { return newFixtureIn(t, g, volumeNamespace) }

// newFixtureIn makes the fixture with its Engine in namespace engineNS.
func newFixtureIn(t *testing.T, g Gomega, engineNS string) *fixture {
	t.Helper()
	ctx := context.Background()
	f := &fixture{ns: "app-" + rand.String(5), volume: "pvc-" + rand.String(8), claim: "data"}
	for _, ns := range []string{engineNS, f.ns} {
		err := k8sClient.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}})
		g.Expect(client.IgnoreAlreadyExists(err)).To(Succeed())
	}
	size := resource.MustParse("1Gi")
	pv := &corev1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: f.volume}, Spec: corev1.PersistentVolumeSpec{
		Capacity: corev1.ResourceList{corev1.ResourceStorage: size}, AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
		PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{Driver: DriverName, VolumeHandle: f.volume}},
		ClaimRef:               &corev1.ObjectReference{Kind: "PersistentVolumeClaim", Namespace: f.ns, Name: f.claim}}}
	g.Expect(k8sClient.Create(ctx, pv)).To(Succeed())
	pvc := &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: f.claim, Namespace: f.ns}, Spec: corev1.PersistentVolumeClaimSpec{
		AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce}, VolumeName: f.volume,
		Resources: corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: size}}}}
	g.Expect(k8sClient.Create(ctx, pvc)).To(Succeed())
	f.engine = &v1.Engine{ObjectMeta: metav1.ObjectMeta{Name: f.volume + "-e", Namespace: engineNS},
		Spec: v1.EngineSpec{VolumeName: f.volume, NodeName: "node-a", Size: size, DesiredState: v1.DesiredInstanceStateRunning}}
	g.Expect(k8sClient.Create(ctx, f.engine)).To(Succeed())
	return f
}

// pod creates a pod on node using claim, owned by a StatefulSet when
// owned (the owner need not exist: no garbage collector runs here).
func (f *fixture) pod(g Gomega, name, node, claim string, owned bool) {
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: f.ns}, Spec: corev1.PodSpec{
		NodeName:   node,
		Containers: []corev1.Container{{Name: "app", Image: "busybox"}},
		Volumes: []corev1.Volume{{Name: "data", VolumeSource: corev1.VolumeSource{
			PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: claim}}}}}}
	if owned {
		p.OwnerReferences = []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: "StatefulSet", Name: "web", UID: types.UID("uid-" + name),
			Controller: ptr.To(true), BlockOwnerDeletion: ptr.To(true)}}
	}
	g.Expect(k8sClient.Create(context.Background(), p)).To(Succeed())
}

// lose records a device loss on the engine at at, as the Engine
// reconciler does.
func (f *fixture) lose(g Gomega, at time.Time) {
	before := f.engine.DeepCopy()
	f.engine.Status.DeviceLost = &v1.DeviceLoss{At: metav1.NewTime(at), NodeName: "node-a", Device: "/dev/loop3",
		Message: "the engine process restarted and its fuse frontend could not take the device over"}
	g.Expect(k8sClient.Status().Patch(context.Background(), f.engine, client.MergeFrom(before))).To(Succeed())
}

func (f *fixture) deleting(g Gomega, name string) bool {
	p := &corev1.Pod{}
	g.Expect(k8sClient.Get(context.Background(), client.ObjectKey{Namespace: f.ns, Name: name}, p)).To(Succeed())
	return !p.DeletionTimestamp.IsZero()
}

// events returns the reason and message of the Events about the object
// named name in the fixture's namespace.
func (f *fixture) events(g Gomega, kind, name string) []string {
	var list eventsv1.EventList
	g.Expect(k8sClient.List(context.Background(), &list, client.InNamespace(f.ns))).To(Succeed())
	var out []string
	for _, e := range list.Items {
		if e.Regarding.Kind == kind && e.Regarding.Name == name {
			out = append(out, e.Reason+": "+e.Note)
		}
	}
	return out
}

// A device loss deletes the pods on the node that use the volume and a
// controller owns, leaves a bare pod (with an Event), and leaves pods on
// other nodes and pods of other claims alone; the claim's Event names
// both.
func TestDeviceLossDeletesOwnedPods(t *testing.T) {
	g := NewWithT(t)
	f := newFixture(t, g)
	f.pod(g, "web-0", "node-a", f.claim, true)
	f.pod(g, "bare", "node-a", f.claim, false)
	f.pod(g, "elsewhere", "node-b", f.claim, true)
	f.pod(g, "other-claim", "node-a", "other", true)
	f.lose(g, time.Now())

	g.Eventually(func(g Gomega) bool { return f.deleting(g, "web-0") }, within, poll).Should(BeTrue())
	g.Eventually(func(g Gomega) []string { return f.events(g, "Pod", "web-0") }, within, poll).Should(ContainElement(And(
		HavePrefix(EventPodDeleted+": "), ContainSubstring("lost /dev/loop3 on node node-a"), ContainSubstring("StatefulSet web recreates it"))))
	g.Eventually(func(g Gomega) []string { return f.events(g, "Pod", "bare") }, within, poll).Should(ContainElement(And(
		HavePrefix(EventRestartNeeded+": "), ContainSubstring("no controller owns the pod"))))
	g.Eventually(func(g Gomega) []string { return f.events(g, "PersistentVolumeClaim", f.claim) }, within, poll).Should(ContainElement(And(
		HavePrefix(EventDeviceLost+": "), ContainSubstring("could not take the device over"),
		ContainSubstring("recreate them: web-0"), ContainSubstring("by hand: bare"))))
	// The reconcile that recorded these decided about every pod at once.
	g.Expect(f.deleting(g, "bare")).To(BeFalse())
	g.Expect(f.deleting(g, "elsewhere")).To(BeFalse())
	g.Expect(f.deleting(g, "other-claim")).To(BeFalse())
	g.Expect(f.events(g, "Pod", "elsewhere")).To(BeEmpty())
	g.Expect(f.events(g, "Pod", "other-claim")).To(BeEmpty())
}

// reconcileOnce runs a reconciler of its own once, synchronously, with a
// recorder whose Events the test reads.
func reconcileOnce(g Gomega, f *fixture, deletePods bool) []string {
	rec := events.NewFakeRecorder(100)
	r := &Reconciler{Client: k8sClient, Reader: k8sClient, DeletePods: deletePods, Recorder: rec}
	_, err := r.Reconcile(context.Background(), ctrl.Request{NamespacedName: client.ObjectKeyFromObject(f.engine)})
	g.Expect(err).NotTo(HaveOccurred())
	close(rec.Events)
	var out []string
	for e := range rec.Events {
		out = append(out, e)
	}
	return out
}

// With the setting off nothing is deleted; the pod and the claim are
// told. The Engine is outside the suite reconciler's namespace, so only
// the test's own reconciler sees it.
func TestDeviceLossSettingOff(t *testing.T) {
	g := NewWithT(t)
	f := newFixtureIn(t, g, otherNamespace)
	f.pod(g, "web-0", "node-a", f.claim, true)
	f.pod(g, "bare", "node-a", f.claim, false)
	f.lose(g, time.Now())
	evs := reconcileOnce(g, f, false)
	g.Expect(f.deleting(g, "web-0")).To(BeFalse())
	g.Expect(f.deleting(g, "bare")).To(BeFalse())
	g.Expect(evs).To(ContainElement(And(ContainSubstring(EventRestartNeeded), ContainSubstring("--delete-workload-pod-on-device-loss is off"))))
	g.Expect(evs).To(ContainElement(And(ContainSubstring(EventRestartNeeded), ContainSubstring("no controller owns the pod"))))
	g.Expect(evs).To(ContainElement(And(ContainSubstring(EventDeviceLost), ContainSubstring("by hand: bare, web-0"))))
	g.Expect(evs).To(HaveLen(3))

	// The same loss with the setting on deletes the owned pod only.
	evs = reconcileOnce(g, f, true)
	g.Expect(f.deleting(g, "web-0")).To(BeTrue())
	g.Expect(f.deleting(g, "bare")).To(BeFalse())
	g.Expect(evs).To(ContainElement(ContainSubstring(EventPodDeleted)))
}

// Pods created after the loss mount what the node serves then: a loss
// recorded before they existed restarts none of them, and records nothing.
func TestDeviceLossSparesLaterPods(t *testing.T) {
	g := NewWithT(t)
	f := newFixtureIn(t, g, otherNamespace)
	f.pod(g, "web-0", "node-a", f.claim, true)
	f.lose(g, time.Now().Add(-time.Hour))
	g.Expect(reconcileOnce(g, f, true)).To(BeEmpty())
	g.Expect(f.deleting(g, "web-0")).To(BeFalse())
}

// A volume without a PersistentVolume (made by hand) has no pods to
// restart.
func TestDeviceLossWithoutPersistentVolume(t *testing.T) {
	g := NewWithT(t)
	f := newFixtureIn(t, g, otherNamespace)
	f.pod(g, "web-0", "node-a", f.claim, true)
	// No controller runs here to lift the pv-protection finalizer.
	pv := &corev1.PersistentVolume{}
	g.Expect(k8sClient.Get(context.Background(), client.ObjectKey{Name: f.volume}, pv)).To(Succeed())
	before := pv.DeepCopy()
	pv.Finalizers = nil
	g.Expect(k8sClient.Patch(context.Background(), pv, client.MergeFrom(before))).To(Succeed())
	g.Expect(k8sClient.Delete(context.Background(), pv)).To(Succeed())
	g.Eventually(func() error {
		return k8sClient.Get(context.Background(), client.ObjectKey{Name: f.volume}, &corev1.PersistentVolume{})
	}, within, poll).Should(Satisfy(apierrors.IsNotFound))
	f.lose(g, time.Now())
	g.Expect(reconcileOnce(g, f, true)).To(BeEmpty())
	g.Expect(f.deleting(g, "web-0")).To(BeFalse())
}
