package volume

import (
	"fmt"
	"slices"
	"strings"

	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/display"
	"github.com/cairn-io/cairn/controllers/internal/objects"
)

// condFunc sets one of the Volume's conditions.
type condFunc func(typ string, ok bool, reason, msg string)

// computeStatus derives the Volume's status from the scope's observations.
func computeStatus(s *scope) {
	v := s.v
	v.Status.ObservedGeneration = v.Generation
	cond := func(typ string, ok bool, reason, msg string) {
		objects.SetCondition(&v.Status.Conditions, v.Generation, typ, ok, reason, msg)
	}
	n := countReplicas(s)
	setScheduled(s, cond, n)
	if !s.targeted {
		s.target() // a phase failed before attachOrDetach: as it would have
	}
	setState(s, cond, n)
	setRobustness(s, cond, n)
	setRebuilding(s, cond)
	setCloned(s, cond)
}

// replicaCounts are the replicas wanted, placed and running.
type replicaCounts struct {
	want, scheduled, running int
}

func countReplicas(s *scope) replicaCounts {
	n := replicaCounts{want: wantReplicas(s.v)}
	for _, r := range s.replicas {
		if r.Spec.NodeName != "" {
			n.scheduled++
		}
		if r.Status.InstanceState == v1.InstanceStateRunning {
			n.running++
		}
	}
	return n
}

// setScheduled sets the Scheduled condition: every wanted replica placed,
// or the scheduler's reason why not.
func setScheduled(s *scope, cond condFunc, n replicaCounts) {
	switch {
	case n.scheduled >= n.want:
		cond(v1.VolumeConditionScheduled, true, v1.ReasonAsExpected, fmt.Sprintf("%d replicas placed", n.scheduled))
	case s.reason != "":
		cond(v1.VolumeConditionScheduled, false, v1.VolumeReasonReplicaSchedulingFailed, s.reason)
	default:
		cond(v1.VolumeConditionScheduled, false, v1.ReasonReconciling, fmt.Sprintf("%d of %d replicas placed", n.scheduled, n.want))
	}
}

// setState sets status.state, the Ready condition and, attached, the
// endpoint, node and size the engine serves.
func setState(s *scope, cond condFunc, n replicaCounts) {
	v, st, e := s.v, &s.v.Status, s.engine
	p := observeProcesses(s)
	st.Endpoint, st.CurrentNodeName = "", ""
	switch {
	case e == nil || len(s.replicas) < n.want:
		st.State = v1.VolumeStateCreating
		cond(v1.ConditionReady, false, v1.VolumeReasonCreating, "creating the engine and replica objects")
	case v.Spec.NodeName != "" && p.userEngineServes:
		st.State = v1.VolumeStateAttached
		st.Endpoint, st.CurrentNodeName, st.Size = e.Status.Endpoint, e.Spec.NodeName, e.Status.Size
		if e.Status.ActualSize != nil {
			st.ActualSize = e.Status.ActualSize
		}
		cond(v1.ConditionReady, true, v1.ReasonAsExpected, "attached to "+e.Spec.NodeName+" at "+e.Status.Endpoint)
	case v.Spec.NodeName != "":
		st.State = v1.VolumeStateAttaching
		setAttaching(s, cond, n)
	case s.node != "" && s.maintenance && !p.userEngineAlive:
		// No user has the volume; Cairn's own work runs its processes.
		st.State = v1.VolumeStateDetached
		why := s.work
		if !Cloned(v) {
			why = strings.Join(slices.DeleteFunc([]string{"copying from the data source", s.work}, func(x string) bool { return x == "" }), "; ")
		}
		cond(v1.ConditionReady, false, v1.VolumeReasonDetached, fmt.Sprintf("not attached to any node; its replicas and an engine without a device are run on %s for %s (%d of %d scheduled replicas running, engine %s), and stopped when that is done",
			s.node, why, n.running, n.scheduled, engineState(e)))
	case s.restoring && !p.userEngineAlive:
		// No engine runs: the manager writes the backup into the replicas.
		st.State = v1.VolumeStateDetached
		cond(v1.ConditionReady, false, v1.VolumeReasonDetached, fmt.Sprintf("not attached to any node; its replicas run for the restore from a backup (%d of %d scheduled replicas running), and the volume may attach once it is complete",
			n.running, n.scheduled))
	case p.anyProcess:
		st.State = v1.VolumeStateDetaching
		cond(v1.ConditionReady, false, v1.VolumeReasonDetaching, "stopping the engine, then the replicas")
	default:
		st.State = v1.VolumeStateDetached
		cond(v1.ConditionReady, false, v1.VolumeReasonDetached, "not attached to any node")
	}
}

// processes is what setState reads of the volume's processes.
type processes struct {
	// userEngineServes: a user's engine runs on spec.nodeName with a
	// device. Only a user's engine attaches the volume: a maintenance
	// engine has no device, and one runs on the user's node while a
	// clone is copied.
	userEngineServes bool
	// userEngineAlive: a user's engine has a process, in any state.
	userEngineAlive bool
	// anyProcess: the engine or a replica has a process, in any state.
	anyProcess bool
}

func observeProcesses(s *scope) processes {
	e := s.engine
	alive := func(st v1.InstanceState) bool { return st != "" && st != v1.InstanceStateStopped }
	p := processes{
		userEngineServes: e != nil && e.Status.InstanceState == v1.InstanceStateRunning && e.Spec.NodeName == s.v.Spec.NodeName && e.Status.Endpoint != "" && !e.Spec.Maintenance,
		userEngineAlive:  e != nil && !e.Spec.Maintenance && alive(e.Status.InstanceState),
		anyProcess:       e != nil && alive(e.Status.InstanceState),
	}
	for _, r := range s.replicas {
		p.anyProcess = p.anyProcess || alive(r.Status.InstanceState)
	}
	return p
}

// setAttaching sets the Ready condition of a volume attaching to
// spec.nodeName: what it waits for, the copy from its data source first.
func setAttaching(s *scope, cond condFunc, n replicaCounts) {
	v, e := s.v, s.engine
	if !Cloned(v) && (s.clone == nil || s.clone.State != v1.CloneStateCompleted) {
		msg := "the copy from the data source has not started"
		if s.clone != nil {
			msg = s.clone.Message
		}
		cond(v1.ConditionReady, false, v1.VolumeReasonAttaching, fmt.Sprintf("attaching to %s waits for the copy from the data source to complete: %s", v.Spec.NodeName, msg))
		return
	}
	reason := v1.VolumeReasonAttaching
	if c := engineReady(e); c != nil && c.Status != metav1.ConditionTrue && c.Reason == v1.ReasonEncryptionKeyUnusable {
		reason = c.Reason // the CSI driver fails the attach on it
	}
	cond(v1.ConditionReady, false, reason, fmt.Sprintf("attaching to %s: %d of %d scheduled replicas running, engine %s", v.Spec.NodeName, n.running, n.scheduled, engineState(e)))
}

// setRobustness sets status.robustness: from the engine's replica modes
// once attached and reported, from the running replicas before.
func setRobustness(s *scope, cond condFunc, n replicaCounts) {
	st, e := &s.v.Status, s.engine
	st.Robustness = robustness(st.State, n.running, n.want)
	if st.State == v1.VolumeStateAttached && len(e.Status.ReplicaModeMap) > 0 {
		st.Robustness = robustnessFromModes(e.Status.ReplicaModeMap, n.want)
		if st.Robustness == v1.VolumeRobustnessFaulted {
			msg := "no replica is RW: the volume cannot serve I/O; salvaging it"
			if s.salvageWait != "" {
				msg = s.salvageWait
			}
			cond(v1.ConditionReady, false, v1.VolumeReasonFaulted, msg)
		}
	}
}

// setCloned reports the copy from spec.dataSource in status.clone and the
// Cloned condition.
func setCloned(s *scope, cond condFunc) {
	if s.v.Spec.DataSource == nil || s.clone == nil {
		return
	}
	s.v.Status.Clone = s.clone
	c := s.clone
	if s.cloneReason != "" { // a restore's
		cond(v1.VolumeConditionCloned, c.State == v1.CloneStateCompleted, s.cloneReason, c.Message)
		return
	}
	switch c.State {
	case v1.CloneStateCompleted:
		cond(v1.VolumeConditionCloned, true, v1.VolumeReasonCloneCompleted, c.Message)
	case v1.CloneStateFailed:
		cond(v1.VolumeConditionCloned, false, v1.VolumeReasonCloneFailed, c.Message)
	default:
		cond(v1.VolumeConditionCloned, false, v1.VolumeReasonCloneInProgress, c.Message)
	}
}

// robustnessFromModes: healthy with numberOfReplicas RW replicas,
// degraded with fewer but at least one, faulted with none.
func robustnessFromModes(modes map[string]v1.ReplicaMode, want int) v1.VolumeRobustness {
	rw := 0
	for _, m := range modes {
		if m == v1.ReplicaModeRW {
			rw++
		}
	}
	return robustnessOf(rw, want)
}

// robustnessOf: healthy with want usable replicas, degraded with fewer
// but at least one, faulted with none.
func robustnessOf(usable, want int) v1.VolumeRobustness {
	switch {
	case usable >= want:
		return v1.VolumeRobustnessHealthy
	case usable > 0:
		return v1.VolumeRobustnessDegraded
	}
	return v1.VolumeRobustnessFaulted
}

// setRebuilding shows the rebuilds in progress, with their progress, in
// the Rebuilding condition.
func setRebuilding(s *scope, cond condFunc) {
	var parts []string
	if e := s.engine; e != nil && e.Status.InstanceState == v1.InstanceStateRunning {
		names := make([]string, 0, len(e.Status.RebuildStatus))
		for n := range e.Status.RebuildStatus {
			names = append(names, n)
		}
		slices.Sort(names)
		for _, n := range names {
			rb := e.Status.RebuildStatus[n]
			if rb.State != v1.RebuildStateInProgress {
				continue
			}
			kind := "full copy"
			switch {
			case rb.DirtyOnly:
				kind = "regions written while it was away"
			case rb.FullReason != "":
				kind = "full copy: " + rb.FullReason
			}
			parts = append(parts, fmt.Sprintf("%s from %s: %d%% (%s of %s, %s)", n, rb.SourceReplica, rb.Progress,
				display.Bytes(rb.BytesDone), display.Bytes(rb.BytesTotal), kind))
		}
	}
	if len(parts) == 0 {
		cond(v1.VolumeConditionRebuilding, false, v1.VolumeReasonNoRebuild, "no replica is being rebuilt")
		return
	}
	cond(v1.VolumeConditionRebuilding, true, v1.VolumeReasonRebuildInProgress, "rebuilding "+strings.Join(parts, "; "))
}

func engineState(e *v1.Engine) string {
	state := "not started"
	if e != nil && e.Status.InstanceState != "" {
		state = string(e.Status.InstanceState)
	}
	// What only a person can fix is said here, not only on the Engine.
	if c := engineReady(e); c != nil && c.Status != metav1.ConditionTrue && c.Reason == v1.ReasonEncryptionKeyUnusable {
		state += ": " + c.Message
	}
	return state
}

func engineReady(e *v1.Engine) *metav1.Condition {
	if e == nil {
		return nil
	}
	return meta.FindStatusCondition(e.Status.Conditions, v1.ConditionReady)
}

// robustness from the replicas whose processes run, until the engine's
// status stream has reported its replica modes (robustnessFromModes).
func robustness(state v1.VolumeState, running, want int) v1.VolumeRobustness {
	if state != v1.VolumeStateAttached {
		return v1.VolumeRobustnessUnknown
	}
	return robustnessOf(running, want)
}
