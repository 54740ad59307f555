// Package recurringjob reconciles RecurringJobs: on each scheduled time a
// job creates a Snapshot or a Backup of every Volume it selects (at most
// spec.concurrency unfinished at once), then deletes the oldest completed
// ones it made beyond spec.retain per volume. The Snapshot and Backup
// reconcilers do the work; this one only creates, counts and deletes
// their objects. A filesystem-trim job makes no objects: it asks the CSI
// node plugins, through an annotation on each attached Volume, to trim
// the volume's filesystem, and counts their answers (trim.go).
package recurringjob

import (
	"context"
	"errors"
	"fmt"
	"time"

	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/events"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/internal/objects"
)

// Event reasons.
const (
	EventRunStarted   = "RecurringJobRunStarted"
	EventCreateFailed = "RecurringJobCreateFailed"
	EventPruned       = "RecurringJobPruned"
)

// AnnotationScheduledTime is on every object a job makes: the scheduled
// time (RFC 3339, UTC) of the run that made it; retention keeps the
// newest by it.
const AnnotationScheduledTime = "storage.cairn.io/recurring-job-scheduled-time"

// Reconciler runs RecurringJobs.
type Reconciler struct {
	Client client.Client
	// Now is the clock (nil: time.Now); tests move it to scheduled times.
	Now func() time.Time
	// Recorder records Events (nil: none).
	Recorder events.EventRecorder
}

// +kubebuilder:rbac:groups=storage.cairn.io,resources=recurringjobs,verbs=get;list;watch;update;patch
// +kubebuilder:rbac:groups=storage.cairn.io,resources=recurringjobs/status,verbs=get;update;patch
// +kubebuilder:rbac:groups=storage.cairn.io,resources=snapshots;backups,verbs=get;list;watch;create;delete
// +kubebuilder:rbac:groups=storage.cairn.io,resources=volumes,verbs=get;list;watch;patch
// +kubebuilder:rbac:groups=storage.cairn.io,resources=backuptargets,verbs=get;list;watch
// +kubebuilder:rbac:groups=events.k8s.io,resources=events,verbs=create;patch

func (r *Reconciler) now() time.Time {
	if r.Now != nil {
		return r.Now().UTC()
	}
	return time.Now().UTC()
}

// Reconcile starts the run that is due, creates what the current run
// still lacks, prunes beyond retain, and writes status once at the end.
func (r *Reconciler) Reconcile(ctx context.Context, req ctrl.Request) (res ctrl.Result, err error) {
	job := &v1.RecurringJob{}
	if err := r.Client.Get(ctx, req.NamespacedName, job); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	if !job.DeletionTimestamp.IsZero() {
		// What the job made stays: it has no owner reference to the job.
		return ctrl.Result{}, nil
	}
	before := job.DeepCopy()
	defer func() {
		job.Status.ObservedGeneration = job.Generation
		if equality.Semantic.DeepEqual(before.Status, job.Status) {
			return // Volumes change often; an unchanged status is not written
		}
		if perr := r.Client.Status().Patch(ctx, job, client.MergeFrom(before)); perr != nil {
			err = errors.Join(err, client.IgnoreNotFound(perr))
		}
	}()
	return r.reconcileJob(ctx, job)
}

// attachmentChanged passes a Volume's update that attaches or detaches
// it: a filesystem-trim job asks to trim an attached volume and skips a
// detached one.
var attachmentChanged = predicate.Funcs{
	CreateFunc:  func(event.CreateEvent) bool { return true },
	DeleteFunc:  func(event.DeleteEvent) bool { return true },
	GenericFunc: func(event.GenericEvent) bool { return false },
	UpdateFunc: func(e event.UpdateEvent) bool {
		o, ok1 := e.ObjectOld.(*v1.Volume)
		n, ok2 := e.ObjectNew.(*v1.Volume)
		return ok1 && ok2 && (o.Status.State == v1.VolumeStateAttached) != (n.Status.State == v1.VolumeStateAttached)
	},
}

func setReady(job *v1.RecurringJob, ok bool, reason, msg string) {
	objects.SetCondition(&job.Status.Conditions, job.Generation, v1.RecurringJobConditionReady, ok, reason, msg)
}

// reconcileJob is Reconcile's work on job's status in memory.
func (r *Reconciler) reconcileJob(ctx context.Context, job *v1.RecurringJob) (ctrl.Result, error) {
	now := r.now()
	sch, err := parseSchedule(job.Spec.Schedule)
	if err != nil {
		job.Status.NextRunTime = nil
		setReady(job, false, v1.RecurringJobReasonInvalidSchedule, fmt.Sprintf("spec.schedule %q is not a 5-field cron expression (minute hour day-of-month month day-of-week, UTC) or an @hourly-style descriptor: %v", job.Spec.Schedule, err))
		return ctrl.Result{}, nil // a spec change brings us back
	}
	var last time.Time
	if job.Status.LastRunTime != nil {
		last = job.Status.LastRunTime.Time
	}
	p := planRun(sch, last, job.CreationTimestamp.UTC(), now)
	ready, reason, msg, err := r.checkSpec(ctx, job)
	if err != nil {
		return ctrl.Result{}, err
	}
	switch {
	case job.Spec.Suspend:
		job.Status.NextRunTime = nil
		setReady(job, true, v1.RecurringJobReasonSuspended, "spec.suspend is true: no run starts until it is false")
	case !ready:
		job.Status.NextRunTime = timePtr(p.next)
		setReady(job, false, reason, msg)
	default:
		job.Status.NextRunTime = timePtr(p.next)
		setReady(job, true, v1.RecurringJobReasonScheduled, fmt.Sprintf("runs on schedule %q (UTC)", job.Spec.Schedule))
		if !p.due.IsZero() {
			startRun(job, p.due)
			objects.Event(r.Recorder, job, false, EventRunStarted, "Run", "run for %s started", p.due.Format(time.RFC3339))
		}
	}
	if err := r.work(ctx, job, !job.Spec.Suspend && ready); err != nil {
		return ctrl.Result{}, err
	}
	if job.Status.NextRunTime == nil {
		return ctrl.Result{}, nil
	}
	// The wait for the next scheduled time is a wait about time; the
	// objects' changes bring us back for everything else.
	return ctrl.Result{RequeueAfter: max(job.Status.NextRunTime.Sub(now), time.Second)}, nil
}

// startRun records the run for scheduled as the current one. If we crash
// after creating its objects but before this status is written, the
// repeated run finds them by name.
func startRun(job *v1.RecurringJob, scheduled time.Time) {
	job.Status.LastRunTime = timePtr(scheduled)
	job.Status.LastResult = &v1.RecurringJobRunResult{ScheduledTime: metav1.NewTime(scheduled)}
}

func timePtr(t time.Time) *metav1.Time {
	if t.IsZero() {
		return nil
	}
	return &metav1.Time{Time: t}
}

// checkSpec checks what the CRD's validation cannot: a backup job's
// target exists. Without one, each volume's own target is used, and a
// Backup to a missing one says so itself.
func (r *Reconciler) checkSpec(ctx context.Context, job *v1.RecurringJob) (bool, string, string, error) {
	if job.Spec.Task != v1.RecurringJobTaskBackup || job.Spec.Target == "" {
		return true, "", "", nil
	}
	bt := &v1.BackupTarget{}
	if err := r.Client.Get(ctx, client.ObjectKey{Name: job.Spec.Target}, bt); err != nil {
		if apierrors.IsNotFound(err) {
			return false, v1.RecurringJobReasonTargetNotFound, fmt.Sprintf("spec.target %q names no BackupTarget: runs are skipped until it exists (the latest scheduled time then runs if it is less than one period ago)", job.Spec.Target), nil
		}
		return false, "", "", err
	}
	return true, "", "", nil
}

// SetupWithManager registers the reconciler: a job is looked at again
// when an object it made changes (counted in its status, pruned), a
// Volume is created, deleted or relabelled (selection), re-annotated (a
// node plugin's answer to a trim) or attached or detached, or its
// BackupTarget appears.
func (r *Reconciler) SetupWithManager(mgr ctrl.Manager) error {
	if r.Recorder == nil {
		r.Recorder = mgr.GetEventRecorder("cairn-recurringjob")
	}
	c := mgr.GetClient()
	byLabel := handler.EnqueueRequestsFromMapFunc(func(_ context.Context, o client.Object) []reconcile.Request {
		name := o.GetLabels()[v1.LabelRecurringJob]
		if name == "" {
			return nil
		}
		return []reconcile.Request{{NamespacedName: client.ObjectKey{Namespace: o.GetNamespace(), Name: name}}}
	})
	all := func(ctx context.Context, ns string, match func(*v1.RecurringJob) bool) []reconcile.Request {
		var jobs v1.RecurringJobList
		opts := []client.ListOption{}
		if ns != "" {
			opts = append(opts, client.InNamespace(ns))
		}
		if err := c.List(ctx, &jobs, opts...); err != nil {
			return nil
		}
		var out []reconcile.Request
		for i := range jobs.Items {
			if match(&jobs.Items[i]) {
				out = append(out, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(&jobs.Items[i])})
			}
		}
		return out
	}
	return ctrl.NewControllerManagedBy(mgr).
		For(&v1.RecurringJob{}).
		Watches(&v1.Snapshot{}, byLabel).
		Watches(&v1.Backup{}, byLabel).
		Watches(&v1.Volume{}, handler.EnqueueRequestsFromMapFunc(func(ctx context.Context, o client.Object) []reconcile.Request {
			return all(ctx, o.GetNamespace(), func(*v1.RecurringJob) bool { return true })
		}), builder.WithPredicates(predicate.Or[client.Object](predicate.LabelChangedPredicate{}, predicate.AnnotationChangedPredicate{}, attachmentChanged))).
		Watches(&v1.BackupTarget{}, handler.EnqueueRequestsFromMapFunc(func(ctx context.Context, o client.Object) []reconcile.Request {
			return all(ctx, "", func(j *v1.RecurringJob) bool {
				return j.Spec.Task == v1.RecurringJobTaskBackup && j.Spec.Target == o.GetName()
			})
		})).
		Named("recurringjob").
		Complete(r)
}
