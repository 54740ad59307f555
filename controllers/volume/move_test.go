package volume

import (
	"slices"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
)

// A replica moved off its node (controllers/drain) and its replacement:
// the replacement is given to the engine, not deleted as surplus, while
// the moved replica is there; the moved replica, once deleted, is not
// marked failed.
func TestPlanRepairMove(t *testing.T) {
	now := time.Date(2026, 11, 25, 12, 0, 0, 0, time.UTC)
	healthy := &metav1.Time{Time: now.Add(-time.Hour)}
	rep := func(n string, running bool) *v1.Replica {
		r := &v1.Replica{ObjectMeta: metav1.ObjectMeta{Name: n}, Spec: v1.ReplicaSpec{HealthyAt: healthy}}
		if running {
			r.Status.InstanceState, r.Status.Address, r.Status.ControlAddress = v1.InstanceStateRunning, n+":1", n+":2"
		}
		return r
	}
	a, b, c := rep("a", true), rep("b", true), rep("c", true)
	fresh := rep("d", false)
	fresh.Spec.HealthyAt = nil
	fresh.Labels = map[string]string{LabelReplaces: "c"}
	const RW, ERR = v1.ReplicaModeRW, v1.ReplicaModeERR
	in := repairInput{want: 3, replicas: []*v1.Replica{a, b, c, fresh}, modes: map[string]v1.ReplicaMode{"a": RW, "b": RW, "c": RW},
		rebuildLimit: 1, wait: time.Minute, now: now}

	// Not running yet: kept (without the label it is surplus).
	if p := planRepair(in); slices.Contains(p.remove, "d") {
		t.Fatalf("the replacement is removed as surplus: %+v", p)
	}
	unlabelled := fresh.DeepCopy()
	unlabelled.Labels = nil
	in2 := in
	in2.replicas = []*v1.Replica{a, b, c, unlabelled}
	if p := planRepair(in2); !slices.Contains(p.remove, "d") {
		t.Fatalf("a replica that never held data is not surplus without the label: %+v", p)
	}

	// Running: given to the engine to rebuild.
	running := rep("d", true)
	running.Spec.HealthyAt, running.Labels = nil, fresh.Labels
	in.replicas = []*v1.Replica{a, b, c, running}
	if p := planRepair(in); p.addresses["d"] == (v1.ReplicaAddress{}) {
		t.Fatalf("the replacement is not given to the engine: %+v", p)
	}

	// RW; the moved replica deleted (its process stopping: ERR): not failed.
	running.Spec.HealthyAt = healthy
	gone := c.DeepCopy()
	gone.DeletionTimestamp = &metav1.Time{Time: now}
	gone.Finalizers = []string{"x"}
	in.replicas = []*v1.Replica{a, b, gone, running}
	in.modes = map[string]v1.ReplicaMode{"a": RW, "b": RW, "c": ERR, "d": RW}
	p := planRepair(in)
	if slices.Contains(p.failed, "c") {
		t.Fatalf("the moved replica is marked failed: %+v", p)
	}
	if _, ok := p.addresses["c"]; ok {
		t.Fatalf("the moved replica is still given to the engine: %+v", p)
	}
	// Without its replacement, a deleted ERR replica is a failure as before.
	in.replicas = []*v1.Replica{a, b, gone}
	if p := planRepair(in); !slices.Contains(p.failed, "c") {
		t.Fatalf("a deleted ERR replica without a replacement is not marked failed: %+v", p)
	}
}
