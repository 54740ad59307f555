package v1alpha1

import (
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// MaxReplicas is the largest number of replicas a Volume may ask for. Every
// write fans out to every replica, so each replica costs write bandwidth on
// the engine's node; past a handful of replicas durability hardly improves,
// and ten is far beyond what any cluster we target has in failure domains.
const MaxReplicas = 10

// Bounds of a Volume's size, in bytes. The CRD's rules on spec.size (its
// +kubebuilder:validation:XValidation markers, which cannot name a
// constant) spell the same numbers as 1Mi, 64Ti and 4096, and the schema
// tests check each boundary with these constants. MaxVolumeSize is the
// largest volume the data plane's instance manager serves; a thin volume
// may be larger than any disk up to it, its replicas scheduled within the
// manager's over-provisioning.
const (
	MinVolumeSize = 1 << 20
	MaxVolumeSize = 64 << 40
	// BlockSize divides every size: the engine and replicas work in 4 KiB
	// blocks.
	BlockSize = 4096
)

// DefaultNumberOfReplicas is how many replicas a Volume gets when
// spec.numberOfReplicas is not given. The CRD's default for the field
// (its +kubebuilder:default marker, which cannot name a constant) is the
// same number, and a test checks that they agree; code reading a Volume
// goes through VolumeSpec.Replicas, and the CSI driver, which leaves the
// field unset when a StorageClass does not give it, reads this constant.
const DefaultNumberOfReplicas = 3

// Replicas is how many replicas the volume asks for: numberOfReplicas, or
// DefaultNumberOfReplicas when it is unset (a Volume the API server has
// not defaulted, such as one built in memory).
func (s *VolumeSpec) Replicas() int {
	if s.NumberOfReplicas <= 0 {
		return DefaultNumberOfReplicas
	}
	return int(s.NumberOfReplicas)
}

// VolumeState summarises where a Volume is in its life cycle. It is computed
// from observed facts at the end of each reconcile; decisions never read it.
// +kubebuilder:validation:Enum=creating;attaching;attached;detaching;detached;deleting
type VolumeState string

const (
	// VolumeStateCreating means the engine and replica objects are being
	// created and the replicas scheduled onto disks.
	VolumeStateCreating VolumeState = "creating"
	// VolumeStateAttaching means replicas and the engine are being started on
	// the requested node.
	VolumeStateAttaching VolumeState = "attaching"
	// VolumeStateAttached means the engine runs and its frontend serves the
	// block device reported in status.endpoint.
	VolumeStateAttached VolumeState = "attached"
	// VolumeStateDetaching means the engine and replicas are being stopped.
	VolumeStateDetaching VolumeState = "detaching"
	// VolumeStateDetached means no process serves the volume; its data rests
	// on the replicas' disks.
	VolumeStateDetached VolumeState = "detached"
	// VolumeStateDeleting means the volume, its engine, replicas and their
	// data are being removed.
	VolumeStateDeleting VolumeState = "deleting"
)

// VolumeRobustness says how much redundancy an attached Volume has left.
// +kubebuilder:validation:Enum=healthy;degraded;faulted;unknown
type VolumeRobustness string

const (
	// VolumeRobustnessHealthy means every requested replica is RW.
	VolumeRobustnessHealthy VolumeRobustness = "healthy"
	// VolumeRobustnessDegraded means at least one replica is RW but fewer
	// than requested; a replacement is being scheduled or rebuilt.
	VolumeRobustnessDegraded VolumeRobustness = "degraded"
	// VolumeRobustnessFaulted means no replica is usable: the volume cannot
	// serve I/O until an operator recovers a replica.
	VolumeRobustnessFaulted VolumeRobustness = "faulted"
	// VolumeRobustnessUnknown is reported while the volume is detached: no
	// engine is running to observe the replicas.
	VolumeRobustnessUnknown VolumeRobustness = "unknown"
)

// VolumeAccessMode says how many consumers may use a Volume at once. Cairn
// volumes are block devices served on one node at a time.
// +kubebuilder:validation:Enum=ReadWriteOnce;ReadWriteOncePod
type VolumeAccessMode string

const (
	// VolumeAccessModeReadWriteOnce allows read-write use by pods on one node.
	VolumeAccessModeReadWriteOnce VolumeAccessMode = "ReadWriteOnce"
	// VolumeAccessModeReadWriteOncePod allows read-write use by a single pod.
	VolumeAccessModeReadWriteOncePod VolumeAccessMode = "ReadWriteOncePod"
)

// Volume condition types.
const (
	// VolumeConditionScheduled is true when every replica of the volume has
	// been placed on a disk of a StorageNode.
	VolumeConditionScheduled = "Scheduled"
	// VolumeConditionRebuilding is true while the engine copies data to a
	// replica (a new one, or a failed one come back); the message shows
	// the progress.
	VolumeConditionRebuilding = "Rebuilding"
	// VolumeConditionCloned is present on a volume with spec.dataSource:
	// True once the source's data (another volume's, or a backup's) is
	// copied and verified. Until then the volume cannot attach, so no
	// consumer sees a partial copy.
	VolumeConditionCloned = "Cloned"
)

// Volume condition reasons.
const (
	// VolumeReasonCreating (Ready false) means the Volume's Engine and
	// Replica objects are being created.
	VolumeReasonCreating = "Creating"
	// VolumeReasonAttaching (Ready false) means the volume is being
	// attached to spec.nodeName; the message says what it waits for.
	VolumeReasonAttaching = "Attaching"
	// VolumeReasonDetaching (Ready false) means the engine is being
	// stopped, then the replicas.
	VolumeReasonDetaching = "Detaching"
	// VolumeReasonReplicaSchedulingFailed means no disk could take one or more
	// replicas; the message names the constraint that failed (free space,
	// anti-affinity, tags) and how many replicas are unplaced.
	VolumeReasonReplicaSchedulingFailed = "ReplicaSchedulingFailed"
	// VolumeReasonDetached means the volume is not attached to any node.
	VolumeReasonDetached = "Detached"
	// VolumeReasonFaulted means no replica is usable.
	VolumeReasonFaulted = "Faulted"
	// VolumeReasonRebuildInProgress: a replica is being rebuilt.
	VolumeReasonRebuildInProgress = "RebuildInProgress"
	// VolumeReasonNoRebuild: no replica is being rebuilt.
	VolumeReasonNoRebuild = "NoRebuild"
	// VolumeReasonCloneInProgress: the source's data is being copied.
	VolumeReasonCloneInProgress = "CloneInProgress"
	// VolumeReasonCloneCompleted: the copy is complete and verified.
	VolumeReasonCloneCompleted = "CloneCompleted"
	// VolumeReasonCloneFailed: the copy failed and is retried; the message
	// says why (source volume or snapshot missing, no source replica, ...).
	VolumeReasonCloneFailed = "CloneFailed"

	// Reasons of condition Cloned on a volume restored from a backup
	// (spec.dataSource.backup).

	// VolumeReasonRestoreInProgress: the backup is being checked, the
	// replicas started, or its blocks written and verified.
	VolumeReasonRestoreInProgress = "RestoreInProgress"
	// VolumeReasonRestoreCompleted: every block of the backup is written
	// to every replica and verified against the manifest's checksum.
	VolumeReasonRestoreCompleted = "RestoreCompleted"
	// VolumeReasonBackupTargetUnavailable: the BackupTarget named does not
	// exist, or its credentials or CA bundle cannot be read. Retried.
	VolumeReasonBackupTargetUnavailable = "BackupTargetUnavailable"
	// VolumeReasonBackupNotFound: the target holds no such backup of that
	// volume. Retried.
	VolumeReasonBackupNotFound = "BackupNotFound"
	// VolumeReasonBackupTooLarge: the backup holds more bytes than this
	// volume's size. The volume must be created again, bigger.
	VolumeReasonBackupTooLarge = "BackupTooLarge"
	// VolumeReasonBackupEncryptionMismatch: the backup was taken of a
	// volume encrypted otherwise than this one (its manifest's label
	// BackupLabelKeyCheck differs from spec.encryption.keyCheck, or one
	// of them is encrypted and the other not).
	VolumeReasonBackupEncryptionMismatch = "BackupEncryptionMismatch"
	// VolumeReasonBackupCorrupt: a block of the backup is missing from the
	// target or fails its checksum; the message names the block's offset
	// and object. Retried, in case the object is put back.
	VolumeReasonBackupCorrupt = "BackupCorrupt"
	// VolumeReasonRestoreFailed: the restore failed for another reason
	// (the target did not answer, a replica failed); the message says
	// why. Retried.
	VolumeReasonRestoreFailed = "RestoreFailed"
)

// BackupLabelKeyCheck is the manifest label that records the backed-up
// volume's encryption: its spec.encryption.keyCheck, or "" for a volume
// not encrypted. A restore refuses a backup whose label differs from the
// new volume's key check ("" when not encrypted); a backup without the
// label (taken by hand with cairn-data backup) is not checked.
const BackupLabelKeyCheck = "storage.cairn.io/key-check"

// IsCopyFailedReason reports whether reason, on condition Cloned, says
// the copy into the volume (from a volume, a snapshot or a backup)
// failed, rather than that it waits or runs.
func IsCopyFailedReason(reason string) bool {
	switch reason {
	case VolumeReasonCloneFailed, VolumeReasonBackupTargetUnavailable, VolumeReasonBackupNotFound,
		VolumeReasonBackupTooLarge, VolumeReasonBackupEncryptionMismatch, VolumeReasonBackupCorrupt,
		VolumeReasonRestoreFailed:
		return true
	}
	return false
}

// VolumeDataSource names the data a new Volume starts with: another
// volume (or one of its snapshots), or a backup on a backup target.
// Exactly one of volume and backup is set.
// +kubebuilder:validation:XValidation:rule="has(self.volume) != has(self.backup)",message="set exactly one of volume (a clone) and backup (a restore)"
// +kubebuilder:validation:XValidation:rule="!has(self.backup) || !has(self.snapshot)",message="snapshot names a snapshot of volume; a restore from a backup takes none"
type VolumeDataSource struct {
	// volume is the name of an existing Volume in the same namespace to copy.
	// +optional
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	Volume string `json:"volume,omitempty"`

	// snapshot is the name of a snapshot of that volume to copy. When empty,
	// the volume's current data is copied (a clone).
	// +optional
	// +kubebuilder:validation:MaxLength=253
	Snapshot string `json:"snapshot,omitempty"`

	// backup is a backup on a backup target to restore into the volume.
	// The volume must be at least the backup's size.
	// +optional
	Backup *VolumeBackupSource `json:"backup,omitempty"`
}

// VolumeBackupSource names one backup on a backup target: the folder
// volumes/<volume>/ of the target, and a backup in it. A backup made by
// another cluster is restored by a BackupTarget pointed at its bucket and
// prefix.
type VolumeBackupSource struct {
	// target is the name of the BackupTarget (cluster-scoped) holding the
	// backup.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	Target string `json:"target"`

	// volume is the name of the volume as stored on the target (the
	// backed-up volume's name, which need not exist in this cluster).
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([a-z0-9.-]*[a-z0-9])?$`
	Volume string `json:"volume"`

	// name is the backup's name in that volume's folder on the target.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([a-z0-9.-]*[a-z0-9])?$`
	Name string `json:"name"`
}

// CloneState is the phase of a volume's copy from its data source.
// +kubebuilder:validation:Enum=pending;copying;completed;failed
type CloneState string

const (
	// CloneStatePending: waiting for the source's snapshot and a replica of
	// the source to read from.
	CloneStatePending CloneState = "pending"
	// CloneStateCopying: the data is being copied.
	CloneStateCopying CloneState = "copying"
	// CloneStateCompleted: the data is copied and verified.
	CloneStateCompleted CloneState = "completed"
	// CloneStateFailed: the last attempt failed; it is retried.
	CloneStateFailed CloneState = "failed"
)

// CloneStatus reports the copy of a volume's data source.
type CloneStatus struct {
	// state is the phase of the copy.
	State CloneState `json:"state"`

	// sourceVolume is the Volume copied from.
	// +optional
	SourceVolume string `json:"sourceVolume,omitempty"`

	// snapshot is the Snapshot of the source copied: spec.dataSource's, or
	// one taken for a whole-volume clone.
	// +optional
	Snapshot string `json:"snapshot,omitempty"`

	// backup is the backup restored, for a volume restored from one.
	// +optional
	Backup *VolumeBackupSource `json:"backup,omitempty"`

	// progress is the percentage copied, 0 to 100.
	// +optional
	Progress int32 `json:"progress,omitempty"`

	// bytesDone and bytesTotal measure a restore's progress: the backup's
	// bytes written (zero blocks count as written: a new replica reads
	// zeros already), then the bytes read back from every replica and
	// verified.
	// +optional
	BytesDone int64 `json:"bytesDone,omitempty"`
	// +optional
	BytesTotal int64 `json:"bytesTotal,omitempty"`

	// message says why the copy waits or failed.
	// +optional
	Message string `json:"message,omitempty"`
}

// VolumeSpec is what the user asks of a Volume.
// +kubebuilder:validation:XValidation:rule="has(self.dataSource) == has(oldSelf.dataSource)",message="dataSource can only be set when the volume is created"
// +kubebuilder:validation:XValidation:rule="has(self.encryption) == has(oldSelf.encryption)",message="encryption can only be chosen when the volume is created: its data is written encrypted or not from the first byte"
type VolumeSpec struct {
	// size is the volume's capacity in bytes, such as 10Gi, 1.5Ti or
	// 1073741824. It must be at least 1Mi, at most 64Ti and a whole number
	// of 4096-byte blocks. It may grow, never shrink.
	// +required
	// +kubebuilder:validation:XValidation:rule="!isQuantity(string(self)) || quantity(string(self)).compareTo(quantity('1Mi')) >= 0",message="size must be at least 1Mi (1048576 bytes)"
	// +kubebuilder:validation:XValidation:rule="!isQuantity(string(self)) || quantity(string(self)).compareTo(quantity('64Ti')) <= 0",message="size must be at most 64Ti (70368744177664 bytes), the largest volume Cairn serves"
	// +kubebuilder:validation:XValidation:rule="!isQuantity(string(self)) || quantity(string(self)).compareTo(quantity('1Mi')) < 0 || quantity(string(self)).compareTo(quantity('64Ti')) > 0 || quantity(string(self)).sub(int(quantity(string(self)).asApproximateFloat() / 4096.0 + 0.5) * 4096).compareTo(quantity('0')) == 0",message="size must be a whole number of bytes divisible by 4096, such as 10Gi or 1073741824"
	// +kubebuilder:validation:XValidation:rule="!isQuantity(string(self)) || !isQuantity(string(oldSelf)) || quantity(string(self)).compareTo(quantity(string(oldSelf))) >= 0",message="size cannot shrink; create a new volume and copy the data instead"
	Size resource.Quantity `json:"size"`

	// numberOfReplicas is how many copies of the data to keep, each on a
	// different node where possible. Between 1 and 10.
	// +optional
	// +kubebuilder:default=3
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=10
	NumberOfReplicas int32 `json:"numberOfReplicas,omitempty"`

	// frontend is how the volume is exposed on the node it is attached to.
	// fuse (the default) works on any node with FUSE and loop devices; nbd
	// is faster and needs the nbd kernel module on the node.
	// +optional
	// +kubebuilder:default=fuse
	Frontend Frontend `json:"frontend,omitempty"`

	// nodeName is the node the volume should be attached to. Empty means
	// detached. The CSI driver sets it on ControllerPublishVolume.
	// +optional
	// +kubebuilder:validation:MaxLength=253
	NodeName string `json:"nodeName,omitempty"`

	// dataSource, when set, fills the new volume from another volume or one
	// of its snapshots, or from a backup. It can only be set at creation.
	// +optional
	// +kubebuilder:validation:XValidation:rule="self == oldSelf",message="dataSource is immutable"
	DataSource *VolumeDataSource `json:"dataSource,omitempty"`

	// diskSelector lists tags every disk holding a replica of the volume
	// must carry (StorageNode spec.disks[].tags), such as ssd. Empty: any
	// disk. A replica already placed stays where it is when this changes.
	// +optional
	// +kubebuilder:validation:MaxItems=16
	// +kubebuilder:validation:items:MaxLength=63
	// +listType=atomic
	DiskSelector []string `json:"diskSelector,omitempty"`

	// backupTarget names the BackupTarget the volume's backups go to when
	// the one asking for a backup names none (a VolumeSnapshotClass with
	// type: backup and no backupTarget). Set from the StorageClass
	// parameter backupTarget; may be changed.
	// +optional
	// +kubebuilder:validation:MaxLength=253
	BackupTarget string `json:"backupTarget,omitempty"`

	// accessMode says how many consumers may use the volume at once.
	// +optional
	// +kubebuilder:default=ReadWriteOnce
	AccessMode VolumeAccessMode `json:"accessMode,omitempty"`

	// encryption, when set, encrypts the volume's data at rest: the engine
	// encrypts every block before it leaves for the replicas, so replicas,
	// rebuilds and snapshots hold ciphertext only. Chosen at creation.
	// +optional
	// +kubebuilder:validation:XValidation:rule="self == oldSelf",message="encryption is immutable: the data was written with this key"
	Encryption *VolumeEncryption `json:"encryption,omitempty"`
}

// VolumeEncryption is where an encrypted volume's key comes from.
type VolumeEncryption struct {
	// keySecret names a Secret in the Volume's namespace holding the
	// passphrase under the key "passphrase" (16 to 4096 bytes). The manager
	// reads it each time it starts the volume's engine. The CSI driver makes
	// it from the StorageClass's provisioner secret.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	KeySecret string `json:"keySecret"`

	// keyCheck identifies the passphrase the volume was created with
	// without revealing it (32 hex digits, volcrypt.KeyCheck). An engine is
	// never started with a passphrase whose check differs.
	// +required
	// +kubebuilder:validation:Pattern=`^[0-9a-f]{32}$`
	KeyCheck string `json:"keyCheck"`
}

// EncryptionPassphraseKey is the key of the passphrase in an encrypted
// volume's Secret (and in the StorageClass's provisioner secret).
const EncryptionPassphraseKey = "passphrase"

// VolumeStatus is what the Volume reconciler observed.
type VolumeStatus struct {
	// observedGeneration is the metadata.generation this status describes.
	// +optional
	ObservedGeneration int64 `json:"observedGeneration,omitempty"`

	// state summarises the volume's life-cycle phase.
	// +optional
	State VolumeState `json:"state,omitempty"`

	// robustness says how much redundancy the volume has left.
	// +optional
	Robustness VolumeRobustness `json:"robustness,omitempty"`

	// currentNodeName is the node the volume is attached to now; empty when
	// detached.
	// +optional
	CurrentNodeName string `json:"currentNodeName,omitempty"`

	// endpoint is the block device (or NBD socket) path on currentNodeName.
	// +optional
	Endpoint string `json:"endpoint,omitempty"`

	// size is the capacity the engine serves now. It lags spec.size while an
	// expansion is in progress.
	// +optional
	Size *resource.Quantity `json:"size,omitempty"`

	// actualSize is the data one replica holds for the volume, snapshots
	// included (holes take no space): the engine's status.actualSize while
	// attached, its last value while detached.
	// +optional
	ActualSize *resource.Quantity `json:"actualSize,omitempty"`

	// clone reports the copy of spec.dataSource into this volume.
	// +optional
	Clone *CloneStatus `json:"clone,omitempty"`

	// conditions: Scheduled, Ready, Rebuilding, Cloned.
	// +optional
	// +listType=map
	// +listMapKey=type
	Conditions []metav1.Condition `json:"conditions,omitempty"`
}

// Volume is a replicated block device. Users normally create it through a
// PersistentVolumeClaim and the Cairn CSI driver.
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:shortName=cvol,categories=cairn
// +kubebuilder:printcolumn:name="State",type=string,JSONPath=`.status.state`,description="Life-cycle phase"
// +kubebuilder:printcolumn:name="Robustness",type=string,JSONPath=`.status.robustness`,description="Redundancy left"
// +kubebuilder:printcolumn:name="Size",type=string,JSONPath=`.spec.size`,description="Requested capacity"
// +kubebuilder:printcolumn:name="Used",type=string,JSONPath=`.status.actualSize`,description="Data one replica holds, snapshots included",priority=1
// +kubebuilder:printcolumn:name="Replicas",type=integer,JSONPath=`.spec.numberOfReplicas`,description="Requested replicas"
// +kubebuilder:printcolumn:name="Node",type=string,JSONPath=`.status.currentNodeName`,description="Node it is attached to"
// +kubebuilder:printcolumn:name="Frontend",type=string,JSONPath=`.spec.frontend`,priority=1
// +kubebuilder:printcolumn:name="Endpoint",type=string,JSONPath=`.status.endpoint`,priority=1
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type Volume struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// spec is what the user asks for.
	// +required
	Spec VolumeSpec `json:"spec"`

	// status is what Cairn observed.
	// +optional
	Status VolumeStatus `json:"status,omitempty"`
}

// VolumeList is a list of Volumes.
// +kubebuilder:object:root=true
type VolumeList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	// items are the Volumes.
	Items []Volume `json:"items"`
}

func init() {
	SchemeBuilder.Register(&Volume{}, &VolumeList{})
}
