package instancemanager

import (
	"context"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
)

// PodGate sets the readiness gate v1.PodConditionVolumesReady on the
// instance-manager pods that ask for it (decideGate says when; gate.go
// says why). It handles one node per request, as PodDiscovery does, and
// only pods whose gate is not yet True for the current run of their
// containers: once True, the pod is left alone.
type PodGate struct {
	client.Client
	// Namespace of the DaemonSet's pods and of Cairn's objects.
	Namespace string
	// Selector picks the DaemonSet's pods; nil: DefaultPodSelector.
	Selector labels.Selector
	// Now is the clock of the condition's transition time (nil: metav1.Now).
	Now func() metav1.Time
}

// +kubebuilder:rbac:groups="",resources=pods,verbs=get;list;watch;patch
// +kubebuilder:rbac:groups="",resources=pods/status,verbs=get;patch
// +kubebuilder:rbac:groups=storage.cairn.io,resources=volumes;engines;replicas;instancemanagers,verbs=get;list;watch

// Reconcile decides the gate of the node's pending pods; the request's
// name is the node's name.
func (g *PodGate) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	pods, err := g.pending(ctx, req.Name)
	if err != nil || len(pods) == 0 {
		return ctrl.Result{}, err
	}
	f, err := g.facts(ctx, req.Name)
	if err != nil {
		return ctrl.Result{}, err
	}
	for _, p := range pods {
		f.pod = p
		if err := g.apply(ctx, p, decideGate(f)); err != nil {
			return ctrl.Result{}, err
		}
	}
	return ctrl.Result{}, nil
}

// pending lists the pods on node (all nodes: "") that ask for the gate
// and whose gate is not settled.
func (g *PodGate) pending(ctx context.Context, node string) ([]*corev1.Pod, error) {
	var pods corev1.PodList
	if err := g.List(ctx, &pods, client.InNamespace(g.Namespace), client.MatchingLabelsSelector{Selector: g.selector()}); err != nil {
		return nil, err
	}
	var out []*corev1.Pod
	for i := range pods.Items {
		p := &pods.Items[i]
		if (node == "" || p.Spec.NodeName == node) && p.DeletionTimestamp.IsZero() && hasGate(p) && !gateSettled(p) {
			out = append(out, p)
		}
	}
	return out, nil
}

// facts reads what the gates of node's pods are decided from.
func (g *PodGate) facts(ctx context.Context, node string) (gateFacts, error) {
	var f gateFacts
	im := &v1.InstanceManager{}
	switch err := g.Get(ctx, types.NamespacedName{Namespace: g.Namespace, Name: InstanceManagerName(node)}, im); {
	case err == nil:
		f.im = im
	case !apierrors.IsNotFound(err):
		return f, err
	}
	var vl v1.VolumeList
	var el v1.EngineList
	var rl v1.ReplicaList
	for _, l := range []client.ObjectList{&vl, &el, &rl} {
		if err := g.List(ctx, l, client.InNamespace(g.Namespace)); err != nil {
			return f, err
		}
	}
	f.volumes, f.engines, f.replicas = vl.Items, el.Items, rl.Items
	return f, nil
}

// apply writes the decision on the pod: first, for a True gate, the run
// of the containers it holds for (if we crash between the two patches,
// the next reconcile decides again and writes both), then the
// condition, with a strategic merge patch that carries only this
// condition (kubelet writes the others).
func (g *PodGate) apply(ctx context.Context, p *corev1.Pod, d gateDecision) error {
	if run := containersRun(p); d.ready && run != "" && p.Annotations[AnnotationVolumesReadyFor] != run {
		before := p.DeepCopy()
		if p.Annotations == nil {
			p.Annotations = map[string]string{}
		}
		p.Annotations[AnnotationVolumesReadyFor] = run
		if err := g.Patch(ctx, p, client.MergeFrom(before)); err != nil {
			return fmt.Errorf("record the containers' run on pod %s: %w", p.Name, err)
		}
	}
	status := corev1.ConditionFalse
	if d.ready {
		status = corev1.ConditionTrue
	}
	c := gateCondition(p)
	if c != nil && c.Status == status && c.Reason == d.reason && c.Message == d.message {
		return nil
	}
	before := p.DeepCopy()
	now := metav1.Now()
	if g.Now != nil {
		now = g.Now()
	}
	if c == nil {
		p.Status.Conditions = append(p.Status.Conditions, corev1.PodCondition{Type: v1.PodConditionVolumesReady})
		c = &p.Status.Conditions[len(p.Status.Conditions)-1]
	}
	if c.Status != status {
		c.LastTransitionTime = now
	}
	c.Status, c.Reason, c.Message, c.LastProbeTime = status, d.reason, d.message, now
	if err := g.Status().Patch(ctx, p, client.StrategicMergeFrom(before)); err != nil {
		return fmt.Errorf("set %s on pod %s: %w", v1.PodConditionVolumesReady, p.Name, err)
	}
	return nil
}

func (g *PodGate) selector() labels.Selector {
	if g.Selector != nil {
		return g.Selector
	}
	return (&PodDiscovery{}).selector()
}

// SetupWithManager registers the gate. Its pods, their node's
// InstanceManager, the node's replicas and engines, and the engines of
// the volumes with a replica on the node bring a node's request, and
// only while a pod there waits for its gate.
func (g *PodGate) SetupWithManager(mgr ctrl.Manager) error {
	sel := g.selector()
	toNodes := func(nodes func(ctx context.Context, o client.Object) []string) handler.EventHandler {
		return handler.EnqueueRequestsFromMapFunc(func(ctx context.Context, o client.Object) []reconcile.Request {
			waiting, err := g.pending(ctx, "")
			if err != nil || len(waiting) == 0 {
				return nil
			}
			want := map[string]bool{}
			for _, n := range nodes(ctx, o) {
				want[n] = true
			}
			var out []reconcile.Request
			for _, p := range waiting {
				if want[p.Spec.NodeName] {
					want[p.Spec.NodeName] = false
					out = append(out, reconcile.Request{NamespacedName: types.NamespacedName{Namespace: g.Namespace, Name: p.Spec.NodeName}})
				}
			}
			return out
		})
	}
	podNode := func(_ context.Context, o client.Object) []string {
		if o.GetNamespace() != g.Namespace || !sel.Matches(labels.Set(o.GetLabels())) {
			return nil
		}
		return []string{o.(*corev1.Pod).Spec.NodeName}
	}
	imNode := func(_ context.Context, o client.Object) []string {
		return []string{o.(*v1.InstanceManager).Spec.NodeName}
	}
	replicaNode := func(_ context.Context, o client.Object) []string { return []string{o.(*v1.Replica).Spec.NodeName} }
	return ctrl.NewControllerManagedBy(mgr).
		Named("instancemanager-gate").
		Watches(&corev1.Pod{}, toNodes(podNode)).
		Watches(&v1.InstanceManager{}, toNodes(imNode)).
		Watches(&v1.Replica{}, toNodes(replicaNode)).
		Watches(&v1.Engine{}, toNodes(g.engineNodes)).
		Complete(g)
}

// engineNodes are the engine's node and the nodes of its volume's
// replicas: a replica's mode lives in its engine's status.
func (g *PodGate) engineNodes(ctx context.Context, o client.Object) []string {
	e := o.(*v1.Engine)
	out := []string{e.Spec.NodeName}
	var rl v1.ReplicaList
	if err := g.List(ctx, &rl, client.InNamespace(e.Namespace)); err != nil {
		return out
	}
	for _, r := range rl.Items {
		if r.Spec.VolumeName == e.Spec.VolumeName {
			out = append(out, r.Spec.NodeName)
		}
	}
	return out
}
