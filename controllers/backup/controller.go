// Package backup reconciles Backups: it takes (or uses) a Snapshot of the
// volume, reads it from one healthy RW replica through the replica's
// read-only control calls (dataplane/snapshotsource, the code of
// `cairn-data backup`) and uploads it with the backup store, in this
// process, incremental to the last completed backup of the same volume on
// the same target. Deleting a Backup deletes it from the target.
//
// Uploads run in goroutines of the manager, at most MaxUploads at once;
// each patches its progress into the Backup's status and, when it ends,
// wakes the reconciler, which records the outcome. A Backup found
// inProgress with no upload running in this process (the manager
// restarted) is started again; it is reported completed only once its
// manifest is on the target.
package backup

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"time"

	"github.com/go-logr/logr"
	"google.golang.org/grpc"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"
	"sigs.k8s.io/controller-runtime/pkg/source"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/certs"
	"github.com/cairn-io/cairn/dataplane/backupstore"
)

// Finalizer keeps a Backup until its backup is deleted from the target.
const Finalizer = "storage.cairn.io/backup"

// Event reasons, on the Backup.
const (
	// EventCompleted (Normal): the manifest is written.
	EventCompleted = "BackupCompleted"
	// EventFailed (Warning): an attempt failed; the message says why and
	// when it is retried.
	EventFailed = "BackupFailed"
)

// Defaults for the Reconciler's settings.
const (
	DefaultStallTimeout     = 2 * time.Minute
	DefaultProgressInterval = 2 * time.Second
	DefaultMaxUploads       = 2
	DefaultRetryBackoff     = 10 * time.Second
	maxRetryBackoff         = 5 * time.Minute
	// waitRequeue is how soon a Backup waiting for an upload slot, or for
	// a target whose Secret was missing (Secrets are not watched), is
	// looked at again.
	waitRequeue = 10 * time.Second
	// staleRequeue is how soon a Backup whose cached copy was behind the
	// API server is looked at again, should its watch event be lost.
	staleRequeue = time.Second
)

// Labels every backup's manifest carries, so that the reconciler picks a
// parent of the same Volume object only and never deletes or adopts a
// backup another Backup object wrote.
const (
	LabelVolumeUID = "cairn.io/volume-uid"
	LabelBackupUID = "cairn.io/backup-uid"
	LabelBackup    = "cairn.io/backup"
)

// Reconciler runs Backups; it is the only writer of Backup status (its
// uploads' progress patches included).
type Reconciler struct {
	// Client reads and writes Cairn's objects (the manager's client).
	Client client.Client
	// Reader reads the Secrets and ConfigMaps a BackupTarget names,
	// straight from the API server (the manager caches no Secrets).
	Reader client.Reader
	// Log is the reconciler's logger.
	Log logr.Logger
	// DialOptions for the replicas' control API; default: no transport
	// security (loopback tests; a cluster gives mutual TLS credentials).
	DialOptions []grpc.DialOption
	// Keys are the volumes' data-connection keys and DataTLS the client
	// TLS of the replicas' data ports (instance managers with
	// --data-tls): a backup reads the snapshot over the replica's data
	// port as the volume's engine connects to it, and over the control API
	// where the port does not serve it. Nil: no key (replicas that take
	// none, as in tests without Cairn's CA) and plain.
	Keys    certs.VolumeKeys
	DataTLS *tls.Config
	// StoreOptions tune the backup store (call timeout, lease duration).
	StoreOptions backupstore.Options
	// StallTimeout: an upload that reads nothing for this long is
	// cancelled and retried (DefaultStallTimeout if zero).
	StallTimeout time.Duration
	// ProgressInterval is the least time between two progress patches
	// (DefaultProgressInterval if zero).
	ProgressInterval time.Duration
	// MaxUploads is how many uploads run at once (DefaultMaxUploads if
	// zero).
	MaxUploads int
	// RetryBackoff is the wait after a first failure, doubled after each
	// further one up to 5 minutes (DefaultRetryBackoff if zero).
	RetryBackoff time.Duration
	// Recorder records Events on Backups (nil: none).
	Recorder events.EventRecorder

	uploads uploads
	// onProgress, if set, sees every progress report (tests).
	onProgress func(key types.NamespacedName, done, total int64)
}

// +kubebuilder:rbac:groups=storage.cairn.io,resources=backups,verbs=get;list;watch;update;patch
// +kubebuilder:rbac:groups=storage.cairn.io,resources=backups/status,verbs=get;update;patch
// +kubebuilder:rbac:groups=storage.cairn.io,resources=backups/finalizers,verbs=update
// +kubebuilder:rbac:groups=storage.cairn.io,resources=snapshots,verbs=get;list;watch;create;delete
// +kubebuilder:rbac:groups=storage.cairn.io,resources=volumes;engines;replicas;backuptargets,verbs=get;list;watch
// +kubebuilder:rbac:groups="",resources=secrets,verbs=get
// +kubebuilder:rbac:groups="",resources=configmaps,verbs=get
// +kubebuilder:rbac:groups=events.k8s.io,resources=events,verbs=create;patch

// Reconcile moves one Backup along: inputs checked, snapshot ready,
// upload started, outcome recorded; or deletes it from the target.
func (r *Reconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	b := &v1.Backup{}
	if err := r.Client.Get(ctx, req.NamespacedName, b); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	if !b.DeletionTimestamp.IsZero() {
		return r.reconcileDelete(ctx, b)
	}
	if !controllerutil.ContainsFinalizer(b, Finalizer) {
		controllerutil.AddFinalizer(b, Finalizer)
		if err := r.Client.Update(ctx, b); err != nil {
			return ctrl.Result{}, err
		}
	}
	before := b.DeepCopy()
	res, recorded, err := r.reconcileBackup(ctx, b)
	b.Status.ObservedGeneration = b.Generation
	if perr := r.Client.Status().Patch(ctx, b, client.MergeFrom(before)); perr != nil && !apierrors.IsNotFound(perr) {
		return ctrl.Result{}, errors.Join(err, perr)
	}
	if recorded {
		// Only now: had the write failed, the next Reconcile records the
		// outcome again rather than starting the upload over.
		r.uploads.forget(req.NamespacedName)
	}
	return res, err
}

// reconcileBackup records a finished upload (recorded: its outcome is in
// b's status, to be forgotten once written), or checks the inputs and
// starts one.
func (r *Reconciler) reconcileBackup(ctx context.Context, b *v1.Backup) (res ctrl.Result, recorded bool, err error) {
	key := client.ObjectKeyFromObject(b)
	st, known := r.uploads.state(key)
	if b.Status.State == v1.BackupStateCompleted {
		return ctrl.Result{}, known && st.done, nil // a backup never changes
	}
	if known {
		if st.done {
			return r.recordOutcome(b, st.res, st.err), true, nil
		}
		return ctrl.Result{}, false, nil // the upload patches progress and wakes us when it ends
	}
	res, err = r.startUpload(ctx, b)
	return res, false, err
}

// startUpload checks b's inputs and starts its upload, unless it failed
// in a way retrying cannot help or waits to be retried.
func (r *Reconciler) startUpload(ctx context.Context, b *v1.Backup) (ctrl.Result, error) {
	key := client.ObjectKeyFromObject(b)
	if c := meta.FindStatusCondition(b.Status.Conditions, v1.BackupConditionCompleted); b.Status.State == v1.BackupStateFailed &&
		c != nil && c.Reason == v1.BackupReasonNameConflict {
		return ctrl.Result{}, nil // retrying cannot help; the message says what to do
	}
	if wait := r.retryWait(b); wait > 0 {
		return ctrl.Result{RequeueAfter: wait}, nil
	}
	// The cache can be behind this reconciler's own last write: the
	// outcome of the upload that just ended, recorded and forgotten.
	// Started from that view, the backup would be uploaded again and its
	// recorded status written over (bytesTotal back to 0 on a completed
	// Backup). An upload starts only from the object as the API server
	// has it now; the watch brings the newer one.
	if current, err := r.current(ctx, b); err != nil || !current {
		return ctrl.Result{RequeueAfter: staleRequeue}, err
	}
	j, res, err := r.prepare(ctx, b)
	if j == nil || err != nil {
		return res, err
	}
	switch r.uploads.start(key, func(ctx context.Context) (*backupstore.BackupResult, error) { return r.upload(ctx, j) }) {
	case startFull:
		setState(b, v1.BackupStatePending, v1.BackupReasonPending, fmt.Sprintf("waiting for an upload slot: %d backups upload at once in the manager", r.maxUploads()))
		return ctrl.Result{RequeueAfter: waitRequeue}, nil
	case startNotRunning:
		setState(b, v1.BackupStatePending, v1.BackupReasonPending, "waiting for the manager's upload runner to start (or it is stopping)")
		return ctrl.Result{RequeueAfter: time.Second}, nil
	}
	// If we crash after starting the upload but before this status is
	// written, the next manager finds the Backup pending and starts it;
	// if after, it finds it inProgress and starts it again. Either way
	// the backup counts as completed only once its manifest exists.
	now := metavTime()
	b.Status.Attempts++
	b.Status.StartTime = now
	b.Status.BackupName, b.Status.Snapshot, b.Status.Parent = j.name, j.snapshot, ""
	b.Status.BytesDone, b.Status.BytesTotal, b.Status.Progress = 0, 0, 0
	setState(b, v1.BackupStateInProgress, v1.BackupReasonInProgress, fmt.Sprintf("uploading snapshot %s from replica %s (%s) to target %s", j.snapshot, j.replica, j.replicaAddr, b.Spec.Target))
	return ctrl.Result{}, nil
}

// current says whether b (from the cache) is the API server's latest
// version of it.
func (r *Reconciler) current(ctx context.Context, b *v1.Backup) (bool, error) {
	live := &v1.Backup{}
	if err := r.Reader.Get(ctx, client.ObjectKeyFromObject(b), live); err != nil {
		return false, client.IgnoreNotFound(err)
	}
	return live.ResourceVersion == b.ResourceVersion, nil
}

// retryWait is how long a failed Backup still waits before its next
// attempt.
func (r *Reconciler) retryWait(b *v1.Backup) time.Duration {
	if b.Status.State != v1.BackupStateFailed || b.Status.LastFailureTime == nil {
		return 0
	}
	return time.Until(b.Status.LastFailureTime.Add(r.backoff(b.Status.Attempts)))
}

// backoff is the wait after attempts failed attempts.
func (r *Reconciler) backoff(attempts int32) time.Duration {
	d := r.RetryBackoff
	if d <= 0 {
		d = DefaultRetryBackoff
	}
	for i := int32(1); i < attempts && d < maxRetryBackoff; i++ {
		d *= 2
	}
	return min(d, maxRetryBackoff)
}

func (r *Reconciler) maxUploads() int {
	if r.MaxUploads > 0 {
		return r.MaxUploads
	}
	return DefaultMaxUploads
}

// Start runs the uploads' context: they stop when ctx ends, and Start
// returns once they have. The manager runs it (leader only).
func (r *Reconciler) Start(ctx context.Context) error {
	r.uploads.open(ctx, r.maxUploads())
	<-ctx.Done()
	r.uploads.wait()
	return nil
}

// Field indexes of Backups.
const (
	indexVolume   = "spec.volume"
	indexTarget   = "spec.target"
	indexSnapshot = "snapshot"
)

// SetupWithManager registers the reconciler and its uploads' runner. A
// Backup is looked at again when its volume, engine, snapshot or target
// changes, and when its upload ends.
func (r *Reconciler) SetupWithManager(mgr ctrl.Manager) error {
	if r.Client == nil {
		r.Client = mgr.GetClient()
	}
	if r.Reader == nil {
		r.Reader = mgr.GetAPIReader()
	}
	if r.Log.GetSink() == nil {
		r.Log = mgr.GetLogger().WithName("backup")
	}
	if r.Recorder == nil {
		r.Recorder = mgr.GetEventRecorder("cairn-backup")
	}
	if err := mgr.Add(r); err != nil {
		return err
	}
	idx := mgr.GetFieldIndexer()
	for name, fn := range map[string]func(*v1.Backup) string{
		indexVolume:   func(b *v1.Backup) string { return b.Spec.Volume },
		indexTarget:   func(b *v1.Backup) string { return b.Spec.Target },
		indexSnapshot: snapshotName,
	} {
		if err := idx.IndexField(context.Background(), &v1.Backup{}, name, func(o client.Object) []string { return []string{fn(o.(*v1.Backup))} }); err != nil {
			return err
		}
	}
	c := mgr.GetClient()
	by := func(field string, value func(client.Object) (ns, v string)) handler.EventHandler {
		return handler.EnqueueRequestsFromMapFunc(func(ctx context.Context, o client.Object) []reconcile.Request {
			ns, v := value(o)
			var list v1.BackupList
			opts := []client.ListOption{client.MatchingFields{field: v}}
			if ns != "" {
				opts = append(opts, client.InNamespace(ns))
			}
			if err := c.List(ctx, &list, opts...); err != nil {
				return nil
			}
			out := make([]reconcile.Request, 0, len(list.Items))
			for _, b := range list.Items {
				out = append(out, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(&b)})
			}
			return out
		})
	}
	return ctrl.NewControllerManagedBy(mgr).
		Named("backup").
		For(&v1.Backup{}).
		Watches(&v1.Snapshot{}, by(indexSnapshot, func(o client.Object) (string, string) { return o.GetNamespace(), o.GetName() })).
		Watches(&v1.Volume{}, by(indexVolume, func(o client.Object) (string, string) { return o.GetNamespace(), o.GetName() })).
		Watches(&v1.Engine{}, by(indexVolume, func(o client.Object) (string, string) { return o.GetNamespace(), o.(*v1.Engine).Spec.VolumeName })).
		Watches(&v1.BackupTarget{}, by(indexTarget, func(o client.Object) (string, string) { return "", o.GetName() })).
		WatchesRawSource(source.Channel(r.uploads.events(), &handler.EnqueueRequestForObject{})).
		WithOptions(controller.Options{MaxConcurrentReconciles: 4}).
		Complete(r)
}
