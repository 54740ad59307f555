package volume

import (
	"context"
	"fmt"
	"strings"

	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/internal/objects"
)

// AnnotationSalvage lists, while a faulted volume is salvaged, the
// replicas the engine must be restarted with: every one that may hold the
// newest data. Attach waits for all of them to run.
const AnnotationSalvage = "storage.cairn.io/salvage-replicas"

// salvage restarts a faulted engine (no RW replica left), once every
// replica that has ever been RW runs again: the engine's open compares the
// epochs the replicas hold and serves from the ones with the newest, the
// last it held RW, and the others are rebuilt from them. A replica's data
// size or file times never choose. Until every such replica runs, the
// volume stays faulted and says which ones it waits for: starting without
// one of them could serve older data than was acknowledged. It acts only
// on a serving engine whose reported modes hold no RW replica (the plan
// is faulted).
func (r *Reconciler) salvage(ctx context.Context, s *scope) error {
	if !s.serving || !s.engineReported() || !s.plan.faulted {
		return nil
	}
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
