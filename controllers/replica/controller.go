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
	"strings"

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
	"github.com/cairn-io/cairn/controllers/internal/objects"
	"github.com/cairn-io/cairn/controllers/internal/process"
	imv1 "github.com/cairn-io/cairn/dataplane/api/instancemanager/v1"
)

// Finalizer keeps a Replica until its process is stopped and its data
// deleted.
const Finalizer = "storage.cairn.io/replica-data"

// Reconciler runs Replica processes.
type Reconciler struct {
	client.Client
	Pool *imclient.Pool
	// Keys gives each volume's data-port key, sent with the replica's
	// spec (nil: none, for instance managers on loopback in tests).
	Keys certs.VolumeKeys
	// Backoff spaces the starts of a replica process that keeps failing
	// (zero fields: process.DefaultPolicy).
	Backoff process.Policy

	processes process.Lazy
}

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

// reconcileProcess runs the shared process life cycle
// (controllers/internal/process) for a scheduled replica: its process is
// created with its data directory and size, and reports the addresses it
// serves at.
func (r *Reconciler) reconcileProcess(ctx context.Context, rep *v1.Replica) (ctrl.Result, error) {
	st := &rep.Status
	ready := func(ok bool, reason, msg string) {
		objects.SetCondition(&st.Conditions, rep.Generation, v1.ConditionReady, ok, reason, msg)
	}
	if rep.Spec.NodeName == "" || rep.Spec.DiskPath == "" || rep.Spec.DataDirectoryName == "" {
		st.InstanceState, st.Address, st.ControlAddress, st.LocalAddress = v1.InstanceStateStopped, "", "", ""
		ready(false, v1.ReplicaReasonNotScheduled, "the replica has no node, disk path and data directory yet")
		return ctrl.Result{}, nil
	}
	return r.runner().Reconcile(ctx, process.Spec{
		Object: rep, Noun: "replica process", Node: rep.Spec.NodeName, Desired: rep.Spec.DesiredState, Ready: ready,
		Observe: func(o process.Observation) { observe(rep, o) },
		Create:  func(context.Context) (*imv1.ProcessCreateRequest, *process.Wait, error) { return r.createRequest(rep) },
		Running: func(context.Context, *imv1.Process) (ctrl.Result, error) {
			ready(true, v1.ReasonAsExpected, "the replica process serves at "+st.Address)
			return ctrl.Result{}, nil
		},
	})
}

func (r *Reconciler) runner() *process.Runner { return r.processes.Get(r.Client, r.Pool, r.Backoff) }

// observe reports the replica process as found: the addresses it serves
// at while it runs, none otherwise (an address is never reported for a
// process that may not hold it any more).
func observe(rep *v1.Replica, o process.Observation) {
	st := &rep.Status
	st.InstanceState, st.Address, st.ControlAddress, st.LocalAddress = o.State, "", "", ""
	if o.InstanceManager != "" {
		st.InstanceManagerName = o.InstanceManager
	}
	if o.State == v1.InstanceStateRunning && o.Process != nil {
		st.Address, st.ControlAddress = o.Process.GetDataAddress(), o.Process.GetControlAddress()
		if local := o.Process.GetLocalDataAddress(); strings.HasPrefix(local, "unix:") && len(local) <= maxLocalAddress {
			st.LocalAddress = local
		}
	}
}

// maxLocalAddress is status.localAddress's bound in the CRD: an instance
// manager reporting a longer one has the replica reached over TCP only.
const maxLocalAddress = 256

// createRequest is the replica process to create: its data directory,
// its size and the volume's data-port key.
func (r *Reconciler) createRequest(rep *v1.Replica) (*imv1.ProcessCreateRequest, *process.Wait, error) {
	spec := &imv1.ReplicaSpec{DataDir: DataDir(rep), SizeBytes: rep.Spec.Size.Value()}
	if r.Keys != nil {
		key, err := r.Keys.VolumeKey(rep.Namespace, rep.Spec.VolumeName)
		if err != nil {
			return nil, nil, fmt.Errorf("the key of volume %s: %w", rep.Spec.VolumeName, err)
		}
		spec.AuthKey = key
	}
	return &imv1.ProcessCreateRequest{Spec: &imv1.ProcessCreateRequest_Replica{Replica: spec}}, nil, nil
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
		// Each step is idempotent: after a crash the next reconcile
		// repeats whatever had not finished.
		if err := process.Delete(ctx, conn, rep, "replica process"); err != nil {
			return ctrl.Result{}, err
		}
		cctx, cancel := context.WithTimeout(ctx, process.CallTimeout)
		defer cancel()
		if _, err := conn.Client.ReplicaDataDelete(cctx, &imv1.ReplicaDataDeleteRequest{DataDir: DataDir(rep)}); err != nil {
			return ctrl.Result{}, fmt.Errorf("delete replica data %s on %s: %w", DataDir(rep), rep.Spec.NodeName, err)
		}
	}
	r.runner().Forget(rep)
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
