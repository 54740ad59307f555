package secretguard

import (
	"context"
	"strings"
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
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/workload"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// Deadlines are generous (the suite must pass on a loaded 2-core
// machine) and scaled by CAIRN_TEST_DEADLINE_SCALE.
var waitFor = deadline.Scale(60 * time.Second)

const poll = 100 * time.Millisecond

// stillFor is how long a state that must not change is watched; it
// bounds no wait, so it is not scaled.
const stillFor = 3 * time.Second

// newNamespace makes a namespace of its own for one test.
func newNamespace(t *testing.T, g Gomega) string {
	t.Helper()
	ns := "app-" + rand.String(5)
	g.Expect(k8sClient.Create(context.Background(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}})).To(Succeed())
	return ns
}

func newSecret(g Gomega, ns, name string) types.NamespacedName {
	s := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		StringData: map[string]string{v1.EncryptionPassphraseKey: "correct horse battery staple"}}
	g.Expect(k8sClient.Create(context.Background(), s)).To(Succeed())
	return client.ObjectKeyFromObject(s)
}

// pvSpec is what a test's PersistentVolume names.
type pvSpec struct {
	driver           string
	deletionSecret   *types.NamespacedName // the provisioner-deletion annotations
	publishSecret    *types.NamespacedName // spec.csi.controllerPublishSecretRef
	nodeStageSecret  *types.NamespacedName // spec.csi.nodeStageSecretRef
	claim            *corev1.PersistentVolumeClaim
	emptyAnnotations bool // both deletion annotations present and empty
}

// newPV creates a PersistentVolume as external-provisioner would.
func newPV(g Gomega, s pvSpec) *corev1.PersistentVolume {
	name := "pvc-" + rand.String(8)
	if s.driver == "" {
		s.driver = workload.DriverName
	}
	ref := func(k *types.NamespacedName) *corev1.SecretReference {
		if k == nil {
			return nil
		}
		return &corev1.SecretReference{Namespace: k.Namespace, Name: k.Name}
	}
	pv := &corev1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: name, Annotations: map[string]string{}},
		Spec: corev1.PersistentVolumeSpec{
			Capacity:    corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")},
			AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{
				Driver: s.driver, VolumeHandle: name,
				ControllerPublishSecretRef: ref(s.publishSecret), NodeStageSecretRef: ref(s.nodeStageSecret)}},
		}}
	if s.deletionSecret != nil {
		pv.Annotations[AnnotationDeletionSecretNamespace] = s.deletionSecret.Namespace
		pv.Annotations[AnnotationDeletionSecretName] = s.deletionSecret.Name
	} else if s.emptyAnnotations {
		pv.Annotations[AnnotationDeletionSecretNamespace], pv.Annotations[AnnotationDeletionSecretName] = "", ""
	}
	if c := s.claim; c != nil {
		pv.Spec.ClaimRef = &corev1.ObjectReference{Kind: "PersistentVolumeClaim", Namespace: c.Namespace, Name: c.Name, UID: c.UID}
	}
	g.Expect(k8sClient.Create(context.Background(), pv)).To(Succeed())
	return pv
}

func newClaim(g Gomega, ns string) *corev1.PersistentVolumeClaim {
	pvc := &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "data"}, Spec: corev1.PersistentVolumeClaimSpec{
		AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
		Resources:   corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}}}}
	g.Expect(k8sClient.Create(context.Background(), pvc)).To(Succeed())
	return pvc
}

// finalizers returns the Secret's finalizers, or nil and false if it is
// gone.
func finalizers(g Gomega, key types.NamespacedName) ([]string, bool) {
	s := &corev1.Secret{}
	err := k8sClient.Get(context.Background(), key, s)
	if apierrors.IsNotFound(err) {
		return nil, false
	}
	g.Expect(err).NotTo(HaveOccurred())
	return s.Finalizers, true
}

func held(g Gomega, key types.NamespacedName) bool {
	f, ok := finalizers(g, key)
	return ok && len(f) == 1 && f[0] == Finalizer
}

func exists(g Gomega, key types.NamespacedName) bool {
	_, ok := finalizers(g, key)
	return ok
}

// deletePV deletes pv and lifts the pv-protection finalizer the API
// server put on it, as Kubernetes' PV protection controller (which
// envtest does not run) does for a volume no claim uses.
func deletePV(g Gomega, pv *corev1.PersistentVolume) {
	ctx := context.Background()
	g.Expect(k8sClient.Delete(ctx, pv)).To(Succeed())
	g.Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(pv), pv)).To(Succeed())
	g.Expect(pv.DeletionTimestamp).NotTo(BeNil())
	pv.Finalizers = nil
	g.Expect(k8sClient.Update(ctx, pv)).To(Succeed())
}

func deleteSecret(g Gomega, key types.NamespacedName) {
	g.Expect(k8sClient.Delete(context.Background(), &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: key.Namespace, Name: key.Name}})).To(Succeed())
}

// terminating: the Secret is there with a deletion timestamp.
func terminating(g Gomega, key types.NamespacedName) bool {
	s := &corev1.Secret{}
	err := k8sClient.Get(context.Background(), key, s)
	if apierrors.IsNotFound(err) {
		return false
	}
	g.Expect(err).NotTo(HaveOccurred())
	return s.DeletionTimestamp != nil
}

// TestHeldUntilTheLastVolumeGoes: the Secrets a PersistentVolume of
// Cairn's names, through the provisioner-deletion annotations and
// controllerPublishSecretRef, get the finalizer; deleted, they stay
// (Terminating) while a volume names them, and go with the last one.
func TestHeldUntilTheLastVolumeGoes(t *testing.T) {
	g := NewWithT(t)
	ns := newNamespace(t, g)
	prov, publish := newSecret(g, ns, "provisioner"), newSecret(g, ns, "publish")
	pv := newPV(g, pvSpec{deletionSecret: &prov, publishSecret: &publish})
	g.Eventually(func(g Gomega) bool { return held(g, prov) && held(g, publish) }, waitFor, poll).Should(BeTrue(),
		"the PersistentVolume's Secrets get the finalizer")
	// A second volume of the same class names the publish Secret only.
	other := newPV(g, pvSpec{publishSecret: &publish})

	deleteSecret(g, prov)
	deleteSecret(g, publish)
	g.Consistently(func(g Gomega) bool { return terminating(g, prov) && terminating(g, publish) }, stillFor, poll).Should(BeTrue(),
		"deleted Secrets stay Terminating while volumes name them")

	deletePV(g, pv)
	g.Eventually(func(g Gomega) bool { return exists(g, prov) }, waitFor, poll).Should(BeFalse(),
		"the provisioner Secret goes with the last PersistentVolume naming it")
	g.Consistently(func(g Gomega) bool { return terminating(g, publish) && held(g, publish) }, stillFor, poll).Should(BeTrue(),
		"the publish Secret stays while the other volume names it")

	deletePV(g, other)
	g.Eventually(func(g Gomega) bool { return exists(g, publish) }, waitFor, poll).Should(BeFalse(),
		"the publish Secret goes with the last PersistentVolume naming it")
}

// TestReleasedWhenNotDeleted: a Secret no volume names any more loses the
// finalizer and stays, as it was.
func TestReleasedWhenNotDeleted(t *testing.T) {
	g := NewWithT(t)
	ns := newNamespace(t, g)
	stage := newSecret(g, ns, "stage")
	pv := newPV(g, pvSpec{nodeStageSecret: &stage})
	g.Eventually(func(g Gomega) bool { return held(g, stage) }, waitFor, poll).Should(BeTrue())
	deletePV(g, pv)
	g.Eventually(func(g Gomega) []string { f, _ := finalizers(g, stage); return f }, waitFor, poll).Should(BeEmpty())
	g.Expect(terminating(g, stage)).To(BeFalse())
}

// TestOtherDriversIgnored: a PersistentVolume of another driver, or one
// whose deletion annotations are empty, holds nothing.
func TestOtherDriversIgnored(t *testing.T) {
	g := NewWithT(t)
	ns := newNamespace(t, g)
	theirs, ours := newSecret(g, ns, "theirs"), newSecret(g, ns, "ours")
	newPV(g, pvSpec{driver: "other.csi.example.com", deletionSecret: &theirs, publishSecret: &theirs})
	newPV(g, pvSpec{emptyAnnotations: true})
	newPV(g, pvSpec{publishSecret: &ours})
	g.Eventually(func(g Gomega) bool { return held(g, ours) }, waitFor, poll).Should(BeTrue())
	g.Consistently(func(g Gomega) []string { f, _ := finalizers(g, theirs); return f }, stillFor, poll).Should(BeEmpty(),
		"another driver's Secret gets no finalizer")
}

// TestMissingSecretReported: a PersistentVolume naming a Secret that does
// not exist gets a Warning Event with the fix, and so does its claim;
// made again, the Secret is held.
func TestMissingSecretReported(t *testing.T) {
	g := NewWithT(t)
	ns := newNamespace(t, g)
	claim := newClaim(g, ns)
	missing := types.NamespacedName{Namespace: ns, Name: "encryption"}
	pv := newPV(g, pvSpec{deletionSecret: &missing, publishSecret: &missing, claim: claim})

	fix := "kubectl -n " + ns + " create secret generic encryption"
	want := And(HavePrefix("Warning "+v1.EventReasonSecretMissing+": Secret "+missing.String()),
		ContainSubstring("controller-publish and provisioner-deletion secret of PersistentVolume "+pv.Name),
		ContainSubstring("external-attacher"), ContainSubstring("does not need its content"), ContainSubstring(fix))
	g.Eventually(func(g Gomega) []string { return eventsAbout(g, "default", "PersistentVolume", pv.Name) }, waitFor, poll).Should(ContainElement(want))
	g.Eventually(func(g Gomega) []string { return eventsAbout(g, ns, "PersistentVolumeClaim", claim.Name) }, waitFor, poll).Should(ContainElement(want))

	newSecret(g, ns, missing.Name)
	g.Eventually(func(g Gomega) bool { return held(g, missing) }, waitFor, poll).Should(BeTrue(),
		"the Secret made again is held")
}

// TestReleasedAfterARestart: a volume deleted while the manager is down
// still releases its Secret once the manager is back (the Secret's
// finalizer is what it starts from, not the volume's deletion).
func TestReleasedAfterARestart(t *testing.T) {
	g := NewWithT(t)
	ns := newNamespace(t, g)
	prov := newSecret(g, ns, "provisioner")
	pv := newPV(g, pvSpec{deletionSecret: &prov})
	g.Eventually(func(g Gomega) bool { return held(g, prov) }, waitFor, poll).Should(BeTrue())

	env.StopManager()
	deletePV(g, pv)
	deleteSecret(g, prov)
	g.Expect(env.StartManager()).To(Succeed())
	g.Eventually(func(g Gomega) bool { return exists(g, prov) }, waitFor, poll).Should(BeFalse())
}

// eventsAbout returns "Type Reason: note" of the Events in ns about the
// object of kind named name.
func eventsAbout(g Gomega, ns, kind, name string) []string {
	var list eventsv1.EventList
	g.Expect(k8sClient.List(context.Background(), &list, client.InNamespace(ns))).To(Succeed())
	var out []string
	for _, e := range list.Items {
		if e.Regarding.Kind == kind && e.Regarding.Name == name {
			out = append(out, e.Type+" "+e.Reason+": "+e.Note)
		}
	}
	return out
}

// TestMissingNoteFits: the note stays within what the API server takes,
// with every role and the longest names.
func TestMissingNoteFits(t *testing.T) {
	g := NewWithT(t)
	all := []Role{RoleControllerPublish, RoleProvisionerDeletion, RoleNodeStage, RoleNodePublish, RoleControllerExpand, RoleNodeExpand}
	long := types.NamespacedName{Namespace: strings.Repeat("n", 63), Name: strings.Repeat("s", 253)}
	for _, c := range []struct {
		secret types.NamespacedName
		roles  []Role
	}{
		{types.NamespacedName{Namespace: "app", Name: "enc"}, all[:2]},
		{types.NamespacedName{Namespace: "app", Name: "enc"}, all},
		{long, all},
	} {
		note := missingNote(c.secret, kindPV, strings.Repeat("p", 253), c.roles)
		g.Expect(len(note)).To(BeNumerically("<=", noteLimit), note)
		g.Expect(note).To(HavePrefix("Secret " + c.secret.String()))
	}
	g.Expect(missingNote(types.NamespacedName{Namespace: "app", Name: "enc"}, kindPV, "pv1", all[:2])).To(ContainSubstring("kubectl -n app create secret generic enc"))
}
