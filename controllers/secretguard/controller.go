// Package secretguard keeps the Secrets that Cairn's PersistentVolumes and
// VolumeSnapshotContents name for as long as those objects exist.
//
// A StorageClass's CSI secret parameters (provisioner, controller-publish,
// node-stage, ...) end up on each PersistentVolume it provisions: in
// spec.csi.*SecretRef and, for the provisioner secret, in the
// provisioner-deletion annotations. Kubernetes' sidecars and kubelet read
// those Secrets again before they act on the volume (the external-attacher
// before every attach and detach, the external-provisioner before delete,
// kubelet before a mount or a filesystem expansion) and fail while they
// are missing: a claim deleted together with its StorageClass's Secret (a
// namespace or an application's manifests removed) left its volume
// attached and undeleted for good. Cairn's driver itself needs none of
// their content after CreateVolume (an encrypted volume's key is in its
// own Secret in Cairn's namespace).
//
// Snapshots carry the same trap: a VolumeSnapshotClass's snapshotter
// secret is recorded on each VolumeSnapshotContent (the annotations
// AnnotationSnapshotDeletionSecretName and -Namespace), and the
// csi-snapshotter reads it before DeleteSnapshot and retries for good
// while it is missing. Cairn's driver does not need its content to delete
// a snapshot.
//
// The guard puts the finalizer Finalizer on every Secret that a
// PersistentVolume or VolumeSnapshotContent of Cairn's driver names and
// takes it off once none does: a Secret deleted while they exist stays
// (Terminating) until the last of them is gone, and then goes by itself.
// A PersistentVolume naming a Secret that does not exist gets a Warning
// Event (v1alpha1.EventReasonSecretMissing), and so does its claim, saying
// which Secret and how to make it again; a VolumeSnapshotContent and its
// VolumeSnapshot likewise. On a cluster without the external-snapshotter's
// CRDs the guard watches PersistentVolumes only (it looks once, when it
// starts, and logs that it does).
package secretguard

import (
	"context"
	"fmt"
	"slices"

	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"
	"sigs.k8s.io/controller-runtime/pkg/source"

	"github.com/cairn-io/cairn/controllers/workload"
)

// Finalizer is on every Secret a PersistentVolume of Cairn's driver names,
// while one does.
const Finalizer = "storage.cairn.io/secret-in-use"

// Reconciler guards the Secrets named by Cairn's PersistentVolumes and
// VolumeSnapshotContents. Its work item is a Secret's key; events of
// those objects map to the Secrets they name (before and after a change),
// Secret events to the Secret when one of them names it or it carries
// Finalizer.
type Reconciler struct {
	// Writer patches Secrets' finalizers (the manager's client: writes go
	// to the API server, as metadata only).
	Writer client.Writer
	// Reader reads Secrets and claims straight from the API server (the
	// manager's API reader), where the cache may lag: before a Secret is
	// reported missing, and for the claim the report also goes to.
	Reader client.Reader
	// Driver is the CSI driver whose PersistentVolumes are guarded
	// (workload.DriverName if empty).
	Driver string
	// Recorder records Events (SetupWithManager makes one if nil).
	Recorder events.EventRecorder
	// Log is where SetupWithManager says what it watches (the manager's
	// logger if unset); reconciles log through their context's logger.
	Log logr.Logger

	// cache holds Secrets' metadata, PersistentVolumes and, if snapshots,
	// VolumeSnapshotContents (newCache).
	cache cache.Cache
	// snapshots: the API server serves VolumeSnapshotContents, and the
	// guard watches them.
	snapshots bool
}

// +kubebuilder:rbac:groups="",resources=secrets,verbs=get;list;watch;patch
// +kubebuilder:rbac:groups="",resources=persistentvolumes,verbs=get;list;watch
// +kubebuilder:rbac:groups="",resources=persistentvolumeclaims,verbs=get
// +kubebuilder:rbac:groups=snapshot.storage.k8s.io,resources=volumesnapshotcontents,verbs=get;list;watch
// +kubebuilder:rbac:groups=snapshot.storage.k8s.io,resources=volumesnapshots,verbs=get
// +kubebuilder:rbac:groups=events.k8s.io,resources=events,verbs=create;patch

// Reconcile brings one Secret's finalizer in line with the
// PersistentVolumes and VolumeSnapshotContents that name it: on while any
// does, off when none does; a named Secret that does not exist is
// reported on them.
func (r *Reconciler) Reconcile(ctx context.Context, req reconcile.Request) (reconcile.Result, error) {
	users, err := r.usersOf(ctx, req.NamespacedName)
	if err != nil {
		return reconcile.Result{}, err
	}
	secret := secretMeta()
	switch err := r.cache.Get(ctx, req.NamespacedName, secret); {
	case apierrors.IsNotFound(err):
		secret = nil
	case err != nil:
		return reconcile.Result{}, fmt.Errorf("read Secret %s: %w", req.NamespacedName, err)
	}
	switch {
	case users.empty():
		return reconcile.Result{}, r.release(ctx, secret)
	case secret == nil:
		return reconcile.Result{}, r.reportMissing(ctx, req.NamespacedName, users)
	default:
		return reconcile.Result{}, r.hold(ctx, secret, users)
	}
}

// hold puts Finalizer on secret. A Secret already being deleted cannot
// take a new finalizer (the API server refuses it): it goes, and its
// volumes are reported when it has gone (its delete event brings it back
// here). If the manager crashes after the patch, the next reconcile finds
// the finalizer there; a conflicting change of the Secret fails the patch
// (it carries the resourceVersion it was computed from) and is retried.
func (r *Reconciler) hold(ctx context.Context, secret *metav1.PartialObjectMetadata, u users) error {
	if controllerutil.ContainsFinalizer(secret, Finalizer) {
		return nil
	}
	log := ctrl.LoggerFrom(ctx)
	if secret.DeletionTimestamp != nil {
		log.Info("Secret is being deleted and no finalizer can be added any more; the objects that name it will need it made again",
			u.keysAndValues()...)
		return nil
	}
	before := secret.DeepCopy()
	controllerutil.AddFinalizer(secret, Finalizer)
	if err := r.Writer.Patch(ctx, secret, client.MergeFromWithOptions(before, client.MergeFromWithOptimisticLock{})); err != nil {
		return client.IgnoreNotFound(fmt.Errorf("hold Secret %s/%s for PersistentVolumes %v and VolumeSnapshotContents %v: %w",
			secret.Namespace, secret.Name, names(u.pvs), contentNames(u.contents), err))
	}
	log.V(1).Info("holding Secret", u.keysAndValues()...)
	return nil
}

// release takes Finalizer off secret (nil: gone already). A Secret being
// deleted then goes. Crash story: the patch either happened (the next
// reconcile finds no finalizer) or did not (it is made again).
func (r *Reconciler) release(ctx context.Context, secret *metav1.PartialObjectMetadata) error {
	if secret == nil || !controllerutil.ContainsFinalizer(secret, Finalizer) {
		return nil
	}
	before := secret.DeepCopy()
	controllerutil.RemoveFinalizer(secret, Finalizer)
	if err := r.Writer.Patch(ctx, secret, client.MergeFromWithOptions(before, client.MergeFromWithOptimisticLock{})); err != nil {
		return client.IgnoreNotFound(fmt.Errorf("release Secret %s/%s: %w", secret.Namespace, secret.Name, err))
	}
	ctrl.LoggerFrom(ctx).V(1).Info("released Secret: no PersistentVolume or VolumeSnapshotContent names it")
	return nil
}

func names(pvs []corev1.PersistentVolume) []string {
	out := make([]string, 0, len(pvs))
	for i := range pvs {
		out = append(out, pvs[i].Name)
	}
	return out
}

// SetupWithManager registers the guard and its cache with mgr.
func (r *Reconciler) SetupWithManager(mgr ctrl.Manager) error {
	if r.Driver == "" {
		r.Driver = workload.DriverName
	}
	if r.Writer == nil {
		r.Writer = mgr.GetClient()
	}
	if r.Reader == nil {
		r.Reader = mgr.GetAPIReader()
	}
	if r.Recorder == nil {
		r.Recorder = mgr.GetEventRecorder("cairn-secret-guard")
	}
	if r.Log.GetSink() == nil {
		r.Log = mgr.GetLogger().WithName("secretguard")
	}
	snapshots, err := snapshotsServed(mgr.GetRESTMapper(), r.Log)
	if err != nil {
		return err
	}
	r.snapshots = snapshots
	c, err := newCache(mgr, r.Driver, snapshots)
	if err != nil {
		return err
	}
	r.cache = c
	toSecrets := func(_ context.Context, pv *corev1.PersistentVolume) []reconcile.Request {
		var out []reconcile.Request
		for _, s := range secretsOf(pv, r.Driver) {
			out = append(out, reconcile.Request{NamespacedName: s})
		}
		return out
	}
	b := ctrl.NewControllerManagedBy(mgr).
		Named("secretguard").
		WatchesRawSource(source.Kind(c, &corev1.PersistentVolume{}, handler.TypedEnqueueRequestsFromMapFunc(toSecrets))).
		WatchesRawSource(source.Kind(c, secretMeta(), &handler.TypedEnqueueRequestForObject[*metav1.PartialObjectMetadata]{},
			predicate.NewTypedPredicateFuncs(r.concerns)))
	if snapshots {
		contentToSecret := func(_ context.Context, u *unstructured.Unstructured) []reconcile.Request {
			if s, ok := contentSecret(u, r.Driver); ok {
				return []reconcile.Request{{NamespacedName: s}}
			}
			return nil
		}
		b = b.WatchesRawSource(source.Kind(c, contentObject(), handler.TypedEnqueueRequestsFromMapFunc(contentToSecret)))
	}
	r.Log.Info("guarding the Secrets of PersistentVolumes", "driver", r.Driver, "volumeSnapshotContents", snapshots)
	return b.Complete(r)
}

// concerns tells whether a Secret's event is the guard's business: it
// carries Finalizer (it may have to be released: its last user went
// while the manager was down), or a PersistentVolume or
// VolumeSnapshotContent of the driver names it (it was made again after
// being reported missing, or it is gone).
func (r *Reconciler) concerns(s *metav1.PartialObjectMetadata) bool {
	if slices.Contains(s.Finalizers, Finalizer) {
		return true
	}
	users, err := r.usersOf(context.Background(), types.NamespacedName{Namespace: s.Namespace, Name: s.Name})
	return err != nil || !users.empty()
}
