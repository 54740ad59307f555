package instancemanager

import (
	"cmp"
	"fmt"
	"net"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/internal/process"
)

// The readiness gate of the instance-manager DaemonSet's pods
// (v1.PodConditionVolumesReady) keeps a rolling update of the DaemonSet
// from restarting the next node's instance manager while the previous
// node's volumes are still without their replicas there: with
// maxUnavailable 1, the DaemonSet controller replaces the next old pod
// only once the new one is Ready, and a pod is Ready only once every
// readiness gate is True.
//
// The gate holds for the run of the pod's containers it was decided for
// (AnnotationVolumesReadyFor records which). A gate that went back to
// False while those containers run would make an old pod unavailable,
// and the DaemonSet controller replaces an unavailable old pod at once,
// whatever maxUnavailable says: restarting its instance manager while
// another node's replicas are being rebuilt. So the gate goes back to
// False only when the pod's containers restarted, which has already
// restarted every process of that node.

// AnnotationVolumesReadyFor, on an instance-manager pod, is the run of
// its containers (their container IDs) for which the manager set the
// gate True. A pod whose gate is True without it (set by hand, to let a
// stuck rollout go on) is left alone.
const AnnotationVolumesReadyFor = "storage.cairn.io/volumes-ready-for"

// gateFacts are what the gate of one pod is decided from.
type gateFacts struct {
	pod *corev1.Pod
	// im is the InstanceManager of the pod's node (nil: none yet).
	im       *v1.InstanceManager
	volumes  []v1.Volume
	engines  []v1.Engine
	replicas []v1.Replica
}

// gateDecision is the gate's status, reason and message.
type gateDecision struct {
	ready           bool
	reason, message string
}

func waiting(reason, format string, args ...any) gateDecision {
	return gateDecision{reason: reason, message: fmt.Sprintf(format, args...)}
}

// decideGate says whether the pod's instance manager serves its node's
// volumes again: the manager reaches it at the pod's address; every
// engine that is to run on the node runs there with an RW replica; and
// every replica that is to run on the node runs there and is RW in its
// volume's running engine at its current address, unless that engine
// already holds as many RW replicas on other nodes as the volume asks
// for (then the volume does not need it). A replica whose volume's engine
// does not run (stopped, failed, starting) is not waited for: nothing
// serves from it yet; one whose engine's state is unknown is.
func decideGate(f gateFacts) gateDecision {
	node := f.pod.Spec.NodeName
	addr, ok := podAddress(f.pod)
	if !ok {
		return waiting(v1.GateReasonWaitingForInstanceManager, "the instance manager's container on %s is not ready", node)
	}
	if d, ok := imServes(f.im, node, addr); !ok {
		return d
	}
	host := hostOf(f.im.Spec.Address)
	procs := map[string]v1.ProcessStatus{}
	for _, p := range f.im.Status.Processes {
		procs[p.Name] = p
	}
	engineOf := map[string]*v1.Engine{}
	for i := range f.engines {
		engineOf[f.engines[i].Spec.VolumeName] = &f.engines[i]
	}
	engines, replicas := 0, 0
	for _, e := range sortedByName(f.engines, func(e *v1.Engine) bool {
		return wanted(e.Spec.NodeName, e.Spec.DesiredState, e.DeletionTimestamp == nil, node)
	}) {
		if d, ok := engineServes(e, procs[process.Name(e)], f.im, host); !ok {
			return d
		}
		engines++
	}
	rs := &replicaSet{byName: map[string]*v1.Replica{}, want: map[string]int{}}
	for i := range f.replicas {
		rs.byName[f.replicas[i].Name] = &f.replicas[i]
	}
	for i := range f.volumes {
		if n := f.volumes[i].Spec.NumberOfReplicas; n > 0 {
			rs.want[f.volumes[i].Name] = int(n)
		}
	}
	for _, r := range sortedByName(f.replicas, func(r *v1.Replica) bool {
		return wanted(r.Spec.NodeName, r.Spec.DesiredState, r.DeletionTimestamp == nil, node)
	}) {
		if d, ok := rs.serves(r, engineOf[r.Spec.VolumeName], procs[process.Name(r)], f.im, host); !ok {
			return d
		}
		replicas++
	}
	return gateDecision{ready: true, reason: v1.GateReasonVolumesServed,
		message: fmt.Sprintf("the instance manager at %s serves node %s's volumes: %d engines and %d replicas run, every replica RW or not needed", addr, node, engines, replicas)}
}

// wanted: an object that is to run on node.
func wanted(objNode string, desired v1.DesiredInstanceState, live bool, node string) bool {
	return live && objNode == node && desired == v1.DesiredInstanceStateRunning
}

func sortedByName[T any, P interface {
	*T
	GetName() string
}](items []T, keep func(P) bool) []P {
	var out []P
	for i := range items {
		if p := P(&items[i]); keep(p) {
			out = append(out, p)
		}
	}
	slices.SortFunc(out, func(a, b P) int { return cmp.Compare(a.GetName(), b.GetName()) })
	return out
}

// imServes: the node's InstanceManager names this pod (a discovered one;
// one written by hand names the operator's address) and the manager's
// watch of it is current.
func imServes(im *v1.InstanceManager, node, addr string) (gateDecision, bool) {
	switch {
	case im == nil:
		return waiting(v1.GateReasonWaitingForInstanceManager, "no InstanceManager for node %s yet", node), false
	case im.Labels[LabelDiscovered] == "true" && im.Spec.Address != addr:
		return waiting(v1.GateReasonWaitingForInstanceManager, "InstanceManager %s names %q, not this pod's %s, yet", im.Name, im.Spec.Address, addr), false
	case im.Status.ObservedGeneration != im.Generation || im.Status.State != v1.InstanceManagerStateRunning:
		return waiting(v1.GateReasonWaitingForInstanceManager, "the manager does not reach the instance manager at %s yet (InstanceManager %s: %s)",
			im.Spec.Address, im.Name, cmp.Or(string(im.Status.State), "no status")), false
	}
	return gateDecision{}, true
}

// engineServes: the engine's process runs on this instance manager, its
// object says so at an address of this pod, and it holds an RW replica.
func engineServes(e *v1.Engine, p v1.ProcessStatus, im *v1.InstanceManager, host string) (gateDecision, bool) {
	if p.State != v1.InstanceStateRunning {
		return waiting(v1.GateReasonWaitingForEngine, "engine %s of volume %s does not run on the instance manager yet (%s)",
			e.Name, e.Spec.VolumeName, cmp.Or(string(p.State), "no process")), false
	}
	if e.Status.InstanceState != v1.InstanceStateRunning || e.Status.InstanceManagerName != im.Name || hostOf(e.Status.Address) != host {
		return waiting(v1.GateReasonWaitingForEngine, "engine %s of volume %s: its status does not report it running at %s yet", e.Name, e.Spec.VolumeName, host), false
	}
	for _, m := range e.Status.ReplicaModeMap {
		if m == v1.ReplicaModeRW {
			return gateDecision{}, true
		}
	}
	return waiting(v1.GateReasonWaitingForEngine, "engine %s of volume %s runs without an RW replica", e.Name, e.Spec.VolumeName), false
}

// replicaSet is what a replica's check needs of the others.
type replicaSet struct {
	byName map[string]*v1.Replica
	// want is each volume's numberOfReplicas, where set.
	want map[string]int
}

// serves: the replica runs on this instance manager and its volume's
// running engine holds it RW at its current address, or the volume does
// not need it (no engine to serve, or enough RW replicas elsewhere).
//
// The engine is given a replica's new address only once it no longer
// holds the replica RW or WO (planRepair), and an ERR replica becomes RW
// only through a rebuild, so RW at the address of this pod's process is
// RW after this pod's start, never a mode left from before it.
func (rs *replicaSet) serves(r *v1.Replica, e *v1.Engine, p v1.ProcessStatus, im *v1.InstanceManager, host string) (gateDecision, bool) {
	switch {
	case e == nil || e.DeletionTimestamp != nil || e.Spec.DesiredState != v1.DesiredInstanceStateRunning:
		return gateDecision{}, true
	case e.Status.InstanceState == v1.InstanceStateUnknown:
		return waiting(v1.GateReasonWaitingForReplica, "the state of engine %s of volume %s is unknown (its instance manager is not reachable): replica %s may be needed",
			e.Name, r.Spec.VolumeName, r.Name), false
	case e.Status.InstanceState != v1.InstanceStateRunning:
		// Nothing serves from it now: an engine on this node is checked
		// on its own, and one that starts opens the replicas where they
		// run.
		return gateDecision{}, true
	}
	if rs.rwElsewhere(e, r.Spec.NodeName) >= rs.wantOf(r.Spec.VolumeName) {
		return gateDecision{}, true
	}
	if p.State != v1.InstanceStateRunning || r.Status.InstanceState != v1.InstanceStateRunning ||
		r.Status.InstanceManagerName != im.Name || hostOf(r.Status.ControlAddress) != host {
		return waiting(v1.GateReasonWaitingForReplica, "replica %s of volume %s does not run on the instance manager at %s yet (%s)",
			r.Name, r.Spec.VolumeName, host, cmp.Or(string(p.State), "no process")), false
	}
	given, ok := e.Spec.ReplicaAddresses[r.Name]
	mode := e.Status.ReplicaModeMap[r.Name]
	if ok && r.Status.ServesAt(given) && mode == v1.ReplicaModeRW {
		return gateDecision{}, true
	}
	what := "not given to the engine at its current address yet"
	switch {
	case ok && given.Control == r.Status.ControlAddress && mode == v1.ReplicaModeWO:
		rb := e.Status.RebuildStatus[r.Name]
		what = fmt.Sprintf("being rebuilt: %d%% of %d bytes", rb.Progress, rb.BytesTotal)
	case ok && given.Control == r.Status.ControlAddress:
		what = "mode " + cmp.Or(string(mode), "none yet")
	}
	return waiting(v1.GateReasonWaitingForReplica, "replica %s of volume %s is not RW in engine %s again: %s", r.Name, r.Spec.VolumeName, e.Name, what), false
}

// rwElsewhere counts the RW replicas of e that are not on node.
func (rs *replicaSet) rwElsewhere(e *v1.Engine, node string) int {
	n := 0
	for name, m := range e.Status.ReplicaModeMap {
		if r := rs.byName[name]; m == v1.ReplicaModeRW && r != nil && r.Spec.NodeName != node {
			n++
		}
	}
	return n
}

// wantOf is the volume's numberOfReplicas; the CRD's default (3) for a
// volume not found or not defaulted.
func (rs *replicaSet) wantOf(volume string) int {
	if w, ok := rs.want[volume]; ok {
		return w
	}
	return 3
}

// hostOf is the host of host:port ("" when it is not one).
func hostOf(addr string) string {
	h, _, err := net.SplitHostPort(addr)
	if err != nil {
		return ""
	}
	return h
}

// hasGate: the pod's spec asks for the gate.
func hasGate(p *corev1.Pod) bool {
	for _, g := range p.Spec.ReadinessGates {
		if string(g.ConditionType) == v1.PodConditionVolumesReady {
			return true
		}
	}
	return false
}

func gateCondition(p *corev1.Pod) *corev1.PodCondition {
	for i := range p.Status.Conditions {
		if string(p.Status.Conditions[i].Type) == v1.PodConditionVolumesReady {
			return &p.Status.Conditions[i]
		}
	}
	return nil
}

// containersRun identifies the current run of the pod's containers (their
// IDs); "" while one has none yet.
func containersRun(p *corev1.Pod) string {
	ids := make([]string, 0, len(p.Status.ContainerStatuses))
	for _, cs := range p.Status.ContainerStatuses {
		if cs.ContainerID == "" {
			return ""
		}
		ids = append(ids, cs.ContainerID)
	}
	slices.Sort(ids)
	return strings.Join(ids, ",")
}

// gateSettled: the gate is True for the current run of the pod's
// containers (or was set True by hand), so it is not decided again.
func gateSettled(p *corev1.Pod) bool {
	c := gateCondition(p)
	if c == nil || c.Status != corev1.ConditionTrue {
		return false
	}
	was, run := p.Annotations[AnnotationVolumesReadyFor], containersRun(p)
	return was == "" || run == "" || was == run
}
