// Package volume reconciles Volume objects: it creates the volume's Engine
// and Replicas, places the replicas on disks (controllers/scheduler),
// starts them and then the engine on spec.nodeName to attach, stops them
// in the reverse order to detach, keeps a running engine's replica set
// whole (repair, salvage), fills a clone from its data source, and deletes
// the engine and replicas with their data when the Volume goes. Status is
// computed at the end of each reconcile from what was observed; no
// decision reads it.
//
// The files follow the reconcile's phases (runPhases): engine.go and
// replicas.go (the Engine and Replica objects, placement), repair_plan.go
// (planRepair, the one decision about failed, replaced and surplus
// replicas), target.go (where the engine runs, and for what), clone.go
// (the copy from a data source), attach.go (starting and stopping the
// processes), repair.go and salvage.go (a running engine's replica set),
// move.go (replicas moved off a node), delete.go, status.go, events.go
// and watches.go.
package volume

import (
	"context"
	"errors"
	"slices"
	"strings"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/events"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/manager"
	"sigs.k8s.io/controller-runtime/pkg/source"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/internal/objects"
	"github.com/cairn-io/cairn/controllers/internal/volumes"
	"github.com/cairn-io/cairn/controllers/scheduler"
)

// Finalizer keeps a Volume until its engine and replicas (and with them
// the replicas' data) are gone.
const Finalizer = "storage.cairn.io/volume"

// LabelVolume marks a Volume's Engine, Replicas and Snapshots with its name.
const LabelVolume = volumes.LabelVolume

// IndexDataSourceVolume indexes Volumes by spec.dataSource.volume.
const IndexDataSourceVolume = "spec.dataSource.volume"

// Reconciler owns the Volume life cycle.
type Reconciler struct {
	client.Client
	// OverProvisioningPercent for scheduling; 0: the scheduler's default.
	OverProvisioningPercent int
	// Ledger places replicas, shared with everything else in the process
	// that does (the drain controller); nil: SetupWithManager makes one.
	Ledger *scheduler.Ledger
	// ReplenishmentWait is how long a failed replica may take to come back
	// before a replacement is built; 0: DefaultReplenishmentWait.
	ReplenishmentWait time.Duration
	// ConcurrentRebuildLimit is how many replicas of a volume are rebuilt
	// at once; 0: DefaultConcurrentRebuildLimit.
	ConcurrentRebuildLimit int
	// Recorder records Events (nil: none).
	Recorder events.EventRecorder
	// Restore configures the restores of volumes from backups (restore.go).
	Restore RestoreOptions
	// restores are the restores running in this manager; restoreEvents
	// bring their volumes back to the reconciler; apiReader reads
	// BackupTargets and the Secrets they name, uncached.
	restores      restoreRuns
	restoreEvents chan event.GenericEvent
	apiReader     client.Reader
	// now is the clock (tests); nil: time.Now.
	now func() time.Time
}

func (r *Reconciler) clock() time.Time {
	if r.now != nil {
		return r.now()
	}
	return time.Now()
}

func (r *Reconciler) wait() time.Duration {
	if r.ReplenishmentWait > 0 {
		return r.ReplenishmentWait
	}
	return DefaultReplenishmentWait
}

func (r *Reconciler) rebuildLimit() int {
	if r.ConcurrentRebuildLimit > 0 {
		return r.ConcurrentRebuildLimit
	}
	return DefaultConcurrentRebuildLimit
}

// +kubebuilder:rbac:groups=storage.cairn.io,resources=volumes,verbs=get;list;watch;update;patch
// +kubebuilder:rbac:groups=storage.cairn.io,resources=volumes/status,verbs=get;update;patch
// +kubebuilder:rbac:groups=storage.cairn.io,resources=volumes/finalizers,verbs=update
// +kubebuilder:rbac:groups=storage.cairn.io,resources=engines;replicas,verbs=get;list;watch;create;update;patch;delete
// +kubebuilder:rbac:groups=storage.cairn.io,resources=storagenodes,verbs=get;list;watch
// +kubebuilder:rbac:groups=storage.cairn.io,resources=snapshots,verbs=get;list;watch;create;delete
// +kubebuilder:rbac:groups=storage.cairn.io,resources=backups,verbs=get;list;watch

// scope is what one reconcile observed of a volume, and what its phases
// decided for the phases after them and for the status.
type scope struct {
	v        *v1.Volume
	engine   *v1.Engine // nil if missing
	replicas []*v1.Replica
	// now is the reconcile's time: failures are stamped with it and
	// waits measured from it.
	now time.Time
	// unplaced and reason: the scheduler's verdict on replicas it could
	// not place in this reconcile.
	unplaced int
	reason   string
	// plan is planRepair's decision from the replicas and the engine as
	// observed (planReplicas): the replacements ensureReplicas creates,
	// and what repair and salvage do to a running engine's set.
	plan repairPlan
	// serving is set by attachOrDetach when the engine is to go on
	// running where it is, as it is: repair and salvage keep its replica
	// set. It is false while the engine is stopped, started or moved.
	serving bool
	// requeueAfter is when the volume is reconciled again though no
	// watched object changes (a failed replica's wait ending, a restore
	// retried, a disk the scheduler's record ruled out freed); the
	// soonest of the phases' wishes (requeueWithin), 0 for none.
	requeueAfter time.Duration
	// salvageWait says why a faulted volume is not salvaged yet.
	salvageWait string
	// work says what Cairn's own work needs the volume's processes for
	// ("" nothing): snapshots to take or delete, clones reading from it.
	work string
	// clone is this volume's copy from spec.dataSource as observed
	// (nil without one); cloneFrom the source replica once known.
	clone     *v1.CloneStatus
	cloneFrom *v1.EngineCloneSource
	// cloneReason, when set, is condition Cloned's reason (a restore's);
	// restoring is set while a restore needs the replicas running and
	// the engine stopped (restore.go).
	cloneReason string
	restoring   bool
	// node is where the engine is to run ("" nowhere), maintenance
	// whether without a device (runTarget).
	node        string
	maintenance bool
	targeted    bool
}

// requeueWithin asks for a reconcile within d (none when d is 0).
func (s *scope) requeueWithin(d time.Duration) {
	if d > 0 && (s.requeueAfter == 0 || d < s.requeueAfter) {
		s.requeueAfter = d
	}
}

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
	s := &scope{v: v, now: r.clock()}
	err := r.runPhases(ctx, s)
	computeStatus(s)
	r.recordTransitions(before, v)
	if perr := r.Status().Patch(ctx, v, client.MergeFrom(before)); perr != nil {
		return ctrl.Result{}, errors.Join(err, perr)
	}
	if err != nil {
		return ctrl.Result{}, err // retried with backoff, sooner than any wish
	}
	return ctrl.Result{RequeueAfter: s.requeueAfter}, nil
}

// runPhases runs the reconcile's phases in order, stopping at the first
// error; each reads what the ones before it observed and decided in s.
func (r *Reconciler) runPhases(ctx context.Context, s *scope) error {
	for _, phase := range []func(context.Context, *scope) error{
		r.observe,        // the Engine and the Replicas
		r.observeWork,    // snapshots to take or delete, clones reading from the volume
		r.planReplicas,   // planRepair: replacements, failures, the engine's set
		r.ensureEngine,   // the Engine object
		r.ensureReplicas, // the Replica objects, with the plan's replacements
		r.schedule,       // replicas placed on disks
		r.planClone,      // the copy from spec.dataSource.volume
		r.planRestore,    // the restore from spec.dataSource.backup
		r.attachOrDetach, // processes started or stopped where the engine is to run
		r.repair,         // a serving engine's replica set kept whole
		r.salvage,        // a faulted engine restarted on the newest replicas
		r.finishClone,    // a completed copy's leftovers
	} {
		if err := phase(ctx, s); err != nil {
			return err
		}
	}
	return nil
}

// observe reads the volume's Engine (nil if missing) and the Replicas it
// controls, by name.
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

// SetupWithManager registers the reconciler.
func (r *Reconciler) SetupWithManager(mgr ctrl.Manager) error {
	if r.Recorder == nil {
		r.Recorder = mgr.GetEventRecorder("cairn-volume")
	}
	if r.Ledger == nil {
		r.Ledger = scheduler.NewLedger()
	}
	if err := r.Ledger.SetupWithManager(mgr); err != nil {
		return err
	}
	if err := mgr.GetFieldIndexer().IndexField(context.Background(), &v1.Volume{}, IndexDataSourceVolume, indexDataSourceVolume); err != nil {
		return err
	}
	if r.apiReader == nil {
		r.apiReader = mgr.GetAPIReader()
	}
	r.restoreEvents = make(chan event.GenericEvent, 64)
	r.restores.slots = make(chan struct{}, r.restoreOpts().MaxConcurrent)
	// Restores run while this manager leads, and stop with it.
	if err := mgr.Add(manager.RunnableFunc(func(ctx context.Context) error {
		<-ctx.Done()
		r.restores.stopAll()
		return nil
	})); err != nil {
		return err
	}
	m := watchMaps{c: mgr.GetClient()}
	return ctrl.NewControllerManagedBy(mgr).
		For(&v1.Volume{}).
		Owns(&v1.Engine{}).
		Owns(&v1.Replica{}).
		Watches(&v1.Snapshot{}, handler.EnqueueRequestsFromMapFunc(m.snapshot)).
		Watches(&v1.Backup{}, handler.EnqueueRequestsFromMapFunc(m.backup)).
		Watches(&v1.Volume{}, handler.EnqueueRequestsFromMapFunc(m.cloneOrSource)).
		Watches(&v1.Engine{}, handler.EnqueueRequestsFromMapFunc(m.engineOfSource)).
		Watches(&v1.Replica{}, handler.EnqueueRequestsFromMapFunc(m.replicaOfSource)).
		Watches(&v1.StorageNode{}, handler.EnqueueRequestsFromMapFunc(m.unscheduled)).
		WatchesRawSource(source.Channel(r.restoreEvents, &handler.EnqueueRequestForObject{})).
		Named("volume").
		WithOptions(controller.Options{MaxConcurrentReconciles: objects.Workers}).
		Complete(r)
}
