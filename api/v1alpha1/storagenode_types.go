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
}

// StorageNode lists the disks of one Kubernetes node that Cairn may place
// replicas on, and reports their capacity.
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:shortName=csn,categories=cairn
// +kubebuilder:printcolumn:name="Node",type=string,JSONPath=`.spec.nodeName`
// +kubebuilder:printcolumn:name="Schedulable",type=boolean,JSONPath=`.spec.allowScheduling`
// +kubebuilder:printcolumn:name="Ready",type=string,JSONPath=`.status.conditions[?(@.type=="Ready")].status`
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
