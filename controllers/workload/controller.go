// Package workload restarts the application pods whose mount of a Cairn
// volume went bad. When the Engine reconciler records that a volume's
// device was lost on its node while the volume stayed attached there
// (Engine status.deviceLost: a new engine process serves a fresh device,
// the old one is gone), every filesystem mounted from the old device
// returns I/O errors until it is mounted again. The reconciler finds the
// pods on that node that use the volume (through the PersistentVolume
// whose CSI volume handle is the volume's name, and its claim) and were
// created before the loss, deletes those a controller owns (a ReplicaSet,
// StatefulSet, DaemonSet, Job...) so that it recreates them with a fresh
// mount, and records an Event on each pod and on the claim saying why. A
// pod no controller owns is never deleted: its Event says to restart it.
// With the setting off (--delete-workload-pod-on-device-loss=false) only
// the Events are recorded.
package workload

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/client-go/tools/events"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/predicate"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/internal/objects"
)

// DriverName is the name of Cairn's CSI driver (csi.DriverName): the
// PersistentVolumes it provisions name it in spec.csi.driver, with the
// Volume's name as the volume handle.
const DriverName = "storage.cairn.io"

// Event reasons, on pods and claims.
const (
	// EventPodDeleted: a pod whose mount went bad was deleted so that its
	// controller recreates it with a fresh mount.
	EventPodDeleted = "VolumeDeviceLostPodDeleted"
	// EventRestartNeeded: a pod whose mount went bad was left alone (no
	// controller owns it, or the setting is off); it must be restarted
	// to use the volume again.
	EventRestartNeeded = "VolumeDeviceLostRestartNeeded"
	// EventDeviceLost: on the claim, what happened and what was done
	// about each pod.
	EventDeviceLost = "VolumeDeviceLost"
)

// FlagDeletePods is the manager flag that switches pod deletion on and off.
const FlagDeletePods = "delete-workload-pod-on-device-loss"

// Reconciler handles the Engines whose status.deviceLost is set.
type Reconciler struct {
	// Client reads Engines (cached).
	client.Client
	// Reader reads PersistentVolumes, claims and pods straight from the
	// API server: the manager caches no application pods, and this
	// happens rarely. SetupWithManager takes the manager's API reader if
	// nil.
	Reader client.Reader
	// Namespace is where Cairn's Engines are (cairn-manager's
	// --namespace); empty: every namespace.
	Namespace string
	// DeletePods deletes the pods a controller owns; false records the
	// Events only.
	DeletePods bool
	// Recorder records Events (nil: none).
	Recorder events.EventRecorder
}

// +kubebuilder:rbac:groups=storage.cairn.io,resources=engines,verbs=get;list;watch
// +kubebuilder:rbac:groups="",resources=persistentvolumes,verbs=get;list;watch
// +kubebuilder:rbac:groups="",resources=persistentvolumeclaims,verbs=get;list;watch
// +kubebuilder:rbac:groups="",resources=pods,verbs=get;list;watch;delete
// +kubebuilder:rbac:groups=events.k8s.io,resources=events,verbs=create;patch

// scope is what one reconcile observed.
type scope struct {
	engine *v1.Engine
	loss   v1.DeviceLoss
	pv     *corev1.PersistentVolume
	claim  *corev1.PersistentVolumeClaim // nil if gone
	pods   []corev1.Pod
}

// Reconcile handles one Engine's device loss: it is safe to run again
// (pods created after the loss, or already being deleted, are left
// alone), so a crash halfway through is finished by the next reconcile.
func (r *Reconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	e := &v1.Engine{}
	if err := r.Get(ctx, req.NamespacedName, e); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	if e.Status.DeviceLost == nil || !e.DeletionTimestamp.IsZero() {
		return ctrl.Result{}, nil
	}
	s := &scope{engine: e, loss: *e.Status.DeviceLost}
	if err := r.observe(ctx, s); err != nil || s.pv == nil {
		return ctrl.Result{}, err
	}
	return ctrl.Result{}, r.act(ctx, s)
}

// observe finds the volume's PersistentVolume, its claim and the pods on
// the loss's node that mount the claim. A volume made without a
// PersistentVolume (by hand) has no pods to restart.
func (r *Reconciler) observe(ctx context.Context, s *scope) error {
	var pvs corev1.PersistentVolumeList
	if err := r.Reader.List(ctx, &pvs); err != nil {
		return fmt.Errorf("list PersistentVolumes: %w", err)
	}
	for i := range pvs.Items {
		if csi := pvs.Items[i].Spec.CSI; csi != nil && csi.Driver == DriverName && csi.VolumeHandle == s.engine.Spec.VolumeName {
			s.pv = &pvs.Items[i]
			break
		}
	}
	if s.pv == nil || s.pv.Spec.ClaimRef == nil {
		s.pv = nil
		return nil
	}
	ref := s.pv.Spec.ClaimRef
	claim := &corev1.PersistentVolumeClaim{}
	switch err := r.Reader.Get(ctx, client.ObjectKey{Namespace: ref.Namespace, Name: ref.Name}, claim); {
	case err == nil:
		s.claim = claim
	case !apierrors.IsNotFound(err):
		return fmt.Errorf("get claim %s/%s: %w", ref.Namespace, ref.Name, err)
	}
	var pods corev1.PodList
	if err := r.Reader.List(ctx, &pods, client.InNamespace(ref.Namespace), client.MatchingFields{"spec.nodeName": s.loss.NodeName}); err != nil {
		return fmt.Errorf("list pods on %s: %w", s.loss.NodeName, err)
	}
	for _, p := range pods.Items {
		if usesClaim(&p, ref.Name) {
			s.pods = append(s.pods, p)
		}
	}
	slices.SortFunc(s.pods, func(a, b corev1.Pod) int { return strings.Compare(a.Name, b.Name) })
	return nil
}

func usesClaim(p *corev1.Pod, claim string) bool {
	for _, v := range p.Spec.Volumes {
		if c := v.PersistentVolumeClaim; c != nil && c.ClaimName == claim {
			return true
		}
	}
	return false
}

// act deletes or flags each pod as decide says, and sums it up on the
// claim.
func (r *Reconciler) act(ctx context.Context, s *scope) error {
	var deleted, left []string
	var errs []error
	why := lossText(s)
	for i := range s.pods {
		p := &s.pods[i]
		switch v := decide(p, s.loss, r.DeletePods); v {
		case verdictDelete:
			// Deleted with its grace period: the application is told to
			// stop as at any rollout. A crash after the delete: the next
			// reconcile sees it being deleted and leaves it.
			err := r.Delete(ctx, p, client.Preconditions{UID: &p.UID})
			if apierrors.IsNotFound(err) || apierrors.IsConflict(err) {
				continue // gone, or replaced by a pod of the same name
			}
			if err != nil {
				errs = append(errs, fmt.Errorf("delete pod %s/%s: %w", p.Namespace, p.Name, err))
				continue
			}
			deleted = append(deleted, p.Name)
			objects.Event(r.Recorder, p, true, EventPodDeleted, "Delete",
				"%s; the pod was deleted so that its %s recreates it with a fresh mount", why, controllerName(p))
		case verdictBare, verdictSettingOff:
			left = append(left, p.Name)
			objects.Event(r.Recorder, p, true, EventRestartNeeded, "Observe", "%s; %s", why, restartAdvice(v))
		}
	}
	if s.claim != nil && len(deleted)+len(left) > 0 {
		objects.Event(r.Recorder, s.claim, true, EventDeviceLost, "Observe", "%s%s%s", why,
			listed("; deleted so that their controllers recreate them: ", deleted),
			listed("; to restart by hand: ", left))
	}
	return errors.Join(errs...)
}

func lossText(s *scope) string {
	dev := s.loss.Device
	if dev == "" {
		dev = "its device"
	}
	msg := fmt.Sprintf("volume %s (PersistentVolume %s) lost %s on node %s at %s while attached there: a filesystem mounted from it returns I/O errors",
		s.engine.Spec.VolumeName, s.pv.Name, dev, s.loss.NodeName, s.loss.At.UTC().Format(time.RFC3339))
	if s.loss.Message != "" {
		msg += " (" + s.loss.Message + ")"
	}
	return msg
}

func restartAdvice(v verdict) string {
	if v == verdictBare {
		return "no controller owns the pod, so it is not deleted: delete and recreate it to mount the volume again"
	}
	return "--" + FlagDeletePods + " is off, so the pod is not deleted: restart it to mount the volume again"
}

func controllerName(p *corev1.Pod) string {
	for _, o := range p.OwnerReferences {
		if o.Controller != nil && *o.Controller {
			return o.Kind + " " + o.Name
		}
	}
	return "controller"
}

func listed(prefix string, names []string) string {
	if len(names) == 0 {
		return ""
	}
	return prefix + strings.Join(names, ", ")
}

// lossChanged passes an Engine whose status.deviceLost is new or different
// (and every Engine with one when the manager starts), not every status
// change of a running engine.
var lossChanged = predicate.Funcs{
	CreateFunc:  func(ev event.CreateEvent) bool { return ev.Object.(*v1.Engine).Status.DeviceLost != nil },
	DeleteFunc:  func(event.DeleteEvent) bool { return false },
	GenericFunc: func(event.GenericEvent) bool { return false },
	UpdateFunc: func(ev event.UpdateEvent) bool {
		a, b := ev.ObjectOld.(*v1.Engine).Status.DeviceLost, ev.ObjectNew.(*v1.Engine).Status.DeviceLost
		return b != nil && (a == nil || !a.At.Equal(&b.At) || a.NodeName != b.NodeName)
	},
}

// SetupWithManager registers the reconciler.
func (r *Reconciler) SetupWithManager(mgr ctrl.Manager) error {
	if r.Reader == nil {
		r.Reader = mgr.GetAPIReader()
	}
	if r.Recorder == nil {
		r.Recorder = mgr.GetEventRecorder("cairn-workload")
	}
	inNamespace := predicate.NewPredicateFuncs(func(o client.Object) bool { return r.Namespace == "" || o.GetNamespace() == r.Namespace })
	return ctrl.NewControllerManagedBy(mgr).
		For(&v1.Engine{}, builder.WithPredicates(lossChanged, inNamespace)).
		Named("workload").
		Complete(r)
}
