package volume

import (
	"testing"

	. "github.com/onsi/gomega"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
)

// The builders of TestComputeStatus's observations: a volume of three
// replicas at generation 4, replicas and engines as their reconcilers
// report them.

func statusVolume(node string) *v1.Volume {
	return &v1.Volume{ObjectMeta: metav1.ObjectMeta{Name: "v", Namespace: "default", Generation: 4},
		Spec: v1.VolumeSpec{Size: resource.MustParse("16Mi"), NumberOfReplicas: 3, NodeName: node}}
}

func statusReplica(name, node string, st v1.InstanceState) *v1.Replica {
	r := &v1.Replica{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default"}, Spec: v1.ReplicaSpec{VolumeName: "v", NodeName: node}}
	r.Status.InstanceState = st
	if st == v1.InstanceStateRunning {
		r.Status.Address, r.Status.ControlAddress = "10.0.0.1:1", "10.0.0.1:2"
	}
	return r
}

// threeReplicas are three scheduled replicas in state st.
func threeReplicas(st v1.InstanceState) []*v1.Replica {
	return []*v1.Replica{statusReplica("r1", "n1", st), statusReplica("r2", "n2", st), statusReplica("r3", "n3", st)}
}

func statusEngine(node string, st v1.InstanceState, modes ...v1.ReplicaMode) *v1.Engine {
	e := &v1.Engine{ObjectMeta: metav1.ObjectMeta{Name: "v-e", Namespace: "default"}, Spec: v1.EngineSpec{VolumeName: "v", NodeName: node}}
	e.Status.InstanceState = st
	if st == v1.InstanceStateRunning {
		e.Status.Endpoint = "/dev/loop7"
		size := resource.MustParse("16Mi")
		e.Status.Size = &size
	}
	for i, m := range modes {
		if e.Status.ReplicaModeMap == nil {
			e.Status.ReplicaModeMap = map[string]v1.ReplicaMode{}
		}
		e.Status.ReplicaModeMap[[]string{"r1", "r2", "r3"}[i]] = m
	}
	return e
}

// with returns x changed by f.
func with[T any](x T, f func(T)) T { f(x); return x }

// TestComputeStatus: from observed engine and replicas to the state,
// robustness and conditions `kubectl get volumes` shows.
func TestComputeStatus(t *testing.T) {
	const (
		RW  = v1.ReplicaModeRW
		WO  = v1.ReplicaModeWO
		ERR = v1.ReplicaModeERR
	)
	running, stopped := v1.InstanceStateRunning, v1.InstanceStateStopped
	for _, tc := range []struct {
		name       string
		s          *scope
		state      v1.VolumeState
		robustness v1.VolumeRobustness
		// ready is the Ready condition's reason, readyMsg part of its
		// message.
		ready, readyMsg string
		check           func(g *WithT, st *v1.VolumeStatus)
	}{
		{name: "no engine yet", s: &scope{v: statusVolume("")},
			state: v1.VolumeStateCreating, robustness: v1.VolumeRobustnessUnknown, ready: v1.VolumeReasonCreating,
			check: func(g *WithT, st *v1.VolumeStatus) {
				c := meta.FindStatusCondition(st.Conditions, v1.VolumeConditionScheduled)
				g.Expect(c.Reason).To(Equal(v1.ReasonReconciling))
				g.Expect(c.Message).To(Equal("0 of 3 replicas placed"))
			}},
		{name: "fewer replica objects than wanted", s: &scope{v: statusVolume(""), engine: statusEngine("", ""), replicas: threeReplicas("")[:2]},
			state: v1.VolumeStateCreating, robustness: v1.VolumeRobustnessUnknown, ready: v1.VolumeReasonCreating},
		{name: "scheduling failed", s: &scope{v: statusVolume(""), engine: statusEngine("", ""),
			replicas: []*v1.Replica{statusReplica("r1", "n1", ""), statusReplica("r2", "", ""), statusReplica("r3", "", "")},
			reason:   "no disk has 16Mi free"},
			state: v1.VolumeStateDetached, robustness: v1.VolumeRobustnessUnknown, ready: v1.VolumeReasonDetached,
			check: func(g *WithT, st *v1.VolumeStatus) {
				c := meta.FindStatusCondition(st.Conditions, v1.VolumeConditionScheduled)
				g.Expect(c.Status).To(Equal(metav1.ConditionFalse))
				g.Expect(c.Reason).To(Equal(v1.VolumeReasonReplicaSchedulingFailed))
				g.Expect(c.Message).To(Equal("no disk has 16Mi free"))
			}},
		{name: "detached", s: &scope{v: statusVolume(""), engine: statusEngine("", stopped), replicas: threeReplicas(stopped)},
			state: v1.VolumeStateDetached, robustness: v1.VolumeRobustnessUnknown, ready: v1.VolumeReasonDetached, readyMsg: "not attached to any node",
			check: func(g *WithT, st *v1.VolumeStatus) {
				g.Expect(meta.IsStatusConditionTrue(st.Conditions, v1.VolumeConditionScheduled)).To(BeTrue())
				g.Expect(st.Endpoint).To(BeEmpty())
				g.Expect(st.CurrentNodeName).To(BeEmpty())
			}},
		{name: "detaching: a process still runs", s: &scope{v: statusVolume(""), engine: statusEngine("n1", stopped), replicas: threeReplicas(running)},
			state: v1.VolumeStateDetaching, robustness: v1.VolumeRobustnessUnknown, ready: v1.VolumeReasonDetaching},
		{name: "attaching: replicas starting", s: &scope{v: statusVolume("n1"), engine: statusEngine("", ""),
			replicas: []*v1.Replica{statusReplica("r1", "n1", running), statusReplica("r2", "n2", v1.InstanceStateStarting), statusReplica("r3", "n3", "")}},
			state: v1.VolumeStateAttaching, robustness: v1.VolumeRobustnessUnknown, ready: v1.VolumeReasonAttaching,
			readyMsg: "attaching to n1: 1 of 3 scheduled replicas running, engine not started"},
		{name: "attaching: the engine's key cannot be used", s: &scope{v: statusVolume("n1"), replicas: threeReplicas(running),
			engine: with(statusEngine("n1", v1.InstanceStateError), func(e *v1.Engine) {
				meta.SetStatusCondition(&e.Status.Conditions, metav1.Condition{Type: v1.ConditionReady, Status: metav1.ConditionFalse,
					Reason: v1.ReasonEncryptionKeyUnusable, Message: "Secret k has no passphrase"})
			})},
			state: v1.VolumeStateAttaching, robustness: v1.VolumeRobustnessUnknown, ready: v1.ReasonEncryptionKeyUnusable,
			readyMsg: "engine error: Secret k has no passphrase"},
		{name: "attaching: the engine runs on another node", s: &scope{v: statusVolume("n2"), engine: statusEngine("n1", running, RW, RW, RW), replicas: threeReplicas(running)},
			state: v1.VolumeStateAttaching, robustness: v1.VolumeRobustnessUnknown, ready: v1.VolumeReasonAttaching},
		{name: "attaching: a maintenance engine on the user's node", s: &scope{v: statusVolume("n1"), replicas: threeReplicas(running),
			engine: with(statusEngine("n1", running, RW, RW, RW), func(e *v1.Engine) { e.Spec.Maintenance = true })},
			state: v1.VolumeStateAttaching, robustness: v1.VolumeRobustnessUnknown, ready: v1.VolumeReasonAttaching},
		{name: "attached, healthy", s: &scope{v: statusVolume("n1"), engine: statusEngine("n1", running, RW, RW, RW), replicas: threeReplicas(running)},
			state: v1.VolumeStateAttached, robustness: v1.VolumeRobustnessHealthy, ready: v1.ReasonAsExpected, readyMsg: "attached to n1 at /dev/loop7",
			check: func(g *WithT, st *v1.VolumeStatus) {
				g.Expect(st.Endpoint).To(Equal("/dev/loop7"))
				g.Expect(st.CurrentNodeName).To(Equal("n1"))
				g.Expect(st.Size.String()).To(Equal("16Mi"))
				g.Expect(meta.FindStatusCondition(st.Conditions, v1.VolumeConditionRebuilding).Reason).To(Equal(v1.VolumeReasonNoRebuild))
			}},
		{name: "attached, one replica rebuilding", s: &scope{v: statusVolume("n1"), replicas: threeReplicas(running),
			engine: with(statusEngine("n1", running, RW, RW, WO), func(e *v1.Engine) {
				e.Status.RebuildStatus = map[string]v1.RebuildStatus{
					"r3": {State: v1.RebuildStateInProgress, SourceReplica: "r1", Progress: 50, BytesDone: 8 << 20, BytesTotal: 16 << 20},
					"r0": {State: v1.RebuildStateComplete, SourceReplica: "r1"},
				}
			})},
			state: v1.VolumeStateAttached, robustness: v1.VolumeRobustnessDegraded, ready: v1.ReasonAsExpected,
			check: func(g *WithT, st *v1.VolumeStatus) {
				c := meta.FindStatusCondition(st.Conditions, v1.VolumeConditionRebuilding)
				g.Expect(c.Status).To(Equal(metav1.ConditionTrue))
				g.Expect(c.Reason).To(Equal(v1.VolumeReasonRebuildInProgress))
				g.Expect(c.Message).To(Equal("rebuilding r3 from r1: 50% (8.0 MiB of 16.0 MiB, full copy)"))
			}},
		{name: "attached, modes not reported yet: robustness from running replicas", s: &scope{v: statusVolume("n1"), engine: statusEngine("n1", running),
			replicas: []*v1.Replica{statusReplica("r1", "n1", running), statusReplica("r2", "n2", running), statusReplica("r3", "n3", stopped)}},
			state: v1.VolumeStateAttached, robustness: v1.VolumeRobustnessDegraded, ready: v1.ReasonAsExpected},
		{name: "attached, faulted: salvaging", s: &scope{v: statusVolume("n1"), engine: statusEngine("n1", running, ERR, ERR, ERR), replicas: threeReplicas(running)},
			state: v1.VolumeStateAttached, robustness: v1.VolumeRobustnessFaulted, ready: v1.VolumeReasonFaulted, readyMsg: "no replica is RW"},
		{name: "attached, faulted: the salvage waits", s: &scope{v: statusVolume("n1"), engine: statusEngine("n1", running, ERR, ERR), replicas: threeReplicas(running),
			salvageWait: "salvage waits for r3 on n3"},
			state: v1.VolumeStateAttached, robustness: v1.VolumeRobustnessFaulted, ready: v1.VolumeReasonFaulted, readyMsg: "salvage waits for r3 on n3"},
		{name: "detached, running for a snapshot", s: &scope{v: statusVolume(""), engine: with(statusEngine("n2", running, RW, RW, RW), func(e *v1.Engine) { e.Spec.Maintenance = true }),
			replicas: threeReplicas(running), work: "taking snapshot s1"},
			state: v1.VolumeStateDetached, robustness: v1.VolumeRobustnessUnknown, ready: v1.VolumeReasonDetached,
			readyMsg: "an engine without a device are run on n2 for taking snapshot s1 (3 of 3 scheduled replicas running, engine running)"},
		{name: "attach waits for the clone's copy", s: &scope{v: with(statusVolume("n1"), func(v *v1.Volume) { v.Spec.DataSource = &v1.VolumeDataSource{Volume: "src"} }),
			engine: statusEngine("", ""), replicas: threeReplicas(running),
			clone: &v1.CloneStatus{State: v1.CloneStateCopying, SourceVolume: "src", Message: "copying snapshot clone-v of volume src: 40%"}},
			state: v1.VolumeStateAttaching, robustness: v1.VolumeRobustnessUnknown, ready: v1.VolumeReasonAttaching,
			readyMsg: "waits for the copy from the data source to complete: copying snapshot clone-v of volume src: 40%",
			check: func(g *WithT, st *v1.VolumeStatus) {
				c := meta.FindStatusCondition(st.Conditions, v1.VolumeConditionCloned)
				g.Expect(c.Status).To(Equal(metav1.ConditionFalse))
				g.Expect(c.Reason).To(Equal(v1.VolumeReasonCloneInProgress))
				g.Expect(st.Clone.State).To(Equal(v1.CloneStateCopying))
			}},
		{name: "a clone that failed", s: &scope{v: with(statusVolume(""), func(v *v1.Volume) { v.Spec.DataSource = &v1.VolumeDataSource{Volume: "gone"} }),
			engine: statusEngine("", ""), replicas: threeReplicas(""),
			clone: &v1.CloneStatus{State: v1.CloneStateFailed, SourceVolume: "gone", Message: "source volume gone does not exist"}},
			state: v1.VolumeStateDetached, robustness: v1.VolumeRobustnessUnknown, ready: v1.VolumeReasonDetached,
			check: func(g *WithT, st *v1.VolumeStatus) {
				c := meta.FindStatusCondition(st.Conditions, v1.VolumeConditionCloned)
				g.Expect(c.Reason).To(Equal(v1.VolumeReasonCloneFailed))
				g.Expect(c.Message).To(Equal("source volume gone does not exist"))
			}},
		{name: "a clone complete, attached", s: &scope{v: with(statusVolume("n1"), func(v *v1.Volume) {
			v.Spec.DataSource = &v1.VolumeDataSource{Volume: "src"}
			v.Annotations = map[string]string{"storage.cairn.io/cloned": "src/clone-v"}
		}), engine: statusEngine("n1", running, RW, RW, RW), replicas: threeReplicas(running),
			clone: &v1.CloneStatus{State: v1.CloneStateCompleted, SourceVolume: "src", Progress: 100, Message: "copied"}},
			state: v1.VolumeStateAttached, robustness: v1.VolumeRobustnessHealthy, ready: v1.ReasonAsExpected,
			check: func(g *WithT, st *v1.VolumeStatus) {
				g.Expect(meta.IsStatusConditionTrue(st.Conditions, v1.VolumeConditionCloned)).To(BeTrue())
			}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			computeStatus(tc.s)
			st := &tc.s.v.Status
			g.Expect(st.ObservedGeneration).To(Equal(int64(4)))
			g.Expect(st.State).To(Equal(tc.state))
			g.Expect(st.Robustness).To(Equal(tc.robustness))
			ready := meta.FindStatusCondition(st.Conditions, v1.ConditionReady)
			g.Expect(ready).NotTo(BeNil())
			g.Expect(ready.Reason).To(Equal(tc.ready))
			g.Expect(ready.Status == metav1.ConditionTrue).To(Equal(tc.state == v1.VolumeStateAttached && tc.robustness != v1.VolumeRobustnessFaulted))
			g.Expect(ready.Message).To(ContainSubstring(tc.readyMsg))
			g.Expect(ready.ObservedGeneration).To(Equal(int64(4)))
			if tc.check != nil {
				tc.check(g, st)
			}
		})
	}
}

// TestComputeStatusKeepsTransitionTime: recomputing an unchanged status
// changes nothing, not even a condition's lastTransitionTime, so a settled
// volume's status patch is empty.
func TestComputeStatusKeepsTransitionTime(t *testing.T) {
	g := NewWithT(t)
	s := &scope{v: statusVolume("n1"), engine: statusEngine("n1", v1.InstanceStateRunning, v1.ReplicaModeRW, v1.ReplicaModeRW, v1.ReplicaModeRW),
		replicas: threeReplicas(v1.InstanceStateRunning)}
	computeStatus(s)
	for i := range s.v.Status.Conditions {
		s.v.Status.Conditions[i].LastTransitionTime = metav1.Unix(1000, 0)
	}
	before := s.v.Status.DeepCopy()
	s2 := &scope{v: s.v, engine: s.engine, replicas: s.replicas}
	computeStatus(s2)
	g.Expect(s2.v.Status).To(Equal(*before))
}
