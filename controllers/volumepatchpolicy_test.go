package controllers

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"
	"time"

	admissionv1 "k8s.io/api/admissionregistration/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// TestVolumePatchPolicy applies config/csi/volume-patch-policy.yaml: a
// requester that may patch Volumes but not update them (the CSI node
// plugins) can write trim-result annotations and nothing else of a
// Volume; a requester that may update Volumes is not limited.
func TestVolumePatchPolicy(t *testing.T) {
	raw, err := os.ReadFile(filepath.Join("..", "config", "csi", "volume-patch-policy.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(raw), 4096)
	policy, binding := &admissionv1.ValidatingAdmissionPolicy{}, &admissionv1.ValidatingAdmissionPolicyBinding{}
	if err := dec.Decode(policy); err != nil {
		t.Fatal(err)
	}
	if err := dec.Decode(binding); err != nil {
		t.Fatal(err)
	}
	for _, o := range []client.Object{policy, binding} {
		if err := k8sClient.Create(ctx, o); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = k8sClient.Delete(ctx, o) })
	}
	const user = "system:serviceaccount:cairn-system:cairn-csi-node"
	role := &rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: "patch-volumes"}, Rules: []rbacv1.PolicyRule{
		{APIGroups: []string{v1.GroupVersion.Group}, Resources: []string{"volumes"}, Verbs: []string{"get", "list", "watch", "patch"}}}}
	rb := &rbacv1.ClusterRoleBinding{ObjectMeta: metav1.ObjectMeta{Name: "patch-volumes"},
		RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: role.Name},
		Subjects: []rbacv1.Subject{{Kind: rbacv1.UserKind, APIGroup: rbacv1.GroupName, Name: user}}}
	for _, o := range []client.Object{role, rb} {
		if err := k8sClient.Create(ctx, o); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = k8sClient.Delete(ctx, o) })
	}
	cfg := *restCfg
	cfg.Impersonate.UserName = user
	node, err := client.New(&cfg, client.Options{Scheme: k8sClient.Scheme()})
	if err != nil {
		t.Fatal(err)
	}
	vol := &v1.Volume{ObjectMeta: metav1.ObjectMeta{Name: "vap", Namespace: "default", Labels: map[string]string{"app": "db"},
		Annotations: map[string]string{"keep": "me"}}, Spec: v1.VolumeSpec{Size: resource.MustParse("1Gi"), NumberOfReplicas: 3}}
	if err := k8sClient.Create(ctx, vol); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = k8sClient.Delete(ctx, vol) })
	patch := func(c client.Client, body string) error {
		return c.Patch(ctx, &v1.Volume{ObjectMeta: metav1.ObjectMeta{Name: vol.Name, Namespace: vol.Namespace}}, client.RawPatch(types.MergePatchType, []byte(body)))
	}
	// The policy takes effect once the API server has loaded it: a spec
	// change by the node plugin is refused from then on.
	dl := time.Now().Add(deadline.Scale(time.Minute))
	for err := patch(node, `{"spec":{"numberOfReplicas":1}}`); !apierrors.IsInvalid(err) && !apierrors.IsForbidden(err); err = patch(node, `{"spec":{"numberOfReplicas":1}}`) {
		if time.Now().After(dl) {
			t.Fatalf("a spec change by a requester that may only patch: %v, want refused by the policy", err)
		}
		if err == nil { // allowed before the policy was loaded: put it back
			if err := patch(k8sClient, `{"spec":{"numberOfReplicas":3}}`); err != nil {
				t.Fatal(err)
			}
		}
		time.Sleep(100 * time.Millisecond)
	}
	for name, body := range map[string]string{
		"a label":            `{"metadata":{"labels":{"app":"other"}}}`,
		"another annotation": `{"metadata":{"annotations":{"keep":null}}}`,
		"a trim request":     `{"metadata":{"annotations":{"trim-request.storage.cairn.io/j":"2026-11-27T00:00:00Z"}}}`,
		"a finalizer":        `{"metadata":{"finalizers":["x/y"]}}`,
	} {
		if err := patch(node, body); !apierrors.IsInvalid(err) && !apierrors.IsForbidden(err) {
			t.Errorf("%s changed by a requester that may only patch: %v, want refused", name, err)
		}
	}
	if err := patch(node, `{"metadata":{"annotations":{"trim-result.storage.cairn.io/j":"{}"}}}`); err != nil {
		t.Fatalf("a trim answer by the node plugin: %v", err)
	}
	if err := patch(k8sClient, `{"spec":{"numberOfReplicas":2},"metadata":{"labels":{"app":"other"}}}`); err != nil {
		t.Fatalf("a requester that may update Volumes is not limited: %v", err)
	}
	got := &v1.Volume{}
	if err := k8sClient.Get(ctx, client.ObjectKeyFromObject(vol), got); err != nil {
		t.Fatal(err)
	}
	if got.Spec.NumberOfReplicas != 2 || got.Annotations["keep"] != "me" || got.Annotations["trim-result.storage.cairn.io/j"] != "{}" || len(got.Finalizers) != 0 {
		t.Fatalf("volume after the patches: spec %+v, annotations %v, finalizers %v", got.Spec, got.Annotations, got.Finalizers)
	}
}
