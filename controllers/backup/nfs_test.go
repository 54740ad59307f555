package backup

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/dataplane/backupstore"
	"github.com/cairn-io/cairn/dataplane/testutil/nfsserver"
)

// nfsTarget serves a temporary directory with go-nfs (a user-space
// NFSv3 server on loopback) and creates an available BackupTarget for it;
// it returns the target's config, to look at what the reconciler wrote,
// and the directory.
func (r *rig) nfsTarget(name string) (backupstore.NFSConfig, string) {
	r.t.Helper()
	dir := r.t.TempDir()
	srv, err := nfsserver.Start(nfsserver.Options{Dir: dir})
	r.g.Expect(err).NotTo(HaveOccurred())
	r.t.Cleanup(srv.Stop)
	bt := &v1.BackupTarget{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: v1.BackupTargetSpec{NFS: &v1.NFSBackupTarget{
		Server: srv.Host, Path: srv.Export, Prefix: r.vol, Port: int32(srv.Port), MountPort: int32(srv.Port)}}}
	r.g.Expect(k8sClient.Create(context.Background(), bt)).To(Succeed())
	meta.SetStatusCondition(&bt.Status.Conditions, metav1.Condition{Type: v1.BackupTargetConditionAvailable, Status: metav1.ConditionTrue, Reason: v1.BackupTargetReasonAvailable, Message: "ok"})
	r.g.Expect(k8sClient.Status().Update(context.Background(), bt)).To(Succeed())
	return backupstore.NFSConfig{Server: srv.Host, Export: srv.Export, Prefix: r.vol, NFSPort: srv.Port, MountPort: srv.Port}, dir
}

// TestBackupToNFSTarget: Backups to an NFS target are uploaded over NFSv3
// from user space: a full and an incremental backup complete and are on
// the export; deleting one deletes it from the export and collects its
// blocks no other backup uses.
func TestBackupToNFSTarget(t *testing.T) {
	r := newRig(t, "vol-nfs")
	rec, _ := r.reconciler()
	rec.StoreOptions.GCMinAge = time.Nanosecond // collect blocks as soon as unreferenced
	cfg, dir := r.nfsTarget("vol-nfs-nfs")
	tg, err := backupstore.NewNFSTarget(cfg)
	r.g.Expect(err).NotTo(HaveOccurred())
	t.Cleanup(func() { _ = tg.Close() })
	store, err := backupstore.New(tg, backupstore.Options{})
	r.g.Expect(err).NotTo(HaveOccurred())
	listed := func() []string {
		list, err := store.List(context.Background(), r.vol)
		r.g.Expect(err).NotTo(HaveOccurred())
		var names []string
		for _, b := range list {
			names = append(names, b.Name)
		}
		slices.Sort(names)
		return names
	}
	blocks := func() int {
		n := 0
		err := filepath.WalkDir(filepath.Join(dir, r.vol, "volumes", r.vol, "blocks"), func(_ string, d os.DirEntry, err error) error {
			if err == nil && !d.IsDir() {
				n++
			}
			return err
		})
		r.g.Expect(err).NotTo(HaveOccurred())
		return n
	}

	r.write(0, 4*mib)
	r.backup("n1", "vol-nfs-nfs")
	n1 := r.until(rec, "n1", v1.BackupStateCompleted)
	r.g.Expect(n1.Status.Parent).To(BeEmpty())
	r.g.Expect(n1.Status.UploadedBytes).To(BeNumerically(">=", 4*mib))
	r.write(0, 2*mib) // replaces the first of n1's two blocks
	r.backup("n2", "vol-nfs-nfs")
	n2 := r.until(rec, "n2", v1.BackupStateCompleted)
	r.g.Expect(n2.Status.Parent).To(Equal("n1"))
	r.g.Expect(n2.Status.BytesTotal).To(Equal(int64(2 * mib)))
	r.g.Expect(listed()).To(Equal([]string{"n1", "n2"}))
	r.g.Expect(r.listed()).To(BeEmpty(), "nothing went to the rig's S3 target")
	before := blocks()

	r.g.Expect(k8sClient.Delete(context.Background(), r.get("n1"))).To(Succeed())
	r.g.Eventually(func() bool {
		_, _ = rec.Reconcile(context.Background(), ctrl.Request{NamespacedName: client.ObjectKey{Namespace: ns, Name: "n1"}})
		return apierrors.IsNotFound(k8sClient.Get(context.Background(), client.ObjectKey{Namespace: ns, Name: "n1"}, &v1.Backup{}))
	}, timeout, 50*time.Millisecond).Should(BeTrue())
	r.g.Expect(listed()).To(Equal([]string{"n2"}))
	r.g.Expect(blocks()).To(BeNumerically("<", before), "the block only n1 used was collected from the export")
}
