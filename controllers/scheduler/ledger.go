package scheduler

import (
	"context"
	"fmt"
	"sync"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/internal/volumes"
)

// IndexReplicaDisk indexes Replicas by the disk they are placed on
// (DiskKey.String); unplaced replicas are not in it.
const IndexReplicaDisk = "spec.nodeName/diskName"

// unseenFor is how long a placement this process wrote is counted while
// the cache has not seen its Replica at all. The cache shows a write
// within moments; a Replica it never shows was deleted right after it was
// created, and its bytes stop counting after this.
const unseenFor = time.Minute

// Ledger places replicas one decision at a time, with the bytes scheduled
// on each disk counted from the Replicas placed there.
//
// A StorageNode's status.disks[].scheduled lags the Replicas (its
// reconciler writes it after they change), and so does the manager's
// cache: workers placing at the same time from either would all see the
// same free room and could fill it twice over. The Ledger holds one lock
// from reading the scheduled bytes to writing the placements, reads the
// Replicas on each disk through a field index of the cache, and adds the
// placements it wrote that the cache does not show yet. It is shared by
// everything in the process that places replicas (the Volume reconciler
// and the drain controller); only one manager runs at a time (leader
// election), so nothing else places concurrently.
type Ledger struct {
	reader client.Reader

	mu sync.Mutex
	// written are the placements this process wrote, until the cache
	// shows them.
	written map[client.ObjectKey]written
	now     func() time.Time

	setup    sync.Once
	setupErr error
}

// written is one placement written to a Replica.
type written struct {
	volume string
	disk   DiskKey
	size   int64
	at     time.Time
}

// NewLedger returns a Ledger; SetupWithManager gives it its cache.
func NewLedger() *Ledger {
	return &Ledger{written: map[client.ObjectKey]written{}, now: time.Now}
}

// SetupWithManager registers IndexReplicaDisk with the manager's cache and
// reads Replicas through it. Calling it again (every user of a shared
// Ledger does) changes nothing.
func (l *Ledger) SetupWithManager(mgr ctrl.Manager) error {
	l.setup.Do(func() {
		l.reader = mgr.GetClient()
		l.setupErr = mgr.GetFieldIndexer().IndexField(context.Background(), &v1.Replica{}, IndexReplicaDisk, func(o client.Object) []string {
			if k, ok := DiskOf(o.(*v1.Replica)); ok {
				return []string{k.String()}
			}
			return nil
		})
	})
	return l.setupErr
}

// PlaceOptions is one placement decision.
type PlaceOptions struct {
	// Namespace of the Replicas and StorageNodes.
	Namespace string
	// Volume whose replicas are placed; its Replicas carry its name in
	// volumes.LabelVolume.
	Volume string
	// Request and N are Schedule's. Placed are the volume's replicas the
	// caller knows placed; Place adds those the cache and its own record
	// show, so a caller's stale view never puts two on one disk.
	Request Request
	Placed  []Placed
	N       int
	// Disks to choose from (FromStorageNodes); their Scheduled is
	// replaced by what the Replicas say.
	Disks []Disk
	// Write records placement i of the result on its Replica (a patch of
	// an unplaced one, or the create of a new one) and returns the
	// Replica's key. Place stops at the first error and returns it.
	Write func(ctx context.Context, i int, p Placement) (client.ObjectKey, error)
}

// Place decides where o.N replicas go and writes them, holding the lock
// throughout, so that no two decisions in the process count the same free
// room.
func (l *Ledger) Place(ctx context.Context, o PlaceOptions) (Result, error) {
	if l == nil || l.reader == nil {
		return Result{}, fmt.Errorf("scheduler.Ledger: SetupWithManager was not called")
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	disks := append([]Disk(nil), o.Disks...)
	pending, err := l.unseen(ctx, o.Namespace)
	if err != nil {
		return Result{}, err
	}
	placed, err := l.placed(ctx, o)
	if err != nil {
		return Result{}, err
	}
	for i := range disks {
		var reps v1.ReplicaList
		if err := l.reader.List(ctx, &reps, client.InNamespace(o.Namespace), client.MatchingFields{IndexReplicaDisk: disks[i].Key().String()}); err != nil {
			return Result{}, err
		}
		disks[i].Scheduled = ScheduledBytes(reps.Items)[disks[i].Key()] + pending[disks[i].Key()]
	}
	res := Schedule(o.Request, disks, placed, o.N)
	if res.Unplaced > 0 {
		res.RetryAfter = l.forgetsIn(o.Namespace, disks)
	}
	for i, p := range res.Placements {
		key, err := o.Write(ctx, i, p)
		// Written, or maybe (a timeout, a lost connection: the server
		// may have applied it): counted from now on, by the cache once it
		// shows the Replica placed, by this record until then.
		if key.Name != "" && (err == nil || maybeApplied(err)) {
			l.written[key] = written{volume: o.Volume, disk: DiskKey{Node: p.Node, Disk: p.Disk}, size: o.Request.Size, at: l.now()}
		}
		if err != nil {
			return res, err
		}
	}
	return res, nil
}

// maybeApplied reports whether a write that returned err may have been
// applied all the same: anything but the API server's definite refusals.
func maybeApplied(err error) bool {
	switch {
	case apierrors.IsConflict(err), apierrors.IsNotFound(err), apierrors.IsAlreadyExists(err),
		apierrors.IsInvalid(err), apierrors.IsBadRequest(err), apierrors.IsForbidden(err), apierrors.IsUnauthorized(err):
		return false
	}
	return true
}

// placed is every disk holding a replica of o.Volume as far as anything
// in the process knows: o.Placed, the volume's Replicas in the cache, and
// the placements this process wrote for it that the cache does not show
// yet (unseen has just dropped those it shows). Each disk is listed once.
func (l *Ledger) placed(ctx context.Context, o PlaceOptions) ([]Placed, error) {
	seen := map[DiskKey]bool{}
	var out []Placed
	add := func(k DiskKey) {
		if !seen[k] {
			seen[k] = true
			out = append(out, Placed(k))
		}
	}
	for _, p := range o.Placed {
		add(DiskKey(p))
	}
	if o.Volume == "" {
		return out, nil
	}
	var reps v1.ReplicaList
	if err := l.reader.List(ctx, &reps, client.InNamespace(o.Namespace), client.MatchingLabels{volumes.LabelVolume: o.Volume}); err != nil {
		return nil, err
	}
	for i := range reps.Items {
		if k, ok := DiskOf(&reps.Items[i]); ok {
			add(k)
		}
	}
	for key, w := range l.written {
		if key.Namespace == o.Namespace && w.volume == o.Volume {
			add(w.disk)
		}
	}
	return out, nil
}

// forgetsIn is how long until unseen drops the first record in namespace
// ns of a placement on one of disks (it drops one older than unseenFor),
// plus a second; zero when there is none. Such a record may rule its disk
// out for a volume (a replica of it there) or for any volume (its bytes),
// and nothing watched changes when it goes.
func (l *Ledger) forgetsIn(ns string, disks []Disk) time.Duration {
	on := make(map[DiskKey]bool, len(disks))
	for _, d := range disks {
		on[d.Key()] = true
	}
	var first time.Duration
	for key, w := range l.written {
		if key.Namespace != ns || !on[w.disk] {
			continue
		}
		left := max(unseenFor-l.now().Sub(w.at), 0) + time.Second
		if first == 0 || left < first {
			first = left
		}
	}
	return first
}

// unseen sums, by disk, the placements written in namespace ns that the
// cache does not show yet, and forgets those it shows.
func (l *Ledger) unseen(ctx context.Context, ns string) (map[DiskKey]int64, error) {
	out := map[DiskKey]int64{}
	for key, w := range l.written {
		if key.Namespace != ns {
			continue
		}
		rep := &v1.Replica{}
		err := l.reader.Get(ctx, key, rep)
		switch {
		case client.IgnoreNotFound(err) != nil:
			return nil, err
		case err == nil && rep.Spec.NodeName != "":
			delete(l.written, key) // the index counts it now
		case l.now().Sub(w.at) > unseenFor:
			// Created and deleted before the cache saw it, or a write
			// whose outcome was unknown that did not happen.
			delete(l.written, key)
		default:
			out[w.disk] += w.size
		}
	}
	return out, nil
}
