package v1alpha1

import (
	"encoding/json"
	"errors"
	"fmt"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// RecurringJobTask is what a RecurringJob does to each volume it selects.
// +kubebuilder:validation:Enum=snapshot;backup;filesystem-trim
type RecurringJobTask string

const (
	// RecurringJobTaskSnapshot creates a Snapshot of each volume.
	RecurringJobTaskSnapshot RecurringJobTask = "snapshot"
	// RecurringJobTaskBackup creates a Backup of each volume to
	// spec.target (the Backup takes its own Snapshot).
	RecurringJobTaskBackup RecurringJobTask = "backup"
	// RecurringJobTaskFilesystemTrim discards the free blocks of the
	// filesystem of each attached volume (fstrim), so that its replicas
	// free the space the filesystem no longer uses. The CSI node plugin
	// of the node the volume is attached to runs it; raw block volumes
	// and detached volumes are skipped.
	RecurringJobTaskFilesystemTrim RecurringJobTask = "filesystem-trim"
)

// Limits of a RecurringJob.
const (
	// MaxRecurringJobRetain bounds spec.retain.
	MaxRecurringJobRetain = 100
	// DefaultRecurringJobConcurrency is spec.concurrency when not given.
	DefaultRecurringJobConcurrency = 2
	// MaxRecurringJobGroups bounds spec.groups and the StorageClass
	// parameter recurringJobGroups.
	MaxRecurringJobGroups = 16
	// MaxRecurringJobGroupLength bounds a group name so that the label
	// key it makes (RecurringJobGroupLabel) keeps its name part within
	// Kubernetes' 63 characters.
	MaxRecurringJobGroupLength = 63 - len(recurringJobGroupLabelName)
)

// Labels a RecurringJob reads and writes.
const (
	// LabelRecurringJob is on every Snapshot and Backup a RecurringJob
	// created; its value is the job's name. Retention counts only these.
	LabelRecurringJob = "storage.cairn.io/recurring-job"
	// recurringJobGroupLabelName is the name part of a group label
	// before the group's name.
	recurringJobGroupLabelName = "recurring-job-group."
	// RecurringJobGroupLabelPrefix, followed by a group name, is the
	// label key that puts a Volume in that group (value
	// RecurringJobGroupEnabled).
	RecurringJobGroupLabelPrefix = "storage.cairn.io/" + recurringJobGroupLabelName
	// RecurringJobGroupEnabled is the value of a group label that puts
	// the Volume in the group; any other value leaves it out.
	RecurringJobGroupEnabled = "enabled"
)

// RecurringJobGroupLabel is the label key that puts a Volume in group g.
func RecurringJobGroupLabel(g string) string { return RecurringJobGroupLabelPrefix + g }

// Annotations a filesystem-trim job and the CSI node plugin exchange on a
// Volume: the job asks, the node plugin of the node the volume is
// attached to answers. Each job has its own pair, so that two jobs
// trimming the same volume do not overwrite each other's requests.
const (
	// FilesystemTrimRequestAnnotationPrefix, followed by the job's name,
	// is the annotation a filesystem-trim job sets on a Volume to have it
	// trimmed; its value is the run's scheduled time (RFC 3339, UTC, at
	// most MaxFilesystemTrimRunLength characters).
	FilesystemTrimRequestAnnotationPrefix = "trim-request.storage.cairn.io/"
	// FilesystemTrimResultAnnotationPrefix, followed by the job's name,
	// is the annotation the CSI node plugin sets on the Volume once it
	// has answered the request: a FilesystemTrimResult in JSON whose run
	// is the request's value.
	FilesystemTrimResultAnnotationPrefix = "trim-result.storage.cairn.io/"
	// MaxFilesystemTrimRunLength bounds a request's value.
	MaxFilesystemTrimRunLength = 64
	// MaxFilesystemTrimMessageLength bounds a result's message.
	MaxFilesystemTrimMessageLength = 512
	// MaxFilesystemTrimResultLength bounds a result annotation's value;
	// a longer one is not read.
	MaxFilesystemTrimResultLength = 1024
	// MaxFilesystemTrimRequests bounds how many jobs' requests the node
	// plugin answers on one Volume; the others are left unanswered.
	MaxFilesystemTrimRequests = 16
)

// FilesystemTrimRequestAnnotation is the annotation key job's requests
// are in.
func FilesystemTrimRequestAnnotation(job string) string {
	return FilesystemTrimRequestAnnotationPrefix + job
}

// FilesystemTrimResultAnnotation is the annotation key the answers to
// job's requests are in.
func FilesystemTrimResultAnnotation(job string) string {
	return FilesystemTrimResultAnnotationPrefix + job
}

// FilesystemTrimOutcome is how the node plugin answered a trim request.
type FilesystemTrimOutcome string

// Outcomes of a trim request.
const (
	// FilesystemTrimTrimmed: fstrim ran on the volume's filesystem.
	FilesystemTrimTrimmed FilesystemTrimOutcome = "trimmed"
	// FilesystemTrimSkipped: the volume has no filesystem mounted on its
	// node (a raw block volume, or one not staged); the message says
	// which.
	FilesystemTrimSkipped FilesystemTrimOutcome = "skipped"
	// FilesystemTrimFailed: fstrim failed; the message has the cause.
	FilesystemTrimFailed FilesystemTrimOutcome = "failed"
)

// FilesystemTrimResult is the node plugin's answer to one trim request,
// kept in the FilesystemTrimResultAnnotation of the Volume.
// +kubebuilder:object:generate=false
type FilesystemTrimResult struct {
	// Run is the request's value the answer is for.
	Run string `json:"run"`
	// Outcome is trimmed, skipped or failed.
	Outcome FilesystemTrimOutcome `json:"outcome"`
	// Node is the node whose plugin answered.
	Node string `json:"node,omitempty"`
	// Bytes is how many bytes the filesystem reported discarding (the
	// kernel's FITRIM count, which fstrim -v prints).
	Bytes int64 `json:"bytes,omitempty"`
	// Message says why a trim was skipped or failed.
	Message string `json:"message,omitempty"`
}

// ErrBadFilesystemTrimResult is returned by DecodeFilesystemTrimResult
// for a value that is not a result the node plugin writes.
var ErrBadFilesystemTrimResult = errors.New("not a filesystem trim result")

// Encode returns r in JSON, its message cut to
// MaxFilesystemTrimMessageLength bytes.
func (r FilesystemTrimResult) Encode() string {
	r.Message = TruncateMessage(r.Message, MaxFilesystemTrimMessageLength)
	b, _ := json.Marshal(r) // strings and numbers only: cannot fail
	return string(b)
}

// DecodeFilesystemTrimResult reads a result annotation's value, refusing
// one longer than MaxFilesystemTrimResultLength, with a message longer
// than MaxFilesystemTrimMessageLength or an unknown outcome.
func DecodeFilesystemTrimResult(s string) (FilesystemTrimResult, error) {
	var r FilesystemTrimResult
	if len(s) > MaxFilesystemTrimResultLength {
		return r, fmt.Errorf("%w: %d bytes, more than %d", ErrBadFilesystemTrimResult, len(s), MaxFilesystemTrimResultLength)
	}
	if err := json.Unmarshal([]byte(s), &r); err != nil {
		return FilesystemTrimResult{}, fmt.Errorf("%w: %w", ErrBadFilesystemTrimResult, err)
	}
	switch {
	case r.Outcome != FilesystemTrimTrimmed && r.Outcome != FilesystemTrimSkipped && r.Outcome != FilesystemTrimFailed:
		return FilesystemTrimResult{}, fmt.Errorf("%w: outcome %q", ErrBadFilesystemTrimResult, r.Outcome)
	case len(r.Message) > MaxFilesystemTrimMessageLength, len(r.Run) > MaxFilesystemTrimRunLength, r.Bytes < 0:
		return FilesystemTrimResult{}, fmt.Errorf("%w: a field out of bounds", ErrBadFilesystemTrimResult)
	}
	return r, nil
}

// RecurringJob condition types.
const (
	// RecurringJobConditionReady is True while the job's spec can run:
	// its schedule parses and, for a backup job, its target exists.
	RecurringJobConditionReady = "Ready"
)

// RecurringJob condition reasons.
const (
	// RecurringJobReasonScheduled: the schedule parses and the job runs
	// at status.nextRunTime.
	RecurringJobReasonScheduled = "Scheduled"
	// RecurringJobReasonSuspended: spec.suspend is true; no run starts.
	RecurringJobReasonSuspended = "Suspended"
	// RecurringJobReasonInvalidSchedule: spec.schedule is not a 5-field
	// cron expression; the message says why.
	RecurringJobReasonInvalidSchedule = "InvalidSchedule"
	// RecurringJobReasonTargetNotFound: spec.target names no
	// BackupTarget; runs are skipped until it exists.
	RecurringJobReasonTargetNotFound = "TargetNotFound"
)

// RecurringJobSpec says what to do, when, to which volumes.
// +kubebuilder:validation:XValidation:rule="(has(self.groups) && size(self.groups) > 0) || has(self.selector)",message="a job needs spec.groups or spec.selector to select volumes"
// +kubebuilder:validation:XValidation:rule="self.task == 'filesystem-trim' || has(self.retain)",message="spec.retain is required for task snapshot and backup: how many of the job's Snapshots or Backups to keep per volume"
// +kubebuilder:validation:XValidation:rule="self.task != 'filesystem-trim' || !has(self.retain)",message="spec.retain is not allowed for task filesystem-trim: a trim makes nothing to keep"
// +kubebuilder:validation:XValidation:rule="self.task != 'filesystem-trim' || !has(self.target)",message="spec.target is not allowed for task filesystem-trim: only a backup job has a target"
type RecurringJobSpec struct {
	// schedule is a standard 5-field cron expression (minute hour
	// day-of-month month day-of-week, in UTC), or a descriptor such as
	// @hourly or @daily. A bad one sets the Ready condition False with
	// reason InvalidSchedule.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=128
	Schedule string `json:"schedule"`

	// task is what each run does to each selected volume: snapshot,
	// backup or filesystem-trim.
	// +required
	Task RecurringJobTask `json:"task"`

	// retain is how many of the Snapshots or Backups this job created it
	// keeps per volume; after a run it deletes the oldest completed ones
	// beyond this count. Required for task snapshot and backup; not
	// allowed for filesystem-trim, which makes nothing to keep.
	// +optional
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=100
	Retain int32 `json:"retain,omitempty"`

	// target is the BackupTarget a backup job backs up to; ignored for
	// task snapshot, not allowed for filesystem-trim. Empty: each
	// volume's own spec.backupTarget (set from
	// its StorageClass's backupTarget parameter); a volume with none is
	// skipped and named in the run's result.
	// +optional
	// +kubebuilder:validation:MaxLength=253
	Target string `json:"target,omitempty"`

	// groups select the Volumes labelled
	// storage.cairn.io/recurring-job-group.<group>: enabled for any of
	// these groups (the StorageClass parameter recurringJobGroups sets
	// these labels). A volume matching groups or selector is selected.
	// +optional
	// +listType=set
	// +kubebuilder:validation:MaxItems=16
	// +kubebuilder:validation:items:MinLength=1
	// +kubebuilder:validation:items:MaxLength=43
	// +kubebuilder:validation:items:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?$`
	Groups []string `json:"groups,omitempty"`

	// selector selects the Volumes whose labels it matches. An empty
	// selector ({}) selects every Volume in the namespace.
	// +optional
	Selector *metav1.LabelSelector `json:"selector,omitempty"`

	// concurrency is how many volumes a run works on at once (how many
	// of its Snapshots, Backups or trims may be unfinished at a time).
	// +optional
	// +kubebuilder:default=2
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=100
	Concurrency int32 `json:"concurrency,omitempty"`

	// suspend stops the job: no run starts and the current run creates
	// no more objects (those created go on); retention still applies.
	// +optional
	Suspend bool `json:"suspend,omitempty"`
}

// RecurringJobRunResult is what one run did.
type RecurringJobRunResult struct {
	// scheduledTime is the schedule time the run is for (its objects are
	// named after it).
	// +required
	ScheduledTime metav1.Time `json:"scheduledTime"`

	// volumes is how many volumes the run selected.
	// +optional
	Volumes int32 `json:"volumes"`

	// succeeded is how many of them have a completed Snapshot or Backup
	// of this run, or were trimmed.
	// +optional
	Succeeded int32 `json:"succeeded"`

	// failed is how many of them have a failed one, or none could be
	// created, or whose trim failed (the message says why).
	// +optional
	Failed int32 `json:"failed"`

	// skipped is how many of them a filesystem-trim run did not trim:
	// detached, raw block, or with no filesystem mounted (the message
	// names them and says why).
	// +optional
	Skipped int32 `json:"skipped,omitempty"`

	// trimmedBytes is, for a filesystem-trim run, the bytes the trimmed
	// volumes' filesystems reported discarding.
	// +optional
	TrimmedBytes int64 `json:"trimmedBytes,omitempty"`

	// message says what is still running or what failed.
	// +optional
	// +kubebuilder:validation:MaxLength=1024
	Message string `json:"message,omitempty"`
}

// RecurringJobStatus is what the RecurringJob reconciler observed.
type RecurringJobStatus struct {
	// observedGeneration is the metadata.generation this status describes.
	// +optional
	ObservedGeneration int64 `json:"observedGeneration,omitempty"`

	// lastRunTime is the scheduled time of the last run started.
	// +optional
	LastRunTime *metav1.Time `json:"lastRunTime,omitempty"`

	// nextRunTime is when the next run starts (empty while suspended or
	// when the schedule does not parse).
	// +optional
	NextRunTime *metav1.Time `json:"nextRunTime,omitempty"`

	// lastResult is what the last run did so far.
	// +optional
	LastResult *RecurringJobRunResult `json:"lastResult,omitempty"`

	// conditions: Ready.
	// +optional
	// +listType=map
	// +listMapKey=type
	Conditions []metav1.Condition `json:"conditions,omitempty"`
}

// RecurringJob snapshots, backs up or trims a set of Volumes on a cron
// schedule and keeps the newest spec.retain of what it made per volume.
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:shortName=crj,categories=cairn
// +kubebuilder:validation:XValidation:rule="size(self.metadata.name) <= 40",message="a recurring job name is at most 40 characters (its Snapshots and Backups are named <job>-<time stamp>)"
// +kubebuilder:printcolumn:name="Task",type=string,JSONPath=`.spec.task`
// +kubebuilder:printcolumn:name="Schedule",type=string,JSONPath=`.spec.schedule`
// +kubebuilder:printcolumn:name="Retain",type=integer,JSONPath=`.spec.retain`
// +kubebuilder:printcolumn:name="Last Run",type=date,JSONPath=`.status.lastRunTime`
// +kubebuilder:printcolumn:name="Next Run",type=string,JSONPath=`.status.nextRunTime`
// +kubebuilder:printcolumn:name="Suspended",type=boolean,JSONPath=`.spec.suspend`,priority=1
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type RecurringJob struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// spec says what to do, when, to which volumes.
	// +required
	Spec RecurringJobSpec `json:"spec"`

	// status is what Cairn observed.
	// +optional
	Status RecurringJobStatus `json:"status,omitempty"`
}

// RecurringJobList is a list of RecurringJobs.
// +kubebuilder:object:root=true
type RecurringJobList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	// items are the RecurringJobs.
	Items []RecurringJob `json:"items"`
}

func init() {
	SchemeBuilder.Register(&RecurringJob{}, &RecurringJobList{})
}
