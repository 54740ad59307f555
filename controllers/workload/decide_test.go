package workload

import (
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
)

func TestDecide(t *testing.T) {
	at := time.Date(2025, 1, 1, 12, 0, 0, 0, time.UTC)
	loss := v1.DeviceLoss{At: metav1.NewTime(at), NodeName: "n1"}
	owner := []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: "StatefulSet", Name: "web", UID: "u", Controller: ptr.To(true)}}
	notController := []metav1.OwnerReference{{APIVersion: "v1", Kind: "ConfigMap", Name: "x", UID: "c"}}
	gone := metav1.NewTime(at.Add(time.Minute))
	pod := func(mut func(*corev1.Pod)) *corev1.Pod {
		p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{CreationTimestamp: metav1.NewTime(at.Add(-time.Hour)), OwnerReferences: owner},
			Spec: corev1.PodSpec{NodeName: "n1"}, Status: corev1.PodStatus{Phase: corev1.PodRunning}}
		if mut != nil {
			mut(p)
		}
		return p
	}
	for _, tc := range []struct {
		name   string
		pod    *corev1.Pod
		delete bool
		want   verdict
	}{
		{"owned, before the loss", pod(nil), true, verdictDelete},
		{"owned, same second as the loss", pod(func(p *corev1.Pod) { p.CreationTimestamp = metav1.NewTime(at) }), true, verdictDelete},
		{"owned, setting off", pod(nil), false, verdictSettingOff},
		{"bare", pod(func(p *corev1.Pod) { p.OwnerReferences = nil }), true, verdictBare},
		{"owner that is not a controller", pod(func(p *corev1.Pod) { p.OwnerReferences = notController }), true, verdictBare},
		{"bare, setting off", pod(func(p *corev1.Pod) { p.OwnerReferences = nil }), false, verdictBare},
		{"created after the loss", pod(func(p *corev1.Pod) { p.CreationTimestamp = metav1.NewTime(at.Add(time.Second)) }), true, verdictSkip},
		{"other node", pod(func(p *corev1.Pod) { p.Spec.NodeName = "n2" }), true, verdictSkip},
		{"already being deleted", pod(func(p *corev1.Pod) { p.DeletionTimestamp = &gone }), true, verdictSkip},
		{"succeeded", pod(func(p *corev1.Pod) { p.Status.Phase = corev1.PodSucceeded }), true, verdictSkip},
		{"failed", pod(func(p *corev1.Pod) { p.Status.Phase = corev1.PodFailed }), true, verdictSkip},
		{"pending (waiting for the mount)", pod(func(p *corev1.Pod) { p.Status.Phase = corev1.PodPending }), true, verdictDelete},
	} {
		if got := decide(tc.pod, loss, tc.delete); got != tc.want {
			t.Errorf("%s: decide = %v, want %v", tc.name, got, tc.want)
		}
	}
}
