// Package instancemanager reconciles InstanceManager objects: each names
// one node's instance manager (spec.address), and its status reports
// whether the manager can reach it and the processes it supervises, as
// the shared imclient.Pool's watch stream last reported them.
package instancemanager

import (
	"context"
	"sort"
	"sync"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	logf "sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/source"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/imclient"
	"github.com/cairn-io/cairn/controllers/internal/objects"
	"github.com/cairn-io/cairn/controllers/internal/process"
	imv1 "github.com/cairn-io/cairn/dataplane/api/instancemanager/v1"
)

// Reconciler keeps InstanceManager status current.
type Reconciler struct {
	client.Client
	Pool *imclient.Pool

	// byAddr maps an address to the objects that name it, so a change the
	// pool reports reaches the right objects.
	mu     sync.Mutex
	byAddr map[string]map[types.NamespacedName]struct{}
	events chan event.GenericEvent
}

// Changed is the pool's OnChange: it queues every InstanceManager with
// that address. It never blocks (a full queue already holds a reconcile).
func (r *Reconciler) Changed(addr string) {
	r.mu.Lock()
	var names []types.NamespacedName
	for n := range r.byAddr[addr] {
		names = append(names, n)
	}
	r.mu.Unlock()
	for _, n := range names {
		obj := &v1.InstanceManager{ObjectMeta: metav1.ObjectMeta{Namespace: n.Namespace, Name: n.Name}}
		select {
		case r.events <- event.GenericEvent{Object: obj}:
		default:
		}
	}
}

func (r *Reconciler) remember(addr string, n types.NamespacedName) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for a, set := range r.byAddr {
		if a != addr {
			delete(set, n)
		}
	}
	if addr == "" {
		return
	}
	if r.byAddr[addr] == nil {
		r.byAddr[addr] = map[types.NamespacedName]struct{}{}
	}
	r.byAddr[addr][n] = struct{}{}
}

// +kubebuilder:rbac:groups=storage.cairn.io,resources=instancemanagers,verbs=get;list;watch
// +kubebuilder:rbac:groups=storage.cairn.io,resources=instancemanagers/status,verbs=get;update;patch

// Reconcile observes one instance manager and writes its status once.
func (r *Reconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	im := &v1.InstanceManager{}
	if err := r.Get(ctx, req.NamespacedName, im); err != nil {
		r.remember("", req.NamespacedName)
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	r.remember(im.Spec.Address, req.NamespacedName)
	before := im.DeepCopy()
	observe(ctx, r.Pool, im)
	im.Status.ObservedGeneration = im.Generation
	if err := r.Status().Patch(ctx, im, client.MergeFrom(before)); err != nil {
		return ctrl.Result{}, err
	}
	return ctrl.Result{}, nil
}

// observe fills im.Status from the pool's connection to it.
func observe(ctx context.Context, pool *imclient.Pool, im *v1.InstanceManager) {
	setReady := func(ok bool, reason, msg string) {
		objects.SetCondition(&im.Status.Conditions, im.Generation, v1.ConditionReady, ok, reason, msg)
	}
	if im.Spec.Address == "" {
		im.Status.State = v1.InstanceManagerStateUnknown
		setReady(false, v1.InstanceManagerReasonNoAddress, "spec.address is empty: no instance manager to reach")
		markUnknown(im)
		return
	}
	conn, err := pool.Get(im.Spec.Address)
	if err != nil {
		im.Status.State = v1.InstanceManagerStateUnknown
		setReady(false, v1.InstanceManagerReasonUnreachable, err.Error())
		markUnknown(im)
		return
	}
	conn.WaitSettled(ctx)
	procs, current, werr := conn.Processes()
	if !current {
		im.Status.State = v1.InstanceManagerStateUnknown
		msg := "waiting for the first process watch from " + im.Spec.Address
		if werr != nil {
			msg = "the process watch from " + im.Spec.Address + " is down (redialling): " + werr.Error()
		}
		setReady(false, v1.InstanceManagerReasonUnreachable, msg)
		markUnknown(im)
		return
	}
	im.Status.State = v1.InstanceManagerStateRunning
	im.Status.Processes = processStatuses(procs)
	ictx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if ni, err := conn.Client.NodeInfo(ictx, &imv1.NodeInfoRequest{}); err == nil {
		im.Status.Version = ni.GetVersion()
	} else {
		logf.FromContext(ctx).Info("NodeInfo failed", "reason", err.Error())
	}
	setReady(true, v1.ReasonAsExpected, "the process watch is current")
}

// markUnknown keeps the last known processes but says their states are
// unknown: the manager cannot see them.
func markUnknown(im *v1.InstanceManager) {
	for i := range im.Status.Processes {
		im.Status.Processes[i].State = v1.InstanceStateUnknown
	}
}

func processStatuses(procs map[string]*imv1.Process) []v1.ProcessStatus {
	out := make([]v1.ProcessStatus, 0, len(procs))
	for _, p := range procs {
		ps := v1.ProcessStatus{Name: p.GetName(), State: process.StateFromProto(p.GetState()), Error: p.GetError(), Ports: p.GetPorts()}
		switch p.GetKind() {
		case imv1.ProcessKind_PROCESS_KIND_ENGINE:
			ps.Kind = v1.ProcessKindEngine
		case imv1.ProcessKind_PROCESS_KIND_REPLICA:
			ps.Kind = v1.ProcessKindReplica
		}
		if p.GetState() == imv1.ProcessState_PROCESS_STATE_STOPPED || p.GetState() == imv1.ProcessState_PROCESS_STATE_ERROR {
			code := p.GetExitCode()
			ps.ExitCode = &code
		}
		out = append(out, ps)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// SetupWithManager registers the reconciler; the pool's OnChange must
// call r.Changed.
func (r *Reconciler) SetupWithManager(mgr ctrl.Manager) error {
	if r.byAddr == nil {
		r.byAddr = map[string]map[types.NamespacedName]struct{}{}
	}
	if r.events == nil {
		r.events = make(chan event.GenericEvent, 1024)
	}
	return ctrl.NewControllerManagedBy(mgr).
		For(&v1.InstanceManager{}).
		WatchesRawSource(source.Channel(r.events, &handler.EnqueueRequestForObject{})).
		Named("instancemanager").
		Complete(r)
}

// NewReconciler returns a Reconciler whose Changed may be given to the
// pool before SetupWithManager runs.
func NewReconciler(c client.Client, pool *imclient.Pool) *Reconciler {
	return &Reconciler{Client: c, Pool: pool, byAddr: map[string]map[types.NamespacedName]struct{}{},
		events: make(chan event.GenericEvent, 1024)}
}
