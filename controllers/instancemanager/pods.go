package instancemanager

import (
	"context"
	"fmt"
	"net"
	"slices"
	"strconv"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
)

// Discovery defaults: the labels and port of the instance-manager
// DaemonSet's pods (config/instance-manager).
const (
	DefaultPodSelector = "app.kubernetes.io/name=cairn,app.kubernetes.io/component=instance-manager"
	DefaultPort        = 8500
	// PortName is the name of the pod's container port that serves the
	// instance-manager gRPC API; DefaultPort when no port has this name.
	PortName = "grpc"
	// LabelDiscovered marks InstanceManagers the discovery keeps; one
	// without it (written by hand) is left alone.
	LabelDiscovered = "storage.cairn.io/discovered"
)

// PodDiscovery keeps one InstanceManager, and one StorageNode, per node
// where a pod of the instance-manager DaemonSet has its containers ready: the
// InstanceManager `im-<node>` gets that pod's IP and gRPC port as
// spec.address. When the node has no such pod any more the address is
// cleared, so the InstanceManager reports unknown (NoAddress) and
// nothing is started there. A StorageNode is created with the default
// disk (the instance manager's data directory) and never deleted: it
// holds the operator's disk settings.
type PodDiscovery struct {
	client.Client
	// Namespace of the DaemonSet's pods and of the objects kept.
	Namespace string
	// Selector picks the DaemonSet's pods; nil: DefaultPodSelector.
	Selector labels.Selector
}

// +kubebuilder:rbac:groups="",resources=pods,verbs=get;list;watch
// +kubebuilder:rbac:groups=storage.cairn.io,resources=instancemanagers;storagenodes,verbs=get;list;watch;create;update;patch

// InstanceManagerName is the name of the InstanceManager discovered on a
// node.
func InstanceManagerName(node string) string { return "im-" + node }

// podAddress is where a pod whose containers are ready serves the
// instance-manager API, or false when they are not or it has no IP yet.
// It reads ContainersReady, not Ready: the pod is Ready only once its
// readiness gate (v1.PodConditionVolumesReady) is True, which the
// manager sets once engines and replicas run there, which needs the
// address first.
func podAddress(p *corev1.Pod) (string, bool) {
	if !p.DeletionTimestamp.IsZero() || p.Status.PodIP == "" || p.Spec.NodeName == "" {
		return "", false
	}
	ready := false
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.ContainersReady && c.Status == corev1.ConditionTrue {
			ready = true
		}
	}
	if !ready {
		return "", false
	}
	port := int32(DefaultPort)
	for _, c := range p.Spec.Containers {
		for _, cp := range c.Ports {
			if cp.Name == PortName {
				port = cp.ContainerPort
			}
		}
	}
	return net.JoinHostPort(p.Status.PodIP, strconv.Itoa(int(port))), true
}

// Reconcile handles one node: the request's name is the node's name.
func (d *PodDiscovery) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	node := req.Name
	var pods corev1.PodList
	if err := d.List(ctx, &pods, client.InNamespace(d.Namespace), client.MatchingLabelsSelector{Selector: d.selector()}); err != nil {
		return ctrl.Result{}, err
	}
	// The newest pod with ready containers on the node wins (a rolling update has two for
	// a moment).
	slices.SortFunc(pods.Items, func(a, b corev1.Pod) int { return b.CreationTimestamp.Compare(a.CreationTimestamp.Time) })
	addr := ""
	for i := range pods.Items {
		if p := &pods.Items[i]; p.Spec.NodeName == node {
			if a, ok := podAddress(p); ok {
				addr = a
				break
			}
		}
	}
	im := &v1.InstanceManager{}
	err := d.Get(ctx, types.NamespacedName{Namespace: d.Namespace, Name: InstanceManagerName(node)}, im)
	switch {
	case apierrors.IsNotFound(err):
		if addr == "" {
			return ctrl.Result{}, nil
		}
		im = &v1.InstanceManager{ObjectMeta: metav1.ObjectMeta{Namespace: d.Namespace, Name: InstanceManagerName(node),
			Labels: map[string]string{LabelDiscovered: "true"}}, Spec: v1.InstanceManagerSpec{NodeName: node, Address: addr}}
		// A crash after the create: the next reconcile finds it by name.
		if err := d.Create(ctx, im); err != nil && !apierrors.IsAlreadyExists(err) {
			return ctrl.Result{}, err
		}
	case err != nil:
		return ctrl.Result{}, err
	case im.Labels[LabelDiscovered] != "true":
		// Written by hand: its address is the operator's.
	case im.Spec.Address != addr:
		before := im.DeepCopy()
		im.Spec.Address = addr
		if err := d.Patch(ctx, im, client.MergeFrom(before)); err != nil {
			return ctrl.Result{}, err
		}
	}
	if addr == "" {
		return ctrl.Result{}, nil
	}
	sn := &v1.StorageNode{ObjectMeta: metav1.ObjectMeta{Namespace: d.Namespace, Name: node}, Spec: v1.StorageNodeSpec{NodeName: node}}
	if err := d.Create(ctx, sn); err != nil && !apierrors.IsAlreadyExists(err) {
		return ctrl.Result{}, fmt.Errorf("create StorageNode %s: %w", node, err)
	}
	return ctrl.Result{}, nil
}

func (d *PodDiscovery) selector() labels.Selector {
	if d.Selector != nil {
		return d.Selector
	}
	sel, err := labels.Parse(DefaultPodSelector)
	if err != nil {
		panic(err) // a constant
	}
	return sel
}

// SetupWithManager registers the discovery: a pod of the DaemonSet is
// mapped to its node.
func (d *PodDiscovery) SetupWithManager(mgr ctrl.Manager) error {
	sel := d.selector()
	toNode := handler.EnqueueRequestsFromMapFunc(func(_ context.Context, o client.Object) []reconcile.Request {
		p := o.(*corev1.Pod)
		if p.Spec.NodeName == "" {
			return nil
		}
		return []reconcile.Request{{NamespacedName: types.NamespacedName{Namespace: d.Namespace, Name: p.Spec.NodeName}}}
	})
	onNode := handler.EnqueueRequestsFromMapFunc(func(_ context.Context, o client.Object) []reconcile.Request {
		im := o.(*v1.InstanceManager)
		if im.Labels[LabelDiscovered] != "true" {
			return nil
		}
		return []reconcile.Request{{NamespacedName: types.NamespacedName{Namespace: d.Namespace, Name: im.Spec.NodeName}}}
	})
	ours := predicate.NewPredicateFuncs(func(o client.Object) bool {
		return o.GetNamespace() == d.Namespace && sel.Matches(labels.Set(o.GetLabels()))
	})
	return ctrl.NewControllerManagedBy(mgr).
		Named("instancemanager-discovery").
		Watches(&corev1.Pod{}, toNode, builder.WithPredicates(ours)).
		Watches(&v1.InstanceManager{}, onNode).
		Complete(d)
}
