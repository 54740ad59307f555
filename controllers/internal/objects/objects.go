// Package objects holds what several reconcilers do alike with their
// objects: set a condition from a verdict, record an event, find the
// objects placed on a node, and tell whether a node is out of service.
package objects

import (
	"context"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/tools/events"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"
)

// SetCondition sets the condition typ to True when ok, False otherwise.
func SetCondition(conds *[]metav1.Condition, generation int64, typ string, ok bool, reason, msg string) {
	status := metav1.ConditionFalse
	if ok {
		status = metav1.ConditionTrue
	}
	meta.SetStatusCondition(conds, metav1.Condition{Type: typ, Status: status, Reason: reason, Message: msg, ObservedGeneration: generation})
}

// OnNode lists the objects of list's kind in namespace and returns a
// reconcile request for each whose node (nodeOf) is node. A failed list
// gives none: the watch that asked is not the only trigger.
func OnNode[T client.Object](ctx context.Context, c client.Reader, list client.ObjectList, namespace, node string, nodeOf func(T) string) []reconcile.Request {
	if err := c.List(ctx, list, client.InNamespace(namespace)); err != nil {
		return nil
	}
	items, err := meta.ExtractList(list)
	if err != nil {
		return nil
	}
	var out []reconcile.Request
	for _, it := range items {
		if o, ok := it.(T); ok && nodeOf(o) == node {
			out = append(out, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(o)})
		}
	}
	return out
}

// Event records a Kubernetes Event about o for `kubectl describe` (and
// logs nothing more); a nil recorder (some tests) records nothing.
func Event(rec events.EventRecorder, o runtime.Object, warning bool, reason, action, format string, args ...any) {
	if rec == nil {
		return
	}
	typ := "Normal"
	if warning {
		typ = "Warning"
	}
	rec.Eventf(o, nil, typ, reason, action, "%s", fmt.Sprintf(format, args...))
}

// Workers is how many objects of one kind the process reconcilers
// (Volume, Engine, Replica) handle at once. Their calls to instance
// managers and engines can take seconds (a replica add, an expansion, an
// unreachable node's timeout); one slow node must not stall every other
// volume. The work queue never hands one object to two workers at once.
const Workers = 8

// UnreachableRecheck is when an object whose instance manager's process
// watch is not current is looked at again. A watch coming back is
// announced through the InstanceManager object, but when its status does
// not change (a new manager's first watch finds what the old one saw) no
// event follows, and the object would wait for ever.
const UnreachableRecheck = 5 * time.Second

// OutOfService reports whether node carries Kubernetes' out-of-service
// taint (corev1.TaintNodeOutOfService, non-graceful node shutdown): an
// operator's word that the node is shut down, after which Kubernetes
// force-deletes its pods and detaches its volumes. Cairn takes the same
// word: no engine or replica process of ours runs there, whatever its
// instance manager last reported (a stopped node's process watch can look
// current for as long as nothing is sent on it). A node that does not
// exist is not out of service.
func OutOfService(ctx context.Context, c client.Reader, node string) (bool, error) {
	n := &corev1.Node{}
	if err := c.Get(ctx, client.ObjectKey{Name: node}, n); err != nil {
		return false, client.IgnoreNotFound(err)
	}
	return hasOutOfService(n), nil
}

func hasOutOfService(n *corev1.Node) bool {
	for _, t := range n.Spec.Taints {
		if t.Key == corev1.TaintNodeOutOfService {
			return true
		}
	}
	return false
}

// OutOfServiceChanged passes Node updates that add or remove the
// out-of-service taint, and nothing else: a reconciler watching Nodes
// with it is not woken by every node heartbeat.
var OutOfServiceChanged = predicate.Funcs{
	CreateFunc:  func(event.CreateEvent) bool { return false },
	DeleteFunc:  func(event.DeleteEvent) bool { return false },
	GenericFunc: func(event.GenericEvent) bool { return false },
	UpdateFunc: func(ev event.UpdateEvent) bool {
		a, okA := ev.ObjectOld.(*corev1.Node)
		b, okB := ev.ObjectNew.(*corev1.Node)
		return okA && okB && hasOutOfService(a) != hasOutOfService(b)
	},
}
