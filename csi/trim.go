package csi

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/go-logr/logr"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/util/workqueue"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
)

// A RecurringJob of task filesystem-trim asks for a trim by setting
// v1.FilesystemTrimRequestAnnotation(job) on a Volume to its run's
// scheduled time. Only the node the volume is attached to has its
// filesystem mounted, so the node plugin there answers: it runs FITRIM
// (what fstrim runs) on the mount and sets
// v1.FilesystemTrimResultAnnotation(job) to the outcome for that run.
// The discards go down the volume's device to the engine, which unmaps
// the ranges on every replica.

const (
	// trimWorkers is how many volumes this node trims at once.
	trimWorkers = 2
	// watchRetryMin and watchRetryMax bound the wait before the Volume
	// watch is opened again after it failed.
	watchRetryMin, watchRetryMax = time.Second, 30 * time.Second
)

// ServeTrims answers the filesystem-trim requests on the Volumes attached
// to this node until ctx ends: it watches the namespace's Volumes with w
// (each time the watch is opened it lists them all, so a request made
// while it was closed is seen) and trims each volume asked. It fails at
// once only when the driver has no node service.
func (d *Driver) ServeTrims(ctx context.Context, w client.WithWatch) error {
	if d.node == nil {
		return errors.New("csi: ServeTrims needs the node service (mode node or all)")
	}
	t := &trimmer{
		node: d.node,
		w:    w,
		log:  d.opts.Logger.WithName("trim"),
		queue: workqueue.NewTypedRateLimitingQueue(
			workqueue.NewTypedItemExponentialFailureRateLimiter[string](time.Second, 2*time.Minute)),
	}
	return t.run(ctx)
}

// trimmer is the node plugin's answerer of trim requests.
type trimmer struct {
	node *NodeServer
	w    client.WithWatch
	log  logr.Logger
	// queue holds the names of Volumes that may have a request to answer.
	queue workqueue.TypedRateLimitingInterface[string]
}

func (t *trimmer) run(ctx context.Context) error {
	done := make(chan struct{})
	for range trimWorkers {
		go func() {
			defer func() { done <- struct{}{} }()
			for t.next(ctx) {
			}
		}()
	}
	t.watchLoop(ctx)
	t.queue.ShutDown()
	for range trimWorkers {
		<-done
	}
	return nil
}

// watchLoop keeps a watch of the namespace's Volumes open until ctx ends,
// queueing each one attached here with a request to answer.
func (t *trimmer) watchLoop(ctx context.Context) {
	wait := watchRetryMin
	for ctx.Err() == nil {
		seen, err := t.watchOnce(ctx)
		if ctx.Err() != nil {
			return
		}
		if seen {
			wait = watchRetryMin
		}
		t.log.Info("the Volume watch ended; opening it again", "after", wait, "error", errString(err))
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
		wait = min(2*wait, watchRetryMax)
	}
}

// watchOnce watches until the watch ends and says whether it delivered
// any Volume. Opened without a resource version, the watch begins with
// every existing Volume.
func (t *trimmer) watchOnce(ctx context.Context) (bool, error) {
	wi, err := t.w.Watch(ctx, &v1.VolumeList{}, client.InNamespace(t.node.ns))
	if err != nil {
		return false, err
	}
	defer wi.Stop()
	seen := false
	for ev := range wi.ResultChan() {
		switch ev.Type {
		case watch.Error:
			return seen, apierrors.FromObject(ev.Object)
		case watch.Added, watch.Modified:
			v, ok := ev.Object.(*v1.Volume)
			if !ok {
				continue
			}
			seen = true
			if attachedHere(v, t.node.nodeID) && len(pendingTrims(v)) > 0 {
				t.queue.Add(v.Name)
			}
		}
	}
	return seen, nil
}

func errString(err error) string {
	if err == nil {
		return "closed by the API server"
	}
	return err.Error()
}

// next answers one queued Volume; false once the queue is shut down.
func (t *trimmer) next(ctx context.Context) bool {
	name, quit := t.queue.Get()
	if quit {
		return false
	}
	defer t.queue.Done(name)
	if err := t.answer(ctx, name); err != nil {
		t.log.Info("answering the volume's trim request failed; retrying", "volume", name, "error", err.Error())
		t.queue.AddRateLimited(name)
		return true
	}
	t.queue.Forget(name)
	return true
}

// attachedHere reports whether v is attached to node, where its
// filesystem, if any, is mounted.
func attachedHere(v *v1.Volume, node string) bool {
	return v.Status.State == v1.VolumeStateAttached && v.Status.CurrentNodeName == node && v.Status.Endpoint != ""
}

// pendingTrims returns the requests on v not answered yet, job name to
// run. Only well-formed requests count (a job name that can end an
// annotation key, a run that is an RFC 3339 time of at most
// v1.MaxFilesystemTrimRunLength characters), at most
// v1.MaxFilesystemTrimRequests of them, by job name.
func pendingTrims(v *v1.Volume) map[string]string {
	var jobs []string
	for k := range v.Annotations {
		job, ok := strings.CutPrefix(k, v1.FilesystemTrimRequestAnnotationPrefix)
		if ok && job != "" && len(job) <= 63 {
			jobs = append(jobs, job)
		}
	}
	slices.Sort(jobs)
	out := map[string]string{}
	for _, job := range jobs {
		if len(out) == v1.MaxFilesystemTrimRequests {
			break
		}
		run := v.Annotations[v1.FilesystemTrimRequestAnnotation(job)]
		if len(run) > v1.MaxFilesystemTrimRunLength {
			continue
		}
		if _, err := time.Parse(time.RFC3339, run); err != nil {
			continue
		}
		if raw, ok := v.Annotations[v1.FilesystemTrimResultAnnotation(job)]; ok {
			if res, err := v1.DecodeFilesystemTrimResult(raw); err == nil && res.Run == run {
				continue
			}
		}
		out[job] = run
	}
	return out
}

// answer trims the Volume name if it is attached here with requests not
// answered, and writes the outcome as the answer to each of them. It
// holds the volume's lock, so the volume is not staged or unstaged
// meanwhile. If we crash after trimming but before the answer is
// written, the request is still there on restart and the volume is
// trimmed again, which discards nothing more.
func (t *trimmer) answer(ctx context.Context, name string) error {
	key := client.ObjectKey{Namespace: t.node.ns, Name: name}
	v := &v1.Volume{}
	if err := t.node.c.Get(ctx, key, v); err != nil {
		return client.IgnoreNotFound(err)
	}
	if !attachedHere(v, t.node.nodeID) || len(pendingTrims(v)) == 0 {
		return nil
	}
	unlock, err := t.node.locks.lock("volume " + name)
	if err != nil {
		return err
	}
	defer unlock()
	// Read again under the lock: a stage or unstage that held it may
	// have changed where the volume is and what its device is.
	if err := t.node.c.Get(ctx, key, v); err != nil {
		return client.IgnoreNotFound(err)
	}
	reqs := pendingTrims(v)
	if !attachedHere(v, t.node.nodeID) || len(reqs) == 0 {
		return nil
	}
	res := t.node.trim(v)
	t.log.Info("trim", "volume", name, "outcome", res.Outcome, "bytes", res.Bytes, "message", res.Message)
	before := v.DeepCopy()
	for job, run := range reqs {
		res.Run = run
		v.Annotations[v1.FilesystemTrimResultAnnotation(job)] = res.Encode()
	}
	// A merge patch of the answers only: a request made meanwhile stays
	// and is answered next (its run differs from the answer's).
	return client.IgnoreNotFound(t.node.c.Patch(ctx, v, client.MergeFrom(before)))
}

// trim runs FITRIM on the filesystem of v, attached here, and says how
// it went. A device with no filesystem mounted is skipped: a raw block
// volume, or one attached but not staged.
func (s *NodeServer) trim(v *v1.Volume) v1.FilesystemTrimResult {
	res := v1.FilesystemTrimResult{Node: s.nodeID}
	dev := v.Status.Endpoint
	mounts, err := s.mounter.FilesystemMounts(dev)
	if err != nil {
		res.Outcome, res.Message = v1.FilesystemTrimFailed, fmt.Sprintf("read the mount table: %v", err)
		return res
	}
	if len(mounts) == 0 {
		res.Outcome, res.Message = v1.FilesystemTrimSkipped, s.notMounted(dev)
		return res
	}
	var errs []error
	for _, m := range mounts {
		n, err := s.mounter.Trim(m)
		if err == nil {
			res.Outcome, res.Bytes = v1.FilesystemTrimTrimmed, n
			return res
		}
		errs = append(errs, err)
		if errors.Is(err, ErrDiscardNotSupported) {
			break // the same device under every mount
		}
	}
	res.Outcome, res.Message = v1.FilesystemTrimFailed, fmt.Sprintf("fstrim of %s: %v", dev, errors.Join(errs...))
	return res
}

// notMounted says why a volume attached here has no filesystem to trim.
func (s *NodeServer) notMounted(dev string) string {
	fs, err := s.mounter.Filesystem(dev)
	switch {
	case err != nil:
		return fmt.Sprintf("no filesystem of its device %s is mounted on node %s (reading the device: %v)", dev, s.nodeID, err)
	case fs.Type == "":
		return fmt.Sprintf("a raw block volume: its device %s on node %s holds no filesystem", dev, s.nodeID)
	}
	return fmt.Sprintf("its %s filesystem is not mounted on node %s: a raw block volume holding a filesystem, or not staged yet", fs.Type, s.nodeID)
}
