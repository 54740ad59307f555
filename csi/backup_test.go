package csi

import (
	"context"
	"strings"
	"testing"
	"time"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	. "github.com/onsi/gomega"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/dataplane/backupstore"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
	"github.com/cairn-io/cairn/dataplane/testutil/versitygw"
)

// backupTarget starts a real S3 server (versitygw) and a BackupTarget
// naming it, and waits until the BackupTarget reconciler found it
// available.
func backupTarget(t *testing.T, g *WithT, name string) *backupstore.Store {
	t.Helper()
	const bucket = "csi-backups"
	gw, err := versitygw.Start(versitygw.Options{Dir: t.TempDir(), Bucket: bucket})
	g.Expect(err).NotTo(HaveOccurred())
	t.Cleanup(gw.Stop)
	ctx := context.Background()
	sec := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: name + "-s3", Namespace: testNamespace},
		StringData: map[string]string{"AWS_ACCESS_KEY_ID": versitygw.AccessKey, "AWS_SECRET_ACCESS_KEY": versitygw.SecretKey}}
	g.Expect(cluster.Client.Create(ctx, sec)).To(Succeed())
	bt := &v1.BackupTarget{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: v1.BackupTargetSpec{S3: &v1.S3BackupTarget{
		Endpoint: gw.Endpoint, Bucket: bucket, Region: versitygw.Region, PathStyle: true,
		CredentialsSecret: v1.SecretReference{Name: sec.Name, Namespace: testNamespace}}}}
	g.Expect(cluster.Client.Create(ctx, bt)).To(Succeed())
	t.Cleanup(func() {
		_ = cluster.Client.Delete(ctx, bt)
		_ = cluster.Client.Delete(ctx, sec)
	})
	g.Eventually(func() bool {
		g.Expect(cluster.Client.Get(ctx, client.ObjectKeyFromObject(bt), bt)).To(Succeed())
		for _, c := range bt.Status.Conditions {
			if c.Type == v1.BackupTargetConditionAvailable && c.Status == metav1.ConditionTrue {
				return true
			}
		}
		return false
	}, deadline.Scale(time.Minute), 200*time.Millisecond).Should(BeTrue(), "the BackupTarget is available")
	target, err := backupstore.NewS3Target(backupstore.S3Config{Endpoint: gw.Endpoint, Bucket: bucket, Region: versitygw.Region,
		PathStyle: true, AccessKeyID: versitygw.AccessKey, SecretAccessKey: versitygw.SecretKey})
	g.Expect(err).NotTo(HaveOccurred())
	store, err := backupstore.New(target, backupstore.Options{})
	g.Expect(err).NotTo(HaveOccurred())
	return store
}

// TestBackupSnapshotClass makes the calls the external-snapshotter and
// -provisioner make for a VolumeSnapshotClass with type: backup: a
// VolumeSnapshot of a mounted ext4 volume becomes a Backup on a real S3
// server, ready once uploaded; the source volume is deleted; a claim twice
// the size is restored from it on another node, holds the files and a
// filesystem grown to the new size; deleting the VolumeSnapshot deletes the
// backup from the target.
func TestBackupSnapshotClass(t *testing.T) {
	needRoot(t)
	g := NewWithT(t)
	store := backupTarget(t, g, "csi-offsite")
	addNodes(t, "bak-a", "bak-b")
	ctrl := startDriver(t, "bak-b")
	nodeA, nodeB := startDriver(t, "bak-a"), ctrl
	ctx := callCtx(t)
	vc := volCap("ext4", false)
	const size = 64 << 20
	params := map[string]string{ParamNumberOfReplicas: "2", ParamFSType: "ext4"}

	created, err := ctrl.controller.CreateVolume(ctx, &csipb.CreateVolumeRequest{Name: "pvc-backup-src",
		CapacityRange: &csipb.CapacityRange{RequiredBytes: size}, VolumeCapabilities: []*csipb.VolumeCapability{vc}, Parameters: params})
	g.Expect(err).NotTo(HaveOccurred())
	src := created.GetVolume()
	a := mountOn(t, g, ctrl, nodeA, src, vc)
	files := writeData(t, g, a, "backed-up")

	t.Log("bad classes change nothing")
	// type: backup without a target is refused while the volume has no
	// default target either.
	for _, p := range []map[string]string{{ParamSnapshotType: SnapshotTypeBackup}, {ParamSnapshotType: "bak"}, {ParamBackupTarget: "csi-offsite"},
		{ParamSnapshotType: SnapshotTypeBackup, ParamBackupTarget: "csi-offsite", ParamBackupMode: "differential"}, {ParamBackupMode: "full"}} {
		_, err := ctrl.controller.CreateSnapshot(ctx, &csipb.CreateSnapshotRequest{Name: "snapshot-bad", SourceVolumeId: src.GetVolumeId(), Parameters: p})
		g.Expect(status.Code(err)).To(Equal(codes.InvalidArgument), "%v: %v", p, err)
	}
	var backups v1.BackupList
	g.Expect(cluster.Client.List(ctx, &backups, client.InNamespace(testNamespace))).To(Succeed())
	g.Expect(backups.Items).To(BeEmpty())

	t.Log("the volume's default target (StorageClass parameter backupTarget) is set")
	vol := &v1.Volume{}
	g.Expect(cluster.Client.Get(ctx, client.ObjectKey{Namespace: testNamespace, Name: src.GetVolumeId()}, vol)).To(Succeed())
	patch := client.MergeFrom(vol.DeepCopy())
	vol.Spec.BackupTarget = "csi-offsite"
	g.Expect(cluster.Client.Patch(ctx, vol, patch)).To(Succeed())

	t.Log("CreateSnapshot with a backup class naming no target (the volume's is used) and backupMode full, called again until ready as the snapshotter does")
	req := &csipb.CreateSnapshotRequest{Name: "snapshot-backup-1", SourceVolumeId: src.GetVolumeId(),
		Parameters: map[string]string{ParamSnapshotType: SnapshotTypeBackup, ParamBackupMode: "full"}}
	var snap *csipb.Snapshot
	g.Eventually(func() bool {
		res, err := ctrl.controller.CreateSnapshot(ctx, req)
		g.Expect(err).NotTo(HaveOccurred())
		snap = res.GetSnapshot()
		return snap.GetReadyToUse()
	}, deadline.Scale(2*time.Minute), 500*time.Millisecond).Should(BeTrue(), "the backup completes")
	g.Expect(snap.GetSnapshotId()).To(HavePrefix("backup:"))
	var made v1.Backup
	g.Expect(cluster.Client.Get(ctx, client.ObjectKey{Namespace: testNamespace, Name: strings.TrimPrefix(snap.GetSnapshotId(), "backup:")}, &made)).To(Succeed())
	g.Expect(made.Spec.Target).To(Equal("csi-offsite"), "the volume's default target")
	g.Expect(made.Spec.Mode).To(Equal(v1.BackupModeFull), "the class's backupMode")
	g.Expect(snap.GetSizeBytes()).To(Equal(int64(size)))
	g.Expect(snap.GetSourceVolumeId()).To(Equal(src.GetVolumeId()))
	list, err := store.List(ctx, src.GetVolumeId())
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(list).To(HaveLen(1), "one backup of the volume on the target")

	listed, err := ctrl.controller.ListSnapshots(ctx, &csipb.ListSnapshotsRequest{SourceVolumeId: src.GetVolumeId()})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(listed.GetEntries()).To(HaveLen(1), "the backup is listed, the Snapshot it took for itself is not")
	g.Expect(listed.GetEntries()[0].GetSnapshot().GetSnapshotId()).To(Equal(snap.GetSnapshotId()))

	t.Log("the source volume goes, with the Snapshot its backup took")
	unmountFrom(t, g, ctrl, a, src.GetVolumeId())
	_, err = ctrl.controller.DeleteVolume(ctx, &csipb.DeleteVolumeRequest{VolumeId: src.GetVolumeId()})
	g.Expect(err).NotTo(HaveOccurred())
	var snaps v1.SnapshotList
	g.Expect(cluster.Client.List(ctx, &snaps, client.InNamespace(testNamespace))).To(Succeed())
	for _, sn := range snaps.Items {
		g.Expect(sn.Spec.Volume).NotTo(Equal(src.GetVolumeId()), "snapshot %s of the deleted volume is left", sn.Name)
	}

	t.Log("CreateVolume twice the size from the backup, mounted on the other node")
	restored, err := ctrl.controller.CreateVolume(ctx, &csipb.CreateVolumeRequest{Name: "pvc-backup-restored",
		CapacityRange: &csipb.CapacityRange{RequiredBytes: 2 * size}, VolumeCapabilities: []*csipb.VolumeCapability{vc}, Parameters: params,
		VolumeContentSource: &csipb.VolumeContentSource{Type: &csipb.VolumeContentSource_Snapshot{
			Snapshot: &csipb.VolumeContentSource_SnapshotSource{SnapshotId: snap.GetSnapshotId()}}}})
	g.Expect(err).NotTo(HaveOccurred())
	r := mountOn(t, g, ctrl, nodeB, restored.GetVolume(), vc)
	g.Expect(readData(t, g, r, files)).To(Succeed(), "the restored volume holds the backed-up files")
	g.Expect(usableBytes(g, r)).To(BeNumerically(">", int64(size)), "its filesystem was grown to the new size at stage")

	t.Log("DeleteSnapshot deletes the backup from the target")
	_, err = ctrl.controller.DeleteSnapshot(ctx, &csipb.DeleteSnapshotRequest{SnapshotId: snap.GetSnapshotId()})
	g.Expect(err).NotTo(HaveOccurred())
	list, err = store.List(ctx, src.GetVolumeId())
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(list).To(BeEmpty(), "no backup of the volume is left on the target")
	_, err = ctrl.controller.CreateVolume(ctx, &csipb.CreateVolumeRequest{Name: "pvc-backup-gone",
		CapacityRange: &csipb.CapacityRange{RequiredBytes: size}, VolumeCapabilities: []*csipb.VolumeCapability{vc}, Parameters: params,
		VolumeContentSource: &csipb.VolumeContentSource{Type: &csipb.VolumeContentSource_Snapshot{
			Snapshot: &csipb.VolumeContentSource_SnapshotSource{SnapshotId: snap.GetSnapshotId()}}}})
	g.Expect(status.Code(err)).To(Equal(codes.NotFound), "%v", err)

	t.Log("the restored volume goes")
	unmountFrom(t, g, ctrl, r, restored.GetVolume().GetVolumeId())
	_, err = ctrl.controller.DeleteVolume(ctx, &csipb.DeleteVolumeRequest{VolumeId: restored.GetVolume().GetVolumeId()})
	g.Expect(err).NotTo(HaveOccurred())
}

// TestPublishRefusedWhileRestoreFails: a volume whose restore from a
// backup fails (here: its BackupTarget does not exist) is refused at
// ControllerPublishVolume with FailedPrecondition and the restore's
// message, instead of waiting out the attacher's timeout.
func TestPublishRefusedWhileRestoreFails(t *testing.T) {
	g := NewWithT(t)
	addNodes(t, "rf-a")
	d := startDriver(t, "rf-a")
	ctx := callCtx(t)
	v := &v1.Volume{ObjectMeta: metav1.ObjectMeta{Name: "restore-fails", Namespace: testNamespace},
		Spec: v1.VolumeSpec{Size: resource.MustParse("64Mi"), NumberOfReplicas: 1,
			DataSource: &v1.VolumeDataSource{Backup: &v1.VolumeBackupSource{Target: "no-such-target", Volume: "pvc-gone", Name: "b1"}}}}
	g.Expect(cluster.Client.Create(ctx, v)).To(Succeed())
	g.Eventually(func() string {
		g.Expect(cluster.Client.Get(ctx, client.ObjectKeyFromObject(v), v)).To(Succeed())
		if c := meta.FindStatusCondition(v.Status.Conditions, v1.VolumeConditionCloned); c != nil {
			return c.Reason
		}
		return ""
	}, deadline.Scale(time.Minute), 200*time.Millisecond).Should(Equal(v1.VolumeReasonBackupTargetUnavailable))
	_, err := d.controller.ControllerPublishVolume(ctx, &csipb.ControllerPublishVolumeRequest{VolumeId: v.Name, NodeId: "rf-a",
		VolumeCapability: volCap("ext4", false)})
	g.Expect(status.Code(err)).To(Equal(codes.FailedPrecondition), "%v", err)
	g.Expect(status.Convert(err).Message()).To(ContainSubstring("no-such-target"))
	g.Expect(cluster.Client.Get(ctx, client.ObjectKeyFromObject(v), v)).To(Succeed())
	g.Expect(v.Spec.NodeName).To(BeEmpty(), "nothing changed")

	// Gone, replicas and all, while its node still runs: the other tests
	// check that nothing is left in the namespace.
	_, err = d.controller.DeleteVolume(ctx, &csipb.DeleteVolumeRequest{VolumeId: v.Name})
	g.Expect(err).NotTo(HaveOccurred())
	var reps v1.ReplicaList
	g.Expect(cluster.Client.List(ctx, &reps, client.InNamespace(testNamespace), client.MatchingLabels{labelVolume: v.Name})).To(Succeed())
	g.Expect(reps.Items).To(BeEmpty(), "the volume's replicas are gone")
}
