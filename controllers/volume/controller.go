// Package volume reconciles Volume objects: it creates the volume's Engine
// and Replicas, places the replicas on disks (controllers/scheduler),
// starts them and then the engine on spec.nodeName to attach, stops them
// in the reverse order to detach, and deletes them with their data when
// the Volume goes. Status is computed at the end of each reconcile from
// what was observed; no decision reads it.
package volume

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/scheduler"
	"github.com/cairn-io/cairn/controllers/storagenode"
)

// Finalizer keeps a Volume until its engine and replicas (and with them
// the replicas' data) are gone.
const Finalizer = "storage.cairn.io/volume"

// LabelVolume marks a Volume's Engine and Replicas with its name.
const LabelVolume = "storage.cairn.io/volume"

// Ready condition reasons.
const (
	ReasonAttaching = "Attaching"
	ReasonDetaching = "Detaching"
	ReasonCreating  = "Creating"
)

// Reconciler owns the Volume life cycle.
type Reconciler struct {
	client.Client
	// OverProvisioningPercent for scheduling; 0: the scheduler's default.
	OverProvisioningPercent int
}

// +kubebuilder:rbac:groups=storage.cairn.io,resources=volumes,verbs=get;list;watch;update;patch
// +kubebuilder:rbac:groups=storage.cairn.io,resources=volumes/status,verbs=get;update;patch
// +kubebuilder:rbac:groups=storage.cairn.io,resources=volumes/finalizers,verbs=update
// +kubebuilder:rbac:groups=storage.cairn.io,resources=engines;replicas,verbs=get;list;watch;create;update;patch;delete
// +kubebuilder:rbac:groups=storage.cairn.io,resources=storagenodes,verbs=get;list;watch

// scope is what one reconcile observed of a volume.
type scope struct {
	v        *v1.Volume
	engine   *v1.Engine // nil if missing
	replicas []*v1.Replica
	// unplaced and reason: the scheduler's verdict on replicas it could
	// not place in this reconcile.
	unplaced int
	reason   string
}

// EngineName is the name of a volume's Engine.
func EngineName(v *v1.Volume) string { return v.Name + "-e" }

// Reconcile runs the volume's phases and writes its status once.
func (r *Reconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	v := &v1.Volume{}
	if err := r.Get(ctx, req.NamespacedName, v); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	if !v.DeletionTimestamp.IsZero() {
		return r.reconcileDelete(ctx, v)
	}
	if controllerutil.AddFinalizer(v, Finalizer) {
		if err := r.Update(ctx, v); err != nil {
			return ctrl.Result{}, err
		}
	}
	before := v.DeepCopy()
	s := &scope{v: v}
	err := r.observe(ctx, s)
	if err == nil {
		for _, phase := range []func(context.Context, *scope) error{r.ensureEngine, r.ensureReplicas, r.schedule, r.attachOrDetach} {
			if err = phase(ctx, s); err != nil {
				break
			}
		}
	}
	computeStatus(s)
	if perr := r.Status().Patch(ctx, v, client.MergeFrom(before)); perr != nil {
		return ctrl.Result{}, errors.Join(err, perr)
	}
	return ctrl.Result{}, err
}

func (r *Reconciler) observe(ctx context.Context, s *scope) error {
	e := &v1.Engine{}
	err := r.Get(ctx, client.ObjectKey{Namespace: s.v.Namespace, Name: EngineName(s.v)}, e)
	switch {
	case err == nil:
		s.engine = e
	case !apierrors.IsNotFound(err):
		return err
	}
	var reps v1.ReplicaList
	if err := r.List(ctx, &reps, client.InNamespace(s.v.Namespace), client.MatchingLabels{LabelVolume: s.v.Name}); err != nil {
		return err
	}
	for i := range reps.Items {
		if metav1.IsControlledBy(&reps.Items[i], s.v) {
			s.replicas = append(s.replicas, &reps.Items[i])
		}
	}
	slices.SortFunc(s.replicas, func(a, b *v1.Replica) int { return strings.Compare(a.Name, b.Name) })
	return nil
}

// ensureEngine creates the Engine (stopped) if it is missing.
func (r *Reconciler) ensureEngine(ctx context.Context, s *scope) error {
	if s.engine != nil {
		return nil
	}
	e := &v1.Engine{ObjectMeta: metav1.ObjectMeta{Name: EngineName(s.v), Namespace: s.v.Namespace, Labels: map[string]string{LabelVolume: s.v.Name}},
		Spec: v1.EngineSpec{VolumeName: s.v.Name, Size: s.v.Spec.Size, Frontend: s.v.Spec.Frontend, DesiredState: v1.DesiredInstanceStateStopped}}
	if err := controllerutil.SetControllerReference(s.v, e, r.Scheme()); err != nil {
		return err
	}
	// A crash after the create: the next reconcile gets it by name.
	if err := r.Create(ctx, e); err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	s.engine = e
	return nil
}

// ensureReplicas creates Replicas (unscheduled, stopped) up to
// numberOfReplicas.
func (r *Reconciler) ensureReplicas(ctx context.Context, s *scope) error {
	want := int(s.v.Spec.NumberOfReplicas)
	if want <= 0 {
		want = 3
	}
	for len(s.replicas) < want {
		rep := &v1.Replica{ObjectMeta: metav1.ObjectMeta{GenerateName: s.v.Name + "-r-", Namespace: s.v.Namespace, Labels: map[string]string{LabelVolume: s.v.Name}},
			Spec: v1.ReplicaSpec{VolumeName: s.v.Name, Size: s.v.Spec.Size, DesiredState: v1.DesiredInstanceStateStopped}}
		if err := controllerutil.SetControllerReference(s.v, rep, r.Scheme()); err != nil {
			return err
		}
		// A crash after the create: the next reconcile lists it by label.
		if err := r.Create(ctx, rep); err != nil {
			return err
		}
		s.replicas = append(s.replicas, rep)
	}
	return nil
}

// schedule places every unscheduled replica on a disk.
func (r *Reconciler) schedule(ctx context.Context, s *scope) error {
	var pending []*v1.Replica
	var placed []scheduler.Placed
	for _, rep := range s.replicas {
		if rep.Spec.NodeName == "" {
			pending = append(pending, rep)
		} else {
			placed = append(placed, scheduler.Placed{Node: rep.Spec.NodeName, Disk: rep.Spec.DiskName})
		}
	}
	if len(pending) == 0 {
		return nil
	}
	var sns v1.StorageNodeList
	if err := r.List(ctx, &sns, client.InNamespace(s.v.Namespace)); err != nil {
		return err
	}
	res := scheduler.Schedule(scheduler.Request{Size: s.v.Spec.Size.Value(), OverProvisioningPercent: r.OverProvisioningPercent},
		Disks(sns.Items), placed, len(pending))
	for i, p := range res.Placements {
		rep := pending[i]
		before := rep.DeepCopy()
		rep.Spec.NodeName, rep.Spec.DiskName, rep.Spec.DiskPath = p.Node, p.Disk, p.Path
		rep.Spec.DataDirectoryName = rep.Name
		if err := r.Patch(ctx, rep, client.MergeFrom(before)); err != nil {
			return err
		}
	}
	s.unplaced, s.reason = res.Unplaced, res.Reason
	return nil
}

// Disks turns StorageNodes into the scheduler's disks.
func Disks(sns []v1.StorageNode) []scheduler.Disk {
	var out []scheduler.Disk
	for _, sn := range sns {
		nodeAllowed := sn.Spec.AllowScheduling == nil || *sn.Spec.AllowScheduling
		specs := map[string]v1.DiskSpec{}
		for _, d := range sn.Spec.Disks {
			specs[d.Name] = d
		}
		for _, ds := range sn.Status.Disks {
			d := scheduler.Disk{Node: sn.Spec.NodeName, Name: ds.Name, Path: ds.Path, NodeAllowScheduling: nodeAllowed, AllowScheduling: true,
				Ready: meta.IsStatusConditionTrue(ds.Conditions, v1.ConditionReady) && ds.Path != ""}
			if spec, ok := specs[ds.Name]; ok {
				d.AllowScheduling = spec.AllowScheduling == nil || *spec.AllowScheduling
				d.Tags = spec.Tags
				if spec.StorageReserved != nil {
					d.Reserved = spec.StorageReserved.Value()
				}
			} else if ds.Name != storagenode.DefaultDiskName {
				continue // removed from the spec: takes no new replicas
			}
			if ds.Capacity != nil {
				d.Capacity = ds.Capacity.Value()
			}
			if ds.Available != nil {
				d.Available = ds.Available.Value()
			}
			if ds.Scheduled != nil {
				d.Scheduled = ds.Scheduled.Value()
			}
			out = append(out, d)
		}
	}
	return out
}

// attachOrDetach moves processes toward spec.nodeName: to attach, the
// replicas start, then the engine starts on the node with their
// addresses; to detach, the engine stops, then the replicas.
func (r *Reconciler) attachOrDetach(ctx context.Context, s *scope) error {
	node := s.v.Spec.NodeName
	e := s.engine
	if node == "" || (e.Spec.NodeName != "" && e.Spec.NodeName != node) {
		// Detach (or move: stop where it runs first).
		if err := r.setEngine(ctx, e, func(e *v1.Engine) { e.Spec.DesiredState = v1.DesiredInstanceStateStopped }); err != nil {
			return err
		}
		if e.Status.InstanceState != v1.InstanceStateStopped {
			return nil // the engine's status change brings us back
		}
		if err := r.setEngine(ctx, e, func(e *v1.Engine) { e.Spec.NodeName = "" }); err != nil {
			return err
		}
		if node != "" {
			return nil // moving: the next reconcile attaches on the new node
		}
		for _, rep := range s.replicas {
			if err := r.setReplica(ctx, rep, v1.DesiredInstanceStateStopped); err != nil {
				return err
			}
		}
		return nil
	}
	// Attach.
	addrs := map[string]v1.ReplicaAddress{}
	waiting := 0
	for _, rep := range s.replicas {
		if rep.Spec.NodeName == "" {
			continue
		}
		if err := r.setReplica(ctx, rep, v1.DesiredInstanceStateRunning); err != nil {
			return err
		}
		if rep.Status.InstanceState == v1.InstanceStateRunning && rep.Status.Address != "" && rep.Status.ControlAddress != "" {
			addrs[rep.Name] = v1.ReplicaAddress{Data: rep.Status.Address, Control: rep.Status.ControlAddress}
		} else {
			waiting++
		}
	}
	if e.Spec.DesiredState == v1.DesiredInstanceStateRunning {
		return nil // replica changes of a running engine go through its rebuild
	}
	if waiting > 0 || len(addrs) == 0 {
		return nil // every scheduled replica runs first; their status changes bring us back
	}
	return r.setEngine(ctx, e, func(e *v1.Engine) {
		e.Spec.NodeName, e.Spec.DesiredState, e.Spec.ReplicaAddresses = node, v1.DesiredInstanceStateRunning, addrs
		e.Spec.Size, e.Spec.Frontend = s.v.Spec.Size, s.v.Spec.Frontend
	})
}

func (r *Reconciler) setEngine(ctx context.Context, e *v1.Engine, mutate func(*v1.Engine)) error {
	before := e.DeepCopy()
	mutate(e)
	if equalEngineSpec(before, e) {
		return nil
	}
	return r.Patch(ctx, e, client.MergeFrom(before))
}

func equalEngineSpec(a, b *v1.Engine) bool {
	x, y := a.Spec.DeepCopy(), b.Spec.DeepCopy()
	return fmt.Sprintf("%+v", *x) == fmt.Sprintf("%+v", *y)
}

func (r *Reconciler) setReplica(ctx context.Context, rep *v1.Replica, want v1.DesiredInstanceState) error {
	if rep.Spec.DesiredState == want {
		return nil
	}
	before := rep.DeepCopy()
	rep.Spec.DesiredState = want
	return r.Patch(ctx, rep, client.MergeFrom(before))
}

// reconcileDelete deletes the engine and the replicas (whose finalizers
// stop their processes and delete their data) and lets the Volume go once
// they are gone.
func (r *Reconciler) reconcileDelete(ctx context.Context, v *v1.Volume) (ctrl.Result, error) {
	if !controllerutil.ContainsFinalizer(v, Finalizer) {
		return ctrl.Result{}, nil
	}
	s := &scope{v: v}
	if err := r.observe(ctx, s); err != nil {
		return ctrl.Result{}, err
	}
	// The engine first: it must not run on replicas being deleted.
	if s.engine != nil {
		if s.engine.DeletionTimestamp.IsZero() {
			if err := r.Delete(ctx, s.engine); client.IgnoreNotFound(err) != nil {
				return ctrl.Result{}, err
			}
		}
		return ctrl.Result{}, nil // its deletion brings us back (Owns)
	}
	for _, rep := range s.replicas {
		if rep.DeletionTimestamp.IsZero() {
			if err := r.Delete(ctx, rep); client.IgnoreNotFound(err) != nil {
				return ctrl.Result{}, err
			}
		}
	}
	if len(s.replicas) > 0 {
		before := v.DeepCopy()
		v.Status.State = v1.VolumeStateDeleting
		return ctrl.Result{}, r.Status().Patch(ctx, v, client.MergeFrom(before))
	}
	controllerutil.RemoveFinalizer(v, Finalizer)
	return ctrl.Result{}, r.Update(ctx, v)
}

// SetupWithManager registers the reconciler.
func (r *Reconciler) SetupWithManager(mgr ctrl.Manager) error {
	return ctrl.NewControllerManagedBy(mgr).
		For(&v1.Volume{}).
		Owns(&v1.Engine{}).
		Owns(&v1.Replica{}).
		// Disks appearing or changing may let unplaced replicas be placed.
		Watches(&v1.StorageNode{}, handler.EnqueueRequestsFromMapFunc(func(ctx context.Context, o client.Object) []reconcile.Request {
			var vs v1.VolumeList
			if err := mgr.GetClient().List(ctx, &vs, client.InNamespace(o.GetNamespace())); err != nil {
				return nil
			}
			var out []reconcile.Request
			for _, v := range vs.Items {
				if c := meta.FindStatusCondition(v.Status.Conditions, v1.VolumeConditionScheduled); c == nil || c.Status != metav1.ConditionTrue {
					out = append(out, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(&v)})
				}
			}
			return out
		})).
		Named("volume").
		Complete(r)
}
