package v1alpha1

import (
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// StorageNode condition types.
const (
	// StorageNodeConditionSchedulable is true when at least one disk of the
	// node can take new replicas.
	StorageNodeConditionSchedulable = "Schedulable"
)

// StorageNodeReasonInsufficientStorage means a disk is ready and allowed
// but has no room for a new replica: the sizes of the replicas scheduled
// on it reach (capacity − storageReserved) × the over-provisioning
// percentage, or its filesystem has nothing free beyond the reserve.
const StorageNodeReasonInsufficientStorage = "InsufficientStorage"

// StorageNode condition reasons besides StorageNodeReasonInsufficientStorage
// and the instance-manager ones an Engine or Replica reports too
// (ReasonNoInstanceManager, ReasonInstanceManagerDown).
const (
	// StorageNodeReasonNotADataDirectory (a disk's Ready false) means the
	// disk's path is not one of the data directories the node's instance
	// manager serves (its --data-dir flags).
	StorageNodeReasonNotADataDirectory = "NotADataDirectory"
	// StorageNodeReasonSchedulingDisabled means allowScheduling is false
	// on the node or on the disk.
	StorageNodeReasonSchedulingDisabled = "SchedulingDisabled"
	// StorageNodeReasonNoSchedulableDisk (Schedulable false) means no disk
	// is ready, allowed and with room for a replica, or (for one disk)
	// that the disk is not ready.
	StorageNodeReasonNoSchedulableDisk = "NoSchedulableDisk"
)

// DefaultDiskName is the name of the disk a StorageNode without
// spec.disks has: its instance manager's first data directory.
const DefaultDiskName = "default"

// DiskSpec is one disk (a mounted filesystem) replicas may be placed on.
type DiskSpec struct {
	// name identifies the disk within the node; replicas refer to it.
	// +required
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?$`
	// +kubebuilder:validation:MaxLength=63
	Name string `json:"name"`

	// path is the absolute path of the disk's mount point on the node.
	// +required
	// +kubebuilder:validation:Pattern=`^/`
	// +kubebuilder:validation:MaxLength=4096
	Path string `json:"path"`

	// allowScheduling, when false, keeps new replicas off this disk;
	// existing replicas stay.
	// +optional
	// +kubebuilder:default=true
	AllowScheduling *bool `json:"allowScheduling,omitempty"`

	// storageReserved is space on the disk that replicas must leave free
	// for other users of the filesystem.
	// +optional
	StorageReserved *resource.Quantity `json:"storageReserved,omitempty"`

	// tags restrict which volumes may use the disk (matched by later
	// scheduling policies).
	// +optional
	// +listType=set
	Tags []string `json:"tags,omitempty"`
}

// StorageNodeSpec describes the disks of one Kubernetes node.
type StorageNodeSpec struct {
	// nodeName is the Kubernetes node these disks belong to.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:XValidation:rule="self == oldSelf",message="nodeName is immutable"
	NodeName string `json:"nodeName"`

	// allowScheduling, when false, keeps new replicas off every disk of the
	// node (for draining it); existing replicas stay.
	// +optional
	// +kubebuilder:default=true
	AllowScheduling *bool `json:"allowScheduling,omitempty"`

	// disks are the node's disks.
	// +optional
	// +listType=map
	// +listMapKey=name
	// +kubebuilder:validation:MaxItems=64
	Disks []DiskSpec `json:"disks,omitempty"`

	// evictionRequested, when true, moves every replica off the node
	// before it is taken away: for each volume in turn (one at a time), a
	// replacement replica is placed on another node, the volume's engine
	// rebuilds it, and once it is RW the replica here is deleted with its
	// data. A replica of a detached volume is moved when the volume is
	// next attached (the copy goes through its engine). status.drain says
	// what is left. A cordoned node (kubectl cordon or drain) moves only
	// the replicas that hold a volume's last healthy copy.
	// +optional
	EvictionRequested bool `json:"evictionRequested,omitempty"`
}

// DrainBlockReason says why a node cannot be drained yet.
// +kubebuilder:validation:Enum=EngineRunning;LastHealthyReplica
type DrainBlockReason string

const (
	// DrainBlockEngineRunning: a volume's engine runs on the node (the
	// volume is attached there, or Cairn's own work runs there). It stops
	// once the pods using the volume are evicted and the volume detaches.
	DrainBlockEngineRunning DrainBlockReason = "EngineRunning"
	// DrainBlockLastHealthyReplica: every healthy replica of a volume is
	// on the node; taking the node away would leave the volume without
	// its data. It is moved to another node first.
	DrainBlockLastHealthyReplica DrainBlockReason = "LastHealthyReplica"
)

// DrainBlocker is one volume that holds a drain of the node.
type DrainBlocker struct {
	// volume is the Volume's name.
	// +required
	Volume string `json:"volume"`

	// reason is why it holds the drain.
	// +required
	Reason DrainBlockReason `json:"reason"`

	// message says what is awaited.
	// +optional
	Message string `json:"message,omitempty"`
}

// DrainStatus says whether the node can be drained without taking away
// the last healthy replica of a volume. The drain controller of
// cairn-manager writes it (and nothing else of the status).
type DrainStatus struct {
	// safe is true when nothing on the node holds a drain: the node's
	// drain guard pod may be evicted. While it is false, the guard's
	// PodDisruptionBudget refuses the eviction, so kubectl drain waits.
	Safe bool `json:"safe"`

	// blockers are the volumes that hold a drain, by name (at most 50).
	// +optional
	// +kubebuilder:validation:MaxItems=50
	Blockers []DrainBlocker `json:"blockers,omitempty"`

	// moving says which replica is being moved off the node now (the node
	// is cordoned or spec.evictionRequested), and to where; or why none can
	// be.
	// +optional
	Moving string `json:"moving,omitempty"`

	// replicas is how many replicas the node holds.
	// +optional
	Replicas int32 `json:"replicas,omitempty"`
}

// DiskStatus is what Cairn observed of one disk.
type DiskStatus struct {
	// name is the disk's name in spec.disks ("default" for the disk a node
	// without spec.disks gets at its instance manager's data directory).
	// +required
	Name string `json:"name"`

	// path is the disk's mount path on the node.
	// +optional
	Path string `json:"path,omitempty"`

	// filesystem is the type of the filesystem mounted at the disk's path.
	// +optional
	Filesystem string `json:"filesystem,omitempty"`

	// capacity is the filesystem's total size.
	// +optional
	Capacity *resource.Quantity `json:"capacity,omitempty"`

	// available is the free space in the filesystem.
	// +optional
	Available *resource.Quantity `json:"available,omitempty"`

	// scheduled is the sum of the sizes of the replicas placed on the disk.
	// +optional
	Scheduled *resource.Quantity `json:"scheduled,omitempty"`

	// conditions: Ready, Schedulable.
	// +optional
	// +listType=map
	// +listMapKey=type
	Conditions []metav1.Condition `json:"conditions,omitempty"`
}

// StorageNodeStatus is what the StorageNode reconciler observed.
type StorageNodeStatus struct {
	// observedGeneration is the metadata.generation this status describes.
	// +optional
	ObservedGeneration int64 `json:"observedGeneration,omitempty"`

	// disks report each disk's capacity and use.
	// +optional
	// +listType=map
	// +listMapKey=name
	Disks []DiskStatus `json:"disks,omitempty"`

	// conditions: Ready, Schedulable.
	// +optional
	// +listType=map
	// +listMapKey=type
	Conditions []metav1.Condition `json:"conditions,omitempty"`

	// drain says what holds a drain of the node, if anything.
	// +optional
	Drain *DrainStatus `json:"drain,omitempty"`
}

// StorageNode lists the disks of one Kubernetes node that Cairn may place
// replicas on, and reports their capacity.
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:shortName=csn,categories=cairn
// +kubebuilder:printcolumn:name="Node",type=string,JSONPath=`.spec.nodeName`
// +kubebuilder:printcolumn:name="Schedulable",type=boolean,JSONPath=`.spec.allowScheduling`
// +kubebuilder:printcolumn:name="Ready",type=string,JSONPath=`.status.conditions[?(@.type=="Ready")].status`
// +kubebuilder:printcolumn:name="Drainable",type=boolean,JSONPath=`.status.drain.safe`,description="Whether a drain of the node can proceed now"
// +kubebuilder:printcolumn:name="Replicas",type=integer,JSONPath=`.status.drain.replicas`,priority=1
// +kubebuilder:printcolumn:name="Evicting",type=boolean,JSONPath=`.spec.evictionRequested`,priority=1
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type StorageNode struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// spec lists the node's disks.
	// +required
	Spec StorageNodeSpec `json:"spec"`

	// status reports the disks' capacity and use.
	// +optional
	Status StorageNodeStatus `json:"status,omitempty"`
}

// StorageNodeList is a list of StorageNodes.
// +kubebuilder:object:root=true
type StorageNodeList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	// items are the StorageNodes.
	Items []StorageNode `json:"items"`
}

func init() {
	SchemeBuilder.Register(&StorageNode{}, &StorageNodeList{})
}
