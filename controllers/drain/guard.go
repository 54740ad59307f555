package drain

import (
	"context"
	"fmt"
	"hash/fnv"

	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
)

// Labels of a drain guard pod.
const (
	// LabelGuard carries a hash of the guarded node's name (node names can
	// be longer than a label value); the PodDisruptionBudget selects it.
	LabelGuard = "storage.cairn.io/drain-guard"
	// GuardArg is the argument the guard's container runs the manager
	// binary with: it waits for its termination and does nothing else.
	GuardArg = "drain-guard"
)

// GuardName is the name of a node's drain guard pod and of its
// PodDisruptionBudget.
func GuardName(sn *v1.StorageNode) string { return "cairn-drain-guard-" + sn.Name }

func guardLabel(node string) string {
	h := fnv.New64a()
	h.Write([]byte(node))
	return fmt.Sprintf("%016x", h.Sum64())
}

// guardPod is the node's drain guard: a pod bound to the node (no
// scheduler) that tolerates every taint, owned by the StorageNode. Its
// owner is a controller, so kubectl drain evicts it like any other
// managed pod (it is not a DaemonSet's pod, which --ignore-daemonsets
// would skip), and the eviction waits for its PodDisruptionBudget.
func (r *Reconciler) guardPod(sn *v1.StorageNode, image string, command []string) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: GuardName(sn), Namespace: sn.Namespace, Labels: map[string]string{
			"app.kubernetes.io/name": "cairn", "app.kubernetes.io/component": "drain-guard", LabelGuard: guardLabel(sn.Spec.NodeName)}},
		Spec: corev1.PodSpec{
			NodeName:                      sn.Spec.NodeName,
			Tolerations:                   []corev1.Toleration{{Operator: corev1.TolerationOpExists}},
			AutomountServiceAccountToken:  ptr.To(false),
			TerminationGracePeriodSeconds: ptr.To[int64](5),
			SecurityContext: &corev1.PodSecurityContext{RunAsNonRoot: ptr.To(true), RunAsUser: ptr.To[int64](65532),
				SeccompProfile: &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault}},
			Containers: []corev1.Container{{
				Name: "guard", Image: image, Command: command, Args: []string{GuardArg},
				Resources: corev1.ResourceRequirements{
					Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("1m"), corev1.ResourceMemory: resource.MustParse("8Mi")},
					Limits:   corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("32Mi")}},
				SecurityContext: &corev1.SecurityContext{AllowPrivilegeEscalation: ptr.To(false), ReadOnlyRootFilesystem: ptr.To(true),
					Capabilities: &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}}},
			}},
		},
	}
}

// ensureGuard keeps the node's guard pod, and its PodDisruptionBudget
// exactly while the node is not safe to drain: maxUnavailable 0 refuses
// the guard's eviction, so kubectl drain retries until the budget is
// deleted. A budget that exists only while needed (rather than one
// flipped between 0 and 1) refuses evictions from the moment it is
// created, before any disruption controller has looked at it.
func (r *Reconciler) ensureGuard(ctx context.Context, sn *v1.StorageNode, safe bool) error {
	image, command, err := r.image(ctx)
	if err != nil || image == "" {
		return err
	}
	pod := r.guardPod(sn, image, command)
	if err := controllerutil.SetControllerReference(sn, pod, r.Scheme()); err != nil {
		return err
	}
	// The guard is read straight from the API server: the manager caches
	// only the instance managers' pods. A guard evicted by a drain is made
	// again: a later drain is guarded too (a drain under way does not
	// look at pods it did not list first).
	have := &corev1.Pod{}
	switch err := r.Reader.Get(ctx, client.ObjectKeyFromObject(pod), have); {
	case apierrors.IsNotFound(err):
		if err := r.Create(ctx, pod); client.IgnoreAlreadyExists(err) != nil {
			return fmt.Errorf("create drain guard %s: %w", pod.Name, err)
		}
	case err != nil:
		return err
	}
	pdb := &policyv1.PodDisruptionBudget{ObjectMeta: metav1.ObjectMeta{Name: pod.Name, Namespace: pod.Namespace, Labels: map[string]string{
		"app.kubernetes.io/name": "cairn", "app.kubernetes.io/component": "drain-guard"}}}
	if safe {
		if err := r.Delete(ctx, pdb); client.IgnoreNotFound(err) != nil {
			return fmt.Errorf("delete drain guard budget %s: %w", pdb.Name, err)
		}
		return nil
	}
	pdb.Spec = policyv1.PodDisruptionBudgetSpec{MaxUnavailable: ptr.To(intstr.FromInt32(0)),
		Selector: &metav1.LabelSelector{MatchLabels: map[string]string{LabelGuard: guardLabel(sn.Spec.NodeName)}}}
	if err := controllerutil.SetControllerReference(sn, pdb, r.Scheme()); err != nil {
		return err
	}
	if err := r.Create(ctx, pdb); client.IgnoreAlreadyExists(err) != nil {
		return fmt.Errorf("create drain guard budget %s: %w", pdb.Name, err)
	}
	return nil
}
