package claims

import (
	"testing"

	. "github.com/onsi/gomega"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
)

func vol(r v1.VolumeRobustness, scheduled metav1.ConditionStatus) *v1.Volume {
	v := &v1.Volume{Status: v1.VolumeStatus{Robustness: r}}
	if scheduled != "" {
		v.Status.Conditions = []metav1.Condition{{Type: v1.VolumeConditionScheduled, Status: scheduled}}
	}
	return v
}

// TestNoticesOf: each change for the worse gives its notice once; the
// way back to healthy gives one; nothing else does.
func TestNoticesOf(t *testing.T) {
	const (
		healthy  = v1.VolumeRobustnessHealthy
		degraded = v1.VolumeRobustnessDegraded
		faulted  = v1.VolumeRobustnessFaulted
		unknown  = v1.VolumeRobustnessUnknown
	)
	for _, tc := range []struct {
		name     string
		old, cur *v1.Volume
		want     []string
	}{
		{"first seen healthy", nil, vol(healthy, ""), nil},
		{"first seen degraded", nil, vol(degraded, ""), []string{v1.EventReasonVolumeDegraded}},
		{"healthy to degraded", vol(healthy, ""), vol(degraded, ""), []string{v1.EventReasonVolumeDegraded}},
		{"degraded stays", vol(degraded, ""), vol(degraded, ""), nil},
		{"degraded to faulted", vol(degraded, ""), vol(faulted, ""), []string{v1.EventReasonVolumeFaulted}},
		{"faulted to degraded", vol(faulted, ""), vol(degraded, ""), []string{v1.EventReasonVolumeDegraded}},
		{"degraded to healthy", vol(degraded, ""), vol(healthy, ""), []string{v1.EventReasonVolumeHealthy}},
		{"faulted to healthy", vol(faulted, ""), vol(healthy, ""), []string{v1.EventReasonVolumeHealthy}},
		{"unknown to healthy (an attach)", vol(unknown, ""), vol(healthy, ""), nil},
		{"degraded to unknown (a detach)", vol(degraded, ""), vol(unknown, ""), nil},
		{"scheduling fails", vol(unknown, metav1.ConditionTrue), vol(unknown, metav1.ConditionFalse), []string{v1.EventReasonReplicaUnschedulable}},
		{"scheduling still fails", vol(unknown, metav1.ConditionFalse), vol(unknown, metav1.ConditionFalse), nil},
		{"scheduled again", vol(unknown, metav1.ConditionFalse), vol(unknown, metav1.ConditionTrue), nil},
		{"first seen unschedulable", nil, vol(unknown, metav1.ConditionFalse), []string{v1.EventReasonReplicaUnschedulable}},
		{"degraded and unschedulable at once", vol(healthy, metav1.ConditionTrue), vol(degraded, metav1.ConditionFalse),
			[]string{v1.EventReasonVolumeDegraded, v1.EventReasonReplicaUnschedulable}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			NewWithT(t).Expect(noticesOf(tc.old, tc.cur)).To(Equal(tc.want))
		})
	}
}

// TestAttachAsked: the wait starts when a node is asked for that the
// volume is not attached to; not again while the same node is asked.
func TestAttachAsked(t *testing.T) {
	at := func(spec, state, current string) *v1.Volume {
		return &v1.Volume{Spec: v1.VolumeSpec{NodeName: spec}, Status: v1.VolumeStatus{State: v1.VolumeState(state), CurrentNodeName: current}}
	}
	for _, tc := range []struct {
		name     string
		old, cur *v1.Volume
		node     string
	}{
		{"asked", at("", "detached", ""), at("a", "detached", ""), "a"},
		{"first seen attaching", nil, at("a", "attaching", ""), "a"},
		{"first seen attached", nil, at("a", "attached", "a"), ""},
		{"still asked", at("a", "attaching", ""), at("a", "attaching", ""), ""},
		{"moved", at("a", "attached", "a"), at("b", "attached", "a"), "b"},
		{"detach", at("a", "attached", "a"), at("", "detaching", "a"), ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			node, ok := attachAsked(tc.old, tc.cur)
			NewWithT(t).Expect(node).To(Equal(tc.node))
			NewWithT(t).Expect(ok).To(Equal(tc.node != ""))
		})
	}
}

// TestHolds: a notice is dropped once what it says is over.
func TestHolds(t *testing.T) {
	g := NewWithT(t)
	g.Expect(holds(notice{Reason: v1.EventReasonVolumeDegraded}, vol(v1.VolumeRobustnessDegraded, ""))).To(BeTrue())
	g.Expect(holds(notice{Reason: v1.EventReasonVolumeDegraded}, vol(v1.VolumeRobustnessHealthy, ""))).To(BeFalse())
	g.Expect(holds(notice{Reason: v1.EventReasonVolumeFaulted}, vol(v1.VolumeRobustnessDegraded, ""))).To(BeFalse())
	g.Expect(holds(notice{Reason: v1.EventReasonReplicaUnschedulable}, vol(v1.VolumeRobustnessUnknown, metav1.ConditionTrue))).To(BeFalse())
	waiting := &v1.Volume{Spec: v1.VolumeSpec{NodeName: "a"}, Status: v1.VolumeStatus{State: v1.VolumeStateAttaching}}
	g.Expect(holds(notice{Reason: v1.EventReasonAttachWaiting, Node: "a"}, waiting)).To(BeTrue())
	g.Expect(holds(notice{Reason: v1.EventReasonAttachWaiting, Node: "b"}, waiting)).To(BeFalse(), "asked elsewhere since")
	waiting.Status.State, waiting.Status.CurrentNodeName = v1.VolumeStateAttached, "a"
	g.Expect(holds(notice{Reason: v1.EventReasonAttachWaiting, Node: "a"}, waiting)).To(BeFalse())
}
