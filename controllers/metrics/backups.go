package metrics

import (
	"context"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
)

var (
	backupLabels    = []string{"namespace", "backup", "volume", "target"}
	descBackupState = prometheus.NewDesc("cairn_backup_state",
		"1 for the backup's state (pending, inProgress, completed, failed), 0 for the others.", append(backupLabels, "state"), nil)
	descBackupDone = prometheus.NewDesc("cairn_backup_bytes_done",
		"Bytes of the volume's snapshot the backup has read so far.", backupLabels, nil)
	descBackupTotal = prometheus.NewDesc("cairn_backup_bytes_total",
		"Bytes of the volume's snapshot the backup reads in all (an incremental backup reads only what changed).", backupLabels, nil)
	descBackupUploaded = prometheus.NewDesc("cairn_backup_uploaded_bytes",
		"Bytes the backup uploaded to its target (new blocks, compressed).", backupLabels, nil)
	descBackupCompleted = prometheus.NewDesc("cairn_backup_completion_timestamp_seconds",
		"When the backup completed (Unix time); absent until it has.", backupLabels, nil)
	descTargetAvailable = prometheus.NewDesc("cairn_backup_target_available",
		"1 when the BackupTarget's last check found it reachable and writable, 0 otherwise.", []string{"target"}, nil)
	descJobLastRun = prometheus.NewDesc("cairn_recurring_job_last_run_timestamp_seconds",
		"When the RecurringJob last ran (its scheduled time, Unix time).", []string{"namespace", "job", "task"}, nil)
	descJobFailed = prometheus.NewDesc("cairn_recurring_job_last_run_failed_volumes",
		"Volumes whose snapshot or backup failed in the RecurringJob's last run.", []string{"namespace", "job", "task"}, nil)

	backupStates = []v1.BackupState{v1.BackupStatePending, v1.BackupStateInProgress, v1.BackupStateCompleted, v1.BackupStateFailed}
	backupDescs  = []*prometheus.Desc{descBackupState, descBackupDone, descBackupTotal, descBackupUploaded, descBackupCompleted,
		descTargetAvailable, descJobLastRun, descJobFailed}
)

func unixSeconds(t *metav1.Time) float64 { return float64(t.UnixNano()) / float64(time.Second) }

// collectBackups: each Backup's state, progress and upload, each
// BackupTarget's availability, and each RecurringJob's last run.
func (c *Collector) collectBackups(ctx context.Context, ch chan<- prometheus.Metric) {
	var backups v1.BackupList
	if err := c.Client.List(ctx, &backups); err != nil {
		c.Logger.Error(err, "metrics: list backups")
	}
	for _, b := range backups.Items {
		l := []string{b.Namespace, b.Name, b.Spec.Volume, b.Spec.Target}
		st := b.Status.State
		if st == "" {
			st = v1.BackupStatePending
		}
		for _, s := range backupStates {
			gauge(ch, descBackupState, bool01(s == st), append(l, string(s))...)
		}
		gauge(ch, descBackupDone, float64(b.Status.BytesDone), l...)
		gauge(ch, descBackupTotal, float64(b.Status.BytesTotal), l...)
		gauge(ch, descBackupUploaded, float64(b.Status.UploadedBytes), l...)
		if b.Status.State == v1.BackupStateCompleted && b.Status.CompletionTime != nil {
			gauge(ch, descBackupCompleted, unixSeconds(b.Status.CompletionTime), l...)
		}
	}
	var targets v1.BackupTargetList
	if err := c.Client.List(ctx, &targets); err != nil {
		c.Logger.Error(err, "metrics: list backup targets")
	}
	for _, t := range targets.Items {
		gauge(ch, descTargetAvailable, bool01(meta.IsStatusConditionTrue(t.Status.Conditions, v1.BackupTargetConditionAvailable)), t.Name)
	}
	var jobs v1.RecurringJobList
	if err := c.Client.List(ctx, &jobs); err != nil {
		c.Logger.Error(err, "metrics: list recurring jobs")
	}
	for _, j := range jobs.Items {
		l := []string{j.Namespace, j.Name, string(j.Spec.Task)}
		if j.Status.LastRunTime != nil {
			gauge(ch, descJobLastRun, unixSeconds(j.Status.LastRunTime), l...)
		}
		if r := j.Status.LastResult; r != nil {
			gauge(ch, descJobFailed, float64(r.Failed), l...)
		}
	}
}
