package instancemanager

import (
	"testing"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
)

// The node "n1" rolled: its new pod is at 10.0.0.9 (the old one was at
// 10.0.0.1). Volume "v" has replicas r1 on n1, r2 on n2, r3 on n3, and its
// engine runs on n2. The fixtures are the state once n1 serves again;
// each case breaks one fact.
const (
	newHost = "10.0.0.9"
	oldHost = "10.0.0.1"
)

func gatePod() *corev1.Pod {
	return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "im-pod", Namespace: "ns"},
		Spec: corev1.PodSpec{NodeName: "n1", ReadinessGates: []corev1.PodReadinessGate{{ConditionType: v1.PodConditionVolumesReady}},
			Containers: []corev1.Container{{Name: "im", Ports: []corev1.ContainerPort{{Name: PortName, ContainerPort: 8500}}}}},
		Status: corev1.PodStatus{PodIP: newHost, Conditions: []corev1.PodCondition{{Type: corev1.ContainersReady, Status: corev1.ConditionTrue}},
			ContainerStatuses: []corev1.ContainerStatus{{Name: "im", ContainerID: "containerd://b"}}}}
}

func gateIM() *v1.InstanceManager {
	return &v1.InstanceManager{ObjectMeta: metav1.ObjectMeta{Name: "im-n1", Namespace: "ns", Generation: 2, Labels: map[string]string{LabelDiscovered: "true"}},
		Spec: v1.InstanceManagerSpec{NodeName: "n1", Address: newHost + ":8500"},
		Status: v1.InstanceManagerStatus{ObservedGeneration: 2, State: v1.InstanceManagerStateRunning, Processes: []v1.ProcessStatus{
			{Name: "ns/r1", Kind: v1.ProcessKindReplica, State: v1.InstanceStateRunning},
			{Name: "ns/w-e", Kind: v1.ProcessKindEngine, State: v1.InstanceStateRunning},
			{Name: "ns/w-r1", Kind: v1.ProcessKindReplica, State: v1.InstanceStateRunning}}}}
}

func gateReplica(name, vol, node, host string) v1.Replica {
	return v1.Replica{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ns"},
		Spec: v1.ReplicaSpec{VolumeName: vol, NodeName: node, Size: resource.MustParse("1Gi"), DesiredState: v1.DesiredInstanceStateRunning},
		Status: v1.ReplicaStatus{InstanceState: v1.InstanceStateRunning, InstanceManagerName: "im-" + node,
			Address: host + ":10001", ControlAddress: host + ":10000"}}
}

func addrOf(r v1.Replica) v1.ReplicaAddress {
	return v1.ReplicaAddress{Data: r.Status.Address, Control: r.Status.ControlAddress}
}

// gateFixture: volume v (engine on n2, replicas on n1..n3) and volume w
// (engine and one replica w-r1 on n1, one w-r2 on n2), all served.
func gateFixture() gateFacts {
	reps := []v1.Replica{gateReplica("r1", "v", "n1", newHost), gateReplica("r2", "v", "n2", "10.0.0.2"), gateReplica("r3", "v", "n3", "10.0.0.3"),
		gateReplica("w-r1", "w", "n1", newHost), gateReplica("w-r2", "w", "n2", "10.0.0.2")}
	ev := v1.Engine{ObjectMeta: metav1.ObjectMeta{Name: "v-e", Namespace: "ns"},
		Spec: v1.EngineSpec{VolumeName: "v", NodeName: "n2", DesiredState: v1.DesiredInstanceStateRunning,
			ReplicaAddresses: map[string]v1.ReplicaAddress{"r1": addrOf(reps[0]), "r2": addrOf(reps[1]), "r3": addrOf(reps[2])}},
		Status: v1.EngineStatus{InstanceState: v1.InstanceStateRunning, InstanceManagerName: "im-n2", Address: "10.0.0.2:10010",
			ReplicaModeMap: map[string]v1.ReplicaMode{"r1": v1.ReplicaModeRW, "r2": v1.ReplicaModeRW, "r3": v1.ReplicaModeRW}}}
	ew := v1.Engine{ObjectMeta: metav1.ObjectMeta{Name: "w-e", Namespace: "ns"},
		Spec: v1.EngineSpec{VolumeName: "w", NodeName: "n1", DesiredState: v1.DesiredInstanceStateRunning,
			ReplicaAddresses: map[string]v1.ReplicaAddress{"w-r1": addrOf(reps[3]), "w-r2": addrOf(reps[4])}},
		Status: v1.EngineStatus{InstanceState: v1.InstanceStateRunning, InstanceManagerName: "im-n1", Address: newHost + ":10020",
			ReplicaModeMap: map[string]v1.ReplicaMode{"w-r1": v1.ReplicaModeRW, "w-r2": v1.ReplicaModeRW}}}
	vols := []v1.Volume{{ObjectMeta: metav1.ObjectMeta{Name: "v", Namespace: "ns"}, Spec: v1.VolumeSpec{NumberOfReplicas: 3}},
		{ObjectMeta: metav1.ObjectMeta{Name: "w", Namespace: "ns"}, Spec: v1.VolumeSpec{NumberOfReplicas: 2}}}
	return gateFacts{pod: gatePod(), im: gateIM(), volumes: vols, engines: []v1.Engine{ev, ew}, replicas: reps}
}

func (f gateFacts) engine(name string) *v1.Engine {
	for i := range f.engines {
		if f.engines[i].Name == name {
			return &f.engines[i]
		}
	}
	panic(name)
}

func (f gateFacts) replica(name string) *v1.Replica {
	for i := range f.replicas {
		if f.replicas[i].Name == name {
			return &f.replicas[i]
		}
	}
	panic(name)
}

func (f gateFacts) process(name string) *v1.ProcessStatus {
	for i := range f.im.Status.Processes {
		if f.im.Status.Processes[i].Name == name {
			return &f.im.Status.Processes[i]
		}
	}
	panic(name)
}

func TestDecideGate(t *testing.T) {
	for _, tc := range []struct {
		name   string
		change func(f *gateFacts)
		reason string
	}{
		{"every engine and replica on the node serves", func(*gateFacts) {}, v1.GateReasonVolumesServed},
		{"nothing on the node", func(f *gateFacts) { f.engines, f.replicas, f.im.Status.Processes = nil, nil, nil }, v1.GateReasonVolumesServed},
		{"the container is not ready", func(f *gateFacts) { f.pod.Status.Conditions[0].Status = corev1.ConditionFalse }, v1.GateReasonWaitingForInstanceManager},
		{"the pod has no IP yet", func(f *gateFacts) { f.pod.Status.PodIP = "" }, v1.GateReasonWaitingForInstanceManager},
		{"no InstanceManager yet", func(f *gateFacts) { f.im = nil }, v1.GateReasonWaitingForInstanceManager},
		{"the InstanceManager names the old pod", func(f *gateFacts) { f.im.Spec.Address = oldHost + ":8500" }, v1.GateReasonWaitingForInstanceManager},
		{"the InstanceManager's status is of its previous address", func(f *gateFacts) { f.im.Status.ObservedGeneration = 1 }, v1.GateReasonWaitingForInstanceManager},
		{"the manager does not reach the instance manager", func(f *gateFacts) { f.im.Status.State = v1.InstanceManagerStateUnknown }, v1.GateReasonWaitingForInstanceManager},
		{"one written by hand at another address, running", func(f *gateFacts) {
			delete(f.im.Labels, LabelDiscovered)
			f.im.Spec.Address = newHost + ":9000"
		}, v1.GateReasonVolumesServed},
		{"an engine on the node has no process yet", func(f *gateFacts) { f.process("ns/w-e").State = v1.InstanceStateStarting }, v1.GateReasonWaitingForEngine},
		{"an engine's status is still the old pod's", func(f *gateFacts) { f.engine("w-e").Status.Address = oldHost + ":10020" }, v1.GateReasonWaitingForEngine},
		{"an engine's status is not running yet", func(f *gateFacts) { f.engine("w-e").Status.InstanceState = v1.InstanceStateStarting }, v1.GateReasonWaitingForEngine},
		{"an engine on the node without an RW replica", func(f *gateFacts) {
			f.engine("w-e").Status.ReplicaModeMap = map[string]v1.ReplicaMode{"w-r1": v1.ReplicaModeERR, "w-r2": v1.ReplicaModeERR}
		}, v1.GateReasonWaitingForEngine},
		{"an engine asked to stop is not waited for", func(f *gateFacts) {
			e := f.engine("w-e")
			e.Spec.DesiredState, e.Status.InstanceState = v1.DesiredInstanceStateStopped, v1.InstanceStateStopped
		}, v1.GateReasonVolumesServed},
		{"a replica's process does not run yet", func(f *gateFacts) { f.process("ns/r1").State = v1.InstanceStateStarting }, v1.GateReasonWaitingForReplica},
		{"a replica's status is still the old pod's, and the engine still says RW there", func(f *gateFacts) {
			old := gateReplica("r1", "v", "n1", oldHost)
			f.replica("r1").Status = old.Status
			f.engine("v-e").Spec.ReplicaAddresses["r1"] = addrOf(old)
		}, v1.GateReasonWaitingForReplica},
		{"the engine still names the replica's old address", func(f *gateFacts) {
			f.engine("v-e").Spec.ReplicaAddresses["r1"] = addrOf(gateReplica("r1", "v", "n1", oldHost))
			f.engine("v-e").Status.ReplicaModeMap["r1"] = v1.ReplicaModeERR
		}, v1.GateReasonWaitingForReplica},
		{"the replica is being rebuilt", func(f *gateFacts) {
			f.engine("v-e").Status.ReplicaModeMap["r1"] = v1.ReplicaModeWO
			f.engine("v-e").Status.RebuildStatus = map[string]v1.RebuildStatus{"r1": {Progress: 40, BytesTotal: 1 << 20}}
		}, v1.GateReasonWaitingForReplica},
		{"the replica is not in the engine's map yet", func(f *gateFacts) { delete(f.engine("v-e").Status.ReplicaModeMap, "r1") }, v1.GateReasonWaitingForReplica},
		{"the engine's state is unknown", func(f *gateFacts) { f.engine("v-e").Status.InstanceState = v1.InstanceStateUnknown }, v1.GateReasonWaitingForReplica},
		{"the volume does not need the replica: as many RW elsewhere as it asks for", func(f *gateFacts) {
			f.volumes[0].Spec.NumberOfReplicas = 2
			f.engine("v-e").Status.ReplicaModeMap["r1"] = v1.ReplicaModeERR
		}, v1.GateReasonVolumesServed},
		{"a replacement elsewhere is RW: the volume has three without it", func(f *gateFacts) {
			r4 := gateReplica("r4", "v", "n4", "10.0.0.4")
			f.replicas = append(f.replicas, r4)
			e := f.engine("v-e")
			e.Spec.ReplicaAddresses["r4"], e.Status.ReplicaModeMap["r4"], e.Status.ReplicaModeMap["r1"] = addrOf(r4), v1.ReplicaModeRW, v1.ReplicaModeERR
			f.process("ns/r1").State = v1.InstanceStateError
		}, v1.GateReasonVolumesServed},
		{"the volume's engine is starting: it opens the replicas where they run", func(f *gateFacts) {
			f.engine("v-e").Status.InstanceState = v1.InstanceStateStarting
			f.process("ns/r1").State = v1.InstanceStateStarting
		}, v1.GateReasonVolumesServed},
		{"the volume is detached", func(f *gateFacts) {
			f.engine("v-e").Spec.DesiredState = v1.DesiredInstanceStateStopped
			f.process("ns/r1").State = v1.InstanceStateError
		}, v1.GateReasonVolumesServed},
		{"a replica asked to stop is not waited for", func(f *gateFacts) {
			f.replica("r1").Spec.DesiredState = v1.DesiredInstanceStateStopped
			f.engine("v-e").Status.ReplicaModeMap["r1"] = v1.ReplicaModeERR
		}, v1.GateReasonVolumesServed},
		{"a replica being deleted is not waited for", func(f *gateFacts) {
			f.replica("r1").DeletionTimestamp = &metav1.Time{}
			f.engine("v-e").Status.ReplicaModeMap["r1"] = v1.ReplicaModeERR
		}, v1.GateReasonVolumesServed},
		{"a replica on another node is another pod's matter", func(f *gateFacts) {
			f.engine("v-e").Status.ReplicaModeMap["r3"] = v1.ReplicaModeERR
		}, v1.GateReasonVolumesServed},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			f := gateFixture()
			tc.change(&f)
			d := decideGate(f)
			g.Expect(d.reason).To(Equal(tc.reason), d.message)
			g.Expect(d.ready).To(Equal(tc.reason == v1.GateReasonVolumesServed))
			g.Expect(d.message).NotTo(BeEmpty())
		})
	}
}

// TestDecideGateMessages: what a waiting gate says names the object and
// what it waits for.
func TestDecideGateMessages(t *testing.T) {
	g := NewWithT(t)
	f := gateFixture()
	f.engine("v-e").Status.ReplicaModeMap["r1"] = v1.ReplicaModeWO
	f.engine("v-e").Status.RebuildStatus = map[string]v1.RebuildStatus{"r1": {Progress: 40, BytesTotal: 1 << 20}}
	g.Expect(decideGate(f).message).To(Equal("replica r1 of volume v is not RW in engine v-e again: being rebuilt: 40% of 1048576 bytes"))
	f = gateFixture()
	f.im.Spec.Address = oldHost + ":8500"
	g.Expect(decideGate(f).message).To(Equal(`InstanceManager im-n1 names "10.0.0.1:8500", not this pod's 10.0.0.9:8500, yet`))
}

func TestGateSettled(t *testing.T) {
	withGate := func(status corev1.ConditionStatus, readyFor, run string) *corev1.Pod {
		p := gatePod()
		p.Status.Conditions = append(p.Status.Conditions, corev1.PodCondition{Type: v1.PodConditionVolumesReady, Status: status})
		if readyFor != "" {
			p.Annotations = map[string]string{AnnotationVolumesReadyFor: readyFor}
		}
		p.Status.ContainerStatuses[0].ContainerID = run
		return p
	}
	for _, tc := range []struct {
		name string
		pod  *corev1.Pod
		want bool
	}{
		{"no condition yet", gatePod(), false},
		{"False", withGate(corev1.ConditionFalse, "", "containerd://b"), false},
		{"True for this run of the containers", withGate(corev1.ConditionTrue, "containerd://b", "containerd://b"), true},
		{"True for a run before a container restart", withGate(corev1.ConditionTrue, "containerd://a", "containerd://b"), false},
		{"True, set by hand", withGate(corev1.ConditionTrue, "", "containerd://b"), true},
		{"True, a container without an ID for now", withGate(corev1.ConditionTrue, "containerd://a", ""), true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			NewWithT(t).Expect(gateSettled(tc.pod)).To(Equal(tc.want))
		})
	}
}
