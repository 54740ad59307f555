package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// InstanceManagerState is the observed state of a node's instance manager.
// +kubebuilder:validation:Enum=starting;running;stopped;error;unknown
type InstanceManagerState string

const (
	// InstanceManagerStateStarting means its pod exists and the gRPC service
	// does not answer yet.
	InstanceManagerStateStarting InstanceManagerState = "starting"
	// InstanceManagerStateRunning means the gRPC service answers and the
	// process list in status is current.
	InstanceManagerStateRunning InstanceManagerState = "running"
	// InstanceManagerStateStopped means no instance manager runs on the node.
	InstanceManagerStateStopped InstanceManagerState = "stopped"
	// InstanceManagerStateError means it runs but reports an error.
	InstanceManagerStateError InstanceManagerState = "error"
	// InstanceManagerStateUnknown means it cannot be reached; the states of
	// its processes are unknown too.
	InstanceManagerStateUnknown InstanceManagerState = "unknown"
)

// ProcessKind is the kind of data-plane process an instance manager runs.
// +kubebuilder:validation:Enum=engine;replica
type ProcessKind string

const (
	// ProcessKindEngine is a `cairn-data engine` process.
	ProcessKindEngine ProcessKind = "engine"
	// ProcessKindReplica is a `cairn-data replica` process.
	ProcessKindReplica ProcessKind = "replica"
)

// InstanceManagerSpec says where a node's instance manager runs.
type InstanceManagerSpec struct {
	// nodeName is the Kubernetes node the instance manager runs on.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	NodeName string `json:"nodeName"`

	// image is the container image of the data plane (cairn-data) it runs.
	// +optional
	Image string `json:"image,omitempty"`

	// address is the host:port of its gRPC service.
	// +optional
	// +kubebuilder:validation:MaxLength=261
	Address string `json:"address,omitempty"`
}

// ProcessStatus is one process an instance manager supervises.
type ProcessStatus struct {
	// name is the process name: the Engine or Replica object's name.
	// +required
	// +kubebuilder:validation:MinLength=1
	Name string `json:"name"`

	// kind is engine or replica.
	// +optional
	Kind ProcessKind `json:"kind,omitempty"`

	// state is the process state.
	// +optional
	State InstanceState `json:"state,omitempty"`

	// ports are the TCP ports allocated to the process.
	// +optional
	// +listType=atomic
	Ports []int32 `json:"ports,omitempty"`

	// exitCode is the exit status of a process that exited.
	// +optional
	ExitCode *int32 `json:"exitCode,omitempty"`

	// error says why a process is in state error, with the last lines of its log.
	// +optional
	Error string `json:"error,omitempty"`
}

// InstanceManagerStatus is what the InstanceManager reconciler observed.
type InstanceManagerStatus struct {
	// observedGeneration is the metadata.generation this status describes.
	// +optional
	ObservedGeneration int64 `json:"observedGeneration,omitempty"`

	// state is the instance manager's state.
	// +optional
	State InstanceManagerState `json:"state,omitempty"`

	// version is the data-plane version the instance manager reports.
	// +optional
	Version string `json:"version,omitempty"`

	// processes are the processes it supervises.
	// +optional
	// +listType=map
	// +listMapKey=name
	Processes []ProcessStatus `json:"processes,omitempty"`

	// conditions: Ready.
	// +optional
	// +listType=map
	// +listMapKey=type
	Conditions []metav1.Condition `json:"conditions,omitempty"`
}

// InstanceManager is the process supervisor on one node that starts and stops
// engine and replica processes for the manager.
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:shortName=cim,categories=cairn
// +kubebuilder:printcolumn:name="State",type=string,JSONPath=`.status.state`
// +kubebuilder:printcolumn:name="Node",type=string,JSONPath=`.spec.nodeName`
// +kubebuilder:printcolumn:name="Address",type=string,JSONPath=`.spec.address`
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type InstanceManager struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// spec says where the instance manager runs.
	// +required
	Spec InstanceManagerSpec `json:"spec"`

	// status is what the InstanceManager reconciler observed.
	// +optional
	Status InstanceManagerStatus `json:"status,omitempty"`
}

// InstanceManagerList is a list of InstanceManagers.
// +kubebuilder:object:root=true
type InstanceManagerList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	// items are the InstanceManagers.
	Items []InstanceManager `json:"items"`
}

func init() {
	SchemeBuilder.Register(&InstanceManager{}, &InstanceManagerList{})
}

// PodConditionVolumesReady is the readiness gate of the instance-manager
// DaemonSet's pods (spec.readinessGates). cairn-manager sets it on a pod
// once the engines and replicas it wants on the pod's node run there and
// every replica on the node is RW again in its volume's engine (or its
// volume does not need it), so a rolling update of the DaemonSet
// restarts the next node's instance manager only after the previous
// node's volumes have their replicas back. It stays True for the run of
// the pod's containers it was decided for.
const PodConditionVolumesReady = "storage.cairn.io/volumes-ready"

// Reasons of an instance-manager pod's PodConditionVolumesReady.
const (
	// GateReasonVolumesServed: every engine and replica the manager wants
	// on the node runs, and every replica there is RW in its volume's
	// engine or not needed by its volume.
	GateReasonVolumesServed = "VolumesServed"
	// GateReasonWaitingForInstanceManager: the pod's container is not
	// ready, or the manager has not reached the instance manager in this
	// pod yet (its InstanceManager names another address, or is not
	// running).
	GateReasonWaitingForInstanceManager = "WaitingForInstanceManager"
	// GateReasonWaitingForEngine: an engine that is to run on the node
	// does not run yet, or has no RW replica.
	GateReasonWaitingForEngine = "WaitingForEngine"
	// GateReasonWaitingForReplica: a replica on the node does not run yet
	// or is not RW again in its volume's engine (the message has the
	// rebuild's progress), and its volume needs it.
	GateReasonWaitingForReplica = "WaitingForReplica"
)
