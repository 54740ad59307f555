package main

import (
	"context"
	"fmt"
	"text/tabwriter"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/drain"
)

// drainView is what drain-check reports of a node.
type drainView struct {
	Node              string            `json:"node"`
	Cordoned          bool              `json:"cordoned"`
	EvictionRequested bool              `json:"evictionRequested"`
	Replicas          int               `json:"replicas"`
	Safe              bool              `json:"safe"`
	Blockers          []v1.DrainBlocker `json:"blockers,omitempty"`
	// Moving is the drain controller's word on the replica it moves off
	// the node (StorageNode status.drain.moving).
	Moving string `json:"moving,omitempty"`
}

// drainCheck says what holds a drain of node now, computed from the
// objects as the manager's drain controller does (controllers/drain),
// and reports whether the node can be drained.
func (o *options) drainCheck(ctx context.Context, node string) (bool, error) {
	objs, err := o.load(ctx)
	if err != nil {
		return false, err
	}
	all := &drain.Objects{Volumes: objs.vols, Engines: objs.engs, Replicas: objs.reps}
	dv := drainView{Node: node, Replicas: drain.ReplicasOn(node, all), Blockers: drain.Blockers(node, all)}
	dv.Safe = len(dv.Blockers) == 0
	n := &corev1.Node{}
	switch err := o.c.Get(ctx, client.ObjectKey{Name: node}, n); {
	case err == nil:
		dv.Cordoned = n.Spec.Unschedulable
	case !apierrors.IsNotFound(err):
		return false, fmt.Errorf("get node %s: %w", node, err)
	}
	var sns v1.StorageNodeList
	if err := o.c.List(ctx, &sns, client.InNamespace(o.namespace)); err != nil {
		return false, fmt.Errorf("list storage nodes in %s: %w", o.namespace, err)
	}
	for _, sn := range sns.Items {
		if sn.Spec.NodeName == node {
			dv.EvictionRequested = sn.Spec.EvictionRequested
			if sn.Status.Drain != nil {
				dv.Moving = sn.Status.Drain.Moving
			}
		}
	}
	if done, err := o.emit(dv); done {
		return dv.Safe, err
	}
	state := "schedulable"
	if dv.Cordoned {
		state = "cordoned"
	}
	if dv.EvictionRequested {
		state += ", eviction requested"
	}
	fmt.Fprintf(o.out, "node %s (%s) holds %d replicas\n", node, state, dv.Replicas)
	if dv.Safe {
		fmt.Fprintln(o.out, "it can be drained: no engine runs there, and every volume with a replica there has a healthy one elsewhere")
	} else {
		fmt.Fprintln(o.out, "a drain waits (the drain guard's PodDisruptionBudget refuses its eviction) for:")
		tw := tabwriter.NewWriter(o.out, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "VOLUME\tREASON\tWHAT")
		for _, b := range dv.Blockers {
			fmt.Fprintf(tw, "%s\t%s\t%s\n", b.Volume, b.Reason, b.Message)
		}
		if err := tw.Flush(); err != nil {
			return false, err
		}
		if !dv.Cordoned && !dv.EvictionRequested {
			fmt.Fprintln(o.out, "a last healthy replica is moved elsewhere once the node is cordoned (kubectl drain does that first), or with the StorageNode's spec.evictionRequested")
		}
	}
	if dv.Moving != "" {
		fmt.Fprintln(o.out, "now:", dv.Moving)
	}
	return dv.Safe, nil
}
