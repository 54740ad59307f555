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
	"time"

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
	"github.com/cairn-io/cairn/controllers/internal/objects"
	"github.com/cairn-io/cairn/controllers/internal/volumes"
	"github.com/cairn-io/cairn/controllers/scheduler"
)

// Finalizer keeps a Volume until its engine and replicas (and with them
// the replicas' data) are gone.
const Finalizer = "storage.cairn.io/volume"

// AnnotationSalvage lists, while a faulted volume is salvaged, the
// replicas the engine must be restarted with: every one that may hold the
// newest data. Attach waits for all of them to run.
const AnnotationSalvage = "storage.cairn.io/salvage-replicas"

// LabelVolume marks a Volume's Engine, Replicas and Snapshots with its name.
const LabelVolume = volumes.LabelVolume

// IndexDataSourceVolume indexes Volumes by spec.dataSource.volume.
const IndexDataSourceVolume = "spec.dataSource.volume"

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
	// now is the clock (tests); nil: time.Now.
	now func() time.Time
}

// Volume event reasons.
const (
	EventReplicaFailed    = "ReplicaFailed"
	EventReplicaHealthy   = "ReplicaHealthy"
	EventReplicaReplaced  = "ReplicaReplaced"
	EventReplicaDeleted   = "FailedReplicaDeleted"
	EventAttached         = "Attached"
	EventDetached         = "Detached"
	EventSchedulingFailed = "SchedulingFailed"
	EventSalvage          = "Salvage"
	EventCloned           = "Cloned"
	EventCloneFailed      = "CloneFailed"
)

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

// +kubebuilder:rbac:groups=storage.cairn.io,resources=volumes,verbs=get;list;watch;update;patch
// +kubebuilder:rbac:groups=storage.cairn.io,resources=volumes/status,verbs=get;update;patch
// +kubebuilder:rbac:groups=storage.cairn.io,resources=volumes/finalizers,verbs=update
// +kubebuilder:rbac:groups=storage.cairn.io,resources=engines;replicas,verbs=get;list;watch;create;update;patch;delete
// +kubebuilder:rbac:groups=storage.cairn.io,resources=storagenodes,verbs=get;list;watch
// +kubebuilder:rbac:groups=storage.cairn.io,resources=snapshots,verbs=get;list;watch;create;delete

// scope is what one reconcile observed of a volume.
type scope struct {
	v        *v1.Volume
	engine   *v1.Engine // nil if missing
	replicas []*v1.Replica
	// unplaced and reason: the scheduler's verdict on replicas it could
	// not place in this reconcile.
	unplaced int
	reason   string
	// plan is the repair plan while the engine runs (nil otherwise).
	plan *repairPlan
	// requeueAfter: when a failed replica's wait ends.
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
	// node is where the engine is to run ("" nowhere), maintenance
	// whether without a device (runTarget).
	node        string
	maintenance bool
	targeted    bool
}

// EngineName is the name of a volume's Engine.
func EngineName(v *v1.Volume) string { return volumes.EngineName(v) }

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
		err = r.observeWork(ctx, s)
	}
	if err == nil {
		for _, phase := range []func(context.Context, *scope) error{r.ensureEngine, r.ensureReplicas, r.schedule, r.planClone, r.attachOrDetach, r.finishClone} {
			if err = phase(ctx, s); err != nil {
				break
			}
		}
	}
	computeStatus(s)
	r.recordTransitions(before, v)
	if perr := r.Status().Patch(ctx, v, client.MergeFrom(before)); perr != nil {
		return ctrl.Result{}, errors.Join(err, perr)
	}
	return ctrl.Result{RequeueAfter: s.requeueAfter}, err
}

// recordTransitions records an Event for each change of state or
// robustness a user would look for in `kubectl describe`.
func (r *Reconciler) recordTransitions(before, v *v1.Volume) {
	if before.Status.State != v.Status.State {
		switch v.Status.State {
		case v1.VolumeStateAttached:
			objects.Event(r.Recorder, v, false, EventAttached, "Attach", "attached to %s at %s", v.Status.CurrentNodeName, v.Status.Endpoint)
		case v1.VolumeStateDetached:
			if before.Status.State != v1.VolumeStateCreating && before.Status.State != "" {
				objects.Event(r.Recorder, v, false, EventDetached, "Detach", "detached; the data rests on the replicas")
			}
		}
	}
	if before.Status.Robustness != v.Status.Robustness && v.Status.State == v1.VolumeStateAttached && v.Status.Robustness != "" {
		warn := v.Status.Robustness != v1.VolumeRobustnessHealthy
		objects.Event(r.Recorder, v, warn, "Robustness"+strings.ToUpper(string(v.Status.Robustness[:1]))+string(v.Status.Robustness[1:]), "Observe",
			"robustness %s -> %s", before.Status.Robustness, v.Status.Robustness)
	}
	if c := v.Status.Clone; c != nil && (before.Status.Clone == nil || before.Status.Clone.State != c.State || (c.State == v1.CloneStateFailed && before.Status.Clone.Message != c.Message)) {
		switch c.State {
		case v1.CloneStateCompleted:
			objects.Event(r.Recorder, v, false, EventCloned, "Clone", "%s", c.Message)
		case v1.CloneStateFailed:
			objects.Event(r.Recorder, v, true, EventCloneFailed, "Clone", "%s", c.Message)
		}
	}
	bc := meta.FindStatusCondition(before.Status.Conditions, v1.VolumeConditionScheduled)
	nc := meta.FindStatusCondition(v.Status.Conditions, v1.VolumeConditionScheduled)
	if nc != nil && nc.Reason == v1.VolumeReasonReplicaSchedulingFailed && (bc == nil || bc.Message != nc.Message) {
		objects.Event(r.Recorder, v, true, EventSchedulingFailed, "Schedule", "%s", nc.Message)
	}
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
		Spec: v1.EngineSpec{VolumeName: s.v.Name, Size: s.v.Spec.Size, Frontend: s.v.Spec.Frontend, DesiredState: v1.DesiredInstanceStateStopped,
			Encryption: s.v.Spec.Encryption}}
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

// ensureReplicas creates Replicas (unscheduled, stopped) until
// numberOfReplicas of them count: a replica being deleted, or failed for
// longer than the replenishment wait, does not count, so a replacement is
// created for it.
func (r *Reconciler) ensureReplicas(ctx context.Context, s *scope) error {
	want := wantReplicas(s.v)
	now, active := r.clock(), 0
	// A failed replica stops counting only while a running engine has an
	// RW replica to rebuild a replacement from, and only if the engine
	// does not hold it (a WO replica is being rebuilt). Otherwise (a
	// faulted volume, an engine stopped for a salvage, a detached volume)
	// it keeps counting: a replacement could not be rebuilt, and would be
	// an empty replica an attach waits for.
	e := s.engine
	canReplace := e != nil && e.Status.InstanceState == v1.InstanceStateRunning && len(e.Status.ReplicaModeMap) > 0 &&
		robustnessFromModes(e.Status.ReplicaModeMap, 1) != v1.VolumeRobustnessFaulted
	for _, rep := range s.replicas {
		if !rep.DeletionTimestamp.IsZero() {
			continue
		}
		_, held := s.heldByEngine(rep.Name)
		if !canReplace || held || !expired(rep, r.wait(), now) {
			active++
		}
	}
	for ; active < want; active++ {
		replacing := len(s.replicas) >= want
		rep := &v1.Replica{ObjectMeta: metav1.ObjectMeta{GenerateName: s.v.Name + "-r-", Namespace: s.v.Namespace, Labels: map[string]string{LabelVolume: s.v.Name}},
			Spec: v1.ReplicaSpec{VolumeName: s.v.Name, Size: s.v.Spec.Size, DesiredState: v1.DesiredInstanceStateStopped}}
		if err := controllerutil.SetControllerReference(s.v, rep, r.Scheme()); err != nil {
			return err
		}
		// A crash after the create: the next reconcile lists it by label.
		if err := r.Create(ctx, rep); err != nil {
			return err
		}
		if replacing {
			objects.Event(r.Recorder, s.v, false, EventReplicaReplaced, "Replenish",
				"replica %s created to replace a replica failed for longer than %s", rep.Name, r.wait())
		}
		s.replicas = append(s.replicas, rep)
	}
	return nil
}

// schedule places every unscheduled replica on a disk, through the
// Ledger, which counts each disk's scheduled bytes from the Replicas and
// lets one placement decision run at a time. Each placement is a patch
// with the Replica's resourceVersion: if another reconcile placed it
// first (from a cache that did not show it placed yet), the patch
// conflicts and this reconcile is retried, rather than moving it.
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
	res, err := r.Ledger.Place(ctx, scheduler.PlaceOptions{Namespace: s.v.Namespace,
		Request: scheduler.Request{Size: s.v.Spec.Size.Value(), Tags: s.v.Spec.DiskSelector, OverProvisioningPercent: r.OverProvisioningPercent},
		Disks:   scheduler.FromStorageNodes(sns.Items), Placed: placed, N: len(pending),
		Write: func(ctx context.Context, i int, p scheduler.Placement) (client.ObjectKey, error) {
			rep := pending[i]
			before := rep.DeepCopy()
			rep.Spec.NodeName, rep.Spec.DiskName, rep.Spec.DiskPath = p.Node, p.Disk, p.Path
			rep.Spec.DataDirectoryName = rep.Name
			return client.ObjectKeyFromObject(rep), r.Patch(ctx, rep, client.MergeFromWithOptions(before, client.MergeFromWithOptimisticLock{}))
		}})
	if err != nil {
		return err
	}
	s.unplaced, s.reason = res.Unplaced, res.Reason
	return nil
}

// attachOrDetach moves processes toward the target runTarget picks:
// spec.nodeName, or for Cairn's own work on a volume no user has (or may
// have yet: a clone being copied) a maintenance engine without a device.
// To attach, the replicas start, then the engine starts on the node with
// their addresses; to detach, the engine stops, then the replicas. An
// engine on another node, or of the other kind (maintenance or a user's),
// is stopped first and started again as wanted.
func (r *Reconciler) attachOrDetach(ctx context.Context, s *scope) error {
	s.target()
	node, maint := s.node, s.maintenance
	e := s.engine
	if node == "" || (e.Spec.NodeName != "" && (e.Spec.NodeName != node || e.Spec.Maintenance != maint)) {
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
	// Attach, or start again an engine whose process does not serve.
	restart := e.Spec.DesiredState == v1.DesiredInstanceStateRunning && engineNotServing(e)
	addrs, waiting, err := r.startSet(ctx, s, restart)
	if err != nil {
		return err
	}
	if restart {
		return r.restartEngine(ctx, s, addrs, waiting)
	}
	if e.Spec.DesiredState == v1.DesiredInstanceStateRunning {
		return r.repair(ctx, s)
	}
	switch e.Status.InstanceState {
	case v1.InstanceStateStarting, v1.InstanceStateRunning, v1.InstanceStateStopping:
		return nil // a stop asked for (a salvage) has not happened yet; the engine's status change brings us back
	}
	if waiting > 0 || len(addrs) == 0 {
		return nil // every scheduled replica runs first; their status changes bring us back
	}
	// The kind of engine and what it copies go in the same patch as the
	// start: a user's engine is never started with a clone source.
	return r.setEngine(ctx, e, func(e *v1.Engine) {
		e.Spec.NodeName, e.Spec.DesiredState, e.Spec.ReplicaAddresses = node, v1.DesiredInstanceStateRunning, addrs
		e.Spec.Size, e.Spec.Frontend = s.v.Spec.Size, s.v.Spec.Frontend
		e.Spec.Maintenance, e.Spec.CloneFrom = maint, s.wantCloneFrom()
	})
}

// repair keeps a running engine's replica set whole (planRepair): it
// marks replicas failed and healthy, gives the engine the replicas it
// should serve (a failed one back once its process runs again), deletes
// failed replicas whose replacement is RW, and passes an expansion on.
// Replacements are created by ensureReplicas and placed by schedule.
func (r *Reconciler) repair(ctx context.Context, s *scope) error {
	e := s.engine
	if e.Status.InstanceState != v1.InstanceStateRunning || e.Spec.NodeName != s.node || len(e.Status.ReplicaModeMap) == 0 {
		// Not running, or its status stream has not reported yet: nothing
		// observed to act on but the size it is to serve and the source
		// it is to copy.
		return r.setEngine(ctx, e, func(e *v1.Engine) { e.Spec.Size, e.Spec.CloneFrom = s.v.Spec.Size, s.wantCloneFrom() })
	}
	now := r.clock()
	limit := r.ConcurrentRebuildLimit
	if limit <= 0 {
		limit = DefaultConcurrentRebuildLimit
	}
	plan := planRepair(repairInput{want: wantReplicas(s.v), replicas: s.replicas, modes: e.Status.ReplicaModeMap,
		engineAddrs: e.Spec.ReplicaAddresses, rebuildLimit: limit, wait: r.wait(), now: now})
	s.plan, s.requeueAfter = &plan, plan.recheckAfter
	if plan.faulted {
		return r.salvage(ctx, s)
	}
	if _, ok := s.v.Annotations[AnnotationSalvage]; ok {
		// Salvaged: the engine serves from an RW replica again.
		before := s.v.DeepCopy()
		delete(s.v.Annotations, AnnotationSalvage)
		if err := r.Patch(ctx, s.v, client.MergeFrom(before)); err != nil {
			return err
		}
	}
	byName := map[string]*v1.Replica{}
	for _, rep := range s.replicas {
		byName[rep.Name] = rep
	}
	for _, n := range plan.failed {
		rep := byName[n]
		if err := r.patchReplica(ctx, rep, func(rep *v1.Replica) { rep.Spec.FailedAt = &metav1.Time{Time: now} }); err != nil {
			return err
		}
		objects.Event(r.Recorder, s.v, true, EventReplicaFailed, "Observe", "replica %s on %s stopped serving (%s); it is given back to the engine when its process runs again, and replaced if it is not back within %s",
			n, rep.Spec.NodeName, modeOrGone(e.Status.ReplicaModeMap, n), r.wait())
	}
	for _, n := range plan.healthy {
		rep := byName[n]
		wasFailed := rep.Spec.FailedAt != nil
		if err := r.patchReplica(ctx, rep, func(rep *v1.Replica) { rep.Spec.FailedAt, rep.Spec.HealthyAt = nil, &metav1.Time{Time: now} }); err != nil {
			return err
		}
		if wasFailed {
			objects.Event(r.Recorder, s.v, false, EventReplicaHealthy, "Observe", "replica %s on %s is RW again", n, rep.Spec.NodeName)
		}
	}
	// A replica that took the engine's new size keeps it on its next start.
	if e.Status.Size != nil {
		for n, m := range e.Status.ReplicaModeMap {
			if rep := byName[n]; rep != nil && m == v1.ReplicaModeRW && rep.Spec.Size.Cmp(*e.Status.Size) < 0 {
				if err := r.patchReplica(ctx, rep, func(rep *v1.Replica) { rep.Spec.Size = *e.Status.Size }); err != nil {
					return err
				}
			}
		}
	}
	if err := r.setEngine(ctx, e, func(e *v1.Engine) {
		e.Spec.Size, e.Spec.ReplicaAddresses, e.Spec.CloneFrom = s.v.Spec.Size, plan.addresses, s.wantCloneFrom()
	}); err != nil {
		return err
	}
	for _, n := range plan.remove {
		// The replica's finalizer stops its process and deletes its data;
		// if we crash after this call the object is already going.
		if err := r.Delete(ctx, byName[n]); client.IgnoreNotFound(err) != nil {
			return err
		}
		if f := byName[n].Spec.FailedAt; f != nil {
			objects.Event(r.Recorder, s.v, false, EventReplicaDeleted, "Replenish", "replica %s on %s, failed since %s, deleted: the volume is healthy without it",
				n, byName[n].Spec.NodeName, f.Format(time.RFC3339))
		} else {
			objects.Event(r.Recorder, s.v, false, EventReplicaDeleted, "Replenish", "replica %s, a replacement that never held data, deleted: the replica it replaced is healthy again",
				n)
		}
	}
	return nil
}

// salvage restarts a faulted engine (no RW replica left), once every
// replica that has ever been RW runs again: the engine's open compares the
// epochs the replicas hold and serves from the ones with the newest, the
// last it held RW, and the others are rebuilt from them. A replica's data
// size or file times never choose. Until every such replica runs, the
// volume stays faulted and says which ones it waits for: starting without
// one of them could serve older data than was acknowledged.
func (r *Reconciler) salvage(ctx context.Context, s *scope) error {
	var waitFor, from []string
	for _, rep := range s.replicas {
		_, given := s.engine.Spec.ReplicaAddresses[rep.Name]
		if !rep.DeletionTimestamp.IsZero() || (rep.Spec.HealthyAt == nil && !given) {
			continue
		}
		if _, ok := runningAddress(rep); ok {
			from = append(from, rep.Name)
		} else {
			waitFor = append(waitFor, fmt.Sprintf("%s on %s", rep.Name, rep.Spec.NodeName))
		}
	}
	if len(waitFor) > 0 || len(from) == 0 {
		s.salvageWait = fmt.Sprintf("no replica is RW; salvage waits for every replica that held the volume's data to run again (%s): the newest data may be on any of them. Bring their nodes back; a replica whose disk is lost for good must be deleted by hand first",
			strings.Join(waitFor, ", "))
		return nil
	}
	// The set is recorded on the Volume first: the engine is started again
	// only when every one of them runs (attach), even if one stops in
	// between. If we crash after the annotation, the next reconcile finds
	// the engine still faulted and goes on.
	if s.v.Annotations[AnnotationSalvage] != strings.Join(from, ",") {
		before := s.v.DeepCopy()
		if s.v.Annotations == nil {
			s.v.Annotations = map[string]string{}
		}
		s.v.Annotations[AnnotationSalvage] = strings.Join(from, ",")
		if err := r.Patch(ctx, s.v, client.MergeFrom(before)); err != nil {
			return err
		}
	}
	objects.Event(r.Recorder, s.v, true, EventSalvage, "Salvage",
		"no replica is RW: restarting the engine on %s; it serves from the ones with the newest epoch and rebuilds the others from them", strings.Join(from, ", "))
	// Stopping the engine is the whole step: once it is stopped, attach
	// starts it again with every running replica. A crash in between
	// finds it stopping or stopped and goes on from there.
	return r.setEngine(ctx, s.engine, func(e *v1.Engine) { e.Spec.DesiredState = v1.DesiredInstanceStateStopped })
}

// heldByEngine reports the replica's mode if the running engine holds it
// RW or WO.
func (s *scope) heldByEngine(name string) (v1.ReplicaMode, bool) {
	if s.engine == nil {
		return "", false
	}
	m := s.engine.Status.ReplicaModeMap[name]
	return m, m == v1.ReplicaModeRW || m == v1.ReplicaModeWO
}

func modeOrGone(modes map[string]v1.ReplicaMode, name string) string {
	if m, ok := modes[name]; ok {
		return "engine mode " + string(m)
	}
	return "no longer held by the engine"
}

func wantReplicas(v *v1.Volume) int { return v.Spec.Replicas() }

func (r *Reconciler) patchReplica(ctx context.Context, rep *v1.Replica, mutate func(*v1.Replica)) error {
	before := rep.DeepCopy()
	mutate(rep)
	return r.Patch(ctx, rep, client.MergeFrom(before))
}

func (r *Reconciler) setEngine(ctx context.Context, e *v1.Engine, mutate func(*v1.Engine)) error {
	before := e.DeepCopy()
	mutate(e)
	if equalEngineSpec(before, e) {
		return nil
	}
	return r.Patch(ctx, e, client.MergeFrom(before))
}

// equalEngineSpec reports whether a patch from a's spec to b's would
// change nothing: field by field, the pointed-to values of encryption and
// cloneFrom and quantities by value, so an unchanged encrypted or cloning
// engine is not patched on every reconcile.
func equalEngineSpec(a, b *v1.Engine) bool {
	return equality.Semantic.DeepEqual(a.Spec, b.Spec)
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
	// Its Snapshots go with it: their data is on the replicas deleted
	// below, so their finalizers just go (the Snapshot reconciler sees
	// the volume deleting). The snapshot a whole-volume clone took of its
	// source is the source's and is deleted from the source's replicas.
	// Deleting them is not waited for.
	var snaps v1.SnapshotList
	if err := r.List(ctx, &snaps, client.InNamespace(v.Namespace), client.MatchingLabels{LabelVolume: v.Name}); err != nil {
		return ctrl.Result{}, err
	}
	for i := range snaps.Items {
		if snaps.Items[i].DeletionTimestamp.IsZero() {
			if err := r.Delete(ctx, &snaps.Items[i]); client.IgnoreNotFound(err) != nil {
				return ctrl.Result{}, err
			}
		}
	}
	if err := r.deleteCloneSnapshots(ctx, v); err != nil {
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
	if r.Recorder == nil {
		r.Recorder = mgr.GetEventRecorder("cairn-volume")
	}
	if r.Ledger == nil {
		r.Ledger = scheduler.NewLedger()
	}
	if err := r.Ledger.SetupWithManager(mgr); err != nil {
		return err
	}
	if err := mgr.GetFieldIndexer().IndexField(context.Background(), &v1.Volume{}, IndexDataSourceVolume, func(o client.Object) []string {
		if ds := o.(*v1.Volume).Spec.DataSource; ds != nil {
			return []string{ds.Volume}
		}
		return nil
	}); err != nil {
		return err
	}
	c := mgr.GetClient()
	// clonesOf are the Volumes copying from volume name.
	clonesOf := func(ctx context.Context, ns, name string) []reconcile.Request {
		var vs v1.VolumeList
		if err := c.List(ctx, &vs, client.InNamespace(ns), client.MatchingFields{IndexDataSourceVolume: name}); err != nil {
			return nil
		}
		var out []reconcile.Request
		for i := range vs.Items {
			if !Cloned(&vs.Items[i]) {
				out = append(out, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(&vs.Items[i])})
			}
		}
		return out
	}
	return ctrl.NewControllerManagedBy(mgr).
		For(&v1.Volume{}).
		Owns(&v1.Engine{}).
		Owns(&v1.Replica{}).
		// A Snapshot to take or delete runs its volume's processes; one
		// taken lets the clones copying it go on.
		Watches(&v1.Snapshot{}, handler.EnqueueRequestsFromMapFunc(func(ctx context.Context, o client.Object) []reconcile.Request {
			sn := o.(*v1.Snapshot)
			out := append([]reconcile.Request{{NamespacedName: client.ObjectKey{Namespace: sn.Namespace, Name: sn.Spec.Volume}}},
				clonesOf(ctx, sn.Namespace, sn.Spec.Volume)...)
			if n := sn.Labels[LabelCloneFor]; n != "" {
				out = append(out, reconcile.Request{NamespacedName: client.ObjectKey{Namespace: sn.Namespace, Name: n}})
			}
			return out
		})).
		// A clone's source learns it is read from, and that it is no more.
		Watches(&v1.Volume{}, handler.EnqueueRequestsFromMapFunc(func(ctx context.Context, o client.Object) []reconcile.Request {
			v := o.(*v1.Volume)
			out := clonesOf(ctx, v.Namespace, v.Name)
			if v.Spec.DataSource != nil {
				out = append(out, reconcile.Request{NamespacedName: client.ObjectKey{Namespace: v.Namespace, Name: v.Spec.DataSource.Volume}})
			}
			return out
		})).
		// A source's replicas and engine say which replica a clone reads.
		Watches(&v1.Engine{}, handler.EnqueueRequestsFromMapFunc(func(ctx context.Context, o client.Object) []reconcile.Request {
			return clonesOf(ctx, o.GetNamespace(), o.(*v1.Engine).Spec.VolumeName)
		})).
		Watches(&v1.Replica{}, handler.EnqueueRequestsFromMapFunc(func(ctx context.Context, o client.Object) []reconcile.Request {
			return clonesOf(ctx, o.GetNamespace(), o.(*v1.Replica).Spec.VolumeName)
		})).
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
		WithOptions(controller.Options{MaxConcurrentReconciles: objects.Workers}).
		Complete(r)
}
