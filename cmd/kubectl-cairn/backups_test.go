package main

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
)

// TestBackups: `kubectl cairn backups` against a real API server (envtest)
// holding a completed backup, one uploading and one whose target is
// missing: state, progress and bytes, the parent, and why one is not
// completed; one volume's only; json; an empty namespace.
func TestBackups(t *testing.T) {
	p := &pluginRig{t: t, ctx: context.Background(), cl: startAPI(t)}
	p.must(p.cl.c.Create(p.ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: pluginNS}}))
	backup := func(name, vol string, status func(*v1.Backup)) {
		b := &v1.Backup{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: pluginNS}, Spec: v1.BackupSpec{Volume: vol, Target: "offsite"}}
		p.create(b, func() { status(b) })
	}
	backup("db-1", "db", func(b *v1.Backup) {
		b.Status.State, b.Status.Progress, b.Status.BytesDone, b.Status.BytesTotal = v1.BackupStateCompleted, 100, 4<<20, 4<<20
		b.Status.UploadedBytes, b.Status.CompletionTime = 3<<20, &metav1.Time{Time: metav1.Now().Time}
		b.Status.Conditions = []metav1.Condition{cond(v1.BackupConditionCompleted, true, v1.BackupReasonCompleted, "done")}
	})
	backup("db-2", "db", func(b *v1.Backup) {
		b.Status.State, b.Status.Progress, b.Status.BytesDone, b.Status.BytesTotal, b.Status.Parent = v1.BackupStateInProgress, 42, 42<<20, 100<<20, "db-1"
		b.Status.Conditions = []metav1.Condition{cond(v1.BackupConditionCompleted, false, v1.BackupReasonInProgress, "uploading snapshot db-2")}
	})
	backup("logs-1", "logs", func(b *v1.Backup) {
		b.Status.State = v1.BackupStatePending
		b.Status.Conditions = []metav1.Condition{cond(v1.BackupConditionCompleted, false, v1.BackupReasonTargetNotFound, "BackupTarget offsite does not exist")}
	})

	out, code := p.kc("backups")
	if code != 0 {
		t.Fatalf("backups: %d %s", code, out)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 4 {
		t.Fatalf("want a header and 3 backups, got:\n%s", out)
	}
	contains(t, lines[1], "db-1", "db", "offsite", "completed", "100% (4.0 MiB / 4.0 MiB)", "3.0 MiB")
	contains(t, lines[2], "db-2", "inProgress", "42% (42.0 MiB / 100.0 MiB)", "db-1", "InProgress: uploading snapshot db-2")
	contains(t, lines[3], "logs-1", "pending", "TargetNotFound: BackupTarget offsite does not exist")

	out, _ = p.kc("backups", "logs")
	if strings.Contains(out, "db-1") || !strings.Contains(out, "logs-1") {
		t.Errorf("backups logs lists another volume's, or not its own:\n%s", out)
	}

	var views []backupView
	var jout, errb bytes.Buffer
	if code := run(p.ctx, []string{"-o", "json", "backups", "db"}, &jout, &errb, p.cl); code != 0 {
		t.Fatalf("backups -o json: %d %s", code, errb.String())
	}
	if err := json.Unmarshal(jout.Bytes(), &views); err != nil {
		t.Fatalf("json: %v\n%s", err, jout.String())
	}
	if len(views) != 2 || views[0].Name != "db-1" || views[0].Uploaded != 3<<20 || views[1].Parent != "db-1" || views[1].Progress != 42 {
		t.Errorf("json views: %+v", views)
	}

	out, _ = p.kc("-n", "elsewhere", "backups")
	contains(t, out, "No backups in elsewhere")
}
