package volume

import (
	"fmt"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/internal/objects"
)

// computeStatus derives the Volume's status from the scope's observations.
func computeStatus(s *scope) {
	v := s.v
	st := &v.Status
	st.ObservedGeneration = v.Generation
	want := int(v.Spec.NumberOfReplicas)
	if want <= 0 {
		want = 3
	}
	scheduled, running := 0, 0
	for _, r := range s.replicas {
		if r.Spec.NodeName != "" {
			scheduled++
		}
		if r.Status.InstanceState == v1.InstanceStateRunning {
			running++
		}
	}
	cond := func(typ string, ok bool, reason, msg string) {
		objects.SetCondition(&st.Conditions, v.Generation, typ, ok, reason, msg)
	}
	switch {
	case scheduled >= want:
		cond(v1.VolumeConditionScheduled, true, v1.ReasonAsExpected, fmt.Sprintf("%d replicas placed", scheduled))
	case s.reason != "":
		cond(v1.VolumeConditionScheduled, false, v1.VolumeReasonReplicaSchedulingFailed, s.reason)
	default:
		cond(v1.VolumeConditionScheduled, false, v1.ReasonReconciling, fmt.Sprintf("%d of %d replicas placed", scheduled, want))
	}

	e := s.engine
	engineRunning := e != nil && e.Status.InstanceState == v1.InstanceStateRunning && e.Spec.NodeName == v.Spec.NodeName && e.Status.Endpoint != ""
	anyProcess := e != nil && e.Status.InstanceState != "" && e.Status.InstanceState != v1.InstanceStateStopped
	for _, r := range s.replicas {
		if r.Status.InstanceState != "" && r.Status.InstanceState != v1.InstanceStateStopped {
			anyProcess = true
		}
	}
	st.Endpoint, st.CurrentNodeName = "", ""
	switch {
	case e == nil || len(s.replicas) < want:
		st.State = v1.VolumeStateCreating
		cond(v1.ConditionReady, false, ReasonCreating, "creating the engine and replica objects")
	case v.Spec.NodeName != "" && engineRunning:
		st.State = v1.VolumeStateAttached
		st.Endpoint, st.CurrentNodeName, st.Size = e.Status.Endpoint, e.Spec.NodeName, e.Status.Size
		cond(v1.ConditionReady, true, v1.ReasonAsExpected, "attached to "+e.Spec.NodeName+" at "+e.Status.Endpoint)
	case v.Spec.NodeName != "":
		st.State = v1.VolumeStateAttaching
		cond(v1.ConditionReady, false, ReasonAttaching, fmt.Sprintf("attaching to %s: %d of %d scheduled replicas running, engine %s", v.Spec.NodeName, running, scheduled, engineState(e)))
	case anyProcess:
		st.State = v1.VolumeStateDetaching
		cond(v1.ConditionReady, false, ReasonDetaching, "stopping the engine, then the replicas")
	default:
		st.State = v1.VolumeStateDetached
		cond(v1.ConditionReady, false, v1.VolumeReasonDetached, "not attached to any node")
	}
	st.Robustness = robustness(st.State, running, want)
}

func engineState(e *v1.Engine) string {
	if e == nil || e.Status.InstanceState == "" {
		return "not started"
	}
	return string(e.Status.InstanceState)
}

// robustness from the replicas whose processes run: the engine's own view
// of replica modes (RW/WO/ERR) refines this once its status stream is
// followed.
func robustness(state v1.VolumeState, running, want int) v1.VolumeRobustness {
	if state != v1.VolumeStateAttached {
		return v1.VolumeRobustnessUnknown
	}
	switch {
	case running >= want:
		return v1.VolumeRobustnessHealthy
	case running > 0:
		return v1.VolumeRobustnessDegraded
	}
	return v1.VolumeRobustnessFaulted
}
