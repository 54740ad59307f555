// Package process runs the life cycle of one Engine's or Replica's
// data-plane process on its node's instance manager, the algorithm both
// reconcilers share: nothing runs on a node that is out of service; find
// the node's instance manager, read the process from its watch, and then
// stop it (desiredState stopped), create it (after a back-off when it
// keeps failing), forget one that exited so the next reconcile starts it
// again, or hand a running one to its reconciler. What differs between an
// engine and a replica (what to create, what to report, what to do while
// it runs) comes in a Spec.
package process

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	grpcstatus "google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/imclient"
	"github.com/cairn-io/cairn/controllers/internal/objects"
	imv1 "github.com/cairn-io/cairn/dataplane/api/instancemanager/v1"
)

// CallTimeout bounds each call to an instance manager.
const CallTimeout = 10 * time.Second

// Name is the instance-manager process name of a Replica or Engine:
// namespace/name, unique across namespaces.
func Name(o client.Object) string { return o.GetNamespace() + "/" + o.GetName() }

var stateFromProto = map[imv1.ProcessState]v1.InstanceState{
	imv1.ProcessState_PROCESS_STATE_STARTING: v1.InstanceStateStarting,
	imv1.ProcessState_PROCESS_STATE_RUNNING:  v1.InstanceStateRunning,
	imv1.ProcessState_PROCESS_STATE_STOPPING: v1.InstanceStateStopping,
	imv1.ProcessState_PROCESS_STATE_STOPPED:  v1.InstanceStateStopped,
	imv1.ProcessState_PROCESS_STATE_ERROR:    v1.InstanceStateError,
}

// StateFromProto maps a process state to the API's instance state.
func StateFromProto(s imv1.ProcessState) v1.InstanceState {
	if st, ok := stateFromProto[s]; ok {
		return st
	}
	return v1.InstanceStateUnknown
}

// Observation is what one reconcile found of the process.
type Observation struct {
	State v1.InstanceState
	// InstanceManager is the name of the node's InstanceManager ("" when
	// none was found: keep the last one reported).
	InstanceManager string
	// Process is the instance manager's record (nil when there is none,
	// or it cannot be read).
	Process *imv1.Process
}

// Wait is a start put off by the kind's own precondition: the Ready
// condition's reason and message, and when to look again (0: a watch
// brings the object back).
type Wait struct {
	Reason, Message string
	RequeueAfter    time.Duration
}

// Spec is one object's process as its reconciler describes it.
type Spec struct {
	// Object is the Engine or Replica: its namespace/name name the
	// process; its UID keys the back-off.
	Object client.Object
	// Noun is what messages call the process ("engine process").
	Noun string
	// Node runs the process; Desired is spec.desiredState.
	Node    string
	Desired v1.DesiredInstanceState
	// Ready sets the object's Ready condition.
	Ready func(ok bool, reason, msg string)
	// Observe records what was found in the object's status. It is called
	// once per reconcile before anything else is decided, and again with
	// InstanceStateStarting after a create.
	Observe func(Observation)
	// Create returns what to create, called only when the process is to be
	// started now. A Wait puts the start off; an error is returned from
	// the reconcile (Create sets the condition it wants for it).
	Create func(ctx context.Context) (*imv1.ProcessCreateRequest, *Wait, error)
	// Running is called while the process runs and is to run; it sets the
	// Ready condition.
	Running func(ctx context.Context, p *imv1.Process) (ctrl.Result, error)
	// Outdated (optional) is asked about a process still starting: a
	// reason ("" none) to replace it, because it was created from another
	// spec than the object now asks for and a process created now could
	// start. It serves nothing yet, so it is deleted and created again
	// (not a failure).
	Outdated func(ctx context.Context, p *imv1.Process) (string, error)
}

// Runner runs processes for one reconciler; its back-off is that
// reconciler's.
type Runner struct {
	client  client.Reader
	pool    *imclient.Pool
	backoff *Backoff
}

// NewRunner returns a Runner reading objects through c, reaching instance
// managers through pool, spacing restarts by policy (zero fields: the
// defaults).
func NewRunner(c client.Reader, pool *imclient.Pool, policy Policy) *Runner {
	return &Runner{client: c, pool: pool, backoff: NewBackoff(policy, nil)}
}

// Reconcile observes s's process, reports it through s.Observe and
// s.Ready, and creates, forgets or stops it as s.Desired asks.
func (r *Runner) Reconcile(ctx context.Context, s Spec) (ctrl.Result, error) {
	// A node an operator declared shut down (the out-of-service taint)
	// runs nothing of ours: the process is reported stopped, and nothing
	// is called there until the taint goes.
	out, err := objects.OutOfService(ctx, r.client, s.Node)
	if err != nil {
		return ctrl.Result{}, err
	}
	if out {
		s.Observe(Observation{State: v1.InstanceStateStopped})
		s.Ready(false, v1.ReasonNodeOutOfService, fmt.Sprintf("node %s has the %s taint: it is shut down, and the %s with it", s.Node, corev1.TaintNodeOutOfService, s.Noun))
		return ctrl.Result{}, nil
	}
	conn, im, err := r.pool.ForNode(ctx, r.client, s.Object.GetNamespace(), s.Node)
	if err != nil {
		s.Observe(Observation{State: v1.InstanceStateUnknown})
		s.Ready(false, v1.ReasonNoInstanceManager, err.Error())
		if errors.Is(err, imclient.ErrNoInstanceManager) {
			return ctrl.Result{}, nil // an InstanceManager appearing triggers a reconcile
		}
		return ctrl.Result{}, err
	}
	proc, exists, current := conn.Process(Name(s.Object))
	if !current {
		s.Observe(Observation{State: v1.InstanceStateUnknown, InstanceManager: im.Name})
		s.Ready(false, v1.ReasonInstanceManagerDown, fmt.Sprintf("instance manager %s at %s is not reachable; the %s's state is unknown", im.Name, im.Spec.Address, s.Noun))
		return ctrl.Result{RequeueAfter: objects.UnreachableRecheck}, nil
	}
	state := v1.InstanceStateStopped
	if exists {
		state = StateFromProto(proc.GetState())
	} else {
		proc = nil
	}
	s.Observe(Observation{State: state, InstanceManager: im.Name, Process: proc})
	if s.Desired != v1.DesiredInstanceStateRunning {
		return ctrl.Result{}, r.stop(ctx, s, conn, exists)
	}
	switch {
	case !exists:
		return r.create(ctx, s, conn, im.Name)
	case state == v1.InstanceStateError || state == v1.InstanceStateStopped:
		return r.exited(ctx, s, conn, proc)
	case state == v1.InstanceStateRunning:
		r.backoff.Running(s.Object.GetUID())
		return s.Running(ctx, proc)
	case state == v1.InstanceStateStarting && s.Outdated != nil:
		return r.starting(ctx, s, conn, proc)
	default:
		s.Ready(false, v1.ReasonStarting, startingMessage(s, string(state), proc))
		return ctrl.Result{}, nil
	}
}

// startingMessage is the Ready message of a process that is not ready
// yet: its state, and what it last said it waits for (an engine waiting
// for a replica that may hold the newest data names it and why).
func startingMessage(s Spec, state string, p *imv1.Process) string {
	msg := "the " + s.Noun + " is " + state
	if w := p.GetWaiting(); w != "" {
		msg += ": " + w
	}
	return msg
}

// starting replaces a starting process that s.Outdated says was created
// from a spec gone stale. If we crash after the delete, the next
// reconcile finds no process and creates one from the current spec.
func (r *Runner) starting(ctx context.Context, s Spec, conn *imclient.Conn, p *imv1.Process) (ctrl.Result, error) {
	why, err := s.Outdated(ctx, p)
	if err != nil {
		return ctrl.Result{}, err
	}
	if why == "" {
		s.Ready(false, v1.ReasonStarting, startingMessage(s, "starting", p))
		return ctrl.Result{}, nil
	}
	s.Ready(false, v1.ReasonStarting, "the "+s.Noun+" is started again before it serves: "+why)
	if err := Delete(ctx, conn, s.Object, s.Noun); err != nil {
		return ctrl.Result{}, err
	}
	return ctrl.Result{}, nil // the process's deletion (its watch event) brings the object back
}

// stop deletes the process (which also forgets an exited one, so a later
// start is clean). A call that times out is not an error: the next
// reconcile sees what became of it.
func (r *Runner) stop(ctx context.Context, s Spec, conn *imclient.Conn, exists bool) error {
	r.backoff.Forget(s.Object.GetUID())
	s.Ready(false, v1.ReasonStopped, "desiredState is stopped")
	if !exists {
		return nil
	}
	cctx, cancel := context.WithTimeout(ctx, CallTimeout)
	defer cancel()
	if _, err := conn.Client.ProcessDelete(cctx, &imv1.ProcessDeleteRequest{Name: Name(s.Object)}); err != nil && grpcstatus.Code(err) != codes.DeadlineExceeded {
		return fmt.Errorf("stop %s %s: %w", s.Noun, Name(s.Object), err)
	}
	return nil
}

// create starts the process unless its back-off or the kind's own
// precondition says to wait. If we crash after the create and before the
// status patch, the next reconcile finds the process by its name.
func (r *Runner) create(ctx context.Context, s Spec, conn *imclient.Conn, imName string) (ctrl.Result, error) {
	if f, wait := r.backoff.Wait(s.Object.GetUID()); wait > 0 {
		s.Ready(false, v1.ReasonProcessBackOff, f.Message(s.Noun))
		return ctrl.Result{RequeueAfter: wait}, nil
	}
	req, w, err := s.Create(ctx)
	if err != nil {
		return ctrl.Result{}, err
	}
	if w != nil {
		s.Ready(false, w.Reason, w.Message)
		return ctrl.Result{RequeueAfter: w.RequeueAfter}, nil
	}
	req.Name = Name(s.Object)
	cctx, cancel := context.WithTimeout(ctx, CallTimeout)
	defer cancel()
	_, err = conn.Client.ProcessCreate(cctx, req)
	switch grpcstatus.Code(err) {
	case codes.OK, codes.AlreadyExists:
		s.Observe(Observation{State: v1.InstanceStateStarting, InstanceManager: imName})
		s.Ready(false, v1.ReasonStarting, "the "+s.Noun+" was created on "+s.Node)
		return ctrl.Result{}, nil
	case codes.InvalidArgument:
		s.Ready(false, v1.ReasonInvalidSpec, grpcstatus.Convert(err).Message())
		return ctrl.Result{}, reconcile.TerminalError(err)
	default:
		cause := fmt.Sprintf("the instance manager did not create the %s: %s", s.Noun, grpcstatus.Convert(err).Message())
		return r.failed(s, "", cause, fmt.Errorf("create %s %s: %w", s.Noun, req.Name, err))
	}
}

// exited forgets a process that exited, so the next reconcile starts it
// again, and counts the failure. If we crash after the delete, the next
// reconcile finds no process and starts one (the count is lost, a single
// immediate restart more).
func (r *Runner) exited(ctx context.Context, s Spec, conn *imclient.Conn, p *imv1.Process) (ctrl.Result, error) {
	cause := fmt.Sprintf("the %s exited (code %d): %s", s.Noun, p.GetExitCode(), p.GetError())
	cctx, cancel := context.WithTimeout(ctx, CallTimeout)
	defer cancel()
	if _, err := conn.Client.ProcessDelete(cctx, &imv1.ProcessDeleteRequest{Name: Name(s.Object)}); err != nil {
		s.Ready(false, v1.ReasonProcessFailed, cause)
		return ctrl.Result{}, fmt.Errorf("forget failed %s %s: %w", s.Noun, Name(s.Object), err)
	}
	return r.failed(s, "pid "+strconv.Itoa(int(p.GetPid())), cause, errors.New(cause))
}

// failed counts a failed start. After the first failure in a row the
// process is started again at once (the returned error requeues it with
// the controller's own short back-off); after more, the reconcile comes
// back when the back-off ends, and Ready says why it waits until then.
func (r *Runner) failed(s Spec, id, cause string, err error) (ctrl.Result, error) {
	f := r.backoff.Failed(s.Object.GetUID(), id, cause)
	if f.Delay == 0 {
		s.Ready(false, v1.ReasonProcessFailed, cause)
		return ctrl.Result{}, err
	}
	s.Ready(false, v1.ReasonProcessBackOff, f.Message(s.Noun))
	return ctrl.Result{RequeueAfter: f.Delay}, nil
}

// Forget drops obj's back-off (it is being deleted).
func (r *Runner) Forget(obj client.Object) { r.backoff.Forget(obj.GetUID()) }

// Delete stops obj's process on conn's instance manager (no error if
// there is none).
func Delete(ctx context.Context, conn *imclient.Conn, obj client.Object, noun string) error {
	cctx, cancel := context.WithTimeout(ctx, CallTimeout)
	defer cancel()
	if _, err := conn.Client.ProcessDelete(cctx, &imv1.ProcessDeleteRequest{Name: Name(obj)}); err != nil {
		return fmt.Errorf("stop %s %s: %w", noun, Name(obj), err)
	}
	return nil
}

// Lazy makes a reconciler's Runner on first use.
type Lazy struct {
	once sync.Once
	r    *Runner
}

// Get returns the Runner, made with NewRunner(c, pool, policy) the first
// time.
func (l *Lazy) Get(c client.Reader, pool *imclient.Pool, policy Policy) *Runner {
	l.once.Do(func() { l.r = NewRunner(c, pool, policy) })
	return l.r
}
