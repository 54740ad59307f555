package backup

import (
	"context"
	"errors"
	"fmt"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/backuptarget"
	"github.com/cairn-io/cairn/dataplane/backupstore"
)

// gcBusyRequeue is how soon a deletion whose garbage collection found a
// backup or restore of the volume running tries again.
const gcBusyRequeue = 30 * time.Second

// reconcileDelete cancels a running upload, deletes the backup from the
// target (its manifest, then the blocks no other backup references),
// deletes the Snapshot it took and lets the object go. A Backup that never started an upload wrote
// nothing; a target that no longer exists cannot be cleaned (the backup
// stays on the bucket, and the object goes).
func (r *Reconciler) reconcileDelete(ctx context.Context, b *v1.Backup) (ctrl.Result, error) {
	if !controllerutil.ContainsFinalizer(b, Finalizer) {
		return ctrl.Result{}, nil
	}
	key := client.ObjectKeyFromObject(b)
	if ended := r.uploads.cancel(key); ended != nil {
		select {
		case <-ended:
		case <-ctx.Done():
			return ctrl.Result{}, ctx.Err()
		}
	}
	if b.Status.Attempts > 0 {
		if res, err := r.deleteFromTarget(ctx, b); err != nil || !res.IsZero() {
			return res, err
		}
	}
	if err := r.deleteOwnSnapshot(ctx, b); err != nil {
		return ctrl.Result{}, err
	}
	controllerutil.RemoveFinalizer(b, Finalizer)
	return ctrl.Result{}, client.IgnoreNotFound(r.Client.Update(ctx, b))
}

// deleteOwnSnapshot deletes the Snapshot the Backup took (named after it,
// controlled by it). The owner reference alone does not: the Snapshot's
// reconciler makes the Volume an owner too, and the garbage collector
// deletes a dependent only once every owner is gone, so the snapshot
// would stay on the replicas (and keep the volume's PV from being
// deleted) until the Volume went.
func (r *Reconciler) deleteOwnSnapshot(ctx context.Context, b *v1.Backup) error {
	if b.Spec.Snapshot != "" {
		return nil // the user's: it stays
	}
	s := &v1.Snapshot{}
	if err := r.Client.Get(ctx, client.ObjectKey{Namespace: b.Namespace, Name: snapshotName(b)}, s); err != nil {
		return client.IgnoreNotFound(err)
	}
	if !metav1.IsControlledBy(s, b) || !s.DeletionTimestamp.IsZero() {
		return nil
	}
	return client.IgnoreNotFound(r.Client.Delete(ctx, s, client.Preconditions{UID: &s.UID}))
}

// deleteFromTarget deletes this Backup's backup (one it wrote: its label
// says so) and collects the volume's garbage. A zero result with no error
// means done.
func (r *Reconciler) deleteFromTarget(ctx context.Context, b *v1.Backup) (ctrl.Result, error) {
	bt := &v1.BackupTarget{}
	if err := r.Client.Get(ctx, client.ObjectKey{Name: b.Spec.Target}, bt); err != nil {
		if apierrors.IsNotFound(err) {
			r.Log.Info("deleting a Backup whose BackupTarget is gone: its data stays on the target", "backup", client.ObjectKeyFromObject(b), "target", b.Spec.Target)
			return ctrl.Result{}, nil
		}
		return ctrl.Result{}, err
	}
	status := func(msg string, requeue time.Duration) (ctrl.Result, error) {
		before := b.DeepCopy()
		setState(b, b.Status.State, v1.BackupReasonTargetUnavailable, msg)
		return ctrl.Result{RequeueAfter: requeue}, client.IgnoreNotFound(r.Client.Status().Patch(ctx, b, client.MergeFrom(before)))
	}
	cfg, reason, msg, err := backuptarget.TargetConfig(ctx, r.Reader, bt.Spec)
	if err != nil {
		return ctrl.Result{}, err
	}
	if reason != "" {
		return status(fmt.Sprintf("deleting: BackupTarget %s: %s (%s); or remove finalizer %s to leave the backup on the target", bt.Name, msg, reason, Finalizer), waitRequeue)
	}
	store, closeStore, err := r.openStore(cfg)
	if err != nil {
		return ctrl.Result{}, err
	}
	defer closeStore()
	vol, name := b.Spec.Volume, b.Name
	m, err := store.Manifest(ctx, vol, name)
	switch {
	case errors.Is(err, backupstore.ErrBackupNotFound):
		// Never written, or deleted before a crash that kept the
		// finalizer: collect what an interrupted upload left.
	case err != nil:
		return ctrl.Result{}, fmt.Errorf("read backup %s/%s: %w", vol, name, err)
	case m.Labels[LabelBackupUID] != string(b.UID):
		return ctrl.Result{}, nil // another Backup's: not ours to delete
	default:
		// If we crash after this, the next reconcile finds no manifest
		// and goes on to the collection.
		if err := store.Delete(ctx, vol, name); err != nil && !errors.Is(err, backupstore.ErrBackupNotFound) {
			return ctrl.Result{}, fmt.Errorf("delete backup %s/%s: %w", vol, name, err)
		}
	}
	if _, err := store.CollectGarbage(ctx, vol); err != nil {
		if errors.Is(err, backupstore.ErrBusy) {
			return status(fmt.Sprintf("deleting: the backup is deleted; its blocks are collected once no backup or restore of volume %s runs", vol), gcBusyRequeue)
		}
		return ctrl.Result{}, fmt.Errorf("collect garbage of volume %s: %w", vol, err)
	}
	return ctrl.Result{}, nil
}

func (r *Reconciler) dialOptions() []grpc.DialOption {
	if len(r.DialOptions) > 0 {
		return r.DialOptions
	}
	return []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}
}
