package scheduler

import (
	"context"
	"errors"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/internal/volumes"
)

// staleLedger is a Ledger over a fake cache that never shows the
// placements written through it: what a worker sees when its cache lags
// the writes of the reconcile before.
func staleLedger(t *testing.T, objs ...client.Object) *Ledger {
	t.Helper()
	scheme := runtime.NewScheme()
	if err := v1.AddToScheme(scheme); err != nil {
		t.Fatal(err)
	}
	c := fake.NewClientBuilder().WithScheme(scheme).WithObjects(objs...).
		WithIndex(&v1.Replica{}, IndexReplicaDisk, func(o client.Object) []string {
			if k, ok := DiskOf(o.(*v1.Replica)); ok {
				return []string{k.String()}
			}
			return nil
		}).Build()
	l := NewLedger()
	l.reader = c
	return l
}

// unplacedReplica is an unplaced Replica of the volume "vol".
func unplacedReplica(name string) *v1.Replica {
	return &v1.Replica{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default", Labels: map[string]string{volumes.LabelVolume: "vol"}},
		Spec: v1.ReplicaSpec{VolumeName: "vol", Size: resource.MustParse("1Gi")}}
}

// TestLedgerStaleCacheKeepsReplicasApart: a reconcile placed a volume's
// first replica on n1; the next reconcile, from a cache that shows that
// replica unplaced still, asks to place the other one without listing
// n1's disk as taken. The Ledger remembers its own write: the second
// replica goes to another node, or nowhere when n1 is all there is, and
// never onto the disk that already holds the first.
func TestLedgerStaleCacheKeepsReplicasApart(t *testing.T) {
	g := NewWithT(t)
	ctx := context.Background()
	l := staleLedger(t, unplacedReplica("vol-r-1"), unplacedReplica("vol-r-2"))
	req := Request{Size: gi}
	noWrite := func(name string) func(context.Context, int, Placement) (client.ObjectKey, error) {
		return func(context.Context, int, Placement) (client.ObjectKey, error) {
			return client.ObjectKey{Namespace: "default", Name: name}, nil // the cache never sees it
		}
	}
	res, err := l.Place(ctx, PlaceOptions{Namespace: "default", Volume: "vol", Request: req, N: 1,
		Disks: []Disk{disk("n1", "d", 10*gi)}, Write: noWrite("vol-r-1")})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(nodes(res.Placements)).To(Equal([]string{"n1/d"}))

	// Only n1 ready as this worker sees it: nothing fits.
	res, err = l.Place(ctx, PlaceOptions{Namespace: "default", Volume: "vol", Request: req, N: 1,
		Disks: []Disk{disk("n1", "d", 10*gi)}, Write: noWrite("vol-r-2")})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(res.Placements).To(BeEmpty())
	g.Expect(res.Reason).To(ContainSubstring(string(RejectHasReplica)))

	// n1 has more room than n2, but holds the first replica.
	res, err = l.Place(ctx, PlaceOptions{Namespace: "default", Volume: "vol", Request: req, N: 1,
		Disks: []Disk{disk("n1", "d", 100*gi), disk("n2", "d", 10*gi)}, Write: noWrite("vol-r-2")})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(nodes(res.Placements)).To(Equal([]string{"n2/d"}))

	// Another volume is not held back by this one's placements.
	res, err = l.Place(ctx, PlaceOptions{Namespace: "default", Volume: "other", Request: req, N: 1,
		Disks: []Disk{disk("n1", "d", 10*gi)}, Write: noWrite("other-r-1")})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(nodes(res.Placements)).To(Equal([]string{"n1/d"}))
}

// TestLedgerCachedReplicasCountAsPlaced: the volume's Replicas the cache
// shows placed rule their disks out even when the caller's list (read
// earlier in its reconcile) does not have them.
func TestLedgerCachedReplicasCountAsPlaced(t *testing.T) {
	g := NewWithT(t)
	first := unplacedReplica("vol-r-1")
	first.Spec.NodeName, first.Spec.DiskName = "n1", "d"
	l := staleLedger(t, first, unplacedReplica("vol-r-2"))
	l.now = func() time.Time { return time.Unix(0, 0) }
	res, err := l.Place(context.Background(), PlaceOptions{Namespace: "default", Volume: "vol", Request: Request{Size: gi}, N: 1,
		Disks: []Disk{disk("n1", "d", 100*gi), disk("n2", "d", 10*gi)},
		Write: func(context.Context, int, Placement) (client.ObjectKey, error) {
			return client.ObjectKey{Namespace: "default", Name: "vol-r-2"}, nil
		}})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(nodes(res.Placements)).To(Equal([]string{"n2/d"}))
}

// TestLedgerUnknownOutcome: a placement whose write timed out may have
// been applied, and is counted as placed (its disk ruled out for the
// volume's other replica) until the cache shows otherwise for a minute;
// one the API server refused is not counted at all.
func TestLedgerUnknownOutcome(t *testing.T) {
	g := NewWithT(t)
	ctx := context.Background()
	l := staleLedger(t, unplacedReplica("vol-r-1"), unplacedReplica("vol-r-2"))
	now := time.Unix(1000, 0)
	l.now = func() time.Time { return now }
	req := Request{Size: gi}
	two := []Disk{disk("n1", "d", 100*gi), disk("n2", "d", 10*gi)}
	place := func(name string, werr error) (Result, error) {
		return l.Place(ctx, PlaceOptions{Namespace: "default", Volume: "vol", Request: req, N: 1, Disks: two,
			Write: func(context.Context, int, Placement) (client.ObjectKey, error) {
				return client.ObjectKey{Namespace: "default", Name: name}, werr
			}})
	}
	conflict := apierrors.NewConflict(schema.GroupResource{Resource: "replicas"}, "vol-r-1", errors.New("changed"))
	_, err := place("vol-r-1", conflict)
	g.Expect(err).To(HaveOccurred())
	res, err := place("vol-r-2", nil)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(nodes(res.Placements)).To(Equal([]string{"n1/d"}), "a refused write holds no disk")

	l = staleLedger(t, unplacedReplica("vol-r-1"), unplacedReplica("vol-r-2"))
	l.now = func() time.Time { return now }
	_, err = place("vol-r-1", apierrors.NewTimeoutError("the patch", 1))
	g.Expect(err).To(HaveOccurred())
	res, err = place("vol-r-2", nil)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(nodes(res.Placements)).To(Equal([]string{"n2/d"}), "a write that timed out may have placed vol-r-1 on n1")

	// A minute on, the cache still shows vol-r-1 unplaced: the write did
	// not happen, and n1 is free for the volume again.
	l = staleLedger(t, unplacedReplica("vol-r-1"), unplacedReplica("vol-r-2"))
	l.now = func() time.Time { return now }
	_, _ = place("vol-r-1", apierrors.NewTimeoutError("the patch", 1))
	now = now.Add(unseenFor + time.Second)
	res, err = place("vol-r-2", nil)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(nodes(res.Placements)).To(Equal([]string{"n1/d"}))
}

// TestLedgerRetryAfterForgottenRecord: a replica placed on the only disk
// and deleted before the cache showed it placed holds that disk, for its
// volume and by its bytes, until the Ledger forgets its record; a
// placement that comes up short meanwhile says when to try again (no
// watched object changes when the record goes), and once it is forgotten
// the disk takes the replica.
func TestLedgerRetryAfterForgottenRecord(t *testing.T) {
	g := NewWithT(t)
	ctx := context.Background()
	l := staleLedger(t, unplacedReplica("vol-r-2"))
	now := time.Unix(1000, 0)
	l.now = func() time.Time { return now }
	one := []Disk{disk("n1", "d", 10*gi)}
	place := func(name string) Result {
		res, err := l.Place(ctx, PlaceOptions{Namespace: "default", Volume: "vol", Request: Request{Size: gi}, N: 1, Disks: one,
			Write: func(context.Context, int, Placement) (client.ObjectKey, error) {
				return client.ObjectKey{Namespace: "default", Name: name}, nil
			}})
		g.Expect(err).NotTo(HaveOccurred())
		return res
	}
	// vol-r-1 is placed, then deleted: the cache never had it.
	res := place("vol-r-1")
	g.Expect(nodes(res.Placements)).To(Equal([]string{"n1/d"}))
	g.Expect(res.RetryAfter).To(BeZero(), "everything was placed")

	now = now.Add(20 * time.Second)
	res = place("vol-r-2")
	g.Expect(res.Placements).To(BeEmpty())
	g.Expect(res.RetryAfter).To(Equal(unseenFor - 20*time.Second + time.Second))
	retry := res.RetryAfter

	// Another volume that does not fit beside the record's bytes is told
	// to wait for it too: the record counts on the disk's room.
	tight := []Disk{disk("n1", "d", 2*gi)}
	res, err := l.Place(ctx, PlaceOptions{Namespace: "default", Volume: "other", Request: Request{Size: 2 * gi}, N: 1, Disks: tight,
		Write: func(context.Context, int, Placement) (client.ObjectKey, error) {
			return client.ObjectKey{}, errors.New("not called")
		}})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(res.Placements).To(BeEmpty())
	g.Expect(res.RetryAfter).To(Equal(retry))
	// A short placement on disks without a record has nothing to wait for.
	res, err = l.Place(ctx, PlaceOptions{Namespace: "default", Volume: "other", Request: Request{Size: 100 * gi}, N: 1,
		Disks: []Disk{disk("n2", "d", 10*gi)},
		Write: func(context.Context, int, Placement) (client.ObjectKey, error) {
			return client.ObjectKey{}, errors.New("not called")
		}})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(res.Placements).To(BeEmpty())
	g.Expect(res.RetryAfter).To(BeZero())

	// Tried again when told to: the record is gone.
	now = now.Add(retry)
	res = place("vol-r-2")
	g.Expect(nodes(res.Placements)).To(Equal([]string{"n1/d"}), "the record is forgotten")
}
