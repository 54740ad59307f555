// Package snapshot reconciles Snapshot objects into snapshots on every
// replica of their volume, taken and deleted through the volume's running
// engine (a crash-consistent snapshot: I/O paused, every replica
// snapshotted under the Snapshot's name, I/O resumed). The engine is the
// user's while the volume is attached; for a detached volume the Volume
// reconciler, which sees the pending work here, runs the replicas and a
// maintenance engine without a device until it is done.
package snapshot

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	grpcstatus "google.golang.org/grpc/status"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/events"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/imclient"
	"github.com/cairn-io/cairn/controllers/internal/objects"
	"github.com/cairn-io/cairn/controllers/internal/process"
	"github.com/cairn-io/cairn/controllers/internal/volumes"
	enginev1 "github.com/cairn-io/cairn/dataplane/api/engine/v1"
)

// Finalizer keeps a Snapshot until its data is deleted from every replica
// its volume's engine holds (or the volume is gone, and its data with it).
const Finalizer = volumes.SnapshotFinalizer

// Event reasons.
const (
	EventTaken        = "SnapshotTaken"
	EventFailed       = "SnapshotFailed"
	EventDeleted      = "SnapshotDeleted"
	EventDeleteFailed = "SnapshotDeleteFailed"
)

// IndexVolume indexes Snapshots by spec.volume.
const IndexVolume = "spec.volume"

// callTimeout bounds a snapshot call to the engine: it flushes every
// replica with I/O paused, and a deletion merges the snapshot's data.
const callTimeout = 60 * time.Second

// Reconciler takes and deletes Snapshots.
type Reconciler struct {
	Client client.Client
	// Pool is the instance managers' connections: an engine is called
	// only while its node's instance manager reports the process running.
	Pool *imclient.Pool
	// DialOptions for the engines' control API; default: no transport
	// security (loopback tests; a cluster gives mutual TLS credentials).
	DialOptions []grpc.DialOption
	// Recorder records Events (nil: none).
	Recorder events.EventRecorder
}

// +kubebuilder:rbac:groups=storage.cairn.io,resources=snapshots,verbs=get;list;watch;create;update;patch;delete
// +kubebuilder:rbac:groups=storage.cairn.io,resources=snapshots/status,verbs=get;update;patch
// +kubebuilder:rbac:groups=storage.cairn.io,resources=snapshots/finalizers,verbs=update
// +kubebuilder:rbac:groups=storage.cairn.io,resources=volumes;engines,verbs=get;list;watch
// +kubebuilder:rbac:groups=events.k8s.io,resources=events,verbs=create;patch

// Reconcile takes the snapshot once, or deletes it.
func (r *Reconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	s := &v1.Snapshot{}
	if err := r.Client.Get(ctx, req.NamespacedName, s); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	if !s.DeletionTimestamp.IsZero() {
		return r.reconcileDelete(ctx, s)
	}
	vol := &v1.Volume{}
	err := r.Client.Get(ctx, client.ObjectKey{Namespace: s.Namespace, Name: s.Spec.Volume}, vol)
	if err != nil && !apierrors.IsNotFound(err) {
		return ctrl.Result{}, err
	}
	if err != nil {
		vol = nil
	}
	// The finalizer, the volume label (how the Volume reconciler finds
	// pending work) and, where the volume exists, an owner reference (a
	// cluster's garbage collector deletes the Snapshots of a deleted
	// Volume; the finalizer then just goes) in one update.
	before := s.DeepCopy()
	controllerutil.AddFinalizer(s, Finalizer)
	if s.Labels == nil {
		s.Labels = map[string]string{}
	}
	s.Labels[volumes.LabelVolume] = s.Spec.Volume
	if vol != nil {
		if err := controllerutil.SetOwnerReference(vol, s, r.Client.Scheme()); err != nil {
			return ctrl.Result{}, err
		}
	}
	if !equalMeta(before, s) {
		if err := r.Client.Update(ctx, s); err != nil {
			return ctrl.Result{}, err
		}
	}
	before = s.DeepCopy()
	err = r.take(ctx, s, vol)
	s.Status.ObservedGeneration = s.Generation
	if perr := r.Client.Status().Patch(ctx, s, client.MergeFrom(before)); perr != nil {
		return ctrl.Result{}, errors.Join(err, perr)
	}
	return ctrl.Result{}, err
}

// equalMeta reports whether the finalizers, labels and owner references
// Reconcile keeps are unchanged, by value (an owner reference's
// controller and blockOwnerDeletion are pointers), so a Snapshot that has
// them is not updated again.
func equalMeta(a, b *v1.Snapshot) bool {
	return equality.Semantic.DeepEqual(a.Finalizers, b.Finalizers) && equality.Semantic.DeepEqual(a.Labels, b.Labels) &&
		equality.Semantic.DeepEqual(a.OwnerReferences, b.OwnerReferences)
}

func setReady(s *v1.Snapshot, ok bool, reason, msg string) {
	objects.SetCondition(&s.Status.Conditions, s.Generation, v1.SnapshotConditionReady, ok, reason, msg)
}

// take has the volume's engine snapshot every replica, once.
func (r *Reconciler) take(ctx context.Context, s *v1.Snapshot, vol *v1.Volume) error {
	if s.Status.ReadyToUse {
		return nil // taken; a snapshot never changes
	}
	if vol == nil {
		setReady(s, false, v1.SnapshotReasonVolumeNotFound, fmt.Sprintf("volume %s does not exist in namespace %s: a Snapshot captures an existing Volume; delete this Snapshot and create one naming an existing volume",
			s.Spec.Volume, s.Namespace))
		return nil // a Volume of that name appearing brings us back
	}
	if !vol.DeletionTimestamp.IsZero() {
		setReady(s, false, v1.SnapshotReasonFailed, fmt.Sprintf("volume %s is being deleted: it can no longer be snapshotted; delete this Snapshot", vol.Name))
		return nil
	}
	if !volumes.Cloned(vol) {
		setReady(s, false, v1.SnapshotReasonPending, fmt.Sprintf("volume %s is being filled from its data source; it is snapshotted once that copy is complete and verified", vol.Name))
		return nil
	}
	e, why, err := r.runningEngine(ctx, vol)
	if err != nil {
		return err
	}
	if e == nil {
		setReady(s, false, v1.SnapshotReasonPending, why)
		return nil // the Engine's changes bring us back
	}
	c, closeConn, err := r.dial(e.Status.Address)
	if err != nil {
		return err
	}
	defer closeConn()
	cctx, cancel := context.WithTimeout(ctx, callTimeout)
	defer cancel()
	// If we crash after the engine took it, or lose its answer, the next
	// call is refused with ALREADY_EXISTS (the engine checks the name
	// before pausing I/O) and the snapshot is found in its list. A
	// snapshot of this name cannot be an older one: a Snapshot's data goes
	// before its object does.
	_, err = c.SnapshotCreate(cctx, &enginev1.SnapshotCreateRequest{Name: s.Name})
	if err != nil && grpcstatus.Code(err) != codes.AlreadyExists {
		msg := fmt.Sprintf("taking the snapshot on volume %s's engine failed (it is retried): %s", vol.Name, grpcstatus.Convert(err).Message())
		setReady(s, false, v1.SnapshotReasonFailed, msg)
		objects.Event(r.Recorder, s, true, EventFailed, "Snapshot", "%s", msg)
		return fmt.Errorf("snapshot %s: %w", s.Name, err)
	}
	list, err := c.SnapshotList(cctx, &enginev1.SnapshotListRequest{})
	if err != nil {
		return fmt.Errorf("list snapshots of %s: %w", vol.Name, err)
	}
	i := slices.IndexFunc(list.GetSnapshots(), func(x *enginev1.Snapshot) bool { return x.GetName() == s.Name })
	if i < 0 {
		return fmt.Errorf("snapshot %s was taken but volume %s's engine does not list it", s.Name, vol.Name)
	}
	taken := list.GetSnapshots()[i]
	if !taken.GetUserCreated() {
		// The engine's own snapshot for a rebuild (rebuild-EPOCH-N) has
		// this name; it goes when the rebuild ends and is no user's.
		msg := fmt.Sprintf("volume %s holds a snapshot of Cairn's own (a rebuild's) named %s: create the Snapshot under another name", vol.Name, s.Name)
		setReady(s, false, v1.SnapshotReasonFailed, msg)
		objects.Event(r.Recorder, s, true, EventFailed, "Snapshot", "%s", msg)
		return reconcile.TerminalError(errors.New(msg))
	}
	s.Status.ReadyToUse = true
	s.Status.CreationTime = &metav1.Time{Time: time.Unix(0, taken.GetCreatedUnixNano())}
	size := vol.Spec.Size.DeepCopy()
	if e.Status.Size != nil && !e.Status.Size.IsZero() {
		size = e.Status.Size.DeepCopy()
	}
	s.Status.Size = &size
	held := heldReplicas(e)
	setReady(s, true, v1.SnapshotReasonTaken, fmt.Sprintf("taken on the %d replicas volume %s's engine holds (%v)", len(held), vol.Name, held))
	objects.Event(r.Recorder, s, false, EventTaken, "Snapshot", "taken on %d replicas of volume %s", len(held), vol.Name)
	return nil
}

// heldReplicas are the replicas the engine holds RW or WO, by name.
func heldReplicas(e *v1.Engine) []string {
	var out []string
	for n, m := range e.Status.ReplicaModeMap {
		if m == v1.ReplicaModeRW || m == v1.ReplicaModeWO {
			out = append(out, n)
		}
	}
	slices.Sort(out)
	return out
}

// runningEngine returns the volume's engine if snapshot calls can go to it
// now: running, its stream reporting an RW replica, and its process
// running as its instance manager reports. Otherwise it says why not.
func (r *Reconciler) runningEngine(ctx context.Context, vol *v1.Volume) (*v1.Engine, string, error) {
	e := &v1.Engine{}
	if err := r.Client.Get(ctx, client.ObjectKey{Namespace: vol.Namespace, Name: volumes.EngineName(vol)}, e); err != nil {
		if apierrors.IsNotFound(err) {
			return nil, fmt.Sprintf("volume %s has no engine yet (it is being created)", vol.Name), nil
		}
		return nil, "", err
	}
	waiting := fmt.Sprintf("waiting for volume %s's engine to run (it is %s): ", vol.Name, orUnknown(e.Status.InstanceState))
	if vol.Spec.NodeName == "" {
		waiting += "the volume is detached, so its replicas and an engine without a device are started on a node holding one of them for this snapshot"
	} else {
		waiting += "the volume is attaching to " + vol.Spec.NodeName
	}
	if c := meta.FindStatusCondition(vol.Status.Conditions, v1.ConditionReady); c != nil && c.Status != metav1.ConditionTrue {
		waiting += "; the volume says: " + c.Message
	}
	if e.Spec.DesiredState != v1.DesiredInstanceStateRunning || e.Status.InstanceState != v1.InstanceStateRunning || e.Status.Address == "" {
		return nil, waiting, nil
	}
	if len(heldReplicas(e)) == 0 || !slices.Contains(mapValues(e.Status.ReplicaModeMap), v1.ReplicaModeRW) {
		return nil, waiting + " (its status stream has not reported an RW replica yet)", nil
	}
	if r.Pool != nil && e.Spec.NodeName != "" {
		if conn, _, err := r.Pool.ForNode(ctx, r.Client, e.Namespace, e.Spec.NodeName); err == nil {
			if p, ok, current := conn.Process(process.Name(e)); current && (!ok || p.GetControlAddress() != e.Status.Address) {
				return nil, waiting + " (its process is not the one the Engine reports)", nil
			}
		}
	}
	return e, "", nil
}

func mapValues(m map[string]v1.ReplicaMode) []v1.ReplicaMode {
	out := make([]v1.ReplicaMode, 0, len(m))
	for _, v := range m {
		out = append(out, v)
	}
	return out
}

func orUnknown(s v1.InstanceState) string {
	if s == "" {
		return "not started"
	}
	return string(s)
}

func (r *Reconciler) dial(addr string) (enginev1.EngineServiceClient, func(), error) {
	opts := r.DialOptions
	if len(opts) == 0 {
		opts = []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}
	}
	cc, err := grpc.NewClient(addr, opts...)
	if err != nil {
		return nil, nil, err
	}
	return enginev1.NewEngineServiceClient(cc), func() { cc.Close() }, nil
}

// reconcileDelete deletes the snapshot from every replica the volume's
// engine holds, then lets the object go. A volume gone or being deleted
// takes its replicas' data with it: nothing to do. A snapshot a clone is
// still copying from waits for the copy.
func (r *Reconciler) reconcileDelete(ctx context.Context, s *v1.Snapshot) (ctrl.Result, error) {
	if !controllerutil.ContainsFinalizer(s, Finalizer) {
		return ctrl.Result{}, nil
	}
	release := func() (ctrl.Result, error) {
		controllerutil.RemoveFinalizer(s, Finalizer)
		return ctrl.Result{}, client.IgnoreNotFound(r.Client.Update(ctx, s))
	}
	vol := &v1.Volume{}
	if err := r.Client.Get(ctx, client.ObjectKey{Namespace: s.Namespace, Name: s.Spec.Volume}, vol); err != nil {
		if apierrors.IsNotFound(err) {
			return release()
		}
		return ctrl.Result{}, err
	}
	if !vol.DeletionTimestamp.IsZero() {
		return release()
	}
	if !volumes.Cloned(vol) {
		// A volume still being filled from its data source has taken no
		// snapshot: take waits for the copy.
		return release()
	}
	status := func(reason, msg string) (ctrl.Result, error) {
		before := s.DeepCopy()
		setReady(s, s.Status.ReadyToUse, reason, msg)
		return ctrl.Result{}, client.IgnoreNotFound(r.Client.Status().Patch(ctx, s, client.MergeFrom(before)))
	}
	if clone, err := r.cloningFrom(ctx, s); err != nil {
		return ctrl.Result{}, err
	} else if clone != "" {
		return status(v1.SnapshotReasonPending, fmt.Sprintf("deleting: volume %s is being cloned from this snapshot; it is deleted once that copy is complete (or that volume is deleted)", clone))
	}
	e, why, err := r.runningEngine(ctx, vol)
	if err != nil {
		return ctrl.Result{}, err
	}
	if e == nil {
		return status(v1.SnapshotReasonPending, "deleting: "+why)
	}
	c, closeConn, err := r.dial(e.Status.Address)
	if err != nil {
		return ctrl.Result{}, err
	}
	defer closeConn()
	cctx, cancel := context.WithTimeout(ctx, callTimeout)
	defer cancel()
	// NOT_FOUND: never taken, or deleted before a crash that kept the
	// finalizer; either way no replica the engine holds has it. Replicas
	// it does not hold lose it when they are rebuilt from one that does
	// not have it.
	if _, err := c.SnapshotDelete(cctx, &enginev1.SnapshotDeleteRequest{Name: s.Name}); err != nil && grpcstatus.Code(err) != codes.NotFound {
		msg := fmt.Sprintf("deleting the snapshot from volume %s's replicas failed (it is retried): %s", vol.Name, grpcstatus.Convert(err).Message())
		objects.Event(r.Recorder, vol, true, EventDeleteFailed, "DeleteSnapshot", "snapshot %s: %s", s.Name, msg)
		if _, perr := status(v1.SnapshotReasonFailed, msg); perr != nil {
			return ctrl.Result{}, errors.Join(err, perr)
		}
		return ctrl.Result{}, fmt.Errorf("delete snapshot %s: %w", s.Name, err)
	}
	// The event goes on the Volume: the Snapshot is about to disappear.
	objects.Event(r.Recorder, vol, false, EventDeleted, "DeleteSnapshot", "snapshot %s deleted from every replica the engine holds (%v)", s.Name, heldReplicas(e))
	return release()
}

// cloningFrom names a Volume still copying from snapshot s, if any.
func (r *Reconciler) cloningFrom(ctx context.Context, s *v1.Snapshot) (string, error) {
	var vs v1.VolumeList
	if err := r.Client.List(ctx, &vs, client.InNamespace(s.Namespace)); err != nil {
		return "", err
	}
	for _, v := range vs.Items {
		if volumes.ClonesFrom(&v, s.Spec.Volume, s.Name) {
			return v.Name, nil
		}
	}
	return "", nil
}

// SetupWithManager registers the reconciler: a Snapshot is looked at
// again when its volume or the volume's engine changes.
func (r *Reconciler) SetupWithManager(mgr ctrl.Manager) error {
	if r.Recorder == nil {
		r.Recorder = mgr.GetEventRecorder("cairn-snapshot")
	}
	if err := mgr.GetFieldIndexer().IndexField(context.Background(), &v1.Snapshot{}, IndexVolume, func(o client.Object) []string {
		return []string{o.(*v1.Snapshot).Spec.Volume}
	}); err != nil {
		return err
	}
	c := mgr.GetClient()
	// byVolume are the Snapshots of the volumes named (by spec.volume, so
	// also those not labelled yet).
	byVolume := func(ctx context.Context, ns string, vols ...string) []reconcile.Request {
		var out []reconcile.Request
		for _, v := range vols {
			if v == "" {
				continue
			}
			var ss v1.SnapshotList
			if err := c.List(ctx, &ss, client.InNamespace(ns), client.MatchingFields{IndexVolume: v}); err != nil {
				continue
			}
			for _, s := range ss.Items {
				out = append(out, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(&s)})
			}
		}
		return out
	}
	return ctrl.NewControllerManagedBy(mgr).
		For(&v1.Snapshot{}).
		Watches(&v1.Engine{}, handler.EnqueueRequestsFromMapFunc(func(ctx context.Context, o client.Object) []reconcile.Request {
			return byVolume(ctx, o.GetNamespace(), o.(*v1.Engine).Spec.VolumeName)
		})).
		Watches(&v1.Volume{}, handler.EnqueueRequestsFromMapFunc(func(ctx context.Context, o client.Object) []reconcile.Request {
			v := o.(*v1.Volume)
			vols := []string{v.Name}
			if v.Spec.DataSource != nil {
				vols = append(vols, v.Spec.DataSource.Volume) // a clone done releases its snapshot
			}
			return byVolume(ctx, v.Namespace, vols...)
		})).
		Named("snapshot").
		WithOptions(controller.Options{MaxConcurrentReconciles: objects.Workers}).
		Complete(r)
}
