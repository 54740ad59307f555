// Package engine reconciles Engine objects: it starts the engine process
// on spec.nodeName through that node's instance manager, with the replica
// addresses the Volume reconciler gives it once each replica is confirmed
// to run at its address (never an address gone stale since it was
// given), through the process life cycle it shares with the Replica
// reconciler (controllers/internal/process); it reports the process's state,
// control address and the block device its frontend serves, and stops it
// when asked or deleted. While it runs, the engine's own status stream
// (Watches) gives each replica's mode, rebuild progress, snapshots and
// size; the reconciler adds and removes replicas through the engine's
// rebuild as spec.replicaAddresses changes, expands it to spec.size, and
// restarts a faulted engine so it reopens the newest replicas.
package engine

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"time"

	"google.golang.org/grpc"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/manager"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"
	"sigs.k8s.io/controller-runtime/pkg/source"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/certs"
	"github.com/cairn-io/cairn/controllers/imclient"
	"github.com/cairn-io/cairn/controllers/internal/objects"
	"github.com/cairn-io/cairn/controllers/internal/process"
	"github.com/cairn-io/cairn/controllers/internal/volumes"
	imv1 "github.com/cairn-io/cairn/dataplane/api/instancemanager/v1"
)

// Finalizer keeps an Engine until its process is stopped (a running
// engine holds the volume's device on its node).
const Finalizer = "storage.cairn.io/engine-process"

const callTimeout = process.CallTimeout

var labelRE = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$`)

// Reconciler runs Engine processes.
type Reconciler struct {
	client.Client
	Pool *imclient.Pool
	// Engines follows each running engine's status stream; SetupWithManager
	// makes one if nil.
	Engines *Watches
	// Recorder records Events (nil: none).
	Recorder events.EventRecorder
	// Keys gives each volume's data-port key, sent with the engine's spec
	// (nil: none, for instance managers on loopback in tests).
	Keys certs.VolumeKeys
	// Secrets reads encrypted volumes' key Secrets, uncached (the manager
	// keeps no Secret in memory); SetupWithManager takes the manager's API
	// reader if nil.
	Secrets client.Reader
	// DialOptions for the engines' control API, used by the Watches
	// SetupWithManager makes (default: no transport security, loopback
	// tests; a cluster gives mutual TLS).
	DialOptions []grpc.DialOption
	// Backoff spaces the starts of an engine process that keeps failing
	// (zero fields: process.DefaultPolicy).
	Backoff process.Policy

	changes   chan event.GenericEvent
	processes process.Lazy
}

// +kubebuilder:rbac:groups=storage.cairn.io,resources=engines,verbs=get;list;watch;update;patch
// +kubebuilder:rbac:groups=storage.cairn.io,resources=engines/status,verbs=get;update;patch
// +kubebuilder:rbac:groups=storage.cairn.io,resources=engines/finalizers,verbs=update
// +kubebuilder:rbac:groups=storage.cairn.io,resources=replicas,verbs=get;list;watch

// Reconcile drives one engine's process toward spec.desiredState.
func (r *Reconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	e := &v1.Engine{}
	if err := r.Get(ctx, req.NamespacedName, e); err != nil {
		if apierrors.IsNotFound(err) {
			r.Engines.Stop(req.NamespacedName)
		}
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	if !e.DeletionTimestamp.IsZero() {
		r.Engines.Stop(req.NamespacedName)
		return r.reconcileDelete(ctx, e)
	}
	if controllerutil.AddFinalizer(e, Finalizer) {
		if err := r.Update(ctx, e); err != nil {
			return ctrl.Result{}, err
		}
	}
	before := e.DeepCopy()
	res, err := r.reconcileProcess(ctx, e)
	e.Status.ObservedGeneration = e.Generation
	if perr := r.Status().Patch(ctx, e, client.MergeFrom(before)); perr != nil {
		return ctrl.Result{}, errors.Join(err, perr)
	}
	return res, err
}

// ProcessSpec is the instance-manager spec for an engine: its replicas in
// the order of their names.
func ProcessSpec(e *v1.Engine) *imv1.EngineSpec {
	names := make([]string, 0, len(e.Spec.ReplicaAddresses))
	for n := range e.Spec.ReplicaAddresses {
		names = append(names, n)
	}
	slices.Sort(names)
	// Size 0: the replicas' size. A volume expanded while detached starts
	// at the size its replicas have and is expanded once running, so the
	// replicas never disagree with the engine at open.
	spec := &imv1.EngineSpec{VolumeName: e.Spec.VolumeName, SizeBytes: 0}
	for _, n := range names {
		a := e.Spec.ReplicaAddresses[n]
		spec.Replicas = append(spec.Replicas, &imv1.ReplicaAddress{Data: a.Data, Control: a.Control})
	}
	switch {
	case e.Spec.Maintenance:
		// Cairn's own work on a volume nobody attached: the NBD socket
		// only, no device on the node for anyone to open.
		spec.Frontend, spec.NbdKernel = imv1.Frontend_FRONTEND_NBD, imv1.NBDKernel_NBD_KERNEL_OFF
	case e.Spec.Frontend == v1.FrontendNBD:
		spec.Frontend = imv1.Frontend_FRONTEND_NBD
	default:
		spec.Frontend = imv1.Frontend_FRONTEND_FUSE
	}
	return spec
}

// reconcileProcess checks what only an engine needs (a volume name that
// can name its device, a node), then runs the shared process life cycle
// (controllers/internal/process) with the engine's own parts.
func (r *Reconciler) reconcileProcess(ctx context.Context, e *v1.Engine) (ctrl.Result, error) {
	ready := func(ok bool, reason, msg string) {
		objects.SetCondition(&e.Status.Conditions, e.Generation, v1.ConditionReady, ok, reason, msg)
	}
	if !labelRE.MatchString(e.Spec.VolumeName) {
		r.reset(e, v1.InstanceStateStopped)
		msg := fmt.Sprintf("spec.volumeName %q must be a DNS label (lowercase letters, digits and '-', at most 63 characters) to name the engine's device", e.Spec.VolumeName)
		ready(false, v1.ReasonInvalidSpec, msg)
		return ctrl.Result{}, reconcile.TerminalError(errors.New(msg))
	}
	if e.Spec.NodeName == "" {
		r.reset(e, v1.InstanceStateStopped)
		ready(false, v1.EngineReasonNotPlaced, "spec.nodeName is empty: the engine runs nowhere")
		return ctrl.Result{}, nil
	}
	return r.runner().Reconcile(ctx, process.Spec{
		Object: e, Noun: "engine process", Node: e.Spec.NodeName, Desired: e.Spec.DesiredState, Ready: ready,
		Observe: func(o process.Observation) { r.observe(e, o) },
		Create: func(ctx context.Context) (*imv1.ProcessCreateRequest, *process.Wait, error) {
			return r.createRequest(ctx, e, ready)
		},
		Outdated: func(ctx context.Context, p *imv1.Process) (string, error) { return r.outdated(ctx, e, p) },
		Running: func(ctx context.Context, p *imv1.Process) (ctrl.Result, error) {
			if len(e.Spec.ReplicaAddresses) == 0 {
				ready(false, v1.EngineReasonNoReplicas, "spec.replicaAddresses is empty: nothing to serve the volume from")
				return ctrl.Result{}, nil
			}
			msg := "the engine serves " + e.Status.Endpoint
			if fb := p.GetEndpoint().GetFallback(); fb != "" {
				msg += " (no kernel block device: " + fb + ")"
			}
			ready(true, v1.ReasonAsExpected, msg)
			return ctrl.Result{}, r.reconcileRunning(ctx, e, p, ready, msg)
		},
	})
}

func (r *Reconciler) runner() *process.Runner { return r.processes.Get(r.Client, r.Pool, r.Backoff) }

// reset clears what the status says of a running engine, and stops
// following its status stream unless it runs.
func (r *Reconciler) reset(e *v1.Engine, state v1.InstanceState) {
	st := &e.Status
	st.InstanceState, st.Address, st.Endpoint, st.Size = state, "", "", nil
	st.ReplicaModeMap, st.RebuildStatus, st.Clone = nil, nil, nil
	if state != v1.InstanceStateRunning {
		r.Engines.Stop(client.ObjectKeyFromObject(e))
	}
}

// observe reports the engine process as found: a running one's control
// address, block device and size.
func (r *Reconciler) observe(e *v1.Engine, o process.Observation) {
	trackDevice(e, o, time.Now())
	r.reset(e, o.State)
	if o.InstanceManager != "" {
		e.Status.InstanceManagerName = o.InstanceManager
	}
	if o.State == v1.InstanceStateRunning && o.Process != nil {
		p := o.Process
		e.Status.Address, e.Status.Endpoint = p.GetControlAddress(), p.GetEndpoint().GetPath()
		e.Status.Size = resource.NewQuantity(p.GetSizeBytes(), resource.BinarySI)
	}
}

// createRequest is the engine process to create now: its replicas at the
// addresses spec.replicaAddresses gives, once each of them is confirmed
// to run there (staleReplicas), and its keys. A spec that names a replica
// not running where it says waits (WaitingForReplicas) until the Volume
// reconciler gives the current addresses.
func (r *Reconciler) createRequest(ctx context.Context, e *v1.Engine, ready func(bool, string, string)) (*imv1.ProcessCreateRequest, *process.Wait, error) {
	want := ProcessSpec(e)
	if len(want.Replicas) == 0 {
		return nil, &process.Wait{Reason: v1.EngineReasonNoReplicas, Message: "spec.replicaAddresses is empty: nothing to serve the volume from"}, nil
	}
	stale, err := r.staleReplicas(ctx, e)
	if err != nil {
		return nil, nil, err
	}
	if len(stale) > 0 {
		return nil, &process.Wait{Reason: v1.ReasonWaitingForReplicas, Message: "the engine is started once every replica it is given runs at the address its spec gives; waiting for " +
			strings.Join(stale, ", ")}, nil
	}
	lost, err := r.lostReplicas(ctx, e)
	if err != nil {
		return nil, nil, err
	}
	if len(lost) > 0 {
		want.AcceptLostMembers = true
		objects.Event(r.Recorder, e, true, v1.ReasonReplicasDeclaredLost, "Start",
			"starting the engine without replica %s: its node is declared shut down (taint %s); writes only it held, if any, are lost",
			strings.Join(lost, ", "), corev1.TaintNodeOutOfService)
	}
	if r.Keys != nil {
		key, err := r.Keys.VolumeKey(e.Namespace, e.Spec.VolumeName)
		if err != nil {
			ready(false, v1.ReasonProcessFailed, err.Error())
			return nil, nil, fmt.Errorf("the key of volume %s: %w", e.Spec.VolumeName, err)
		}
		want.AuthKey = key
	}
	if e.Spec.Encryption != nil {
		key, msg, err := r.encryptionKey(ctx, e)
		if err != nil {
			return nil, nil, err
		}
		if key == "" {
			return nil, &process.Wait{Reason: v1.ReasonEncryptionKeyUnusable, Message: msg, RequeueAfter: keyRecheck}, nil
		}
		want.EncryptionKey, want.EncryptionKeyCheck = []byte(key), e.Spec.Encryption.KeyCheck
	}
	return &imv1.ProcessCreateRequest{Spec: &imv1.ProcessCreateRequest_Engine{Engine: want}}, nil, nil
}

// outdated says why a starting engine process must be started again
// ("" if not): it was given other replicas than spec.replicaAddresses now
// names (a replica came back at a new address while it started, say), and
// every replica the spec names runs where it says. A starting engine
// serves nothing yet; one that waits for a replica it was not given (the
// engine's open waits for every replica that may hold the newest data)
// would otherwise wait until its instance manager gives up on it.
func (r *Reconciler) outdated(ctx context.Context, e *v1.Engine, p *imv1.Process) (string, error) {
	given := p.GetEngine()
	if given == nil {
		return "", nil
	}
	was, want := replicaList(given.GetReplicas()), replicaList(ProcessSpec(e).GetReplicas())
	if slices.Equal(was, want) {
		return "", nil
	}
	stale, err := r.staleReplicas(ctx, e)
	if err != nil || len(stale) > 0 {
		return "", err
	}
	return fmt.Sprintf("its replicas are now %s (it was started with %s)", strings.Join(want, " "), strings.Join(was, " ")), nil
}

// replicaList is replicas as sorted DATA,CONTROL strings.
func replicaList(rs []*imv1.ReplicaAddress) []string {
	out := make([]string, 0, len(rs))
	for _, a := range rs {
		out = append(out, a.GetData()+","+a.GetControl())
	}
	slices.Sort(out)
	return out
}

// reconcileRunning follows the running engine's status stream: the
// replica modes, rebuilds, snapshots and size it reports go to the status,
// and the engine is brought to its spec (syncRunning). Until the stream's
// first status arrives there is nothing to act on; its arrival brings the
// Engine back. The stream is that of this very process (its address and
// pid): a status another process sent, at the same address or not, is
// never applied.
func (r *Reconciler) reconcileRunning(ctx context.Context, e *v1.Engine, p *imv1.Process, ready func(bool, string, string), msg string) error {
	if e.Status.Address == "" {
		return nil
	}
	c, err := r.Engines.Ensure(client.ObjectKeyFromObject(e), Identity{Address: e.Status.Address, PID: p.GetPid()})
	if err != nil {
		return err
	}
	vs, current, werr := c.Status()
	if !current {
		if werr != nil {
			ready(true, v1.ReasonAsExpected, msg+"; its status stream is reconnecting: "+werr.Error())
		}
		return nil
	}
	applyWatchStatus(e, vs)
	if err := r.syncRunning(ctx, e, c, vs); err != nil {
		ready(true, v1.EngineReasonReplicaSyncFailed, msg+"; bringing it to its spec failed: "+err.Error())
		return err
	}
	return nil
}

// Changed queues the Engine key for a reconcile (Watches' OnChange).
func (r *Reconciler) Changed(key types.NamespacedName) {
	e := &v1.Engine{}
	e.Namespace, e.Name = key.Namespace, key.Name
	select {
	case r.changes <- event.GenericEvent{Object: e}:
	default:
		// The queue is full of changes already; a later one comes.
	}
}

// reconcileDelete stops the process, then lets the object go.
func (r *Reconciler) reconcileDelete(ctx context.Context, e *v1.Engine) (ctrl.Result, error) {
	if !controllerutil.ContainsFinalizer(e, Finalizer) {
		return ctrl.Result{}, nil
	}
	out, err := objects.OutOfService(ctx, r.Client, e.Spec.NodeName)
	if err != nil {
		return ctrl.Result{}, err
	}
	// On a node that is out of service the engine is not running.
	if e.Spec.NodeName != "" && !out {
		conn, _, err := r.Pool.ForNode(ctx, r.Client, e.Namespace, e.Spec.NodeName)
		if err != nil && !errors.Is(err, imclient.ErrNoInstanceManager) {
			return ctrl.Result{}, err
		}
		if conn != nil {
			if err := process.Delete(ctx, conn, e, "engine process"); err != nil {
				return ctrl.Result{}, err
			}
		}
		// No instance manager on the node: no process of ours runs there.
	}
	r.runner().Forget(e)
	controllerutil.RemoveFinalizer(e, Finalizer)
	return ctrl.Result{}, r.Update(ctx, e)
}

// SetupWithManager registers the reconciler: an Engine is reconciled when
// it changes and when its node's InstanceManager reports a change.
func (r *Reconciler) SetupWithManager(mgr ctrl.Manager) error {
	r.changes = make(chan event.GenericEvent, 1024)
	if r.Secrets == nil {
		r.Secrets = mgr.GetAPIReader()
	}
	if r.Engines == nil {
		r.Engines = NewWatches(WatchOptions{DialOptions: r.DialOptions, OnChange: r.Changed, Logger: mgr.GetLogger().WithName("engine-watch")})
		if err := mgr.Add(manager.RunnableFunc(func(ctx context.Context) error {
			<-ctx.Done()
			r.Engines.Close()
			return nil
		})); err != nil {
			return err
		}
	}
	if r.Recorder == nil {
		r.Recorder = mgr.GetEventRecorder("cairn-engine")
	}
	return ctrl.NewControllerManagedBy(mgr).
		For(&v1.Engine{}).
		WatchesRawSource(source.Channel(r.changes, &handler.EnqueueRequestForObject{})).
		Watches(&v1.InstanceManager{}, handler.EnqueueRequestsFromMapFunc(func(ctx context.Context, o client.Object) []reconcile.Request {
			return objects.OnNode(ctx, mgr.GetClient(), &v1.EngineList{}, o.GetNamespace(), o.(*v1.InstanceManager).Spec.NodeName,
				func(e *v1.Engine) string { return e.Spec.NodeName })
		})).
		// The out-of-service taint set or lifted on a node stops, or lets
		// start again, what runs there.
		Watches(&corev1.Node{}, handler.EnqueueRequestsFromMapFunc(func(ctx context.Context, o client.Object) []reconcile.Request {
			return objects.OnNode(ctx, mgr.GetClient(), &v1.EngineList{}, "", o.GetName(), func(e *v1.Engine) string { return e.Spec.NodeName })
		}), builder.WithPredicates(objects.OutOfServiceChanged)).
		// A failed replica is given back once the Volume reconciler has
		// recorded its failure and its process runs at the address the
		// spec gives (replicaGivenBack): either may come last.
		Watches(&v1.Replica{}, handler.EnqueueRequestsFromMapFunc(func(_ context.Context, o client.Object) []reconcile.Request {
			rep := o.(*v1.Replica)
			return []reconcile.Request{{NamespacedName: client.ObjectKey{Namespace: rep.Namespace, Name: volumes.EngineNameOf(rep.Spec.VolumeName)}}}
		}), builder.WithPredicates(predicate.Funcs{
			CreateFunc:  func(event.CreateEvent) bool { return false },
			DeleteFunc:  func(event.DeleteEvent) bool { return false },
			GenericFunc: func(event.GenericEvent) bool { return false },
			UpdateFunc: func(ev event.UpdateEvent) bool {
				a, b := ev.ObjectOld.(*v1.Replica), ev.ObjectNew.(*v1.Replica)
				return (a.Spec.FailedAt == nil) != (b.Spec.FailedAt == nil) || a.Status.InstanceState != b.Status.InstanceState ||
					a.Status.Address != b.Status.Address || a.Status.ControlAddress != b.Status.ControlAddress || a.Status.LocalAddress != b.Status.LocalAddress
			},
		})).
		Named("engine").
		WithOptions(controller.Options{MaxConcurrentReconciles: objects.Workers}).
		Complete(r)
}
