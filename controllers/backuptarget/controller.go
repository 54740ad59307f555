// Package backuptarget reconciles BackupTargets: it checks that an S3 or
// NFS target is reachable and writable, by listing, writing, reading back
// and deleting a probe object under the target's prefix, and reports the
// result in condition Available. Nothing else is written to the target, so
// the check never touches backups. An NFS target is spoken to from user
// space (backupstore.NFSTarget): nothing is mounted.
package backuptarget

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/go-logr/logr"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/predicate"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
)

// Defaults for Options.
const (
	// DefaultProbeTimeout bounds one check of a target, every call in it.
	DefaultProbeTimeout = 30 * time.Second
	// DefaultMinRetry is the first re-check of a failing target.
	DefaultMinRetry = 5 * time.Second
	// defaultPollInterval is used when spec.pollInterval is unset (the
	// API server defaults it; this covers objects stored before that).
	defaultPollInterval = 5 * time.Minute
)

// Reconciler checks BackupTargets and writes their status; it is the only
// writer of BackupTarget status.
type Reconciler struct {
	// Client reads and patches BackupTargets (the manager's client).
	Client client.Client
	// Reader reads the Secrets and ConfigMaps a target names, straight
	// from the API server: no Secret is cached by the manager for this.
	Reader client.Reader
	// Log is the reconciler's logger.
	Log logr.Logger
	// ProbeTimeout bounds one check (DefaultProbeTimeout if zero).
	ProbeTimeout time.Duration
	// MinRetry is the first re-check of a failing target; each later one
	// waits as long as the target has been failing, up to its
	// pollInterval (DefaultMinRetry if zero).
	MinRetry time.Duration
	// Now is the clock (time.Now if nil).
	Now func() time.Time
}

// +kubebuilder:rbac:groups=storage.cairn.io,resources=backuptargets,verbs=get;list;watch
// +kubebuilder:rbac:groups=storage.cairn.io,resources=backuptargets/status,verbs=get;update;patch
// +kubebuilder:rbac:groups="",resources=secrets,verbs=get
// +kubebuilder:rbac:groups="",resources=configmaps,verbs=get

// Reconcile checks one BackupTarget and records the result. A check's
// outcome is status, not an error: only a failure to read the referenced
// objects or to write the status is returned (and retried with back-off).
func (r *Reconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	bt := &v1.BackupTarget{}
	if err := r.Client.Get(ctx, req.NamespacedName, bt); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	if !bt.DeletionTimestamp.IsZero() {
		return ctrl.Result{}, nil // no finalizer: nothing to clean up
	}
	before := bt.DeepCopy()
	res, err := r.check(ctx, bt)
	if err != nil {
		return ctrl.Result{}, err
	}
	now := r.now()
	r.recordStatus(bt, res, now)
	if err := r.Client.Status().Patch(ctx, bt, client.MergeFrom(before)); err != nil {
		if apierrors.IsNotFound(err) {
			return ctrl.Result{}, nil
		}
		return ctrl.Result{}, fmt.Errorf("patch BackupTarget %s status: %w", bt.Name, err)
	}
	return ctrl.Result{RequeueAfter: r.nextCheck(bt, now)}, nil
}

// check runs the check the target's type allows.
func (r *Reconciler) check(ctx context.Context, bt *v1.BackupTarget) (result, error) {
	cfg, res, err := r.config(ctx, bt.Spec)
	if err != nil || res != nil {
		if res != nil {
			return *res, nil
		}
		return result{}, err
	}
	ctx, cancel := context.WithTimeout(ctx, r.probeTimeout())
	defer cancel()
	p := probe{cfg: cfg, uid: string(bt.UID), timeout: r.probeTimeout().String()}
	if bt.Spec.S3 != nil {
		p.secret = bt.Spec.S3.CredentialsSecret
	}
	return p.run(ctx), nil
}

// recordStatus writes the summary fields and the Available condition.
func (r *Reconciler) recordStatus(bt *v1.BackupTarget, res result, now time.Time) {
	bt.Status.ObservedGeneration = bt.Generation
	bt.Status.Type, bt.Status.URL = describe(bt.Spec)
	bt.Status.LastCheckTime = &metav1.Time{Time: now}
	meta.SetStatusCondition(&bt.Status.Conditions, metav1.Condition{
		Type: v1.BackupTargetConditionAvailable, Status: res.status, Reason: res.reason,
		Message: res.message, ObservedGeneration: bt.Generation, LastTransitionTime: metav1.Time{Time: now},
	})
	if res.status != metav1.ConditionTrue {
		r.Log.Info("backup target not available", "target", bt.Name, "reason", res.reason, "message", res.message)
	}
}

// nextCheck is when to check bt again: its poll interval while it is
// available; while it fails, as long as it has been failing (so waits
// double), at least MinRetry and at most the poll interval.
func (r *Reconciler) nextCheck(bt *v1.BackupTarget, now time.Time) time.Duration {
	poll := defaultPollInterval
	if bt.Spec.PollInterval != nil && bt.Spec.PollInterval.Duration > 0 {
		poll = bt.Spec.PollInterval.Duration
	}
	c := meta.FindStatusCondition(bt.Status.Conditions, v1.BackupTargetConditionAvailable)
	if c == nil || c.Status == metav1.ConditionTrue {
		return poll
	}
	return min(max(now.Sub(c.LastTransitionTime.Time), r.minRetry()), poll)
}

// describe gives the target's type and a URL naming it, for status.
func describe(spec v1.BackupTargetSpec) (v1.BackupTargetType, string) {
	switch {
	case spec.S3 != nil:
		u := "s3://" + spec.S3.Bucket
		if p := trimSlashes(spec.S3.Prefix); p != "" {
			u += "/" + p
		}
		return v1.BackupTargetTypeS3, u + " at " + spec.S3.Endpoint
	case spec.NFS != nil:
		u := "nfs://" + spec.NFS.Server + spec.NFS.Path
		if p := trimSlashes(spec.NFS.Prefix); p != "" {
			u = strings.TrimSuffix(u, "/") + "/" + p
		}
		return v1.BackupTargetTypeNFS, u
	}
	return "", ""
}

func (r *Reconciler) now() time.Time {
	if r.Now != nil {
		return r.Now()
	}
	return time.Now()
}

func (r *Reconciler) probeTimeout() time.Duration {
	if r.ProbeTimeout > 0 {
		return r.ProbeTimeout
	}
	return DefaultProbeTimeout
}

func (r *Reconciler) minRetry() time.Duration {
	if r.MinRetry > 0 {
		return r.MinRetry
	}
	return DefaultMinRetry
}

// SetupWithManager registers the reconciler. Only spec changes (and the
// re-checks it schedules) trigger a check: its own status writes do not.
// The Secrets a target names are not watched (that would need a Secret
// informer in the manager); a target failing for want of one is
// re-checked within its back-off, so a fixed Secret is seen by then.
func (r *Reconciler) SetupWithManager(mgr ctrl.Manager) error {
	if r.Client == nil {
		r.Client = mgr.GetClient()
	}
	if r.Reader == nil {
		r.Reader = mgr.GetAPIReader()
	}
	if r.Log.GetSink() == nil {
		r.Log = mgr.GetLogger().WithName("backuptarget")
	}
	return ctrl.NewControllerManagedBy(mgr).
		Named("backuptarget").
		For(&v1.BackupTarget{}, builder.WithPredicates(predicate.GenerationChangedPredicate{})).
		// A check may wait its whole timeout on a stalled endpoint; a few
		// at once keep one such target from delaying the others'.
		WithOptions(controller.Options{MaxConcurrentReconciles: 4}).
		Complete(r)
}
