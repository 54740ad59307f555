package v1alpha1

import (
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// ReplicaSpec is what the Volume reconciler asks of a Replica.
type ReplicaSpec struct {
	// volumeName is the Volume this replica holds data for.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	VolumeName string `json:"volumeName"`

	// nodeName is the node whose disk holds the replica. Empty until the
	// replica is scheduled.
	// +optional
	// +kubebuilder:validation:MaxLength=253
	NodeName string `json:"nodeName,omitempty"`

	// diskName is the name of the disk, in that node's StorageNode, that
	// holds the replica.
	// +optional
	// +kubebuilder:validation:MaxLength=63
	DiskName string `json:"diskName,omitempty"`

	// diskPath is that disk's mount path on the node, copied at scheduling.
	// +optional
	// +kubebuilder:validation:Pattern=`^/`
	DiskPath string `json:"diskPath,omitempty"`

	// dataDirectoryName is the replica's directory under diskPath. It never
	// changes once set, so a replica's data can always be found again.
	// +optional
	// +kubebuilder:validation:Pattern=`^[a-zA-Z0-9][a-zA-Z0-9._-]*$`
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:XValidation:rule="oldSelf == '' || self == oldSelf",message="dataDirectoryName cannot change once set"
	DataDirectoryName string `json:"dataDirectoryName,omitempty"`

	// size is the capacity of the volume, in bytes: a multiple of 4096 up
	// to 64Ti.
	// +required
	// +kubebuilder:validation:XValidation:rule="!isQuantity(string(self)) || (quantity(string(self)).compareTo(quantity('0')) > 0 && quantity(string(self)).compareTo(quantity('64Ti')) <= 0)",message="size must be more than 0 and at most 64Ti (70368744177664 bytes)"
	// +kubebuilder:validation:XValidation:rule="!isQuantity(string(self)) || quantity(string(self)).compareTo(quantity('0')) < 0 || quantity(string(self)).compareTo(quantity('64Ti')) > 0 || quantity(string(self)).sub(int(quantity(string(self)).asApproximateFloat() / 4096.0 + 0.5) * 4096).compareTo(quantity('0')) == 0",message="size must be a whole number of bytes divisible by 4096"
	Size resource.Quantity `json:"size"`

	// desiredState is whether the replica process should run.
	// +optional
	// +kubebuilder:default=stopped
	DesiredState DesiredInstanceState `json:"desiredState,omitempty"`

	// failedAt is when the Volume reconciler saw this replica stop serving
	// (the engine marked it ERR, or its process was gone) while the volume
	// was attached. A failed replica is given back to the engine when its
	// process runs again (it resyncs the regions written meanwhile); past
	// the replenishment wait a replacement is built on another disk and
	// this one is deleted once the volume is healthy. It never serves reads
	// as it is.
	// +optional
	FailedAt *metav1.Time `json:"failedAt,omitempty"`

	// healthyAt is when this replica last became RW with a complete copy.
	// +optional
	HealthyAt *metav1.Time `json:"healthyAt,omitempty"`
}

// ReplicaStatus is what the Replica reconciler observed.
type ReplicaStatus struct {
	// observedGeneration is the metadata.generation this status describes.
	// +optional
	ObservedGeneration int64 `json:"observedGeneration,omitempty"`

	// instanceState is the state of the replica process.
	// +optional
	InstanceState InstanceState `json:"instanceState,omitempty"`

	// instanceManagerName is the InstanceManager that runs the process.
	// +optional
	InstanceManagerName string `json:"instanceManagerName,omitempty"`

	// address is the replica's data address (host:port) for the engine.
	// +optional
	Address string `json:"address,omitempty"`

	// controlAddress is the replica's gRPC control address (host:port), as
	// its process reported it.
	// +optional
	ControlAddress string `json:"controlAddress,omitempty"`

	// localAddress is the replica's data address for an engine of the same
	// instance manager (unix:PATH): a unix socket, through which the
	// engine hands write payloads over in shared memory and reads
	// without crossing the network stack. address stays the one for
	// engines elsewhere, rebuilds and backups. Empty when the process
	// serves no such socket.
	// +optional
	// +kubebuilder:validation:MaxLength=256
	LocalAddress string `json:"localAddress,omitempty"`

	// conditions: Ready.
	// +optional
	// +listType=map
	// +listMapKey=type
	Conditions []metav1.Condition `json:"conditions,omitempty"`
}

// ServesAt reports whether the replica's process, as its status reports
// it, is reached at a: its control address and either of its data
// addresses.
func (s *ReplicaStatus) ServesAt(a ReplicaAddress) bool {
	return a.Control == s.ControlAddress && a.Data != "" && (a.Data == s.Address || a.Data == s.LocalAddress)
}

// EngineAddress is where an engine on engineNode reaches the replica of
// this status, placed on replicaNode: its local address when both are on
// the same node (one instance manager runs both) and it has one, its
// address otherwise.
func (s *ReplicaStatus) EngineAddress(replicaNode, engineNode string) ReplicaAddress {
	data := s.Address
	if s.LocalAddress != "" && replicaNode != "" && replicaNode == engineNode {
		data = s.LocalAddress
	}
	return ReplicaAddress{Data: data, Control: s.ControlAddress}
}

// Replica is one copy of a Volume's data on one disk of one node, and the
// process that serves it. The Volume reconciler creates and owns it.
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:shortName=crep,categories=cairn
// +kubebuilder:printcolumn:name="State",type=string,JSONPath=`.status.instanceState`,description="State of the replica process"
// +kubebuilder:printcolumn:name="Volume",type=string,JSONPath=`.spec.volumeName`
// +kubebuilder:printcolumn:name="Node",type=string,JSONPath=`.spec.nodeName`
// +kubebuilder:printcolumn:name="Disk",type=string,JSONPath=`.spec.diskName`
// +kubebuilder:printcolumn:name="Failed",type=date,JSONPath=`.spec.failedAt`,description="When it stopped serving"
// +kubebuilder:printcolumn:name="Address",type=string,JSONPath=`.status.address`,priority=1
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type Replica struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// spec is what the Volume reconciler asks for.
	// +required
	Spec ReplicaSpec `json:"spec"`

	// status is what the Replica reconciler observed.
	// +optional
	Status ReplicaStatus `json:"status,omitempty"`
}

// ReplicaList is a list of Replicas.
// +kubebuilder:object:root=true
type ReplicaList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	// items are the Replicas.
	Items []Replica `json:"items"`
}

func init() {
	SchemeBuilder.Register(&Replica{}, &ReplicaList{})
}
