// Package replica reconciles Replica objects: it starts and stops the
// replica process on the replica's node through that node's instance
// manager, reports the process's state and addresses, and on deletion
// stops the process and deletes the replica's data.
package replica

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"time"

	"google.golang.org/grpc/codes"
	grpcstatus "google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/certs"
	"github.com/cairn-io/cairn/controllers/imclient"
	"github.com/cairn-io/cairn/controllers/instancemanager"
	"github.com/cairn-io/cairn/controllers/internal/objects"
	imv1 "github.com/cairn-io/cairn/dataplane/api/instancemanager/v1"
)

// Finalizer keeps a Replica until its process is stopped and its data
// deleted.
const Finalizer = "storage.cairn.io/replica-data"

// Ready condition reasons.
const (
	ReasonNotScheduled        = "NotScheduled"
	ReasonNoInstanceManager   = "NoInstanceManager"
	ReasonInstanceUnknown     = "InstanceUnknown"
	ReasonProcessFailed       = "ProcessFailed"
	ReasonStopped             = "Stopped"
	ReasonStarting            = "Starting"
	ReasonInstanceManagerDown = "InstanceManagerUnreachable"
)

// callTimeout bounds each call to an instance manager.
const callTimeout = 10 * time.Second

// Reconciler runs Replica processes.
type Reconciler struct {
	client.Client
	Pool *imclient.Pool
	// Keys gives each volume's data-port key, sent with the replica's
	// spec (nil: none, for instance managers on loopback in tests).
	Keys certs.VolumeKeys
}

// ProcessName is the instance-manager process name of a Replica or Engine:
// namespace/name, unique across namespaces.
func ProcessName(o client.Object) string { return o.GetNamespace() + "/" + o.GetName() }

// DataDir is where a scheduled replica's data lives on its node.
func DataDir(r *v1.Replica) string {
	return filepath.Join(r.Spec.DiskPath, r.Spec.DataDirectoryName)
}

// +kubebuilder:rbac:groups=storage.cairn.io,resources=replicas,verbs=get;list;watch;update;patch
// +kubebuilder:rbac:groups=storage.cairn.io,resources=replicas/status,verbs=get;update;patch
// +kubebuilder:rbac:groups=storage.cairn.io,resources=replicas/finalizers,verbs=update

// Reconcile drives one replica's process toward spec.desiredState.
func (r *Reconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	rep := &v1.Replica{}
	if err := r.Get(ctx, req.NamespacedName, rep); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	if !rep.DeletionTimestamp.IsZero() {
		return r.reconcileDelete(ctx, rep)
	}
	if controllerutil.AddFinalizer(rep, Finalizer) {
		if err := r.Update(ctx, rep); err != nil {
			return ctrl.Result{}, err
		}
	}
	before := rep.DeepCopy()
	res, err := r.reconcileProcess(ctx, rep)
	rep.Status.ObservedGeneration = rep.Generation
	if perr := r.Status().Patch(ctx, rep, client.MergeFrom(before)); perr != nil {
		return ctrl.Result{}, errors.Join(err, perr)
	}
	return res, err
}

// reconcileProcess observes the process, creates or deletes it as the
// spec asks, and fills the status from what it observed.
func (r *Reconciler) reconcileProcess(ctx context.Context, rep *v1.Replica) (ctrl.Result, error) {
	st := &rep.Status
	ready := func(ok bool, reason, msg string) {
		objects.SetCondition(&st.Conditions, rep.Generation, v1.ConditionReady, ok, reason, msg)
	}
	if rep.Spec.NodeName == "" || rep.Spec.DiskPath == "" || rep.Spec.DataDirectoryName == "" {
		st.InstanceState, st.Address, st.ControlAddress = v1.InstanceStateStopped, "", ""
		ready(false, ReasonNotScheduled, "the replica has no node, disk path and data directory yet")
		return ctrl.Result{}, nil
	}
	// A node an operator declared shut down (the out-of-service taint)
	// runs no replica: it is reported stopped, and nothing is started
	// there until the taint goes. Its data stays on the node's disk.
	out, err := objects.OutOfService(ctx, r.Client, rep.Spec.NodeName)
	if err != nil {
		return ctrl.Result{}, err
	}
	if out {
		st.InstanceState, st.Address, st.ControlAddress = v1.InstanceStateStopped, "", ""
		ready(false, objects.ReasonNodeOutOfService, fmt.Sprintf("node %s has the %s taint: it is shut down, and the replica process with it", rep.Spec.NodeName, corev1.TaintNodeOutOfService))
		return ctrl.Result{}, nil
	}
	conn, im, err := r.Pool.ForNode(ctx, r.Client, rep.Namespace, rep.Spec.NodeName)
	if err != nil {
		st.InstanceState = v1.InstanceStateUnknown
		ready(false, ReasonNoInstanceManager, err.Error())
		if errors.Is(err, imclient.ErrNoInstanceManager) {
			return ctrl.Result{}, nil // an InstanceManager appearing triggers a reconcile
		}
		return ctrl.Result{}, err
	}
	st.InstanceManagerName = im.Name
	name := ProcessName(rep)
	proc, exists, current := conn.Process(name)
	if !current {
		st.InstanceState = v1.InstanceStateUnknown
		ready(false, ReasonInstanceManagerDown, fmt.Sprintf("instance manager %s at %s is not reachable; the process state is unknown", im.Name, im.Spec.Address))
		return ctrl.Result{RequeueAfter: objects.UnreachableRecheck}, nil
	}
	state := v1.InstanceStateStopped
	if exists {
		state = instancemanager.StateFromProto(proc.GetState())
	}
	st.InstanceState = state
	st.Address, st.ControlAddress = "", ""
	if state == v1.InstanceStateRunning {
		st.Address, st.ControlAddress = proc.GetDataAddress(), proc.GetControlAddress()
	}
	cctx, cancel := context.WithTimeout(ctx, callTimeout)
	defer cancel()
	if rep.Spec.DesiredState != v1.DesiredInstanceStateRunning {
		ready(false, ReasonStopped, "desiredState is stopped")
		if exists {
			// Delete also forgets an exited process, so a later start is clean.
			if _, err := conn.Client.ProcessDelete(cctx, &imv1.ProcessDeleteRequest{Name: name}); err != nil && grpcstatus.Code(err) != codes.DeadlineExceeded {
				return ctrl.Result{}, fmt.Errorf("stop replica process %s: %w", name, err)
			}
		}
		return ctrl.Result{}, nil
	}
	switch {
	case !exists:
		// If we crash after this create and before the status patch, the
		// next reconcile finds the process by its name.
		spec := &imv1.ReplicaSpec{DataDir: DataDir(rep), SizeBytes: rep.Spec.Size.Value()}
		if r.Keys != nil {
			key, err := r.Keys.VolumeKey(rep.Namespace, rep.Spec.VolumeName)
			if err != nil {
				return ctrl.Result{}, fmt.Errorf("the key of volume %s: %w", rep.Spec.VolumeName, err)
			}
			spec.AuthKey = key
		}
		_, err := conn.Client.ProcessCreate(cctx, &imv1.ProcessCreateRequest{Name: name, Spec: &imv1.ProcessCreateRequest_Replica{Replica: spec}})
		switch grpcstatus.Code(err) {
		case codes.OK, codes.AlreadyExists:
			st.InstanceState = v1.InstanceStateStarting
			ready(false, ReasonStarting, "the replica process was created on "+rep.Spec.NodeName)
			return ctrl.Result{}, nil
		case codes.InvalidArgument:
			ready(false, v1.ReasonInvalidSpec, grpcstatus.Convert(err).Message())
			return ctrl.Result{}, reconcile.TerminalError(err)
		default:
			ready(false, ReasonProcessFailed, err.Error())
			return ctrl.Result{}, fmt.Errorf("create replica process %s: %w", name, err)
		}
	case state == v1.InstanceStateError || state == v1.InstanceStateStopped:
		// The process died. Forget it, so the next reconcile starts it
		// again; returning an error spaces the restarts out (back-off).
		msg := fmt.Sprintf("the replica process exited (code %d): %s", proc.GetExitCode(), proc.GetError())
		ready(false, ReasonProcessFailed, msg)
		if _, err := conn.Client.ProcessDelete(cctx, &imv1.ProcessDeleteRequest{Name: name}); err != nil {
			return ctrl.Result{}, fmt.Errorf("forget failed replica process %s: %w", name, err)
		}
		return ctrl.Result{}, errors.New(msg)
	case state == v1.InstanceStateRunning:
		ready(true, v1.ReasonAsExpected, "the replica process serves at "+st.Address)
	default:
		ready(false, ReasonStarting, "the replica process is "+string(state))
	}
	return ctrl.Result{}, nil
}

// reconcileDelete stops the process and deletes the data, then lets the
// object go. If the node's instance manager cannot be reached, the object
// stays (with the reason) rather than leaving data behind unnoticed.
func (r *Reconciler) reconcileDelete(ctx context.Context, rep *v1.Replica) (ctrl.Result, error) {
	if !controllerutil.ContainsFinalizer(rep, Finalizer) {
		return ctrl.Result{}, nil
	}
	if rep.Spec.NodeName != "" && rep.Spec.DiskPath != "" && rep.Spec.DataDirectoryName != "" {
		conn, _, err := r.Pool.ForNode(ctx, r.Client, rep.Namespace, rep.Spec.NodeName)
		if err != nil {
			return ctrl.Result{}, fmt.Errorf("delete replica %s: its data on node %s cannot be removed yet: %w", rep.Name, rep.Spec.NodeName, err)
		}
		cctx, cancel := context.WithTimeout(ctx, callTimeout)
		defer cancel()
		// Each step is idempotent: after a crash the next reconcile
		// repeats whatever had not finished.
		if _, err := conn.Client.ProcessDelete(cctx, &imv1.ProcessDeleteRequest{Name: ProcessName(rep)}); err != nil {
			return ctrl.Result{}, fmt.Errorf("stop replica process %s: %w", ProcessName(rep), err)
		}
		if _, err := conn.Client.ReplicaDataDelete(cctx, &imv1.ReplicaDataDeleteRequest{DataDir: DataDir(rep)}); err != nil {
			return ctrl.Result{}, fmt.Errorf("delete replica data %s on %s: %w", DataDir(rep), rep.Spec.NodeName, err)
		}
	}
	controllerutil.RemoveFinalizer(rep, Finalizer)
	return ctrl.Result{}, r.Update(ctx, rep)
}

// SetupWithManager registers the reconciler: a Replica is reconciled when
// it changes, when its node's InstanceManager reports a change, and when
// its node's out-of-service taint comes or goes.
func (r *Reconciler) SetupWithManager(mgr ctrl.Manager) error {
	return ctrl.NewControllerManagedBy(mgr).
		For(&v1.Replica{}).
		Watches(&v1.InstanceManager{}, handler.EnqueueRequestsFromMapFunc(func(ctx context.Context, o client.Object) []reconcile.Request {
			return objects.OnNode(ctx, mgr.GetClient(), &v1.ReplicaList{}, o.GetNamespace(), o.(*v1.InstanceManager).Spec.NodeName,
				func(r *v1.Replica) string { return r.Spec.NodeName })
		})).
		// The out-of-service taint set or lifted on a node stops, or lets
		// start again, the replicas there.
		Watches(&corev1.Node{}, handler.EnqueueRequestsFromMapFunc(func(ctx context.Context, o client.Object) []reconcile.Request {
			return objects.OnNode(ctx, mgr.GetClient(), &v1.ReplicaList{}, "", o.GetName(), func(r *v1.Replica) string { return r.Spec.NodeName })
		}), builder.WithPredicates(objects.OutOfServiceChanged)).
		Named("replica").
		WithOptions(controller.Options{MaxConcurrentReconciles: objects.Workers}).
		Complete(r)
}
