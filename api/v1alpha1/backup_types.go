package v1alpha1

import (
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// BackupState summarises where a Backup is.
// +kubebuilder:validation:Enum=pending;inProgress;completed;failed
type BackupState string

const (
	// BackupStatePending: waiting for its snapshot, a replica to read,
	// an upload slot, or its retry after a failure.
	BackupStatePending BackupState = "pending"
	// BackupStateInProgress: uploading.
	BackupStateInProgress BackupState = "inProgress"
	// BackupStateCompleted: the backup's manifest is on the target.
	BackupStateCompleted BackupState = "completed"
	// BackupStateFailed: the last attempt failed (the message says why);
	// it is retried with back-off unless the spec must change first.
	BackupStateFailed BackupState = "failed"
)

// Backup condition types.
const (
	// BackupConditionCompleted is True once the backup's manifest is on
	// the target; False says why it is not (yet).
	BackupConditionCompleted = "Completed"
)

// Backup condition reasons.
const (
	// BackupReasonCompleted: the manifest is written; the backup can be
	// restored.
	BackupReasonCompleted = "Completed"
	// BackupReasonPending: waiting for the snapshot or an upload slot.
	BackupReasonPending = "Pending"
	// BackupReasonWaitingForReplica: waiting for a running replica of the
	// volume that its engine holds RW to read from. For a detached volume
	// the Volume reconciler runs its replicas and an engine without a
	// device until the backup is done.
	BackupReasonWaitingForReplica = "WaitingForReplica"
	// BackupReasonInProgress: the upload runs.
	BackupReasonInProgress = "InProgress"
	// BackupReasonVolumeNotFound: spec.volume names no Volume in the
	// namespace.
	BackupReasonVolumeNotFound = "VolumeNotFound"
	// BackupReasonTargetNotFound: spec.target names no BackupTarget.
	BackupReasonTargetNotFound = "TargetNotFound"
	// BackupReasonTargetUnavailable: the BackupTarget is not usable (its
	// check failed or has not run yet, or its credentials or CA bundle
	// are missing).
	BackupReasonTargetUnavailable = "TargetUnavailable"
	// BackupReasonSnapshotInvalid: spec.snapshot names no Snapshot, or
	// one of another volume, or one that failed.
	BackupReasonSnapshotInvalid = "SnapshotInvalid"
	// BackupReasonNameConflict: the target holds a backup of this name
	// for this volume written by another Backup object.
	BackupReasonNameConflict = "NameConflict"
	// BackupReasonStalled: no byte was read for the stall timeout; the
	// transfer was cancelled and is retried.
	BackupReasonStalled = "Stalled"
	// BackupReasonFailed: the upload failed; the message says why, and it
	// is retried with back-off.
	BackupReasonFailed = "Failed"
)

// BackupSpec says what to back up and where.
// +kubebuilder:validation:XValidation:rule="self == oldSelf",message="a Backup's spec cannot change; create another Backup"
type BackupSpec struct {
	// volume is the name of the Volume, in the same namespace, to back up.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=63
	Volume string `json:"volume"`

	// target is the name of the BackupTarget (cluster-scoped) the backup
	// goes to.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	Target string `json:"target"`

	// snapshot names an existing Snapshot of the volume to back up. Empty:
	// the controller takes a Snapshot named after this Backup (owned by
	// it, so deleted with it).
	// +optional
	// +kubebuilder:validation:MaxLength=63
	Snapshot string `json:"snapshot,omitempty"`

	// mode is incremental (the default: only the blocks changed since the
	// volume's newest backup on the target whose snapshot a replica still
	// holds, unless the target's maxIncrementalBackups says the chain is
	// long enough) or full (every block the snapshot holds is read and
	// uploaded again, whatever the target already has).
	// +optional
	// +kubebuilder:validation:Enum=incremental;full
	Mode BackupMode `json:"mode,omitempty"`
}

// BackupMode says whether a backup may build on an earlier one.
type BackupMode string

const (
	// BackupModeIncremental reads only what changed since a parent backup
	// when there is one.
	BackupModeIncremental BackupMode = "incremental"
	// BackupModeFull reads and uploads every block the snapshot holds.
	BackupModeFull BackupMode = "full"
)

// BackupStatus is what the Backup reconciler observed.
type BackupStatus struct {
	// observedGeneration is the metadata.generation this status describes.
	// +optional
	ObservedGeneration int64 `json:"observedGeneration,omitempty"`

	// state summarises the backup: pending, inProgress, completed or
	// failed.
	// +optional
	State BackupState `json:"state,omitempty"`

	// snapshot is the Snapshot the backup reads.
	// +optional
	Snapshot string `json:"snapshot,omitempty"`

	// backupName is the backup's name on the target, under the volume's
	// folder (volumes/<volume>/backups/<backupName>.manifest).
	// +optional
	BackupName string `json:"backupName,omitempty"`

	// parent is the backup on the target this one is incremental to
	// (empty: a full backup).
	// +optional
	Parent string `json:"parent,omitempty"`

	// volumeSize is the volume's size at the snapshot.
	// +optional
	VolumeSize *resource.Quantity `json:"volumeSize,omitempty"`

	// bytesDone is how many of bytesTotal the current or last attempt read.
	// +optional
	BytesDone int64 `json:"bytesDone,omitempty"`

	// bytesTotal is what the backup reads: the bytes the changed ranges
	// cover (for an incremental backup, what changed since its parent).
	// +optional
	BytesTotal int64 `json:"bytesTotal,omitempty"`

	// progress is bytesDone as a percentage of bytesTotal.
	// +optional
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=100
	Progress int32 `json:"progress,omitempty"`

	// uploadedBytes is what the completed backup wrote to the target in
	// new blocks (compressed); blocks its parent already stored are not
	// counted.
	// +optional
	UploadedBytes int64 `json:"uploadedBytes,omitempty"`

	// attempts counts the uploads started; a failed one is retried with
	// back-off.
	// +optional
	Attempts int32 `json:"attempts,omitempty"`

	// startTime is when the current or last upload started.
	// +optional
	StartTime *metav1.Time `json:"startTime,omitempty"`

	// lastFailureTime is when the last attempt failed.
	// +optional
	LastFailureTime *metav1.Time `json:"lastFailureTime,omitempty"`

	// completionTime is when the manifest was written.
	// +optional
	CompletionTime *metav1.Time `json:"completionTime,omitempty"`

	// message says what the backup waits for, or why it failed.
	// +optional
	Message string `json:"message,omitempty"`

	// conditions: Completed.
	// +optional
	// +listType=map
	// +listMapKey=type
	Conditions []metav1.Condition `json:"conditions,omitempty"`
}

// Backup is a backup of a Volume to a BackupTarget: a snapshot of the
// volume, read from one of its healthy replicas and uploaded by the
// manager, incremental to the last completed backup of the same volume on
// the same target. Deleting it deletes the backup from the target.
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:shortName=cbk,categories=cairn
// +kubebuilder:validation:XValidation:rule="size(self.metadata.name) <= 63",message="a backup name is at most 63 characters"
// +kubebuilder:printcolumn:name="Volume",type=string,JSONPath=`.spec.volume`,description="Volume backed up"
// +kubebuilder:printcolumn:name="Target",type=string,JSONPath=`.spec.target`,description="BackupTarget"
// +kubebuilder:printcolumn:name="State",type=string,JSONPath=`.status.state`
// +kubebuilder:printcolumn:name="Progress",type=integer,JSONPath=`.status.progress`,description="Percent of the bytes to read"
// +kubebuilder:printcolumn:name="Parent",type=string,JSONPath=`.status.parent`,priority=1
// +kubebuilder:printcolumn:name="Uploaded",type=integer,JSONPath=`.status.uploadedBytes`,priority=1
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type Backup struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// spec says what to back up and where.
	// +required
	Spec BackupSpec `json:"spec"`

	// status is what Cairn observed.
	// +optional
	Status BackupStatus `json:"status,omitempty"`
}

// BackupList is a list of Backups.
// +kubebuilder:object:root=true
type BackupList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	// items are the Backups.
	Items []Backup `json:"items"`
}

func init() {
	SchemeBuilder.Register(&Backup{}, &BackupList{})
}
