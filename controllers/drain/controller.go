// Package drain keeps node maintenance from taking away the last healthy
// replica of a volume. For each StorageNode it works out what holds a
// drain of the node (Blockers: an engine running there, a volume whose
// every healthy replica is there) and reports it in status.drain. A drain
// guard pod on the node, with a PodDisruptionBudget that exists while
// something holds a drain, makes `kubectl drain` wait until the node is
// safe to take away. While the node is cordoned, the replicas that hold a
// volume's last healthy copy are moved to other nodes; with the
// StorageNode's spec.evictionRequested, every replica is; one volume at a
// time, through the volume's own rebuild (a replacement replica placed
// elsewhere, rebuilt by the engine, the old one deleted once it is RW).
package drain

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/client-go/tools/events"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/internal/volumes"
	"github.com/cairn-io/cairn/controllers/scheduler"
)

// Reconciler keeps each StorageNode's drain status, guard and moves.
type Reconciler struct {
	client.Client
	// Reader reads the guard pods straight from the API server (the
	// manager caches only instance-manager pods); SetupWithManager takes
	// the manager's API reader if nil.
	Reader client.Reader
	// GuardImage is the drain guard's image (one that runs the manager
	// binary: the manager's own). Empty: the image of the container
	// named ManagerContainer of the pod ManagerPod, read once.
	GuardImage string
	// ManagerPod and ManagerContainer name the manager's own pod and
	// container; with neither them nor GuardImage set, no guard is kept
	// (status.drain is still reported, and moves still happen).
	ManagerPod       client.ObjectKey
	ManagerContainer string
	// OverProvisioningPercent for placing replacements (the Volume
	// reconciler's); 0: the scheduler's default.
	OverProvisioningPercent int
	// Ledger places replacements: the Volume reconciler's, so that the
	// two never count the same free room; nil: SetupWithManager makes one.
	Ledger *scheduler.Ledger
	// Recorder records Events (nil: none).
	Recorder events.EventRecorder

	mu         sync.Mutex
	ownImage   string
	ownCommand []string
}

// +kubebuilder:rbac:groups=storage.cairn.io,resources=storagenodes,verbs=get;list;watch
// +kubebuilder:rbac:groups=storage.cairn.io,resources=storagenodes/status,verbs=get;update;patch
// +kubebuilder:rbac:groups=storage.cairn.io,resources=volumes;engines,verbs=get;list;watch
// +kubebuilder:rbac:groups=storage.cairn.io,resources=replicas,verbs=get;list;watch;create;delete
// +kubebuilder:rbac:groups="",resources=nodes,verbs=get;list;watch
// +kubebuilder:rbac:groups="",resources=pods,verbs=get;list;watch;create
// +kubebuilder:rbac:groups=policy,resources=poddisruptionbudgets,verbs=get;list;watch;create;delete

// scope is what one reconcile observed.
type scope struct {
	sn           *v1.StorageNode
	node         string
	cordoned     bool
	objs         *Objects
	storageNodes []v1.StorageNode
	leaving      map[string]bool
	// retryAfter is when a move that found no disk may find one though
	// no watched object changes (scheduler.Result.RetryAfter); 0 for
	// never.
	retryAfter time.Duration
}

func (s *scope) volume(name string) *v1.Volume {
	for i := range s.objs.Volumes {
		if s.objs.Volumes[i].Name == name {
			return &s.objs.Volumes[i]
		}
	}
	return nil
}

func (s *scope) why() string {
	if s.sn.Spec.EvictionRequested {
		return "its StorageNode asks for eviction"
	}
	return "the node is cordoned and holds the volume's last healthy replica"
}

// Reconcile moves a replica a step (if the node is leaving), keeps the
// guard and its budget, and patches status.drain (the only part of the
// StorageNode's status it writes; the StorageNode reconciler writes the
// rest, each with a merge patch of its own fields).
func (r *Reconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	sn := &v1.StorageNode{}
	if err := r.Get(ctx, req.NamespacedName, sn); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	if !sn.DeletionTimestamp.IsZero() {
		return ctrl.Result{}, nil // its guard and budget go with it (owner references)
	}
	s, err := r.observe(ctx, sn)
	if err != nil {
		return ctrl.Result{}, err
	}
	moving := ""
	if s.cordoned || sn.Spec.EvictionRequested {
		if moving, err = r.move(ctx, s); err != nil {
			return ctrl.Result{}, err
		}
	}
	blockers := Blockers(s.node, s.objs)
	gerr := r.ensureGuard(ctx, sn, len(blockers) == 0)
	before := sn.DeepCopy()
	sn.Status.Drain = &v1.DrainStatus{Safe: len(blockers) == 0, Moving: moving, Replicas: int32(ReplicasOn(s.node, s.objs))}
	if len(blockers) > MaxBlockers {
		blockers = blockers[:MaxBlockers]
	}
	sn.Status.Drain.Blockers = blockers
	if err := r.Status().Patch(ctx, sn, client.MergeFrom(before)); err != nil {
		return ctrl.Result{}, err
	}
	if gerr != nil {
		return ctrl.Result{}, gerr
	}
	return ctrl.Result{RequeueAfter: s.retryAfter}, nil
}

func (r *Reconciler) observe(ctx context.Context, sn *v1.StorageNode) (*scope, error) {
	s := &scope{sn: sn, node: sn.Spec.NodeName, objs: &Objects{}}
	node := &corev1.Node{}
	switch err := r.Get(ctx, client.ObjectKey{Name: s.node}, node); {
	case err == nil:
		s.cordoned = node.Spec.Unschedulable
	case !apierrors.IsNotFound(err):
		return nil, err
	}
	in := client.InNamespace(sn.Namespace)
	var vl v1.VolumeList
	var el v1.EngineList
	var rl v1.ReplicaList
	var sl v1.StorageNodeList
	var nl corev1.NodeList
	for _, l := range []client.ObjectList{&vl, &el, &rl, &sl} {
		if err := r.List(ctx, l, in); err != nil {
			return nil, err
		}
	}
	if err := r.List(ctx, &nl); err != nil {
		return nil, err
	}
	s.objs.Volumes, s.objs.Engines, s.objs.Replicas, s.storageNodes = vl.Items, el.Items, rl.Items, sl.Items
	s.leaving = leavingNodes(nl.Items, sl.Items)
	s.leaving[s.node] = true
	return s, nil
}

// image is the guard's image and command: GuardImage with its own
// entrypoint, else the manager's own image and command.
func (r *Reconciler) image(ctx context.Context) (string, []string, error) {
	if r.GuardImage != "" {
		return r.GuardImage, nil, nil
	}
	if r.ManagerPod.Name == "" {
		return "", nil, nil
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.ownImage != "" {
		return r.ownImage, r.ownCommand, nil
	}
	p := &corev1.Pod{}
	if err := r.Reader.Get(ctx, r.ManagerPod, p); err != nil {
		return "", nil, fmt.Errorf("read the manager's pod %s for the drain guard's image: %w", r.ManagerPod, err)
	}
	for _, c := range p.Spec.Containers {
		if c.Name == r.ManagerContainer {
			r.ownImage, r.ownCommand = c.Image, c.Command
			return r.ownImage, r.ownCommand, nil
		}
	}
	return "", nil, fmt.Errorf("the manager's pod %s has no container %q for the drain guard's image", r.ManagerPod, r.ManagerContainer)
}

func slicesSortReplicas(reps []*v1.Replica) {
	slices.SortFunc(reps, func(a, b *v1.Replica) int {
		if c := strings.Compare(a.Spec.VolumeName, b.Spec.VolumeName); c != 0 {
			return c
		}
		return strings.Compare(a.Name, b.Name)
	})
}

// cordonChanged passes Node updates that cordon or uncordon it.
var cordonChanged = predicate.Funcs{
	CreateFunc:  func(event.CreateEvent) bool { return true },
	DeleteFunc:  func(event.DeleteEvent) bool { return true },
	GenericFunc: func(event.GenericEvent) bool { return false },
	UpdateFunc: func(ev event.UpdateEvent) bool {
		a, okA := ev.ObjectOld.(*corev1.Node)
		b, okB := ev.ObjectNew.(*corev1.Node)
		return okA && okB && a.Spec.Unschedulable != b.Spec.Unschedulable
	},
}

// SetupWithManager registers the reconciler: a StorageNode is looked at
// again when it changes, its node is cordoned or uncordoned, its guard's
// budget changes, and when an Engine or Replica of a volume with a
// replica (or the engine) on its node changes.
func (r *Reconciler) SetupWithManager(mgr ctrl.Manager) error {
	if r.Reader == nil {
		r.Reader = mgr.GetAPIReader()
	}
	if r.Recorder == nil {
		r.Recorder = mgr.GetEventRecorder("cairn-drain")
	}
	if r.Ledger == nil {
		r.Ledger = scheduler.NewLedger()
	}
	if err := r.Ledger.SetupWithManager(mgr); err != nil {
		return err
	}
	c := mgr.GetClient()
	// onNodes maps nodes to their StorageNodes in namespace.
	onNodes := func(ctx context.Context, ns string, nodes map[string]bool) []reconcile.Request {
		var sns v1.StorageNodeList
		if err := c.List(ctx, &sns, client.InNamespace(ns)); err != nil {
			return nil
		}
		var out []reconcile.Request
		for i := range sns.Items {
			if nodes[sns.Items[i].Spec.NodeName] {
				out = append(out, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(&sns.Items[i])})
			}
		}
		return out
	}
	// ofVolume maps a volume's objects to the StorageNodes of every node
	// holding one of its replicas or its engine (and of the object's own).
	ofVolume := func(ctx context.Context, ns, vol string, also ...string) []reconcile.Request {
		nodes := map[string]bool{}
		for _, n := range also {
			nodes[n] = true
		}
		var reps v1.ReplicaList
		if err := c.List(ctx, &reps, client.InNamespace(ns), client.MatchingLabels{volumes.LabelVolume: vol}); err == nil {
			for _, rep := range reps.Items {
				nodes[rep.Spec.NodeName] = true
			}
		}
		e := &v1.Engine{}
		if err := c.Get(ctx, client.ObjectKey{Namespace: ns, Name: volumes.EngineNameOf(vol)}, e); err == nil {
			nodes[e.Spec.NodeName] = true
		}
		delete(nodes, "")
		return onNodes(ctx, ns, nodes)
	}
	return ctrl.NewControllerManagedBy(mgr).
		For(&v1.StorageNode{}).
		Owns(&policyv1.PodDisruptionBudget{}).
		Watches(&corev1.Node{}, handler.EnqueueRequestsFromMapFunc(func(ctx context.Context, o client.Object) []reconcile.Request {
			var sns v1.StorageNodeList
			if err := c.List(ctx, &sns); err != nil {
				return nil
			}
			var out []reconcile.Request
			for i := range sns.Items {
				if sns.Items[i].Spec.NodeName == o.GetName() {
					out = append(out, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(&sns.Items[i])})
				}
			}
			return out
		}), builder.WithPredicates(cordonChanged)).
		Watches(&v1.Engine{}, handler.EnqueueRequestsFromMapFunc(func(ctx context.Context, o client.Object) []reconcile.Request {
			e := o.(*v1.Engine)
			return ofVolume(ctx, e.Namespace, e.Spec.VolumeName, e.Spec.NodeName)
		})).
		Watches(&v1.Replica{}, handler.EnqueueRequestsFromMapFunc(func(ctx context.Context, o client.Object) []reconcile.Request {
			rep := o.(*v1.Replica)
			return ofVolume(ctx, rep.Namespace, rep.Spec.VolumeName, rep.Spec.NodeName)
		})).
		Named("drain").
		Complete(r)
}
