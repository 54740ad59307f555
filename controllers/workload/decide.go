package workload

import (
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
)

// verdict is what is done about one pod after a device loss.
type verdict int

const (
	// verdictSkip: the pod cannot hold a mount of the lost device (created
	// after the loss, on another node, finished, or already going).
	verdictSkip verdict = iota
	// verdictDelete: a controller owns it and will recreate it.
	verdictDelete
	// verdictBare: no controller owns it; deleting it would lose it for
	// good, so it is only told about.
	verdictBare
	// verdictSettingOff: a controller owns it, but deleting is switched off.
	verdictSettingOff
)

func (v verdict) String() string {
	switch v {
	case verdictSkip:
		return "skip"
	case verdictDelete:
		return "delete"
	case verdictBare:
		return "bare"
	case verdictSettingOff:
		return "setting-off"
	}
	return "unknown"
}

// decide is what to do about pod, which uses the volume, after loss. A
// pod created before the loss on the loss's node may have mounted the old
// device (a pod created later mounts what the node serves then). The
// creation time and the loss time come from different clocks (the API
// server's and the manager's), both in the cluster; a pod created in the
// same second as the loss counts as before it, so that skew errs on the
// side of a restart rather than a bad mount left in place.
func decide(pod *corev1.Pod, loss v1.DeviceLoss, deletePods bool) verdict {
	switch {
	case pod.Spec.NodeName != loss.NodeName,
		!pod.DeletionTimestamp.IsZero(),
		pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed,
		pod.CreationTimestamp.After(loss.At.Time):
		return verdictSkip
	case metav1.GetControllerOf(pod) == nil:
		return verdictBare
	case !deletePods:
		return verdictSettingOff
	}
	return verdictDelete
}
