package volume

import (
	"context"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/internal/objects"
)

// planReplicas decides what becomes of the volume's replicas
// (planRepair) from the replicas and the engine as observed. The engine's
// replica modes are facts only while its process runs; without them the
// plan is faulted, and no given-up replica stops counting.
func (r *Reconciler) planReplicas(_ context.Context, s *scope) error {
	in := repairInput{want: wantReplicas(s.v), replicas: s.replicas, rebuildLimit: r.rebuildLimit(), wait: r.wait(), now: s.now}
	if e := s.engine; e != nil {
		in.engineAddrs, in.engineNode = e.Spec.ReplicaAddresses, e.Spec.NodeName
		if e.Status.InstanceState == v1.InstanceStateRunning {
			in.modes = e.Status.ReplicaModeMap
		}
	}
	s.plan = planRepair(in)
	return nil
}

// engineReported reports whether the engine runs where it is to run and
// its status stream has reported the replicas' modes: the facts repair
// and salvage act on.
func (s *scope) engineReported() bool {
	e := s.engine
	return e.Status.InstanceState == v1.InstanceStateRunning && e.Spec.NodeName == s.node && len(e.Status.ReplicaModeMap) > 0
}

// repair keeps a serving engine's replica set whole as the plan says
// (planRepair): it marks replicas failed and healthy, gives the engine
// the replicas it should serve (a failed one back once its process runs
// again), deletes failed replicas whose replacement is RW, and passes an
// expansion on. Replacements are created by ensureReplicas and placed by
// schedule; a faulted engine is salvage's.
func (r *Reconciler) repair(ctx context.Context, s *scope) error {
	if !s.serving {
		return nil
	}
	if !s.engineReported() {
		// Not running, or its status stream has not reported yet: nothing
		// observed to act on but the size it is to serve and the source
		// it is to copy.
		return r.setEngine(ctx, s.engine, func(e *v1.Engine) { e.Spec.Size, e.Spec.CloneFrom = s.v.Spec.Size, s.wantCloneFrom() })
	}
	s.requeueWithin(s.plan.recheckAfter)
	if s.plan.faulted {
		return nil
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
	if err := r.markHealth(ctx, s, byName); err != nil {
		return err
	}
	if err := r.keepExpandedSize(ctx, s, byName); err != nil {
		return err
	}
	if err := r.setEngine(ctx, s.engine, func(e *v1.Engine) {
		e.Spec.Size, e.Spec.ReplicaAddresses, e.Spec.CloneFrom = s.v.Spec.Size, s.plan.addresses, s.wantCloneFrom()
	}); err != nil {
		return err
	}
	return r.removeReplicas(ctx, s, byName)
}

// markHealth records the plan's failed replicas (spec.failedAt) and
// healthy ones (spec.healthyAt, failedAt cleared), with an Event each.
func (r *Reconciler) markHealth(ctx context.Context, s *scope, byName map[string]*v1.Replica) error {
	for _, n := range s.plan.failed {
		rep := byName[n]
		if err := r.patchReplica(ctx, rep, func(rep *v1.Replica) { rep.Spec.FailedAt = &metav1.Time{Time: s.now} }); err != nil {
			return err
		}
		objects.Event(r.Recorder, s.v, true, EventReplicaFailed, "Observe", "replica %s on %s stopped serving (%s); it is given back to the engine when its process runs again, and replaced if it is not back within %s",
			n, rep.Spec.NodeName, modeOrGone(s.engine.Status.ReplicaModeMap, n), r.wait())
	}
	for _, n := range s.plan.healthy {
		rep := byName[n]
		wasFailed := rep.Spec.FailedAt != nil
		if err := r.patchReplica(ctx, rep, func(rep *v1.Replica) { rep.Spec.FailedAt, rep.Spec.HealthyAt = nil, &metav1.Time{Time: s.now} }); err != nil {
			return err
		}
		if wasFailed {
			objects.Event(r.Recorder, s.v, false, EventReplicaHealthy, "Observe", "replica %s on %s is RW again", n, rep.Spec.NodeName)
		}
	}
	return nil
}

// keepExpandedSize records the engine's new size on each RW replica that
// took it, so that the replica keeps it on its next start.
func (r *Reconciler) keepExpandedSize(ctx context.Context, s *scope, byName map[string]*v1.Replica) error {
	size := s.engine.Status.Size
	if size == nil {
		return nil
	}
	for n, m := range s.engine.Status.ReplicaModeMap {
		if rep := byName[n]; rep != nil && m == v1.ReplicaModeRW && rep.Spec.Size.Cmp(*size) < 0 {
			if err := r.patchReplica(ctx, rep, func(rep *v1.Replica) { rep.Spec.Size = *size }); err != nil {
				return err
			}
		}
	}
	return nil
}

// removeReplicas deletes the plan's given-up and surplus replicas.
func (r *Reconciler) removeReplicas(ctx context.Context, s *scope, byName map[string]*v1.Replica) error {
	for _, n := range s.plan.remove {
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

func modeOrGone(modes map[string]v1.ReplicaMode, name string) string {
	if m, ok := modes[name]; ok {
		return "engine mode " + string(m)
	}
	return "no longer held by the engine"
}
