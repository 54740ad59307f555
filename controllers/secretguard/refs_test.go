package secretguard

import (
	"testing"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
)

const driver = "storage.cairn.io"

func TestRefsOf(t *testing.T) {
	key := func(ns, name string) types.NamespacedName { return types.NamespacedName{Namespace: ns, Name: name} }
	ref := func(ns, name string) *corev1.SecretReference {
		return &corev1.SecretReference{Namespace: ns, Name: name}
	}
	pv := func(d string, ann map[string]string, src corev1.CSIPersistentVolumeSource) *corev1.PersistentVolume {
		src.Driver = d
		return &corev1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: "pv", Annotations: ann},
			Spec: corev1.PersistentVolumeSpec{PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &src}}}
	}
	deletion := map[string]string{AnnotationDeletionSecretNamespace: "app", AnnotationDeletionSecretName: "enc"}
	for _, c := range []struct {
		name  string
		pv    *corev1.PersistentVolume
		want  []Ref
		names []types.NamespacedName
	}{
		{"no CSI source", &corev1.PersistentVolume{}, nil, nil},
		{"another driver", pv("other", deletion, corev1.CSIPersistentVolumeSource{ControllerPublishSecretRef: ref("app", "enc")}), nil, nil},
		{"no secrets", pv(driver, nil, corev1.CSIPersistentVolumeSource{}), nil, nil},
		{"empty deletion annotations",
			pv(driver, map[string]string{AnnotationDeletionSecretNamespace: "", AnnotationDeletionSecretName: ""}, corev1.CSIPersistentVolumeSource{}), nil, nil},
		{"a name without a namespace", pv(driver, map[string]string{AnnotationDeletionSecretName: "enc"}, corev1.CSIPersistentVolumeSource{}), nil, nil},
		{"one Secret in two roles",
			pv(driver, deletion, corev1.CSIPersistentVolumeSource{ControllerPublishSecretRef: ref("app", "enc")}),
			[]Ref{{key("app", "enc"), RoleControllerPublish}, {key("app", "enc"), RoleProvisionerDeletion}},
			[]types.NamespacedName{key("app", "enc")}},
		{"every role",
			pv(driver, deletion, corev1.CSIPersistentVolumeSource{
				ControllerPublishSecretRef: ref("b", "publish"), NodeStageSecretRef: ref("a", "stage"), NodePublishSecretRef: ref("a", "publish"),
				ControllerExpandSecretRef: ref("c", "expand"), NodeExpandSecretRef: ref("c", "node-expand")}),
			[]Ref{{key("b", "publish"), RoleControllerPublish}, {key("app", "enc"), RoleProvisionerDeletion},
				{key("a", "stage"), RoleNodeStage}, {key("a", "publish"), RoleNodePublish},
				{key("c", "expand"), RoleControllerExpand}, {key("c", "node-expand"), RoleNodeExpand}},
			[]types.NamespacedName{key("a", "publish"), key("a", "stage"), key("app", "enc"), key("b", "publish"), key("c", "expand"), key("c", "node-expand")}},
	} {
		t.Run(c.name, func(t *testing.T) {
			g := NewWithT(t)
			g.Expect(refsOf(c.pv, driver)).To(Equal(c.want))
			g.Expect(secretsOf(c.pv, driver)).To(Equal(c.names))
		})
	}
}

// TestSlim: the cache keeps of a Secret what the guard decides from and
// nothing of its content (kubectl apply's annotation holds the data), and
// of another driver's PersistentVolume its name only.
func TestSlim(t *testing.T) {
	g := NewWithT(t)
	now := metav1.Now()
	in := secretMeta()
	in.ObjectMeta = metav1.ObjectMeta{Name: "enc", Namespace: "app", UID: "u1", ResourceVersion: "7", DeletionTimestamp: &now,
		Finalizers:    []string{Finalizer},
		Labels:        map[string]string{"a": "b"},
		Annotations:   map[string]string{"kubectl.kubernetes.io/last-applied-configuration": `{"data":{"passphrase":"c2VjcmV0"}}`},
		ManagedFields: []metav1.ManagedFieldsEntry{{Manager: "kubectl"}}}
	out, err := slim(driver)(in)
	g.Expect(err).NotTo(HaveOccurred())
	want := secretMeta()
	want.ObjectMeta = metav1.ObjectMeta{Name: "enc", Namespace: "app", UID: "u1", ResourceVersion: "7", DeletionTimestamp: &now, Finalizers: []string{Finalizer}}
	g.Expect(out).To(Equal(want))

	theirs := &corev1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: "pv", ResourceVersion: "3", Annotations: map[string]string{"x": "y"}},
		Spec: corev1.PersistentVolumeSpec{PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{Driver: "other"}}}}
	out, err = slim(driver)(theirs)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(out).To(Equal(&corev1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: "pv", ResourceVersion: "3"}}))

	ours := &corev1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: "pv", Annotations: deletionAnn(), ManagedFields: []metav1.ManagedFieldsEntry{{Manager: "x"}}},
		Spec: corev1.PersistentVolumeSpec{PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{Driver: driver}}}}
	out, err = slim(driver)(ours)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(out.(*corev1.PersistentVolume).Annotations).To(Equal(deletionAnn()))
	g.Expect(out.(*corev1.PersistentVolume).ManagedFields).To(BeNil())
}

func deletionAnn() map[string]string {
	return map[string]string{AnnotationDeletionSecretNamespace: "app", AnnotationDeletionSecretName: "enc"}
}

// content returns an unstructured VolumeSnapshotContent of driver d with
// annotations ann.
func content(d string, ann map[string]string) *unstructured.Unstructured {
	u := contentObject()
	u.SetName("snapcontent-1")
	u.SetAnnotations(ann)
	u.Object["spec"] = map[string]any{"driver": d, "deletionPolicy": "Delete",
		"source":            map[string]any{"snapshotHandle": "h"},
		"volumeSnapshotRef": map[string]any{"namespace": "app", "name": "snap", "uid": "u2", "resourceVersion": "9"}}
	return u
}

func TestContentSecret(t *testing.T) {
	snapAnn := func(ns, name string) map[string]string {
		return map[string]string{AnnotationSnapshotDeletionSecretNamespace: ns, AnnotationSnapshotDeletionSecretName: name}
	}
	for _, c := range []struct {
		name string
		u    *unstructured.Unstructured
		ok   bool
	}{
		{"ours", content(driver, snapAnn("app", "enc")), true},
		{"another driver", content("other", snapAnn("app", "enc")), false},
		{"no annotations", content(driver, nil), false},
		{"empty annotations", content(driver, snapAnn("", "")), false},
		{"a name without a namespace", content(driver, map[string]string{AnnotationSnapshotDeletionSecretName: "enc"}), false},
		{"no spec", contentObject(), false},
	} {
		t.Run(c.name, func(t *testing.T) {
			g := NewWithT(t)
			s, ok := contentSecret(c.u, driver)
			g.Expect(ok).To(Equal(c.ok))
			if ok {
				g.Expect(s).To(Equal(types.NamespacedName{Namespace: "app", Name: "enc"}))
			}
		})
	}
}

// TestSlimContent: the cache keeps of a VolumeSnapshotContent of the
// driver its identity, deletion annotations, driver and VolumeSnapshot
// reference, and of another driver's its identity only.
func TestSlimContent(t *testing.T) {
	g := NewWithT(t)
	ann := map[string]string{AnnotationSnapshotDeletionSecretNamespace: "app", AnnotationSnapshotDeletionSecretName: "enc",
		"kubectl.kubernetes.io/last-applied-configuration": "{}"}
	in := content(driver, ann)
	in.SetUID("u1")
	in.SetResourceVersion("7")
	in.SetManagedFields([]metav1.ManagedFieldsEntry{{Manager: "x"}})
	out, err := slim(driver)(in)
	g.Expect(err).NotTo(HaveOccurred())
	want := contentObject()
	want.SetName("snapcontent-1")
	want.SetUID("u1")
	want.SetResourceVersion("7")
	want.SetAnnotations(map[string]string{AnnotationSnapshotDeletionSecretNamespace: "app", AnnotationSnapshotDeletionSecretName: "enc"})
	want.Object["spec"] = map[string]any{"driver": driver, "volumeSnapshotRef": map[string]any{"namespace": "app", "name": "snap", "uid": "u2"}}
	g.Expect(out).To(Equal(want))
	s, ok := contentSecret(out.(*unstructured.Unstructured), driver)
	g.Expect(ok).To(BeTrue(), "the slim copy still names its Secret")
	g.Expect(s.Name).To(Equal("enc"))

	theirs := content("other", ann)
	theirs.SetResourceVersion("3")
	out, err = slim(driver)(theirs)
	g.Expect(err).NotTo(HaveOccurred())
	want = contentObject()
	want.SetName("snapcontent-1")
	want.SetResourceVersion("3")
	g.Expect(out).To(Equal(want))
}
