package v1alpha1

import (
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// RebuildState is the phase of one replica's rebuild.
// +kubebuilder:validation:Enum=in-progress;complete;failed;cancelled
type RebuildState string

const (
	// RebuildStateInProgress means data is being copied to the replica.
	RebuildStateInProgress RebuildState = "in-progress"
	// RebuildStateComplete means the copy was verified and the replica is RW.
	RebuildStateComplete RebuildState = "complete"
	// RebuildStateFailed means the copy failed; the replica is ERR.
	RebuildStateFailed RebuildState = "failed"
	// RebuildStateCancelled means the rebuild was stopped on request.
	RebuildStateCancelled RebuildState = "cancelled"
)

// EngineSpec is what the Volume reconciler asks of an Engine.
type EngineSpec struct {
	// volumeName is the Volume this engine serves.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	VolumeName string `json:"volumeName"`

	// nodeName is the node the engine process runs on.
	// +optional
	// +kubebuilder:validation:MaxLength=253
	NodeName string `json:"nodeName,omitempty"`

	// desiredState is whether the engine process should run.
	// +optional
	// +kubebuilder:default=stopped
	DesiredState DesiredInstanceState `json:"desiredState,omitempty"`

	// size is the capacity the engine serves, in bytes: a multiple of 4096
	// up to 64Ti.
	// +required
	// +kubebuilder:validation:XValidation:rule="!isQuantity(string(self)) || (quantity(string(self)).compareTo(quantity('0')) >= 0 && quantity(string(self)).compareTo(quantity('64Ti')) <= 0)",message="size must be from 0 to 64Ti (70368744177664 bytes)"
	// +kubebuilder:validation:XValidation:rule="!isQuantity(string(self)) || quantity(string(self)).compareTo(quantity('0')) < 0 || quantity(string(self)).compareTo(quantity('64Ti')) > 0 || quantity(string(self)).sub(int(quantity(string(self)).asApproximateFloat() / 4096.0 + 0.5) * 4096).compareTo(quantity('0')) == 0",message="size must be a whole number of bytes divisible by 4096"
	Size resource.Quantity `json:"size"`

	// frontend is how the engine exposes the volume on its node.
	// +optional
	// +kubebuilder:default=fuse
	Frontend Frontend `json:"frontend,omitempty"`

	// replicaAddresses maps the name of each Replica the engine should use
	// to the addresses that replica's process reported.
	// +optional
	// +kubebuilder:validation:MaxProperties=16
	ReplicaAddresses map[string]ReplicaAddress `json:"replicaAddresses,omitempty"`

	// maintenance runs the engine without a block device (the nbd
	// frontend's socket only, whatever frontend says), for Cairn's own work
	// on a volume no one has attached: taking or deleting snapshots, and
	// filling a clone. Only a maintenance engine ever copies a clone.
	// +optional
	Maintenance bool `json:"maintenance,omitempty"`

	// cloneFrom, on a maintenance engine, asks it to fill its replicas with
	// the view at a snapshot of another volume, read from one of that
	// volume's replicas, and to verify the copy by checksum. The Volume
	// reconciler sets it only until the volume's Cloned condition is True.
	// +optional
	CloneFrom *EngineCloneSource `json:"cloneFrom,omitempty"`

	// encryption is the Volume's: the engine encrypts with the key in its
	// Secret, once the key's check matches.
	// +optional
	Encryption *VolumeEncryption `json:"encryption,omitempty"`
}

// EngineCloneSource is where a clone's data is read from.
type EngineCloneSource struct {
	// replica is the name of the source volume's Replica read from.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	Replica string `json:"replica"`

	// address is that replica's gRPC control address (host:port).
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=256
	Address string `json:"address"`

	// snapshot is the name of the source's snapshot whose view is copied.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=63
	Snapshot string `json:"snapshot"`
}

// EngineCloneStatus is the progress of an engine's clone copy.
type EngineCloneStatus struct {
	// address is the source replica's control address.
	// +optional
	Address string `json:"address,omitempty"`

	// snapshot is the source snapshot copied.
	// +optional
	Snapshot string `json:"snapshot,omitempty"`

	// state is the phase of the copy: in-progress, complete (copied and
	// verified) or failed.
	// +optional
	State RebuildState `json:"state,omitempty"`

	// bytesDone is how much of the source's range has been copied (then
	// verified).
	// +optional
	BytesDone int64 `json:"bytesDone,omitempty"`

	// bytesTotal is the size of the range copied.
	// +optional
	BytesTotal int64 `json:"bytesTotal,omitempty"`

	// progress is bytesDone as a percentage of bytesTotal, 0 to 100.
	// +optional
	Progress int32 `json:"progress,omitempty"`

	// error says why a failed copy failed.
	// +optional
	Error string `json:"error,omitempty"`
}

// ReplicaAddress is where an engine reaches one replica.
type ReplicaAddress struct {
	// data is the replica's data address: host:port, or unix:PATH for a
	// replica on the engine's node.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=256
	Data string `json:"data"`

	// control is the replica's gRPC control address (host:port).
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=256
	Control string `json:"control"`
}

// RebuildStatus is the progress of one replica's rebuild.
type RebuildStatus struct {
	// state is the phase of the rebuild.
	// +optional
	State RebuildState `json:"state,omitempty"`

	// sourceReplica is the RW replica data is copied from.
	// +optional
	SourceReplica string `json:"sourceReplica,omitempty"`

	// bytesDone is how many bytes have been copied so far.
	// +optional
	BytesDone int64 `json:"bytesDone,omitempty"`

	// bytesTotal is how many bytes the rebuild will copy in all. A returning
	// replica copies only the regions its write-intent bitmap marks dirty.
	// +optional
	BytesTotal int64 `json:"bytesTotal,omitempty"`

	// dirtyOnly is true when the replica is one that failed and came back:
	// only the regions written while it was away are copied (a delta
	// resync), not the whole volume.
	// +optional
	DirtyOnly bool `json:"dirtyOnly,omitempty"`

	// fullReason says why a replica that had been a member before copies
	// the whole volume instead of the regions written while it was away
	// (its history is unknown: the engine restarted while it was away,
	// another replica was rebuilt since, ...). Empty for a new replica and
	// for a delta resync.
	// +optional
	// +kubebuilder:validation:MaxLength=256
	FullReason string `json:"fullReason,omitempty"`

	// relayReason says why the rebuild's data passes through the engine
	// instead of going from replica to replica (the new replica reading
	// from the source itself): the new replica cannot reach the source's
	// port, or its instance manager predates that. Such a rebuild works,
	// at more CPU. Empty when the data goes replica to replica.
	// +optional
	// +kubebuilder:validation:MaxLength=256
	RelayReason string `json:"relayReason,omitempty"`

	// progress is bytesDone as a percentage of bytesTotal, 0 to 100.
	// +optional
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=100
	Progress int32 `json:"progress,omitempty"`

	// startedAt is when the rebuild began.
	// +optional
	StartedAt *metav1.Time `json:"startedAt,omitempty"`

	// error says why a failed rebuild failed.
	// +optional
	Error string `json:"error,omitempty"`
}

// SnapshotInfo describes one snapshot in a volume's chain.
type SnapshotInfo struct {
	// name is the snapshot's name, the same on every replica.
	Name string `json:"name"`

	// parent is the name of the older snapshot this one sits on; empty for
	// the oldest.
	// +optional
	Parent string `json:"parent,omitempty"`

	// createdAt is when the snapshot was taken.
	// +optional
	CreatedAt *metav1.Time `json:"createdAt,omitempty"`

	// size is the data held in this snapshot's layer.
	// +optional
	Size *resource.Quantity `json:"size,omitempty"`

	// userCreated is false for snapshots Cairn took itself (for a rebuild).
	// +optional
	UserCreated bool `json:"userCreated,omitempty"`
}

// DeviceLoss records that the block device a volume was served on, on one
// node, went away under its users while the volume stayed attached there:
// a new engine process came up and serves the volume on a fresh device
// instead of taking over the one the previous process served (the
// frontend cannot keep its kernel side across a restart on that node, or
// the takeover failed). Filesystems mounted from the old device return
// I/O errors, and a pod's mount of them stays bad until the pod is
// restarted.
type DeviceLoss struct {
	// at is when the new engine process was seen serving the fresh device.
	// Pods created before it on nodeName may hold a mount of the old one.
	// +required
	At metav1.Time `json:"at"`

	// nodeName is the node whose device was lost.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	NodeName string `json:"nodeName"`

	// device is the path of the device that was lost, when known.
	// +optional
	// +kubebuilder:validation:MaxLength=4096
	Device string `json:"device,omitempty"`

	// message says why the device could not be kept, for people (it goes
	// into the Events on the pods and claims concerned).
	// +optional
	// +kubebuilder:validation:MaxLength=1024
	Message string `json:"message,omitempty"`
}

// ServedDevice is the block device the engine's process serves, or last
// served, on a node: kept while its process is restarted, so that the
// Engine reconciler can tell whether the next process took it over.
type ServedDevice struct {
	// nodeName is the node the device is on.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	NodeName string `json:"nodeName"`

	// path is the device (/dev/loopN, /dev/nbdN).
	// +required
	// +kubebuilder:validation:MaxLength=4096
	Path string `json:"path"`

	// interrupted: the process serving it was seen not running while the
	// engine was still wanted on nodeName.
	// +optional
	Interrupted bool `json:"interrupted,omitempty"`
}

// EngineStatus is what the Engine reconciler observed.
type EngineStatus struct {
	// observedGeneration is the metadata.generation this status describes.
	// +optional
	ObservedGeneration int64 `json:"observedGeneration,omitempty"`

	// instanceState is the state of the engine process.
	// +optional
	InstanceState InstanceState `json:"instanceState,omitempty"`

	// instanceManagerName is the InstanceManager that runs the process.
	// +optional
	InstanceManagerName string `json:"instanceManagerName,omitempty"`

	// address is the engine's control address (host:port).
	// +optional
	Address string `json:"address,omitempty"`

	// endpoint is the block device (or NBD socket) path the frontend serves.
	// +optional
	Endpoint string `json:"endpoint,omitempty"`

	// size is the capacity the engine serves now.
	// +optional
	Size *resource.Quantity `json:"size,omitempty"`

	// actualSize is the data an RW replica holds for the volume, its live
	// layer and every snapshot (holes take no space), as the engine last
	// sampled it (at most every 10 s, and after each snapshot change).
	// +optional
	ActualSize *resource.Quantity `json:"actualSize,omitempty"`

	// replicaModeMap maps each replica the engine uses to its mode, as the
	// engine's status stream last reported it. Empty while the engine is
	// not running or its stream is not connected.
	// +optional
	ReplicaModeMap map[string]ReplicaMode `json:"replicaModeMap,omitempty"`

	// rebuildStatus maps each replica being (or last) rebuilt to its progress.
	// +optional
	RebuildStatus map[string]RebuildStatus `json:"rebuildStatus,omitempty"`

	// snapshots maps snapshot names to what the engine reports of them.
	// +optional
	Snapshots map[string]SnapshotInfo `json:"snapshots,omitempty"`

	// clone is the progress of the copy spec.cloneFrom asked for, as the
	// engine's status stream last reported it.
	// +optional
	Clone *EngineCloneStatus `json:"clone,omitempty"`

	// deviceLost is set by the Engine reconciler when the volume's device
	// on spec.nodeName was lost while the volume stayed attached there (a
	// new engine process serves a fresh device; a restart whose frontend
	// took the old device over leaves it alone). It stays until the next
	// loss replaces it. The workload controller of cairn-manager restarts
	// the pods on that node that use the volume and were created before
	// it, so that they mount the fresh device
	// (--delete-workload-pod-on-device-loss).
	// +optional
	DeviceLost *DeviceLoss `json:"deviceLost,omitempty"`

	// servedDevice is the block device the engine serves, or served
	// before its process stopped, on spec.nodeName; cleared when the
	// engine is stopped or moved.
	// +optional
	ServedDevice *ServedDevice `json:"servedDevice,omitempty"`

	// conditions: Ready.
	// +optional
	// +listType=map
	// +listMapKey=type
	Conditions []metav1.Condition `json:"conditions,omitempty"`
}

// Engine is the per-volume data-plane process that fans I/O out to the
// replicas and exposes the volume through a frontend. The Volume reconciler
// creates and owns it; users do not create Engines.
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:shortName=ceng,categories=cairn
// +kubebuilder:printcolumn:name="State",type=string,JSONPath=`.status.instanceState`,description="State of the engine process"
// +kubebuilder:printcolumn:name="Volume",type=string,JSONPath=`.spec.volumeName`
// +kubebuilder:printcolumn:name="Node",type=string,JSONPath=`.spec.nodeName`
// +kubebuilder:printcolumn:name="Endpoint",type=string,JSONPath=`.status.endpoint`
// +kubebuilder:printcolumn:name="Size",type=string,JSONPath=`.status.size`,priority=1
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type Engine struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// spec is what the Volume reconciler asks for.
	// +required
	Spec EngineSpec `json:"spec"`

	// status is what the Engine reconciler observed.
	// +optional
	Status EngineStatus `json:"status,omitempty"`
}

// EngineList is a list of Engines.
// +kubebuilder:object:root=true
type EngineList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	// items are the Engines.
	Items []Engine `json:"items"`
}

func init() {
	SchemeBuilder.Register(&Engine{}, &EngineList{})
}
