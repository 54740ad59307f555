package engine

import (
	"context"
	"slices"

	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/internal/objects"
	"github.com/cairn-io/cairn/controllers/internal/volumes"
)

// lostReplicas names the replicas of the engine's volume that the engine
// may be opened without although they may have been RW at the volume's
// newest epoch: nil unless at least one replica left out of
// spec.replicaAddresses sits on a node an operator declared shut down
// (the out-of-service taint) and every other replica left out was failed
// (spec.failedAt: the engine that failed it moved the epoch past it, so
// no newer epoch names it). An engine given the others would otherwise
// wait for the shut-down node's replica for good (the data plane's open
// rule cannot tell a replica that went on alone from one that stopped
// with the rest); the taint is the operator's word that it is gone, as
// Kubernetes takes it for the node's pods. A replica left out on a node
// in service that did not fail may come back with the newest data: the
// engine waits for it.
func (r *Reconciler) lostReplicas(ctx context.Context, e *v1.Engine) ([]string, error) {
	var reps v1.ReplicaList
	if err := r.List(ctx, &reps, client.InNamespace(e.Namespace), client.MatchingLabels{volumes.LabelVolume: e.Spec.VolumeName}); err != nil {
		return nil, err
	}
	var lost []string
	for _, rep := range reps.Items {
		if _, given := e.Spec.ReplicaAddresses[rep.Name]; given || rep.Spec.VolumeName != e.Spec.VolumeName {
			continue
		}
		out := false
		if rep.Spec.NodeName != "" {
			var err error
			if out, err = objects.OutOfService(ctx, r.Client, rep.Spec.NodeName); err != nil {
				return nil, err
			}
		}
		switch {
		case out:
			lost = append(lost, rep.Name)
		case rep.Spec.FailedAt == nil:
			return nil, nil
		}
	}
	slices.Sort(lost)
	return lost, nil
}
