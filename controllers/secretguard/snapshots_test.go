package secretguard

import (
	"context"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/go-logr/logr"
	"github.com/go-logr/logr/funcr"
	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/rand"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/config"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/workload"
)

// contentSpec is what a test's VolumeSnapshotContent names.
type contentSpec struct {
	driver         string
	deletionSecret *types.NamespacedName
	snapshot       *unstructured.Unstructured // bound VolumeSnapshot, if any
}

// newContent creates a VolumeSnapshotContent as the external-snapshotter
// would for a class with a snapshotter secret.
func newContent(g Gomega, s contentSpec) *unstructured.Unstructured {
	if s.driver == "" {
		s.driver = workload.DriverName
	}
	name := "snapcontent-" + rand.String(8)
	ref := map[string]any{"namespace": "default", "name": "snap-" + name}
	if s.snapshot != nil {
		ref = map[string]any{"namespace": s.snapshot.GetNamespace(), "name": s.snapshot.GetName(), "uid": string(s.snapshot.GetUID())}
	}
	u := contentObject()
	u.SetName(name)
	u.Object["spec"] = map[string]any{
		"deletionPolicy":    "Delete",
		"driver":            s.driver,
		"source":            map[string]any{"snapshotHandle": "snap-" + rand.String(6)},
		"volumeSnapshotRef": ref,
	}
	if k := s.deletionSecret; k != nil {
		u.SetAnnotations(map[string]string{AnnotationSnapshotDeletionSecretNamespace: k.Namespace, AnnotationSnapshotDeletionSecretName: k.Name})
	}
	g.Expect(k8sClient.Create(context.Background(), u)).To(Succeed())
	return u
}

// newSnapshot creates a VolumeSnapshot in ns bound to a content named
// content.
func newSnapshot(g Gomega, ns, content string) *unstructured.Unstructured {
	u := &unstructured.Unstructured{}
	u.SetGroupVersionKind(snapshotGVK)
	u.SetNamespace(ns)
	u.SetName("snap")
	u.Object["spec"] = map[string]any{"source": map[string]any{"volumeSnapshotContentName": content}}
	g.Expect(k8sClient.Create(context.Background(), u)).To(Succeed())
	return u
}

func deleteContent(g Gomega, u *unstructured.Unstructured) {
	g.Expect(k8sClient.Delete(context.Background(), u)).To(Succeed())
	g.Eventually(func() bool {
		return apierrors.IsNotFound(k8sClient.Get(context.Background(), client.ObjectKeyFromObject(u), contentObject()))
	}, waitFor, poll).Should(BeTrue())
}

// TestHeldUntilTheLastSnapshotContentGoes: the Secret a
// VolumeSnapshotContent of Cairn's names in its deletion annotations gets
// the finalizer; deleted, it stays (Terminating) while the content
// exists, and goes with it.
func TestHeldUntilTheLastSnapshotContentGoes(t *testing.T) {
	g := NewWithT(t)
	ns := newNamespace(t, g)
	snapSecret := newSecret(g, ns, "snapshotter")
	content := newContent(g, contentSpec{deletionSecret: &snapSecret})
	g.Eventually(func(g Gomega) bool { return held(g, snapSecret) }, waitFor, poll).Should(BeTrue(),
		"the VolumeSnapshotContent's deletion Secret gets the finalizer")

	deleteSecret(g, snapSecret)
	g.Consistently(func(g Gomega) bool { return terminating(g, snapSecret) }, stillFor, poll).Should(BeTrue(),
		"a deleted Secret stays Terminating while a VolumeSnapshotContent names it")

	deleteContent(g, content)
	g.Eventually(func(g Gomega) bool { return exists(g, snapSecret) }, waitFor, poll).Should(BeFalse(),
		"the Secret goes with the last VolumeSnapshotContent naming it")
}

// TestSnapshotContentAndVolumeShareASecret: a Secret named by a
// PersistentVolume and a VolumeSnapshotContent stays until both are gone.
func TestSnapshotContentAndVolumeShareASecret(t *testing.T) {
	g := NewWithT(t)
	ns := newNamespace(t, g)
	shared := newSecret(g, ns, "shared")
	pv := newPV(g, pvSpec{deletionSecret: &shared})
	content := newContent(g, contentSpec{deletionSecret: &shared})
	g.Eventually(func(g Gomega) bool { return held(g, shared) }, waitFor, poll).Should(BeTrue())

	deletePV(g, pv)
	g.Consistently(func(g Gomega) bool { return held(g, shared) }, stillFor, poll).Should(BeTrue(),
		"the Secret stays held while the VolumeSnapshotContent names it")
	deleteContent(g, content)
	g.Eventually(func(g Gomega) []string { f, _ := finalizers(g, shared); return f }, waitFor, poll).Should(BeEmpty(),
		"released with the last of them")
}

// TestOtherDriversSnapshotContentsIgnored: another driver's
// VolumeSnapshotContent holds nothing.
func TestOtherDriversSnapshotContentsIgnored(t *testing.T) {
	g := NewWithT(t)
	ns := newNamespace(t, g)
	theirs, ours := newSecret(g, ns, "theirs"), newSecret(g, ns, "ours")
	newContent(g, contentSpec{driver: "other.csi.example.com", deletionSecret: &theirs})
	newContent(g, contentSpec{deletionSecret: &ours})
	g.Eventually(func(g Gomega) bool { return held(g, ours) }, waitFor, poll).Should(BeTrue())
	g.Consistently(func(g Gomega) []string { f, _ := finalizers(g, theirs); return f }, stillFor, poll).Should(BeEmpty(),
		"another driver's Secret gets no finalizer")
}

// TestMissingSnapshotSecretReported: a VolumeSnapshotContent naming a
// Secret that does not exist gets a Warning Event with the fix, and so
// does its VolumeSnapshot; made again, the Secret is held.
func TestMissingSnapshotSecretReported(t *testing.T) {
	g := NewWithT(t)
	ns := newNamespace(t, g)
	contentName := "snapcontent-" + rand.String(8)
	snap := newSnapshot(g, ns, contentName)
	missing := types.NamespacedName{Namespace: ns, Name: "snapshotter"}
	content := newContent(g, contentSpec{deletionSecret: &missing, snapshot: snap})

	want := And(HavePrefix("Warning "+v1.EventReasonSecretMissing+": Secret "+missing.String()),
		ContainSubstring("snapshotter-deletion secret of VolumeSnapshotContent "+content.GetName()),
		ContainSubstring("csi-snapshotter reads it before it deletes the snapshot"),
		ContainSubstring("kubectl -n "+ns+" create secret generic snapshotter"))
	g.Eventually(func(g Gomega) []string { return eventsAbout(g, "default", "VolumeSnapshotContent", content.GetName()) }, waitFor, poll).
		Should(ContainElement(want))
	g.Eventually(func(g Gomega) []string { return eventsAbout(g, ns, "VolumeSnapshot", snap.GetName()) }, waitFor, poll).
		Should(ContainElement(want))

	newSecret(g, ns, missing.Name)
	g.Eventually(func(g Gomega) bool { return held(g, missing) }, waitFor, poll).Should(BeTrue(),
		"the Secret made again is held")
}

// logLines collects the messages a logger was given.
type logLines struct {
	mu    sync.Mutex
	lines []string
}

func (l *logLines) logger() logr.Logger {
	return funcr.New(func(prefix, args string) {
		l.mu.Lock()
		defer l.mu.Unlock()
		l.lines = append(l.lines, prefix+" "+args)
	}, funcr.Options{})
}

func (l *logLines) all() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.lines)
}

// TestStartsWithoutSnapshotCRDs: on an API server without the
// external-snapshotter's CRDs the guard starts, says it guards no
// snapshots, and guards PersistentVolumes' Secrets as before.
func TestStartsWithoutSnapshotCRDs(t *testing.T) {
	g := NewWithT(t)
	bare := &envtest.Environment{}
	cfg, err := bare.Start()
	g.Expect(err).NotTo(HaveOccurred())
	defer func() { g.Expect(bare.Stop()).To(Succeed()) }()

	scheme := clientgoscheme.Scheme
	mgr, err := ctrl.NewManager(cfg, ctrl.Options{Scheme: scheme, Metrics: metricsserver.Options{BindAddress: "0"},
		Controller: config.Controller{SkipNameValidation: ptr.To(true)}})
	g.Expect(err).NotTo(HaveOccurred())
	logs := &logLines{}
	g.Expect((&Reconciler{Log: logs.logger()}).SetupWithManager(mgr)).To(Succeed())
	g.Expect(logs.all()).To(ContainElement(ContainSubstring("does not serve VolumeSnapshotContents")))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- mgr.Start(ctx) }()
	defer func() { cancel(); g.Expect(<-done).To(Succeed()) }()

	c, err := client.New(cfg, client.Options{Scheme: scheme})
	g.Expect(err).NotTo(HaveOccurred())
	bg := context.Background()
	g.Expect(c.Create(bg, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "app"}})).To(Succeed())
	s := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: "app", Name: "provisioner"}}
	g.Expect(c.Create(bg, s)).To(Succeed())
	pv := &corev1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: "pvc-1", Annotations: map[string]string{
		AnnotationDeletionSecretNamespace: "app", AnnotationDeletionSecretName: "provisioner"}},
		Spec: corev1.PersistentVolumeSpec{
			Capacity:    corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")},
			AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{
				Driver: workload.DriverName, VolumeHandle: "pvc-1"}}}}
	g.Expect(c.Create(bg, pv)).To(Succeed())
	g.Eventually(func(g Gomega) []string {
		g.Expect(c.Get(bg, client.ObjectKeyFromObject(s), s)).To(Succeed())
		return s.Finalizers
	}, waitFor, poll).Should(Equal([]string{Finalizer}), "PersistentVolumes' Secrets are guarded without the snapshot CRDs")
	g.Expect(strings.Join(logs.all(), "\n")).To(ContainSubstring(`"volumeSnapshotContents"=false`))
}
