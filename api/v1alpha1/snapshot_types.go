package v1alpha1

import (
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Snapshot condition types.
const (
	// SnapshotConditionReady is True once the snapshot exists on every
	// replica of its volume and can be restored from.
	SnapshotConditionReady = "Ready"
)

// Snapshot condition reasons.
const (
	// SnapshotReasonTaken: the snapshot exists on every replica.
	SnapshotReasonTaken = "Taken"
	// SnapshotReasonPending: the snapshot is waiting for its volume's
	// engine (a detached volume is started for it) or is being taken.
	SnapshotReasonPending = "Pending"
	// SnapshotReasonVolumeNotFound: spec.volume names no Volume.
	SnapshotReasonVolumeNotFound = "VolumeNotFound"
	// SnapshotReasonFailed: taking the snapshot failed; the message says why.
	SnapshotReasonFailed = "Failed"
)

// SnapshotSpec names the volume to snapshot.
type SnapshotSpec struct {
	// volume is the name of the Volume, in the same namespace, whose data
	// the snapshot captures. It cannot change.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=63
	// +kubebuilder:validation:XValidation:rule="self == oldSelf",message="volume cannot change; create another Snapshot instead"
	Volume string `json:"volume"`
}

// SnapshotStatus is what the Snapshot reconciler observed.
type SnapshotStatus struct {
	// observedGeneration is the metadata.generation this status describes.
	// +optional
	ObservedGeneration int64 `json:"observedGeneration,omitempty"`

	// readyToUse is true once the snapshot exists on every replica of the
	// volume: it can be restored or cloned from.
	// +optional
	ReadyToUse bool `json:"readyToUse,omitempty"`

	// creationTime is when the snapshot was taken (I/O was paused and every
	// replica snapshotted under the same name).
	// +optional
	CreationTime *metav1.Time `json:"creationTime,omitempty"`

	// size is the volume's size when the snapshot was taken: a volume made
	// from it must be at least this big.
	// +optional
	Size *resource.Quantity `json:"size,omitempty"`

	// conditions: Ready.
	// +optional
	// +listType=map
	// +listMapKey=type
	Conditions []metav1.Condition `json:"conditions,omitempty"`
}

// Snapshot is a crash-consistent point-in-time image of a Volume, held on
// every replica of the volume under the Snapshot's name. It is taken whether
// the volume is attached or detached, and deleted from every replica when
// the object is deleted. The CSI driver creates one per VolumeSnapshot.
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:shortName=csnap,categories=cairn
// +kubebuilder:validation:XValidation:rule="size(self.metadata.name) <= 63",message="a snapshot name is at most 63 characters"
// +kubebuilder:printcolumn:name="Volume",type=string,JSONPath=`.spec.volume`,description="Volume it captures"
// +kubebuilder:printcolumn:name="Ready",type=boolean,JSONPath=`.status.readyToUse`,description="Exists on every replica"
// +kubebuilder:printcolumn:name="Size",type=string,JSONPath=`.status.size`,description="Volume size when taken"
// +kubebuilder:printcolumn:name="Taken",type=date,JSONPath=`.status.creationTime`,priority=1
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type Snapshot struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// spec names the volume.
	// +required
	Spec SnapshotSpec `json:"spec"`

	// status is what Cairn observed.
	// +optional
	Status SnapshotStatus `json:"status,omitempty"`
}

// SnapshotList is a list of Snapshots.
// +kubebuilder:object:root=true
type SnapshotList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	// items are the Snapshots.
	Items []Snapshot `json:"items"`
}

func init() {
	SchemeBuilder.Register(&Snapshot{}, &SnapshotList{})
}
