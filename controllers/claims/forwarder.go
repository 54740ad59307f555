package claims

import (
	"context"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/events"
	"k8s.io/client-go/util/workqueue"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/source"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/internal/objects"
)

// DefaultAttachWait is how long a volume may take to attach before its
// claim and pods are told that it waits: an attach takes seconds, and
// starting a replica's process on a slow node some more.
const DefaultAttachWait = time.Minute

// Forwarder records the trouble of Cairn's Volumes as Events on the
// objects users look at: the claim of the volume's PersistentVolume, and,
// where the application feels it (faulted, an attach that waits), the
// pods using the claim. It watches Volumes and acts on changes of their
// status (noticesOf): it is edge-triggered, as Events are. When the
// manager starts, it reports once the trouble each volume is in then, so
// a restart may repeat an Event (the API server folds repeats into one
// Event with a count).
type Forwarder struct {
	// Client reads Volumes (the manager's cache).
	Client client.Reader
	// Reader reads PersistentVolumes, claims and pods straight from the
	// API server (the manager caches no application objects; this runs
	// only when a volume's health changes). SetupWithManager takes the
	// manager's API reader if nil.
	Reader client.Reader
	// Namespace is where Cairn's Volumes are; empty: every namespace.
	Namespace string
	// AttachWait is how long an attach may take before it is reported
	// (DefaultAttachWait if zero).
	AttachWait time.Duration
	// Recorder records Events (SetupWithManager makes one if nil).
	Recorder events.EventRecorder
}

// +kubebuilder:rbac:groups=storage.cairn.io,resources=volumes,verbs=get;list;watch
// +kubebuilder:rbac:groups="",resources=persistentvolumes;persistentvolumeclaims;pods,verbs=get;list;watch
// +kubebuilder:rbac:groups=events.k8s.io,resources=events,verbs=create;patch

// Reconcile records the Events of one notice. A notice whose trouble is
// over by now is dropped. It records nothing twice on a retry after an
// error on the claim; after an error on a pod, the claim's Event is
// recorded again (the API server counts it as a repeat).
func (f *Forwarder) Reconcile(ctx context.Context, n notice) (ctrl.Result, error) {
	vol := &v1.Volume{}
	if err := f.Client.Get(ctx, n.Volume, vol); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	if !vol.DeletionTimestamp.IsZero() || !holds(n, vol) {
		return ctrl.Result{}, nil
	}
	var pvs corev1.PersistentVolumeList
	if err := f.Reader.List(ctx, &pvs); err != nil {
		return ctrl.Result{}, fmt.Errorf("list PersistentVolumes: %w", err)
	}
	pv := PersistentVolumeOf(pvs.Items, vol.Name)
	ref, ok := Ref{}, false
	if pv != nil {
		ref, ok = claimOf(pv)
	}
	if !ok {
		return ctrl.Result{}, nil // made by hand, or released: no claim to tell
	}
	pvc := &corev1.PersistentVolumeClaim{}
	if err := f.Reader.Get(ctx, ref, pvc); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	if uid := pv.Spec.ClaimRef.UID; uid != "" && uid != pvc.UID {
		return ctrl.Result{}, nil // a new claim of the same name, bound elsewhere
	}
	msg := message(n, vol, f.attachWait(), ref)
	objects.Event(f.Recorder, pvc, warning(n.Reason), n.Reason, "Observe", "%s", msg)
	if !toPods(n.Reason) {
		return ctrl.Result{}, nil
	}
	pods, err := f.podsUsing(ctx, ref, n)
	if err != nil {
		return ctrl.Result{}, err
	}
	for i := range pods {
		objects.Event(f.Recorder, &pods[i], true, n.Reason, "Observe", "claim %s: %s", ref.Name, msg)
	}
	return ctrl.Result{}, nil
}

// podsUsing lists the pods that mount the claim and have not finished;
// for an attach that waits, only those on the node it waits for.
func (f *Forwarder) podsUsing(ctx context.Context, claim Ref, n notice) ([]corev1.Pod, error) {
	var pods corev1.PodList
	if err := f.Reader.List(ctx, &pods, client.InNamespace(claim.Namespace)); err != nil {
		return nil, fmt.Errorf("list pods in %s: %w", claim.Namespace, err)
	}
	var out []corev1.Pod
	for _, p := range pods.Items {
		if p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed || !usesClaim(&p, claim.Name) {
			continue
		}
		if n.Reason == v1.EventReasonAttachWaiting && p.Spec.NodeName != n.Node {
			continue
		}
		out = append(out, p)
	}
	return out, nil
}

func usesClaim(p *corev1.Pod, claim string) bool {
	for _, v := range p.Spec.Volumes {
		if c := v.PersistentVolumeClaim; c != nil && c.ClaimName == claim {
			return true
		}
	}
	return false
}

// message is what the Event says: what is wrong, in the words of the
// volume's own conditions, and where to look next.
func message(n notice, v *v1.Volume, wait time.Duration, claim Ref) string {
	doctor := fmt.Sprintf("`kubectl cairn doctor %s` says more", claim)
	switch n.Reason {
	case v1.EventReasonVolumeDegraded:
		return fmt.Sprintf("volume %s is degraded: fewer of its %d replicas are healthy than it asks for%s; it keeps serving I/O while Cairn rebuilds. %s",
			v.Name, v.Spec.Replicas(), because(v, v1.ConditionReady, v1.VolumeConditionScheduled), doctor)
	case v1.EventReasonVolumeFaulted:
		return fmt.Sprintf("volume %s is faulted: no replica is usable, so its I/O stops until one is%s. Bring back the nodes of its replicas; %s",
			v.Name, because(v, v1.ConditionReady), doctor)
	case v1.EventReasonVolumeHealthy:
		return fmt.Sprintf("volume %s is healthy again: every replica it asks for is healthy", v.Name)
	case v1.EventReasonReplicaUnschedulable:
		return fmt.Sprintf("a replica of volume %s has no disk to go to%s. Add a node or a disk with room, lower numberOfReplicas, or relax the disk selector; %s",
			v.Name, because(v, v1.VolumeConditionScheduled), doctor)
	case v1.EventReasonAttachWaiting:
		return fmt.Sprintf("volume %s is not attached to node %s after %s (it is %s)%s. %s",
			v.Name, n.Node, wait, orUnknown(string(v.Status.State)), because(v, v1.ConditionReady, v1.VolumeConditionScheduled, v1.VolumeConditionCloned), doctor)
	}
	return "volume " + v.Name + ": " + n.Reason
}

// because is ": <message>" of the first of the conditions (by type) that
// is not True and has a message, or "".
func because(v *v1.Volume, types ...string) string {
	for _, t := range types {
		if c := meta.FindStatusCondition(v.Status.Conditions, t); c != nil && c.Status != metav1.ConditionTrue && c.Message != "" {
			return ": " + c.Message
		}
	}
	return ""
}

func orUnknown(s string) string {
	if s == "" {
		return "in no state yet"
	}
	return s
}

func (f *Forwarder) attachWait() time.Duration {
	if f.AttachWait > 0 {
		return f.AttachWait
	}
	return DefaultAttachWait
}

// enqueue turns a Volume's change into notices: at once for its health,
// after AttachWait for an attach asked for.
func (f *Forwarder) enqueue(old, cur *v1.Volume, q workqueue.TypedRateLimitingInterface[notice]) {
	if f.Namespace != "" && cur.Namespace != f.Namespace {
		return
	}
	key := client.ObjectKeyFromObject(cur)
	for _, reason := range noticesOf(old, cur) {
		q.Add(notice{Volume: key, Reason: reason})
	}
	if node, ok := attachAsked(old, cur); ok {
		q.AddAfter(notice{Volume: key, Reason: v1.EventReasonAttachWaiting, Node: node}, f.attachWait())
	}
}

// SetupWithManager registers the forwarder.
func (f *Forwarder) SetupWithManager(mgr ctrl.Manager) error {
	if f.Client == nil {
		f.Client = mgr.GetClient()
	}
	if f.Reader == nil {
		f.Reader = mgr.GetAPIReader()
	}
	if f.Recorder == nil {
		f.Recorder = mgr.GetEventRecorder("cairn-volume-events")
	}
	h := handler.TypedFuncs[*v1.Volume, notice]{
		CreateFunc: func(_ context.Context, ev event.TypedCreateEvent[*v1.Volume], q workqueue.TypedRateLimitingInterface[notice]) {
			f.enqueue(nil, ev.Object, q)
		},
		UpdateFunc: func(_ context.Context, ev event.TypedUpdateEvent[*v1.Volume], q workqueue.TypedRateLimitingInterface[notice]) {
			f.enqueue(ev.ObjectOld, ev.ObjectNew, q)
		},
	}
	return builder.TypedControllerManagedBy[notice](mgr).
		Named("volume-events").
		WatchesRawSource(source.TypedKind(mgr.GetCache(), &v1.Volume{}, handler.TypedEventHandler[*v1.Volume, notice](h))).
		Complete(f)
}
