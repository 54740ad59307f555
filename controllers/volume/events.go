package volume

import (
	"strings"

	"k8s.io/apimachinery/pkg/api/meta"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/internal/objects"
)

// Volume event reasons.
const (
	EventReplicaFailed    = "ReplicaFailed"
	EventReplicaHealthy   = "ReplicaHealthy"
	EventReplicaReplaced  = "ReplicaReplaced"
	EventReplicaDeleted   = "FailedReplicaDeleted"
	EventAttached         = "Attached"
	EventDetached         = "Detached"
	EventSchedulingFailed = "SchedulingFailed"
	EventSalvage          = "Salvage"
	EventCloned           = "Cloned"
	EventCloneFailed      = "CloneFailed"
)

// recordTransitions records an Event for each change of state or
// robustness a user would look for in `kubectl describe`.
func (r *Reconciler) recordTransitions(before, v *v1.Volume) {
	if before.Status.State != v.Status.State {
		switch v.Status.State {
		case v1.VolumeStateAttached:
			objects.Event(r.Recorder, v, false, EventAttached, "Attach", "attached to %s at %s", v.Status.CurrentNodeName, v.Status.Endpoint)
		case v1.VolumeStateDetached:
			if before.Status.State != v1.VolumeStateCreating && before.Status.State != "" {
				objects.Event(r.Recorder, v, false, EventDetached, "Detach", "detached; the data rests on the replicas")
			}
		}
	}
	if before.Status.Robustness != v.Status.Robustness && v.Status.State == v1.VolumeStateAttached && v.Status.Robustness != "" {
		warn := v.Status.Robustness != v1.VolumeRobustnessHealthy
		objects.Event(r.Recorder, v, warn, "Robustness"+strings.ToUpper(string(v.Status.Robustness[:1]))+string(v.Status.Robustness[1:]), "Observe",
			"robustness %s -> %s", before.Status.Robustness, v.Status.Robustness)
	}
	if c := v.Status.Clone; c != nil && (before.Status.Clone == nil || before.Status.Clone.State != c.State || (c.State == v1.CloneStateFailed && before.Status.Clone.Message != c.Message)) {
		switch c.State {
		case v1.CloneStateCompleted:
			objects.Event(r.Recorder, v, false, EventCloned, "Clone", "%s", c.Message)
		case v1.CloneStateFailed:
			objects.Event(r.Recorder, v, true, EventCloneFailed, "Clone", "%s", c.Message)
		}
	}
	bc := meta.FindStatusCondition(before.Status.Conditions, v1.VolumeConditionScheduled)
	nc := meta.FindStatusCondition(v.Status.Conditions, v1.VolumeConditionScheduled)
	if nc != nil && nc.Reason == v1.VolumeReasonReplicaSchedulingFailed && (bc == nil || bc.Message != nc.Message) {
		objects.Event(r.Recorder, v, true, EventSchedulingFailed, "Schedule", "%s", nc.Message)
	}
}
