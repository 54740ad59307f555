package recurringjob

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/internal/objects"
	"github.com/cairn-io/cairn/controllers/internal/volumes"
)

// item is a Snapshot or Backup a job made, as retention and the run's
// result see it.
type item struct {
	obj       client.Object
	volume    string
	scheduled time.Time
	// done: a Snapshot ready to use, a Backup completed.
	done bool
	// failed: the last attempt failed (the Snapshot and Backup
	// reconcilers retry it).
	failed   bool
	deleting bool
}

// work creates what the current run still lacks (when create), records
// the run's result and prunes beyond retain.
func (r *Reconciler) work(ctx context.Context, job *v1.RecurringJob, create bool) error {
	if job.Spec.Task == v1.RecurringJobTaskFilesystemTrim {
		return r.workTrim(ctx, job, create) // makes no objects: nothing to prune
	}
	vols, targets, err := r.selected(ctx, job)
	if err != nil {
		return err
	}
	vols, noTarget := withTarget(job, vols, targets)
	items, err := r.items(ctx, job)
	if err != nil {
		return err
	}
	if job.Status.LastRunTime != nil {
		run := job.Status.LastRunTime.UTC()
		if create {
			made, err := r.createMissing(ctx, job, run, vols, targets, items)
			items = append(items, made...)
			if err != nil {
				return err
			}
		}
		job.Status.LastResult = runResult(job, run, vols, noTarget, items)
	}
	return r.prune(ctx, job, items)
}

// selected are the names of the Volumes the job selects, sorted, with
// each one's spec.backupTarget.
func (r *Reconciler) selected(ctx context.Context, job *v1.RecurringJob) ([]string, map[string]string, error) {
	vs, err := r.selectedVolumes(ctx, job)
	if err != nil {
		return nil, nil, err
	}
	out := make([]string, 0, len(vs))
	targets := map[string]string{}
	for _, v := range vs {
		out = append(out, v.Name)
		targets[v.Name] = v.Spec.BackupTarget
	}
	return out, targets, nil
}

// selectedVolumes are the Volumes in the job's namespace that
// spec.selector matches or that are in one of spec.groups, sorted by
// name, without those being deleted.
func (r *Reconciler) selectedVolumes(ctx context.Context, job *v1.RecurringJob) ([]v1.Volume, error) {
	var sel labels.Selector
	if job.Spec.Selector != nil {
		s, err := metav1.LabelSelectorAsSelector(job.Spec.Selector)
		if err != nil {
			return nil, fmt.Errorf("spec.selector: %w", err)
		}
		sel = s
	}
	var vs v1.VolumeList
	if err := r.Client.List(ctx, &vs, client.InNamespace(job.Namespace)); err != nil {
		return nil, err
	}
	var out []v1.Volume
	for _, v := range vs.Items {
		if !v.DeletionTimestamp.IsZero() {
			continue
		}
		if (sel != nil && sel.Matches(labels.Set(v.Labels))) || inGroup(v.Labels, job.Spec.Groups) {
			out = append(out, v)
		}
	}
	slices.SortFunc(out, func(a, b v1.Volume) int { return strings.Compare(a.Name, b.Name) })
	return out, nil
}

// withTarget splits the volumes of a backup job without spec.target into
// those whose own spec.backupTarget names one and those that have none.
func withTarget(job *v1.RecurringJob, vols []string, targets map[string]string) (ok, none []string) {
	if job.Spec.Task != v1.RecurringJobTaskBackup || job.Spec.Target != "" {
		return vols, nil
	}
	for _, v := range vols {
		if targets[v] == "" {
			none = append(none, v)
		} else {
			ok = append(ok, v)
		}
	}
	return ok, none
}

func inGroup(l map[string]string, groups []string) bool {
	for _, g := range groups {
		if l[v1.RecurringJobGroupLabel(g)] == v1.RecurringJobGroupEnabled {
			return true
		}
	}
	return false
}

// items lists the objects of the job's task that carry its label.
func (r *Reconciler) items(ctx context.Context, job *v1.RecurringJob) ([]item, error) {
	opts := []client.ListOption{client.InNamespace(job.Namespace), client.MatchingLabels{v1.LabelRecurringJob: job.Name}}
	var out []item
	switch job.Spec.Task {
	case v1.RecurringJobTaskSnapshot:
		var ss v1.SnapshotList
		if err := r.Client.List(ctx, &ss, opts...); err != nil {
			return nil, err
		}
		for i := range ss.Items {
			s := &ss.Items[i]
			c := meta.FindStatusCondition(s.Status.Conditions, v1.SnapshotConditionReady)
			out = append(out, newItem(s, s.Spec.Volume, s.Status.ReadyToUse, c != nil && c.Reason == v1.SnapshotReasonFailed))
		}
	case v1.RecurringJobTaskBackup:
		var bs v1.BackupList
		if err := r.Client.List(ctx, &bs, opts...); err != nil {
			return nil, err
		}
		for i := range bs.Items {
			b := &bs.Items[i]
			out = append(out, newItem(b, b.Spec.Volume, b.Status.State == v1.BackupStateCompleted, b.Status.State == v1.BackupStateFailed))
		}
	}
	return out, nil
}

func newItem(o client.Object, volume string, done, failed bool) item {
	t, err := time.Parse(time.RFC3339, o.GetAnnotations()[AnnotationScheduledTime])
	if err != nil {
		t = o.GetCreationTimestamp().Time
	}
	return item{obj: o, volume: volume, scheduled: t.UTC(), done: done, failed: failed, deleting: !o.GetDeletionTimestamp().IsZero()}
}

// createMissing creates the run's object for each selected volume that
// lacks one, keeping at most spec.concurrency of the run's objects
// unfinished. If we crash after a create, the object's name (fixed by
// job, volume and scheduled time) makes the repeated create find it.
func (r *Reconciler) createMissing(ctx context.Context, job *v1.RecurringJob, run time.Time, vols []string, targets map[string]string, items []item) ([]item, error) {
	have := map[string]bool{}
	unfinished := 0
	for _, it := range items {
		if it.scheduled.Equal(run) {
			have[it.volume] = true
			if !it.done && !it.deleting {
				unfinished++
			}
		}
	}
	limit := int(job.Spec.Concurrency)
	if limit < 1 {
		limit = v1.DefaultRecurringJobConcurrency
	}
	var made []item
	for _, vol := range vols {
		if have[vol] || unfinished >= limit {
			continue
		}
		o := r.newObject(job, vol, targets[vol], run)
		if err := r.Client.Create(ctx, o); err != nil && !apierrors.IsAlreadyExists(err) {
			objects.Event(r.Recorder, job, true, EventCreateFailed, "Run", "creating %s of volume %s: %v", job.Spec.Task, vol, err)
			return made, fmt.Errorf("create %s %s: %w", job.Spec.Task, o.GetName(), err)
		}
		made = append(made, item{obj: o, volume: vol, scheduled: run})
		unfinished++
	}
	return made, nil
}

// newObject is the Snapshot or Backup of vol for the run at run; a
// Backup goes to spec.target, else to the volume's own target.
func (r *Reconciler) newObject(job *v1.RecurringJob, vol, volTarget string, run time.Time) client.Object {
	om := metav1.ObjectMeta{
		Namespace:   job.Namespace,
		Name:        objectName(job.Name, vol, run),
		Labels:      map[string]string{v1.LabelRecurringJob: job.Name, volumes.LabelVolume: vol},
		Annotations: map[string]string{AnnotationScheduledTime: run.UTC().Format(time.RFC3339)},
	}
	if job.Spec.Task == v1.RecurringJobTaskBackup {
		target := job.Spec.Target
		if target == "" {
			target = volTarget
		}
		return &v1.Backup{ObjectMeta: om, Spec: v1.BackupSpec{Volume: vol, Target: target}}
	}
	return &v1.Snapshot{ObjectMeta: om, Spec: v1.SnapshotSpec{Volume: vol}}
}

// runResult counts the run's objects: the volumes are those selected
// now and any the run made an object of; noTarget (selected, but with no
// target to back up to) are named, not counted.
func runResult(job *v1.RecurringJob, run time.Time, vols, noTarget []string, items []item) *v1.RecurringJobRunResult {
	res := &v1.RecurringJobRunResult{ScheduledTime: metav1.NewTime(run)}
	seen := map[string]bool{}
	for _, v := range vols {
		seen[v] = false
	}
	var running, failedNames []string
	for _, it := range items {
		if !it.scheduled.Equal(run) {
			continue
		}
		seen[it.volume] = true
		switch {
		case it.done:
			res.Succeeded++
		case it.failed:
			res.Failed++
			failedNames = append(failedNames, it.volume)
		default:
			running = append(running, it.volume)
		}
	}
	waiting := 0
	for _, made := range seen {
		if !made {
			waiting++
		}
	}
	res.Volumes = int32(len(seen))
	var parts []string
	if len(running) > 0 {
		parts = append(parts, fmt.Sprintf("%d in progress (%s)", len(running), short(running)))
	}
	if waiting > 0 {
		parts = append(parts, fmt.Sprintf("%d not started yet (at most %d at once)", waiting, max(job.Spec.Concurrency, 1)))
	}
	if len(failedNames) > 0 {
		parts = append(parts, fmt.Sprintf("%d failing and retried by their reconciler (%s)", len(failedNames), short(failedNames)))
	}
	if len(parts) == 0 {
		parts = append(parts, fmt.Sprintf("%d of %d volumes done", res.Succeeded, res.Volumes))
	}
	if len(noTarget) > 0 {
		parts = append(parts, fmt.Sprintf("%d skipped: no backup target (spec.target is empty and the Volume has no spec.backupTarget; set the StorageClass parameter backupTarget or the job's spec.target) (%s)", len(noTarget), short(noTarget)))
	}
	res.Message = strings.Join(parts, "; ")
	return res
}

// short lists names, at most five of them.
func short(names []string) string {
	slices.Sort(names)
	if len(names) > 5 {
		return strings.Join(names[:5], ", ") + fmt.Sprintf(" and %d more", len(names)-5)
	}
	return strings.Join(names, ", ")
}

// prune deletes, per volume, the completed objects older than the
// newest spec.retain completed ones. Unfinished and failing objects are
// neither counted nor deleted.
func (r *Reconciler) prune(ctx context.Context, job *v1.RecurringJob, items []item) error {
	for _, it := range toPrune(items, int(job.Spec.Retain)) {
		// If we crash after the delete, the object is already going
		// (deleting) and is not counted or deleted again.
		if err := r.Client.Delete(ctx, it.obj); client.IgnoreNotFound(err) != nil {
			return fmt.Errorf("delete %s %s: %w", job.Spec.Task, it.obj.GetName(), err)
		}
		objects.Event(r.Recorder, job, false, EventPruned, "Prune", "deleted %s %s of volume %s (keeping the newest %d)", job.Spec.Task, it.obj.GetName(), it.volume, job.Spec.Retain)
	}
	return nil
}

// toPrune picks, per volume, the completed items beyond the newest
// retain completed ones by scheduled time.
func toPrune(items []item, retain int) []item {
	byVol := map[string][]item{}
	for _, it := range items {
		if it.done && !it.deleting {
			byVol[it.volume] = append(byVol[it.volume], it)
		}
	}
	var out []item
	for _, its := range byVol {
		slices.SortFunc(its, func(a, b item) int {
			if c := b.scheduled.Compare(a.scheduled); c != 0 {
				return c
			}
			return strings.Compare(b.obj.GetName(), a.obj.GetName())
		})
		if len(its) > retain {
			out = append(out, its[retain:]...)
		}
	}
	return out
}
