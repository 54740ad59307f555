package claims

import (
	"context"
	"errors"
	"testing"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

// TestVolumeOf resolves claims held by a real API server: a bound claim
// of Cairn's driver gives its volume handle; a missing claim, one not
// bound, one bound to a missing PersistentVolume and one of another
// driver give their own errors, each with what to do.
func TestVolumeOf(t *testing.T) {
	g := NewWithT(t)
	ctx := context.Background()
	f := newFixture(t, g)
	got, err := VolumeOf(ctx, k8sClient, types.NamespacedName{Namespace: f.ns, Name: f.claim})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(got).To(Equal(f.vol.Name))

	claim := func(name, volume string, bound bool) {
		pvc := &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: f.ns}, Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce}, VolumeName: volume,
			Resources: corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}}}}
		g.Expect(k8sClient.Create(ctx, pvc)).To(Succeed())
		if bound {
			pvc.Status.Phase = corev1.ClaimBound
			g.Expect(k8sClient.Status().Update(ctx, pvc)).To(Succeed())
		}
	}
	claim("pending", "", false)
	claim("orphan", "pv-gone-"+f.ns, true)
	claim("nfs", "nfs-"+f.ns, true)
	g.Expect(k8sClient.Create(ctx, &corev1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: "nfs-" + f.ns}, Spec: corev1.PersistentVolumeSpec{
		Capacity: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}, AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
		PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{Driver: "nfs.csi.k8s.io", VolumeHandle: "share"}}}})).To(Succeed())

	for _, tc := range []struct {
		name string
		want error
		says []string
	}{
		{"nope", ErrNoClaim, []string{"no PersistentVolumeClaim nope in namespace " + f.ns, "kubectl -n " + f.ns + " get pvc"}},
		{"pending", ErrNotBound, []string{"claim " + f.ns + "/pending is Pending, not bound", "describe pvc pending"}},
		{"orphan", ErrNoPersistentVolume, []string{"PersistentVolume pv-gone-" + f.ns + ", which does not exist"}},
		{"nfs", ErrOtherDriver, []string{"of driver nfs.csi.k8s.io, not of Cairn's driver storage.cairn.io"}},
	} {
		_, err := VolumeOf(ctx, k8sClient, types.NamespacedName{Namespace: f.ns, Name: tc.name})
		g.Expect(errors.Is(err, tc.want)).To(BeTrue(), "%s: %v", tc.name, err)
		for _, s := range tc.says {
			g.Expect(err.Error()).To(ContainSubstring(s))
		}
	}

	var pvs corev1.PersistentVolumeList
	g.Expect(k8sClient.List(ctx, &pvs)).To(Succeed())
	g.Expect(ByVolume(pvs.Items)).To(HaveKeyWithValue(f.vol.Name, Ref{Namespace: f.ns, Name: f.claim}))
	g.Expect(ByVolume(pvs.Items)).NotTo(HaveKey("share"), "another driver's volume")
}

func TestParseClaim(t *testing.T) {
	g := NewWithT(t)
	for in, ok := range map[string]bool{"ns/data": true, "pvc-123": false, "/data": false, "ns/": false, "a/b/c": false} {
		_, got := ParseClaim(in)
		g.Expect(got).To(Equal(ok), in)
	}
	ref, _ := ParseClaim("ns/data")
	g.Expect(ref).To(Equal(types.NamespacedName{Namespace: "ns", Name: "data"}))
}
