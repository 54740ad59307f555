package metrics

import (
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
)

// TestCollectBackups: the gauges of Backups, BackupTargets and
// RecurringJobs as the objects' status says (a unit test of the mapping;
// the objects come from a fake client).
func TestCollectBackups(t *testing.T) {
	scheme := runtime.NewScheme()
	if err := v1.AddToScheme(scheme); err != nil {
		t.Fatal(err)
	}
	done := metav1.NewTime(time.Unix(1_800_000_000, 0))
	objs := []runtime.Object{
		&v1.Backup{ObjectMeta: metav1.ObjectMeta{Name: "b1", Namespace: "cairn-system"}, Spec: v1.BackupSpec{Volume: "pvc-1", Target: "offsite"},
			Status: v1.BackupStatus{State: v1.BackupStateCompleted, BytesDone: 4 << 20, BytesTotal: 4 << 20, UploadedBytes: 3 << 20, CompletionTime: &done}},
		&v1.Backup{ObjectMeta: metav1.ObjectMeta{Name: "b2", Namespace: "cairn-system"}, Spec: v1.BackupSpec{Volume: "pvc-1", Target: "offsite"},
			Status: v1.BackupStatus{State: v1.BackupStateInProgress, BytesDone: 1 << 20, BytesTotal: 2 << 20}},
		&v1.BackupTarget{ObjectMeta: metav1.ObjectMeta{Name: "offsite"}, Status: v1.BackupTargetStatus{Conditions: []metav1.Condition{
			{Type: v1.BackupTargetConditionAvailable, Status: metav1.ConditionTrue, Reason: v1.BackupTargetReasonAvailable}}}},
		&v1.BackupTarget{ObjectMeta: metav1.ObjectMeta{Name: "down"}},
		&v1.RecurringJob{ObjectMeta: metav1.ObjectMeta{Name: "nightly", Namespace: "cairn-system"}, Spec: v1.RecurringJobSpec{Task: v1.RecurringJobTaskBackup},
			Status: v1.RecurringJobStatus{LastRunTime: &done, LastResult: &v1.RecurringJobRunResult{Volumes: 3, Succeeded: 2, Failed: 1}}},
	}
	c := &Collector{Client: fake.NewClientBuilder().WithScheme(scheme).WithRuntimeObjects(objs...).WithStatusSubresource().Build(), Logger: logr.Discard()}
	reg := prometheus.NewRegistry()
	reg.MustRegister(c)
	want := `
# HELP cairn_backup_bytes_done Bytes of the volume's snapshot the backup has read so far.
# TYPE cairn_backup_bytes_done gauge
cairn_backup_bytes_done{backup="b1",namespace="cairn-system",target="offsite",volume="pvc-1"} 4.194304e+06
cairn_backup_bytes_done{backup="b2",namespace="cairn-system",target="offsite",volume="pvc-1"} 1.048576e+06
# HELP cairn_backup_completion_timestamp_seconds When the backup completed (Unix time); absent until it has.
# TYPE cairn_backup_completion_timestamp_seconds gauge
cairn_backup_completion_timestamp_seconds{backup="b1",namespace="cairn-system",target="offsite",volume="pvc-1"} 1.8e+09
# HELP cairn_backup_target_available 1 when the BackupTarget's last check found it reachable and writable, 0 otherwise.
# TYPE cairn_backup_target_available gauge
cairn_backup_target_available{target="down"} 0
cairn_backup_target_available{target="offsite"} 1
# HELP cairn_recurring_job_last_run_failed_volumes Volumes whose snapshot or backup failed in the RecurringJob's last run.
# TYPE cairn_recurring_job_last_run_failed_volumes gauge
cairn_recurring_job_last_run_failed_volumes{job="nightly",namespace="cairn-system",task="backup"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "cairn_backup_bytes_done", "cairn_backup_completion_timestamp_seconds",
		"cairn_backup_target_available", "cairn_recurring_job_last_run_failed_volumes"); err != nil {
		t.Fatal(err)
	}
	if got := testutil.ToFloat64(stateGauge(t, reg, "b2", "inProgress")); got != 1 {
		t.Fatalf("b2 inProgress = %v", got)
	}
}

// stateGauge is the cairn_backup_state series of a backup and state.
func stateGauge(t *testing.T, reg *prometheus.Registry, backup, state string) prometheus.Collector {
	t.Helper()
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range fams {
		if f.GetName() != "cairn_backup_state" {
			continue
		}
		for _, m := range f.GetMetric() {
			l := map[string]string{}
			for _, p := range m.GetLabel() {
				l[p.GetName()] = p.GetValue()
			}
			if l["backup"] == backup && l["state"] == state {
				g := prometheus.NewGauge(prometheus.GaugeOpts{Name: "x"})
				g.Set(m.GetGauge().GetValue())
				return g
			}
		}
	}
	t.Fatalf("no cairn_backup_state for %s %s", backup, state)
	return nil
}
