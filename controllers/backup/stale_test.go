package backup

import (
	"context"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
)

// staleBackups reads Backups as a cache that has not yet seen the
// reconciler's last status write: Get of one Backup returns an older copy.
type staleBackups struct {
	client.Client
	key   client.ObjectKey
	stale *v1.Backup
}

func (c staleBackups) Get(ctx context.Context, key client.ObjectKey, obj client.Object, opts ...client.GetOption) error {
	if b, ok := obj.(*v1.Backup); ok && key == c.key {
		c.stale.DeepCopyInto(b)
		return nil
	}
	return c.Client.Get(ctx, key, obj, opts...)
}

// TestCompletedBackupSurvivesStaleCache: after the reconciler records an
// upload's outcome and forgets the upload, the manager's cache can still
// show the Backup inProgress with the upload's last progress. Reconciled
// from that view, it must neither start the upload again nor write over
// the recorded status: the Backup stays completed, one attempt, with the
// bytes it read.
func TestCompletedBackupSurvivesStaleCache(t *testing.T) {
	r := newRig(t, "vol-stale")
	rec, _ := r.reconciler()
	r.write(0, 2*mib)
	r.backup("stc", r.target)
	var inProgress *v1.Backup
	r.g.Eventually(func() v1.BackupState {
		r.step(rec, "stc")
		b := r.get("stc")
		if b.Status.State == v1.BackupStateInProgress && inProgress == nil {
			inProgress = b
		}
		return b.Status.State
	}, timeout, 50*time.Millisecond).Should(Equal(v1.BackupStateCompleted))
	r.g.Expect(inProgress).NotTo(BeNil(), "the Backup was seen inProgress")
	done := r.get("stc")
	r.g.Expect(done.Status.BytesTotal).To(Equal(int64(2 * mib)))
	r.g.Expect(done.Status.Attempts).To(Equal(int32(1)))

	// The cache's view: inProgress, with the progress the upload's
	// watcher patched.
	key := client.ObjectKey{Namespace: ns, Name: "stc"}
	stale := inProgress.DeepCopy()
	stale.Status.BytesDone, stale.Status.BytesTotal, stale.Status.Progress = mib, 2*mib, 50
	rec.Client = staleBackups{Client: k8sClient, key: key, stale: stale}
	for range 3 {
		_, err := rec.Reconcile(context.Background(), ctrl.Request{NamespacedName: key})
		r.g.Expect(err).NotTo(HaveOccurred())
	}
	_, running := rec.uploads.state(key)
	r.g.Expect(running).To(BeFalse(), "no upload is started from a stale view")
	after := r.get("stc")
	r.g.Expect(after.Status.State).To(Equal(v1.BackupStateCompleted))
	r.g.Expect(after.Status.Attempts).To(Equal(int32(1)))
	r.g.Expect(after.Status.BytesTotal).To(Equal(int64(2*mib)), "the recorded status is not written over")
	r.g.Expect(after.Status.BytesDone).To(Equal(int64(2 * mib)))
}
