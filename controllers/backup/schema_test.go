package backup

import (
	"context"
	"strings"
	"testing"

	. "github.com/onsi/gomega"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
)

// TestSchema checks the CRD's validation on the real API server: a
// Backup's spec cannot change, its name is at most 63 characters (the
// Snapshot it takes is named after it), volume and target are required
// and mode is incremental or full; each refusal is an Invalid error and changes nothing.
func TestSchema(t *testing.T) {
	g := NewWithT(t)
	ctx := context.Background()
	b := &v1.Backup{ObjectMeta: metav1.ObjectMeta{Name: "schema", Namespace: ns}, Spec: v1.BackupSpec{Volume: "v", Target: "t"}}
	g.Expect(k8sClient.Create(ctx, b)).To(Succeed())
	for _, change := range []func(*v1.BackupSpec){
		func(s *v1.BackupSpec) { s.Volume = "other" },
		func(s *v1.BackupSpec) { s.Target = "other" },
		func(s *v1.BackupSpec) { s.Snapshot = "snap" },
		func(s *v1.BackupSpec) { s.Mode = v1.BackupModeFull },
	} {
		changed := b.DeepCopy()
		change(&changed.Spec)
		err := k8sClient.Update(ctx, changed)
		g.Expect(apierrors.IsInvalid(err)).To(BeTrue(), "want Invalid, got %v", err)
	}
	got := &v1.Backup{}
	g.Expect(k8sClient.Get(ctx, keyOf(b), got)).To(Succeed())
	g.Expect(got.Spec).To(Equal(b.Spec))

	for _, bad := range []*v1.Backup{
		{ObjectMeta: metav1.ObjectMeta{Name: strings.Repeat("a", 64), Namespace: ns}, Spec: v1.BackupSpec{Volume: "v", Target: "t"}},
		{ObjectMeta: metav1.ObjectMeta{Name: "no-volume", Namespace: ns}, Spec: v1.BackupSpec{Target: "t"}},
		{ObjectMeta: metav1.ObjectMeta{Name: "no-target", Namespace: ns}, Spec: v1.BackupSpec{Volume: "v"}},
		{ObjectMeta: metav1.ObjectMeta{Name: "bad-mode", Namespace: ns}, Spec: v1.BackupSpec{Volume: "v", Target: "t", Mode: "differential"}},
	} {
		err := k8sClient.Create(ctx, bad)
		g.Expect(apierrors.IsInvalid(err)).To(BeTrue(), "%s: want Invalid, got %v", bad.Name, err)
		g.Expect(apierrors.IsNotFound(k8sClient.Get(ctx, keyOf(bad), &v1.Backup{}))).To(BeTrue())
	}
	g.Expect(k8sClient.Delete(ctx, b)).To(Succeed())
}
