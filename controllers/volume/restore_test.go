package volume

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"
	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/dataplane/backupstore"
	"github.com/cairn-io/cairn/dataplane/engine/replicaclient"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
	"github.com/cairn-io/cairn/dataplane/testutil/nfsserver"
	"github.com/cairn-io/cairn/dataplane/testutil/versitygw"
	"github.com/cairn-io/cairn/dataplane/volcrypt"
)

// snapshotReader reads the view at a replica snapshot through the
// replica's control API, holes as zeros: a backup's source, as
// cairn-data backup reads it.
type snapshotReader struct {
	src  *replicaclient.Source
	name string
}

func (r snapshotReader) ReadAt(p []byte, off int64) (int, error) {
	clear(p)
	ext, err := r.src.ReadSnapshot(context.Background(), r.name, off, int64(len(p)))
	if err != nil {
		return 0, err
	}
	for _, x := range ext {
		copy(p[x.Offset-off:], x.Data)
	}
	return len(p), nil
}

// readDevice copies the whole volume served at sock (NBD) into memory.
func readDevice(t *testing.T, vol, sock string) []byte {
	t.Helper()
	out := filepath.Join(t.TempDir(), "image")
	b, err := exec.Command("qemu-img", "convert", "-f", "raw", "-O", "raw", "nbd+unix:///"+vol+"?socket="+sock, out).CombinedOutput()
	if err != nil {
		t.Fatalf("qemu-img convert: %v\n%s", err, b)
	}
	data, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	return data
}

// firstDiff says where two images differ first, for a failure message.
func firstDiff(a, b []byte) string {
	if len(a) != len(b) {
		return fmt.Sprintf("sizes %d and %d", len(a), len(b))
	}
	for i := range a {
		if a[i] != b[i] {
			return fmt.Sprintf("first difference at byte %d: %#x vs %#x", i, a[i], b[i])
		}
	}
	return "equal"
}

// restoreFixture is a backup target with one backup of a real replica's
// snapshot.
type restoreFixture struct {
	gw     *versitygw.Server
	nfs    *nfsserver.Server // an NFS target's server, else nil
	store  *backupstore.Store
	target string
	prefix string
}

// startBackupTarget runs versitygw with a bucket, and creates its
// credentials Secret and a BackupTarget on it.
func startBackupTarget(t *testing.T, g *WithT, name, prefix string) *restoreFixture {
	ctx := context.Background()
	gw, err := versitygw.Start(versitygw.Options{Dir: t.TempDir(), Bucket: "backups"})
	if err != nil {
		t.Skipf("no S3 server for the restore tests: %v", err)
	}
	t.Cleanup(gw.Stop)
	sec := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: name + "-creds", Namespace: "default"},
		StringData: map[string]string{"AWS_ACCESS_KEY_ID": versitygw.AccessKey, "AWS_SECRET_ACCESS_KEY": versitygw.SecretKey}}
	bt := &v1.BackupTarget{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: v1.BackupTargetSpec{S3: &v1.S3BackupTarget{
		Endpoint: gw.Endpoint, Bucket: "backups", Prefix: prefix, Region: versitygw.Region, PathStyle: true,
		CredentialsSecret: v1.SecretReference{Name: sec.Name, Namespace: "default"}}}}
	for _, o := range []client.Object{sec, bt} {
		g.Expect(k8sClient.Create(ctx, o)).To(Succeed())
		t.Cleanup(func() { _ = k8sClient.Delete(ctx, o) })
	}
	tg, err := backupstore.NewS3Target(backupstore.S3Config{Endpoint: gw.Endpoint, Bucket: "backups", Prefix: prefix, Region: versitygw.Region,
		PathStyle: true, AccessKeyID: versitygw.AccessKey, SecretAccessKey: versitygw.SecretKey})
	g.Expect(err).NotTo(HaveOccurred())
	store, err := backupstore.New(tg, backupstore.Options{})
	g.Expect(err).NotTo(HaveOccurred())
	return &restoreFixture{gw: gw, store: store, target: name, prefix: prefix}
}

// backUp backs the snapshot snap of vol up as backup name, read from one
// of its running replicas.
func (f *restoreFixture) backUp(g *WithT, vol *v1.Volume, snap, name string, labels map[string]string) {
	reps := listReplicas(g, vol)
	g.Expect(reps).NotTo(BeEmpty())
	src, err := replicaclient.DialSource(reps[0].Status.ControlAddress, deadline.Scale(30*time.Second), nil)
	g.Expect(err).NotTo(HaveOccurred())
	defer src.Close()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	_, err = f.store.Backup(ctx, backupstore.BackupOptions{Volume: vol.Name, Name: name, Source: snapshotReader{src: src, name: snap},
		Size: vol.Spec.Size.Value(), Labels: labels})
	g.Expect(err).NotTo(HaveOccurred(), "backup %s of %s", name, vol.Name)
}

// corruptBlock flips the last byte of the object of the backup's block
// at index i and returns the object's key (relative to the prefix).
func (f *restoreFixture) corruptBlock(g *WithT, vol, name string, i uint64) string {
	ctx := context.Background()
	m, err := f.store.Manifest(ctx, vol, name)
	g.Expect(err).NotTo(HaveOccurred())
	var h string
	for _, b := range m.Blocks {
		if b.Index == i {
			h = b.Hash.String()
		}
	}
	g.Expect(h).NotTo(BeEmpty(), "block %d is stored", i)
	key := "volumes/" + vol + "/blocks/" + h[:2] + "/" + h
	full := strings.TrimPrefix(f.prefix+"/"+key, "/")
	obj, err := f.gw.Client.GetObject(ctx, "backups", full, minio.GetObjectOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	var buf bytes.Buffer
	_, err = buf.ReadFrom(obj)
	g.Expect(err).NotTo(HaveOccurred())
	data := buf.Bytes()
	data[len(data)-1] ^= 0xff
	_, err = f.gw.Client.PutObject(ctx, "backups", full, bytes.NewReader(data), int64(len(data)), minio.PutObjectOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	return key
}

// restoreVolume creates volume name of size, restored from src, encrypted
// with enc (nil: not), asked to attach to node at once ("": detached).
func restoreVolume(t *testing.T, g *WithT, name, size, node string, src v1.VolumeBackupSource, enc *v1.VolumeEncryption) client.ObjectKey {
	v := &v1.Volume{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default"}, Spec: v1.VolumeSpec{
		Size: resource.MustParse(size), NumberOfReplicas: 2, Frontend: v1.FrontendNBD, NodeName: node,
		DataSource: &v1.VolumeDataSource{Backup: &src}, Encryption: enc}}
	g.Expect(k8sClient.Create(context.Background(), v)).To(Succeed())
	cleanupVolume(t, v)
	return client.ObjectKeyFromObject(v)
}

// TestRestoreFromBackup backs up a real replica's snapshot of a volume
// written with known patterns to versitygw, then restores it into new
// volumes through spec.dataSource.backup: each attaches only once its
// restore is complete (waitAttached checks at every look) and reads
// every byte of the snapshot, a bigger one zeros past the backup's end.
// A corrupted block fails the restore naming the block and the volume
// stays unattached; a missing target or backup, a backup bigger than the
// volume and a backup of a volume encrypted otherwise fail with their
// reason and start no process.
func TestRestoreFromBackup(t *testing.T) {
	if _, err := exec.LookPath("qemu-img"); err != nil {
		t.Skip("qemu-img is not installed (make test-tools installs it)")
	}
	g := NewWithT(t)
	ctx := context.Background()
	startNodes(t, g, "rb-a", "rb-b")
	f := startBackupTarget(t, g, "rs-target", "cluster-a")

	// The source: patterns in the first block, mid-volume and the last
	// block, a snapshot, then a write after it that no restore may show.
	srcVol := &v1.Volume{ObjectMeta: metav1.ObjectMeta{Name: "rs-src", Namespace: "default"}, Spec: v1.VolumeSpec{
		Size: resource.MustParse("16Mi"), NumberOfReplicas: 2, Frontend: v1.FrontendNBD, NodeName: "rb-a"}}
	g.Expect(k8sClient.Create(ctx, srcVol)).To(Succeed())
	cleanupVolume(t, srcVol)
	sock := waitAttached(t, g, client.ObjectKeyFromObject(srcVol)).Status.Endpoint
	qemuIO(t, srcVol.Name, sock, "write -P 0x11 0 2M", "write -P 0x33 5M 68k", "write -P 0x5a 15M 1M", "flush")
	image := make([]byte, 16<<20)
	for _, w := range []struct {
		b      byte
		off, n int
	}{{0x11, 0, 2 << 20}, {0x33, 5 << 20, 68 << 10}, {0x5a, 15 << 20, 1 << 20}} {
		copy(image[w.off:w.off+w.n], bytes.Repeat([]byte{w.b}, w.n))
	}
	createSnapshot(g, "rs-src-s1", srcVol.Name)
	g.Eventually(func() bool { return getSnapshot(g, "rs-src-s1").Status.ReadyToUse }, timeout, 100*time.Millisecond).Should(BeTrue())
	qemuIO(t, srcVol.Name, sock, "write -P 0x77 0 1M", "flush")
	f.backUp(g, srcVol, "rs-src-s1", "b1", map[string]string{v1.BackupLabelKeyCheck: ""})

	t.Run("same size, attached at once", func(t *testing.T) {
		g := NewWithT(t)
		key := restoreVolume(t, g, "rs-r1", "16Mi", "rb-b", v1.VolumeBackupSource{Target: f.target, Volume: srcVol.Name, Name: "b1"}, nil)
		v := waitAttached(t, g, key)
		g.Expect(v.Status.Clone).NotTo(BeNil())
		g.Expect(v.Status.Clone.State).To(Equal(v1.CloneStateCompleted))
		g.Expect(v.Status.Clone.Progress).To(Equal(int32(100)))
		g.Expect(v.Status.Clone.Backup).To(Equal(&v1.VolumeBackupSource{Target: f.target, Volume: srcVol.Name, Name: "b1"}))
		g.Expect(v.Status.Clone.BytesTotal).To(BeNumerically(">", 16<<20), "the backup's size, then the bytes verified")
		reason, _ := clonedCondition(g, key)
		g.Expect(reason).To(Equal(v1.VolumeReasonRestoreCompleted))
		g.Expect(v.Annotations).To(HaveKeyWithValue("storage.cairn.io/cloned", "backup:rs-target/rs-src/b1"))
		got := readDevice(t, v.Name, v.Status.Endpoint)
		g.Expect(bytes.Equal(got, image)).To(BeTrue(), "restored volume: %s", firstDiff(got, image))
	})

	t.Run("bigger volume", func(t *testing.T) {
		g := NewWithT(t)
		key := restoreVolume(t, g, "rs-r2", "24Mi", "rb-a", v1.VolumeBackupSource{Target: f.target, Volume: srcVol.Name, Name: "b1"}, nil)
		v := waitAttached(t, g, key)
		want := append(bytes.Clone(image), make([]byte, 8<<20)...)
		got := readDevice(t, v.Name, v.Status.Endpoint)
		g.Expect(bytes.Equal(got, want)).To(BeTrue(), "restored volume: %s", firstDiff(got, want))
	})

	// Refused before anything runs: the condition's reason and message,
	// never attached, no replica asked to run.
	for _, tc := range []struct {
		name, size string
		src        v1.VolumeBackupSource
		enc        *v1.VolumeEncryption
		reason     string
		msg        string
	}{
		{"rs-no-target", "16Mi", v1.VolumeBackupSource{Target: "nope", Volume: srcVol.Name, Name: "b1"}, nil,
			v1.VolumeReasonBackupTargetUnavailable, "BackupTarget nope does not exist"},
		{"rs-no-backup", "16Mi", v1.VolumeBackupSource{Target: f.target, Volume: srcVol.Name, Name: "b9"}, nil,
			v1.VolumeReasonBackupNotFound, "holds no backup b9 of volume rs-src"},
		{"rs-too-small", "8Mi", v1.VolumeBackupSource{Target: f.target, Volume: srcVol.Name, Name: "b1"}, nil,
			v1.VolumeReasonBackupTooLarge, "size of at least 16777216"},
		{"rs-encrypted", "16Mi", v1.VolumeBackupSource{Target: f.target, Volume: srcVol.Name, Name: "b1"},
			&v1.VolumeEncryption{KeySecret: "k", KeyCheck: strings.Repeat("ab", 16)}, v1.VolumeReasonBackupEncryptionMismatch, "taken of a volume not encrypted"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			key := restoreVolume(t, g, tc.name, tc.size, "rb-a", tc.src, tc.enc)
			g.Eventually(func() string { r, _ := clonedCondition(g, key); return r }, timeout, 100*time.Millisecond).Should(Equal(tc.reason))
			_, msg := clonedCondition(g, key)
			g.Expect(msg).To(ContainSubstring(tc.msg))
			v := getVolume(g, key)
			g.Expect(v.Status.State).NotTo(Equal(v1.VolumeStateAttached))
			g.Expect(v.Status.Clone.State).To(Equal(v1.CloneStateFailed))
			g.Consistently(func() []v1.DesiredInstanceState {
				var out []v1.DesiredInstanceState
				for _, r := range listReplicas(g, v) {
					out = append(out, r.Spec.DesiredState)
				}
				return out
			}, 2*time.Second, 100*time.Millisecond).ShouldNot(ContainElement(v1.DesiredInstanceStateRunning), "no replica runs for a restore refused")
			g.Expect(getEngine(g, v).Spec.DesiredState).NotTo(Equal(v1.DesiredInstanceStateRunning))
		})
	}

	t.Run("corrupted block", func(t *testing.T) {
		g := NewWithT(t)
		blockKey := f.corruptBlock(g, srcVol.Name, "b1", 2) // bytes 4Mi..6Mi, with 0x33 at 5Mi
		key := restoreVolume(t, g, "rs-corrupt", "16Mi", "rb-b", v1.VolumeBackupSource{Target: f.target, Volume: srcVol.Name, Name: "b1"}, nil)
		g.Eventually(func() string { r, _ := clonedCondition(g, key); return r }, timeout, 100*time.Millisecond).Should(Equal(v1.VolumeReasonBackupCorrupt))
		_, msg := clonedCondition(g, key)
		g.Expect(msg).To(ContainSubstring("block at offset %d", 4<<20))
		g.Expect(msg).To(ContainSubstring(blockKey))
		g.Consistently(func() v1.VolumeState { return getVolume(g, key).Status.State }, 3*time.Second, 100*time.Millisecond).
			ShouldNot(Equal(v1.VolumeStateAttached))
		g.Expect(meta.IsStatusConditionTrue(getVolume(g, key).Status.Conditions, v1.VolumeConditionCloned)).To(BeFalse())
		g.Expect(getVolume(g, key).Annotations).NotTo(HaveKey("storage.cairn.io/cloned"))
	})
}

// TestRestoreEncryptedBackup backs up a snapshot of an encrypted volume
// (its replicas' ciphertext, labelled with its key check) and restores it
// into a volume created with the same passphrase and key check: it reads
// the plaintext written to the source.
func TestRestoreEncryptedBackup(t *testing.T) {
	if _, err := exec.LookPath("qemu-img"); err != nil {
		t.Skip("qemu-img is not installed (make test-tools installs it)")
	}
	g := NewWithT(t)
	ctx := context.Background()
	startNodes(t, g, "re-a", "re-b")
	f := startBackupTarget(t, g, "re-target", "")
	pass := []byte("restore test passphrase, long enough")
	key, err := volcrypt.DeriveKey(pass)
	g.Expect(err).NotTo(HaveOccurred())
	secret := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "re-key", Namespace: "default"}, Data: map[string][]byte{v1.EncryptionPassphraseKey: pass}}
	g.Expect(k8sClient.Create(ctx, secret)).To(Succeed())
	t.Cleanup(func() { _ = k8sClient.Delete(ctx, secret) })
	enc := &v1.VolumeEncryption{KeySecret: secret.Name, KeyCheck: volcrypt.KeyCheck(key)}

	srcVol := &v1.Volume{ObjectMeta: metav1.ObjectMeta{Name: "re-src", Namespace: "default"}, Spec: v1.VolumeSpec{
		Size: resource.MustParse("8Mi"), NumberOfReplicas: 2, Frontend: v1.FrontendNBD, NodeName: "re-a", Encryption: enc.DeepCopy()}}
	g.Expect(k8sClient.Create(ctx, srcVol)).To(Succeed())
	cleanupVolume(t, srcVol)
	sock := waitAttached(t, g, client.ObjectKeyFromObject(srcVol)).Status.Endpoint
	qemuIO(t, srcVol.Name, sock, "write -P 0x42 1M 3M", "flush")
	image := make([]byte, 8<<20)
	copy(image[1<<20:4<<20], bytes.Repeat([]byte{0x42}, 3<<20))
	createSnapshot(g, "re-src-s1", srcVol.Name)
	g.Eventually(func() bool { return getSnapshot(g, "re-src-s1").Status.ReadyToUse }, timeout, 100*time.Millisecond).Should(BeTrue())
	f.backUp(g, srcVol, "re-src-s1", "b1", map[string]string{v1.BackupLabelKeyCheck: enc.KeyCheck})

	rkey := restoreVolume(t, g, "re-r1", "8Mi", "re-b", v1.VolumeBackupSource{Target: f.target, Volume: srcVol.Name, Name: "b1"}, enc.DeepCopy())
	v := waitAttached(t, g, rkey)
	got := readDevice(t, v.Name, v.Status.Endpoint)
	g.Expect(bytes.Equal(got, image)).To(BeTrue(), "restored encrypted volume: %s", firstDiff(got, image))

	// Without encryption, the same backup is refused before anything runs.
	pkey := restoreVolume(t, g, "re-plain", "8Mi", "re-b", v1.VolumeBackupSource{Target: f.target, Volume: srcVol.Name, Name: "b1"}, nil)
	g.Eventually(func() string { r, _ := clonedCondition(g, pkey); return r }, timeout, 100*time.Millisecond).Should(Equal(v1.VolumeReasonBackupEncryptionMismatch))
	_, msg := clonedCondition(g, pkey)
	g.Expect(msg).To(ContainSubstring("encrypted with key check " + enc.KeyCheck))
}

// TestRestoreStatus: a restore's status as computeStatus writes it. While
// the replicas run for it (no engine), the volume reads detached, not
// detaching, and asked to attach it reads attaching with the restore's
// message; condition Cloned carries the restore's own reason.
func TestRestoreStatus(t *testing.T) {
	running, stopped := v1.InstanceStateRunning, v1.InstanceStateStopped
	restoring := func(node string, st v1.CloneState, reason, msg string) *scope {
		v := statusVolume(node)
		v.Spec.DataSource = &v1.VolumeDataSource{Backup: &v1.VolumeBackupSource{Target: "t", Volume: "v", Name: "b"}}
		return &scope{v: v, engine: statusEngine("", stopped), replicas: threeReplicas(running), restoring: st != v1.CloneStateFailed,
			clone: &v1.CloneStatus{State: st, Message: msg}, cloneReason: reason}
	}
	for _, tc := range []struct {
		name         string
		s            *scope
		state        v1.VolumeState
		ready        string
		readyMsg     string
		cloned       metav1.ConditionStatus
		clonedReason string
	}{
		{"writing, detached", restoring("", v1.CloneStateCopying, v1.VolumeReasonRestoreInProgress, "writing backup v/b from target t: 40%"),
			v1.VolumeStateDetached, v1.VolumeReasonDetached, "its replicas run for the restore from a backup", metav1.ConditionFalse, v1.VolumeReasonRestoreInProgress},
		{"writing, asked to attach", restoring("n1", v1.CloneStateCopying, v1.VolumeReasonRestoreInProgress, "writing backup v/b from target t: 40%"),
			v1.VolumeStateAttaching, v1.VolumeReasonAttaching, "waits for the copy from the data source to complete: writing backup v/b", metav1.ConditionFalse, v1.VolumeReasonRestoreInProgress},
		{"corrupt, asked to attach", restoring("n1", v1.CloneStateFailed, v1.VolumeReasonBackupCorrupt, "block at offset 0 (object k) ..."),
			v1.VolumeStateAttaching, v1.VolumeReasonAttaching, "block at offset 0", metav1.ConditionFalse, v1.VolumeReasonBackupCorrupt},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			computeStatus(tc.s)
			st := tc.s.v.Status
			g.Expect(st.State).To(Equal(tc.state))
			r := meta.FindStatusCondition(st.Conditions, v1.ConditionReady)
			g.Expect(r.Reason).To(Equal(tc.ready))
			g.Expect(r.Message).To(ContainSubstring(tc.readyMsg))
			c := meta.FindStatusCondition(st.Conditions, v1.VolumeConditionCloned)
			g.Expect(c).NotTo(BeNil())
			g.Expect(c.Status).To(Equal(tc.cloned))
			g.Expect(c.Reason).To(Equal(tc.clonedReason))
			g.Expect(v1.IsCopyFailedReason(c.Reason)).To(Equal(tc.s.clone.State == v1.CloneStateFailed))
		})
	}
}

// TestRestoreAcrossManagerRestart stops the manager as soon as a restore
// reports a state and starts a new one: the restore is started again,
// completes, and the volume reads the backup's bytes.
func TestRestoreAcrossManagerRestart(t *testing.T) {
	if _, err := exec.LookPath("qemu-img"); err != nil {
		t.Skip("qemu-img is not installed (make test-tools installs it)")
	}
	g := NewWithT(t)
	ctx := context.Background()
	startNodes(t, g, "rm-a", "rm-b")
	f := startBackupTarget(t, g, "rm-target", "")
	srcVol := &v1.Volume{ObjectMeta: metav1.ObjectMeta{Name: "rm-src", Namespace: "default"}, Spec: v1.VolumeSpec{
		Size: resource.MustParse("64Mi"), NumberOfReplicas: 2, Frontend: v1.FrontendNBD, NodeName: "rm-a"}}
	g.Expect(k8sClient.Create(ctx, srcVol)).To(Succeed())
	cleanupVolume(t, srcVol)
	sock := waitAttached(t, g, client.ObjectKeyFromObject(srcVol)).Status.Endpoint
	qemuIO(t, srcVol.Name, sock, "write -P 0x6b 0 40M", "flush")
	image := append(bytes.Repeat([]byte{0x6b}, 40<<20), make([]byte, 24<<20)...)
	createSnapshot(g, "rm-src-s1", srcVol.Name)
	g.Eventually(func() bool { return getSnapshot(g, "rm-src-s1").Status.ReadyToUse }, timeout, 100*time.Millisecond).Should(BeTrue())
	f.backUp(g, srcVol, "rm-src-s1", "b1", nil)

	key := restoreVolume(t, g, "rm-r1", "64Mi", "rm-b", v1.VolumeBackupSource{Target: f.target, Volume: srcVol.Name, Name: "b1"}, nil)
	if !poll(func() bool { c := getVolume(g, key).Status.Clone; return c != nil && c.State != v1.CloneStateCompleted }) {
		t.Fatalf("never saw the restore's state: %s", describeKey(key))
	}
	testEnv.StopManager()
	g.Expect(testEnv.StartManager()).To(Succeed())
	v := waitAttached(t, g, key)
	got := readDevice(t, v.Name, v.Status.Endpoint)
	g.Expect(bytes.Equal(got, image)).To(BeTrue(), "restored volume: %s", firstDiff(got, image))
}

// TestRestoreAddressesSayWhatTheyWaitFor: the restore takes the replicas'
// addresses only once every wanted replica is placed and runs; until
// then it names what it waits for (shown in status.clone.message).
func TestRestoreAddressesSayWhatTheyWaitFor(t *testing.T) {
	running := v1.InstanceStateRunning
	for _, tc := range []struct {
		name    string
		reps    []*v1.Replica
		waiting string // "" = addresses given
	}{
		{"all running", threeReplicas(running), ""},
		{"one starting", []*v1.Replica{statusReplica("r1", "n1", running), statusReplica("r2", "n2", v1.InstanceStateStarting), statusReplica("r3", "n3", running)},
			"replica r2 on node n2 (starting)"},
		{"one never reported", []*v1.Replica{statusReplica("r1", "n1", running), statusReplica("r2", "n2", ""), statusReplica("r3", "n3", running)},
			"replica r2 on node n2 (pending)"},
		{"one unplaced", []*v1.Replica{statusReplica("r1", "n1", running), statusReplica("r2", "", ""), statusReplica("r3", "n3", running)},
			"1 of 3 replicas to be placed on a node"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			v := statusVolume("")
			v.Spec.NumberOfReplicas = 3
			addrs, waiting := restoreAddresses(&scope{v: v, replicas: tc.reps})
			if tc.waiting == "" {
				g.Expect(waiting).To(BeEmpty())
				g.Expect(addrs).To(HaveLen(3))
				return
			}
			g.Expect(addrs).To(BeEmpty())
			g.Expect(waiting).To(ContainSubstring(tc.waiting))
		})
	}
}
