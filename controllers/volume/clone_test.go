package volume

import (
	"strings"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
)

func TestCloned(t *testing.T) {
	ds := &v1.VolumeDataSource{Volume: "src"}
	for _, tc := range []struct {
		name string
		v    v1.Volume
		want bool
	}{
		{"no data source", v1.Volume{}, true},
		{"no status yet", v1.Volume{Spec: v1.VolumeSpec{DataSource: ds}}, false},
		{"copying", v1.Volume{Spec: v1.VolumeSpec{DataSource: ds}, Status: v1.VolumeStatus{Clone: &v1.CloneStatus{State: v1.CloneStateCopying}}}, false},
		{"failed", v1.Volume{Spec: v1.VolumeSpec{DataSource: ds}, Status: v1.VolumeStatus{Clone: &v1.CloneStatus{State: v1.CloneStateFailed}}}, false},
		{"completed", v1.Volume{Spec: v1.VolumeSpec{DataSource: ds}, Status: v1.VolumeStatus{Clone: &v1.CloneStatus{State: v1.CloneStateCompleted}}}, true},
	} {
		if got := Cloned(&tc.v); got != tc.want {
			t.Errorf("%s: Cloned = %v, want %v", tc.name, got, tc.want)
		}
	}
}

func TestCloneSnapshotName(t *testing.T) {
	v := &v1.Volume{ObjectMeta: metav1.ObjectMeta{Name: "pvc-1"}, Spec: v1.VolumeSpec{DataSource: &v1.VolumeDataSource{Volume: "src"}}}
	if got := CloneSnapshotName(v); got != "clone-pvc-1" {
		t.Errorf("whole-volume clone: %q", got)
	}
	v.Spec.DataSource.Snapshot = "snap-1"
	if got := CloneSnapshotName(v); got != "snap-1" {
		t.Errorf("clone of a snapshot: %q", got)
	}
	v.Spec.DataSource.Snapshot = ""
	v.Name = strings.Repeat("a", 70)
	a := CloneSnapshotName(v)
	v.Name = strings.Repeat("a", 69) + "b"
	b := CloneSnapshotName(v)
	if len(a) > 63 || len(b) > 63 || a == b {
		t.Errorf("long names: %q, %q: want distinct names of at most 63 characters", a, b)
	}
}
