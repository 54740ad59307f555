package claims

import (
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
)

// notice is one change of a Volume that its claim should hear of: the
// forwarder's work item. It is comparable, so the same notice queued
// twice is handled once.
type notice struct {
	// Volume is the Volume's key.
	Volume types.NamespacedName
	// Reason is one of v1alpha1's EventReason constants.
	Reason string
	// Node is, for EventReasonAttachWaiting, the node the volume was
	// asked to attach to.
	Node string
}

// noticesOf lists what changed for the worse (or back to healthy) from
// old to cur; old is nil for a Volume seen for the first time (the
// manager starting), which then reports the trouble it is in.
func noticesOf(old, cur *v1.Volume) []string {
	if old == nil {
		old = &v1.Volume{}
	}
	var out []string
	was, is := old.Status.Robustness, cur.Status.Robustness
	switch {
	case is == v1.VolumeRobustnessDegraded && was != is:
		out = append(out, v1.EventReasonVolumeDegraded)
	case is == v1.VolumeRobustnessFaulted && was != is:
		out = append(out, v1.EventReasonVolumeFaulted)
	case is == v1.VolumeRobustnessHealthy && (was == v1.VolumeRobustnessDegraded || was == v1.VolumeRobustnessFaulted):
		out = append(out, v1.EventReasonVolumeHealthy)
	}
	if unschedulable(cur) && !unschedulable(old) {
		out = append(out, v1.EventReasonReplicaUnschedulable)
	}
	return out
}

// unschedulable: the Scheduled condition is False, some replica has no disk.
func unschedulable(v *v1.Volume) bool {
	c := meta.FindStatusCondition(v.Status.Conditions, v1.VolumeConditionScheduled)
	return c != nil && c.Status == metav1.ConditionFalse
}

// attachAsked returns the node cur was asked to attach to if that is new
// since old (or old is nil) and cur is not attached there yet: the start
// of a wait the forwarder looks at again after its AttachWait.
func attachAsked(old, cur *v1.Volume) (string, bool) {
	node := cur.Spec.NodeName
	if node == "" || attachedTo(cur, node) {
		return "", false
	}
	if old != nil && old.Spec.NodeName == node {
		return "", false
	}
	return node, true
}

func attachedTo(v *v1.Volume, node string) bool {
	return v.Status.State == v1.VolumeStateAttached && v.Status.CurrentNodeName == node
}

// holds reports whether what n says is still true of v when the forwarder
// gets to it: a trouble over by then (a degraded volume already healthy
// again, an attach done) is not reported.
func holds(n notice, v *v1.Volume) bool {
	switch n.Reason {
	case v1.EventReasonVolumeDegraded:
		return v.Status.Robustness == v1.VolumeRobustnessDegraded
	case v1.EventReasonVolumeFaulted:
		return v.Status.Robustness == v1.VolumeRobustnessFaulted
	case v1.EventReasonVolumeHealthy:
		return v.Status.Robustness == v1.VolumeRobustnessHealthy
	case v1.EventReasonReplicaUnschedulable:
		return unschedulable(v)
	case v1.EventReasonAttachWaiting:
		return v.Spec.NodeName == n.Node && !attachedTo(v, n.Node)
	}
	return false
}

// toPods reports whether the pods using the claim hear of n too: those
// whose I/O stops (faulted) or which cannot start (an attach that waits).
func toPods(reason string) bool {
	return reason == v1.EventReasonVolumeFaulted || reason == v1.EventReasonAttachWaiting
}

// warning reports whether an Event of reason is a Warning.
func warning(reason string) bool { return reason != v1.EventReasonVolumeHealthy }
