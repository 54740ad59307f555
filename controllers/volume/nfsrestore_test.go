package volume

import (
	"bytes"
	"context"
	"os/exec"
	"runtime/debug"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/dataplane/backupstore"
	"github.com/cairn-io/cairn/dataplane/testutil/nfsserver"
)

// startNFSBackupTarget serves a temporary directory with go-nfs (a
// user-space NFSv3 server on loopback) and creates a BackupTarget on it.
func startNFSBackupTarget(t *testing.T, g *WithT, name, prefix string) *restoreFixture {
	ctx := context.Background()
	srv, err := nfsserver.Start(nfsserver.Options{Dir: t.TempDir()})
	g.Expect(err).NotTo(HaveOccurred())
	t.Cleanup(srv.Stop)
	bt := &v1.BackupTarget{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: v1.BackupTargetSpec{NFS: &v1.NFSBackupTarget{
		Server: srv.Host, Path: srv.Export, Prefix: prefix, Port: int32(srv.Port), MountPort: int32(srv.Port)}}}
	g.Expect(k8sClient.Create(ctx, bt)).To(Succeed())
	t.Cleanup(func() { _ = k8sClient.Delete(ctx, bt) })
	tg, err := backupstore.NewNFSTarget(backupstore.NFSConfig{Server: srv.Host, Export: srv.Export, Prefix: prefix,
		NFSPort: srv.Port, MountPort: srv.Port})
	g.Expect(err).NotTo(HaveOccurred())
	t.Cleanup(func() { _ = tg.Close() })
	store, err := backupstore.New(tg, backupstore.Options{})
	g.Expect(err).NotTo(HaveOccurred())
	return &restoreFixture{nfs: srv, store: store, target: name, prefix: prefix}
}

// TestRestoreFromNFSBackup backs a real replica's snapshot up to an NFS
// target and restores it into a new volume through
// spec.dataSource.backup: the manager reads the export over NFSv3 from
// user space, and the volume reads every byte of the snapshot.
func TestRestoreFromNFSBackup(t *testing.T) {
	if _, err := exec.LookPath("qemu-img"); err != nil {
		t.Skip("qemu-img is not installed (make test-tools installs it)")
	}
	g := NewWithT(t)
	ctx := context.Background()
	startNodes(t, g, "rn-a", "rn-b")
	f := startNFSBackupTarget(t, g, "rn-target", "cluster-a")

	srcVol := &v1.Volume{ObjectMeta: metav1.ObjectMeta{Name: "rn-src", Namespace: "default"}, Spec: v1.VolumeSpec{
		Size: resource.MustParse("8Mi"), NumberOfReplicas: 2, Frontend: v1.FrontendNBD, NodeName: "rn-a"}}
	g.Expect(k8sClient.Create(ctx, srcVol)).To(Succeed())
	cleanupVolume(t, srcVol)
	sock := waitAttached(t, g, client.ObjectKeyFromObject(srcVol)).Status.Endpoint
	qemuIO(t, srcVol.Name, sock, "write -P 0x21 0 1M", "write -P 0x42 5M 68k", "flush")
	image := make([]byte, 8<<20)
	copy(image, bytes.Repeat([]byte{0x21}, 1<<20))
	copy(image[5<<20:], bytes.Repeat([]byte{0x42}, 68<<10))
	createSnapshot(g, "rn-src-s1", srcVol.Name)
	g.Eventually(func() bool { return getSnapshot(g, "rn-src-s1").Status.ReadyToUse }, timeout, 100*time.Millisecond).Should(BeTrue())
	f.backUp(g, srcVol, "rn-src-s1", "b1", map[string]string{v1.BackupLabelKeyCheck: ""})
	conns := f.nfs.OpenConns() // the fixture's own store's
	// With the collector off, a connection the restore leaves open stays
	// open (collected, its descriptor would be closed by a finalizer and
	// hide the leak).
	defer debug.SetGCPercent(debug.SetGCPercent(-1))

	key := restoreVolume(t, g, "rn-r1", "8Mi", "rn-b", v1.VolumeBackupSource{Target: f.target, Volume: srcVol.Name, Name: "b1"}, nil)
	v := waitAttached(t, g, key)
	g.Expect(v.Status.Clone).NotTo(BeNil())
	g.Expect(v.Status.Clone.State).To(Equal(v1.CloneStateCompleted))
	reason, _ := clonedCondition(g, key)
	g.Expect(reason).To(Equal(v1.VolumeReasonRestoreCompleted))
	got := readDevice(t, v.Name, v.Status.Endpoint)
	g.Expect(bytes.Equal(got, image)).To(BeTrue(), "restored volume: %s", firstDiff(got, image))
	// The restore closed its connections to the export when it ended.
	g.Eventually(f.nfs.OpenConns, timeout, 100*time.Millisecond).Should(Equal(conns), "NFS connections left open on the server")
}
