package v1alpha1

import (
	"os"
	"path/filepath"
	"strconv"
	"testing"

	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"sigs.k8s.io/yaml"
)

// TestDefaultNumberOfReplicas: the default the Volume CRD gives
// spec.numberOfReplicas (from its +kubebuilder:default marker) is
// DefaultNumberOfReplicas, the number the code assumes when the field is
// unset.
func TestDefaultNumberOfReplicas(t *testing.T) {
	raw, err := os.ReadFile(filepath.Join("..", "..", "config", "crd", "bases", "storage.cairn.io_volumes.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var crd apiextensionsv1.CustomResourceDefinition
	if err := yaml.Unmarshal(raw, &crd); err != nil {
		t.Fatal(err)
	}
	for _, v := range crd.Spec.Versions {
		if v.Name != GroupVersion.Version {
			continue
		}
		field := v.Schema.OpenAPIV3Schema.Properties["spec"].Properties["numberOfReplicas"]
		if field.Default == nil {
			t.Fatal("the CRD gives spec.numberOfReplicas no default")
		}
		if got := string(field.Default.Raw); got != strconv.Itoa(DefaultNumberOfReplicas) {
			t.Fatalf("the CRD defaults spec.numberOfReplicas to %s, DefaultNumberOfReplicas is %d: make them agree", got, DefaultNumberOfReplicas)
		}
		return
	}
	t.Fatalf("the Volume CRD has no version %s", GroupVersion.Version)
}

// TestVolumeSpecReplicas: an unset numberOfReplicas is the default.
func TestVolumeSpecReplicas(t *testing.T) {
	for in, want := range map[int32]int{0: DefaultNumberOfReplicas, 1: 1, 5: 5} {
		s := VolumeSpec{NumberOfReplicas: in}
		if got := s.Replicas(); got != want {
			t.Errorf("numberOfReplicas %d: Replicas() = %d, want %d", in, got, want)
		}
	}
}
