package volume

import (
	"context"
	"strings"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/internal/objects"
)

// attachOrDetach moves processes toward the target runTarget picks:
// spec.nodeName, or for Cairn's own work on a volume no user has (or may
// have yet: a clone being copied) a maintenance engine without a device.
// To attach, the replicas start, then the engine starts on the node with
// their addresses; to detach, the engine stops, then the replicas. An
// engine on another node, or of the other kind (maintenance or a user's),
// is stopped first and started again as wanted. An engine already asked
// to run there, as it is, is left to repair and salvage (s.serving).
func (r *Reconciler) attachOrDetach(ctx context.Context, s *scope) error {
	s.target()
	if s.restoring {
		return r.runRestoreReplicas(ctx, s) // restore.go
	}
	e := s.engine
	if s.node == "" || (e.Spec.NodeName != "" && (e.Spec.NodeName != s.node || e.Spec.Maintenance != s.maintenance)) {
		return r.detach(ctx, s)
	}
	// Attach, or start again an engine whose process does not serve.
	restart := e.Spec.DesiredState == v1.DesiredInstanceStateRunning && engineNotServing(e)
	addrs, waiting, err := r.startSet(ctx, s, restart)
	if err != nil {
		return err
	}
	switch {
	case restart:
		return r.restartEngine(ctx, s, addrs, waiting)
	case e.Spec.DesiredState == v1.DesiredInstanceStateRunning:
		s.serving = true
		return nil
	}
	return r.startEngine(ctx, s, addrs, waiting)
}

// detach stops the engine, then (unless it is moving to s.node) the
// replicas.
func (r *Reconciler) detach(ctx context.Context, s *scope) error {
	e := s.engine
	if err := r.setEngine(ctx, e, func(e *v1.Engine) { e.Spec.DesiredState = v1.DesiredInstanceStateStopped }); err != nil {
		return err
	}
	if e.Status.InstanceState != v1.InstanceStateStopped {
		return nil // the engine's status change brings us back
	}
	if err := r.setEngine(ctx, e, func(e *v1.Engine) { e.Spec.NodeName = "" }); err != nil {
		return err
	}
	if s.node != "" {
		return nil // moving: the next reconcile attaches on the new node
	}
	for _, rep := range s.replicas {
		if err := r.setReplica(ctx, rep, v1.DesiredInstanceStateStopped); err != nil {
			return err
		}
	}
	return nil
}

// startEngine starts a stopped engine on s.node with the replicas
// startSet chose, once its last process is gone and no replica is waited
// for.
func (r *Reconciler) startEngine(ctx context.Context, s *scope, addrs map[string]v1.ReplicaAddress, waiting int) error {
	switch s.engine.Status.InstanceState {
	case v1.InstanceStateStarting, v1.InstanceStateRunning, v1.InstanceStateStopping:
		return nil // a stop asked for (a salvage) has not happened yet; the engine's status change brings us back
	}
	if waiting > 0 || len(addrs) == 0 {
		return nil // every scheduled replica runs first; their status changes bring us back
	}
	// The kind of engine and what it copies go in the same patch as the
	// start: a user's engine is never started with a clone source.
	return r.setEngine(ctx, s.engine, func(e *v1.Engine) {
		e.Spec.NodeName, e.Spec.DesiredState, e.Spec.ReplicaAddresses = s.node, v1.DesiredInstanceStateRunning, addrs
		e.Spec.Size, e.Spec.Frontend = s.v.Spec.Size, s.v.Spec.Frontend
		e.Spec.Maintenance, e.Spec.CloneFrom = s.maintenance, s.wantCloneFrom()
	})
}

// engineNotServing reports whether the engine's process is known not to
// serve: it exited, the instance manager that ran it is gone and the new
// one has no such process, or it is still starting (the Engine reconciler
// starts a starting engine again when it is given other replicas). An
// engine whose state is unknown (its instance manager does not answer)
// may still run and serve, and is left as it is.
func engineNotServing(e *v1.Engine) bool {
	switch e.Status.InstanceState {
	case v1.InstanceStateStopped, v1.InstanceStateError, v1.InstanceStateStarting:
		return true
	}
	return false
}

// startSet asks every scheduled replica to run and returns the ones an
// engine is (re)started with now: each replica that runs, at the address
// its Replica reports now (never one an earlier start was given), and how
// many replicas the start must wait for.
//
// A replica that does not run is waited for if it is being salvaged
// (every one that may hold the newest data must be there), and not if it
// has failed for longer than the replenishment wait. Otherwise it is not
// waited for when a running replica was RW with the last engine and never
// failed since (the engine's open then serves from the newest epoch among
// those given, and repair gives the missing one back with a delta resync
// once it runs): on a restart (the engine's process died under an
// attached volume), and at an attach for a replica on a node that is out
// of service (shut down, the operator says), which runs again only when
// the node is back. On a restart, a replica about to run again
// (comingBack: the node's replica when its instance manager restarted)
// is held in the engine's spec instead, so that the engine is started
// once, with it. Without such a replica, a missing one may hold the
// only copy of the newest writes, and the start waits for it. A first
// attach waits for every other replica, as a detached volume's replicas
// all stopped together and come back together.
func (r *Reconciler) startSet(ctx context.Context, s *scope, restart bool) (map[string]v1.ReplicaAddress, int, error) {
	salvaging := map[string]bool{}
	if list := s.v.Annotations[AnnotationSalvage]; list != "" {
		for _, n := range strings.Split(list, ",") {
			salvaging[n] = true
		}
	}
	addrs := map[string]v1.ReplicaAddress{}
	waiting, away, inSync := 0, 0, false
	for _, rep := range s.replicas {
		if rep.Spec.NodeName == "" || !rep.DeletionTimestamp.IsZero() {
			continue
		}
		if err := r.setReplica(ctx, rep, v1.DesiredInstanceStateRunning); err != nil {
			return nil, 0, err
		}
		if a, ok := engineAddress(rep, s.node); ok {
			addrs[rep.Name] = a
			inSync = inSync || (rep.Spec.HealthyAt != nil && rep.Spec.FailedAt == nil)
			continue
		}
		switch {
		case salvaging[rep.Name]:
			waiting++
			continue
		case expired(rep, r.wait(), s.now):
			continue
		case restart && comingBack(s, rep):
			if a, ok := s.engine.Spec.ReplicaAddresses[rep.Name]; ok {
				addrs[rep.Name] = a // held: the Engine reconciler waits until it runs, then gets its new address
				continue
			}
			away++
			continue
		case restart:
			away++
			continue
		}
		out, err := objects.OutOfService(ctx, r.Client, rep.Spec.NodeName)
		if err != nil {
			return nil, 0, err
		}
		if out {
			away++
		} else {
			waiting++
		}
	}
	if !inSync {
		waiting += away
	}
	return addrs, waiting, nil
}

// comingBack reports whether a replica that does not run now is about to,
// under an instance manager that answers: its process is starting, or it
// is on the engine's node, whose instance manager has just reported the
// engine's process gone (restart) while the replica's own state there is
// not observed yet. Only a replica RW with the last engine and not failed
// since (spec.healthyAt, no failedAt) counts: the engine's open serves only
// once every replica RW at the newest epoch answers (docs/engine.md,
// "Opening with replicas that do not answer"), so an engine started
// without it would wait for it and be started again when it runs.
// startSet keeps such a replica in the engine's spec at the address the
// engine had for it: the Engine reconciler starts nothing while a replica
// named does not run at the address given (ReasonWaitingForReplicas), and
// the replica's change to running brings the current address here, so
// the engine is started once, with every replica. A replica that fails to
// start (error, stopped) is no longer coming back, and the engine is
// started without it as before.
func comingBack(s *scope, rep *v1.Replica) bool {
	if rep.Spec.HealthyAt == nil || rep.Spec.FailedAt != nil {
		return false
	}
	switch rep.Status.InstanceState {
	case v1.InstanceStateStarting:
		return true
	case v1.InstanceStateUnknown, "":
		return rep.Spec.NodeName == s.node
	}
	return false
}

// restartEngine gives an engine whose process does not serve (engineNotServing)
// the replicas startSet chose, at their current addresses, so that the
// Engine reconciler starts it again on them; the Engine reconciler starts
// nothing until every replica named runs at the address given
// (ReasonWaitingForReplicas), so an address gone stale since this patch
// is caught there and refreshed here on the Replica's next change. A
// restart that must wait for a replica goes back through attach (desired
// state stopped), which starts the engine once the replicas it waits for
// run, as at a first attach.
func (r *Reconciler) restartEngine(ctx context.Context, s *scope, addrs map[string]v1.ReplicaAddress, waiting int) error {
	if waiting > 0 || len(addrs) == 0 {
		return r.setEngine(ctx, s.engine, func(e *v1.Engine) { e.Spec.DesiredState = v1.DesiredInstanceStateStopped })
	}
	return r.setEngine(ctx, s.engine, func(e *v1.Engine) {
		e.Spec.ReplicaAddresses, e.Spec.Size, e.Spec.CloneFrom = addrs, s.v.Spec.Size, s.wantCloneFrom()
	})
}
