package backup

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr/funcr"
	. "github.com/onsi/gomega"
	"google.golang.org/grpc"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/internal/volumes"
	"github.com/cairn-io/cairn/controllers/snapshot"
	enginev1 "github.com/cairn-io/cairn/dataplane/api/engine/v1"
	"github.com/cairn-io/cairn/dataplane/backupstore"
	"github.com/cairn-io/cairn/dataplane/dataconn"
	"github.com/cairn-io/cairn/dataplane/engine"
	"github.com/cairn-io/cairn/dataplane/engine/engineserver"
	"github.com/cairn-io/cairn/dataplane/engine/replicaclient"
	"github.com/cairn-io/cairn/dataplane/replica"
	"github.com/cairn-io/cairn/dataplane/replica/replicaserver"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
	"github.com/cairn-io/cairn/dataplane/testutil/versitygw"
)

const (
	size = 16 << 20
	mib  = 1 << 20
	ns   = "default"
)

var timeout = deadline.Scale(90 * time.Second)

// rig is one volume: two replica servers and an engine over them in
// process (the engine's control API on loopback, for the Snapshot
// reconciler), its Volume, Engine and Replica objects, and the target.
type rig struct {
	t      *testing.T
	g      *WithT
	vol    string
	e      *engine.Engine
	snaps  *snapshot.Reconciler
	target string
}

func newRig(t *testing.T, vol string) *rig {
	r := &rig{t: t, g: NewWithT(t), vol: vol, snaps: &snapshot.Reconciler{Client: k8sClient}, target: vol + "-target"}
	listen := func() net.Listener {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		r.g.Expect(err).NotTo(HaveOccurred())
		return l
	}
	var addrs, controls []string
	for i := range 2 {
		rep, err := replica.Open(filepath.Join(t.TempDir(), fmt.Sprint("r", i)), replica.Options{Size: size})
		r.g.Expect(err).NotTo(HaveOccurred())
		dl, cl := listen(), listen()
		run := replicaserver.Start(rep, replicaserver.Options{Data: dl, Control: cl})
		t.Cleanup(run.Kill)
		addrs = append(addrs, dl.Addr().String()+","+cl.Addr().String())
		controls = append(controls, cl.Addr().String())
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	e, err := engine.Open(ctx, engine.Options{Name: vol, Replicas: addrs,
		Dial: replicaclient.Dialer(replicaclient.Options{Data: dataconn.ClientOptions{Conns: 1}})})
	r.g.Expect(err).NotTo(HaveOccurred())
	t.Cleanup(func() { e.Close() })
	r.e = e
	gs := grpc.NewServer()
	enginev1.RegisterEngineServiceServer(gs, &engineserver.Server{E: e, Name: vol})
	l := listen()
	// Serve returns nil once Stop runs at cleanup.
	go func() { _ = gs.Serve(l) }()
	t.Cleanup(gs.Stop)
	r.objects(l.Addr().String(), controls)
	return r
}

// objects writes the Volume, its Engine and Replicas as their reconcilers
// would for the running processes, and an available S3 BackupTarget.
func (r *rig) objects(engineAddr string, controls []string) {
	ctx := context.Background()
	v := &v1.Volume{ObjectMeta: metav1.ObjectMeta{Name: r.vol, Namespace: ns},
		Spec: v1.VolumeSpec{Size: resource.MustParse("16Mi"), NumberOfReplicas: 2}}
	r.g.Expect(k8sClient.Create(ctx, v)).To(Succeed())
	modes := map[string]v1.ReplicaMode{}
	for i, addr := range controls {
		rep := &v1.Replica{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("%s-r%d", r.vol, i), Namespace: ns},
			Spec: v1.ReplicaSpec{VolumeName: r.vol, Size: v.Spec.Size}}
		r.g.Expect(k8sClient.Create(ctx, rep)).To(Succeed())
		rep.Status.InstanceState, rep.Status.ControlAddress = v1.InstanceStateRunning, addr
		r.g.Expect(k8sClient.Status().Update(ctx, rep)).To(Succeed())
		modes[rep.Name] = v1.ReplicaModeRW
	}
	e := &v1.Engine{ObjectMeta: metav1.ObjectMeta{Name: volumes.EngineName(v), Namespace: ns},
		Spec: v1.EngineSpec{VolumeName: v.Name, NodeName: "n1", Size: v.Spec.Size, DesiredState: v1.DesiredInstanceStateRunning}}
	r.g.Expect(k8sClient.Create(ctx, e)).To(Succeed())
	e.Status.InstanceState, e.Status.Address, e.Status.ReplicaModeMap = v1.InstanceStateRunning, engineAddr, modes
	r.g.Expect(k8sClient.Status().Update(ctx, e)).To(Succeed())

	sec := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: r.target, Namespace: ns},
		StringData: map[string]string{"AWS_ACCESS_KEY_ID": versitygw.AccessKey, "AWS_SECRET_ACCESS_KEY": versitygw.SecretKey}}
	r.g.Expect(k8sClient.Create(ctx, sec)).To(Succeed())
	bt := &v1.BackupTarget{ObjectMeta: metav1.ObjectMeta{Name: r.target}, Spec: v1.BackupTargetSpec{S3: &v1.S3BackupTarget{
		Endpoint: gw.Endpoint, Bucket: bucket, Prefix: r.vol, Region: versitygw.Region, PathStyle: true,
		CredentialsSecret: v1.SecretReference{Name: r.target, Namespace: ns}}}}
	r.g.Expect(k8sClient.Create(ctx, bt)).To(Succeed())
	meta.SetStatusCondition(&bt.Status.Conditions, metav1.Condition{Type: v1.BackupTargetConditionAvailable, Status: metav1.ConditionTrue, Reason: v1.BackupTargetReasonAvailable, Message: "ok"})
	r.g.Expect(k8sClient.Status().Update(ctx, bt)).To(Succeed())
}

// store opens the target as the reconciler does, to look at it.
func (r *rig) store() *backupstore.Store {
	t, err := backupstore.NewS3Target(backupstore.S3Config{Endpoint: gw.Endpoint, Bucket: bucket, Prefix: r.vol, Region: versitygw.Region,
		PathStyle: true, AccessKeyID: versitygw.AccessKey, SecretAccessKey: versitygw.SecretKey})
	r.g.Expect(err).NotTo(HaveOccurred())
	s, err := backupstore.New(t, backupstore.Options{})
	r.g.Expect(err).NotTo(HaveOccurred())
	return s
}

func (r *rig) listed() []string {
	r.t.Helper()
	list, err := r.store().List(context.Background(), r.vol)
	r.g.Expect(err).NotTo(HaveOccurred())
	var names []string
	for _, b := range list {
		names = append(names, b.Name)
	}
	slices.Sort(names)
	return names
}

// write writes n random bytes at off through the engine and flushes.
func (r *rig) write(off, n int64) {
	r.t.Helper()
	buf := make([]byte, n)
	_, _ = rand.Read(buf)
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	r.g.Expect(r.e.WriteAt(ctx, buf, off, false)).To(Succeed())
	r.g.Expect(r.e.Flush(ctx)).To(Succeed())
}

// reconciler returns a Backup reconciler whose uploads run until the
// returned cancel (a manager's stop).
func (r *rig) reconciler() (*Reconciler, context.CancelFunc) {
	rec := &Reconciler{Client: k8sClient, Reader: k8sClient, ProgressInterval: 100 * time.Millisecond, RetryBackoff: time.Second,
		StoreOptions: backupstore.Options{CallTimeout: deadline.Scale(30 * time.Second)}}
	ctx, cancel := context.WithCancel(context.Background())
	rec.uploads.open(ctx, rec.maxUploads())
	r.t.Cleanup(func() { cancel(); rec.uploads.wait() })
	return rec, cancel
}

func (r *rig) backup(name, target string) {
	r.t.Helper()
	b := &v1.Backup{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns}, Spec: v1.BackupSpec{Volume: r.vol, Target: target}}
	r.g.Expect(k8sClient.Create(context.Background(), b)).To(Succeed())
}

func (r *rig) get(name string) *v1.Backup {
	b := &v1.Backup{}
	r.g.Expect(k8sClient.Get(context.Background(), client.ObjectKey{Namespace: ns, Name: name}, b)).To(Succeed())
	return b
}

// step reconciles the Backup and the Snapshot it reads once each.
func (r *rig) step(rec *Reconciler, name string) {
	key := client.ObjectKey{Namespace: ns, Name: name}
	_, err := rec.Reconcile(context.Background(), ctrl.Request{NamespacedName: key})
	r.g.Expect(err).NotTo(HaveOccurred())
	_, _ = r.snaps.Reconcile(context.Background(), ctrl.Request{NamespacedName: key})
}

// until reconciles name until its state is want.
func (r *rig) until(rec *Reconciler, name string, want v1.BackupState) *v1.Backup {
	r.t.Helper()
	r.g.Eventually(func() v1.BackupState {
		r.step(rec, name)
		return r.get(name).Status.State
	}, timeout, 50*time.Millisecond).Should(Equal(want), func() string { return fmt.Sprintf("%+v", r.get(name).Status) })
	return r.get(name)
}

// TestBackupLifecycle: a full backup holds the written bytes; an
// incremental one reads and uploads about what changed; an upload cut off
// by its manager's stop is started again by the next manager and ends
// complete, never reported complete before its manifest exists; deleting
// a Backup removes it from the target's listing and deletes its Snapshot.
func TestBackupLifecycle(t *testing.T) {
	r := newRig(t, "vol-life")
	rec, _ := r.reconciler()
	var logMu sync.Mutex
	var logged strings.Builder
	rec.Log = funcr.New(func(prefix, args string) {
		logMu.Lock()
		defer logMu.Unlock()
		logged.WriteString(args + "\n")
	}, funcr.Options{})

	r.write(0, 4*mib)
	r.backup("b1", r.target)
	b1 := r.until(rec, "b1", v1.BackupStateCompleted)
	logMu.Lock()
	r.g.Expect(logged.String()).To(ContainSubstring(`"read"="over the data port"`), "the snapshot is read over the replica's data port")
	logMu.Unlock()
	r.g.Expect(b1.Status.BackupName).To(Equal("b1"))
	r.g.Expect(b1.Status.Parent).To(BeEmpty())
	r.g.Expect(b1.Status.BytesTotal).To(Equal(int64(4*mib)), "a full backup reads the written blocks only")
	r.g.Expect(b1.Status.UploadedBytes).To(BeNumerically(">=", 4*mib), "random data does not compress")
	r.g.Expect(b1.Status.UploadedBytes).To(BeNumerically("<", 5*mib))
	r.g.Expect(b1.Status.VolumeSize.Value()).To(Equal(int64(size)))
	r.g.Expect(meta.IsStatusConditionTrue(b1.Status.Conditions, v1.BackupConditionCompleted)).To(BeTrue())
	m1, err := r.store().Manifest(context.Background(), r.vol, "b1")
	r.g.Expect(err).NotTo(HaveOccurred())
	r.g.Expect(m1.Labels).To(HaveKeyWithValue(v1.BackupLabelKeyCheck, ""), "the manifest records that the volume is not encrypted, for restores to check")

	// One more MiB, inside one 2 MiB backup block.
	r.write(8*mib, mib)
	r.backup("b2", r.target)
	b2 := r.until(rec, "b2", v1.BackupStateCompleted)
	r.g.Expect(b2.Status.Parent).To(Equal("b1"))
	r.g.Expect(b2.Status.BytesTotal).To(Equal(int64(2*mib)), "an incremental backup reads the changed block only")
	r.g.Expect(b2.Status.UploadedBytes).To(BeNumerically(">=", mib))
	r.g.Expect(b2.Status.UploadedBytes).To(BeNumerically("<", 2*mib+mib/2), "about what changed, not the volume")
	r.g.Expect(r.listed()).To(Equal([]string{"b1", "b2"}))

	// The first manager stops at the upload's first progress report.
	r.write(12*mib, 4*mib)
	rec1, stop1 := r.reconciler()
	var once sync.Once
	rec1.onProgress = func(key types.NamespacedName, _, _ int64) {
		if key.Name == "b3" {
			once.Do(stop1)
		}
	}
	r.backup("b3", r.target)
	r.g.Eventually(func() int32 { r.step(rec1, "b3"); return r.get("b3").Status.Attempts }, timeout, 50*time.Millisecond).Should(Equal(int32(1)))
	rec1.uploads.wait()
	b3 := r.get("b3")
	r.g.Expect(b3.Status.State).To(Equal(v1.BackupStateInProgress))
	_, err = r.store().Manifest(context.Background(), r.vol, "b3")
	r.g.Expect(errors.Is(err, backupstore.ErrBackupNotFound)).To(BeTrue(), "the stopped upload wrote no manifest: %v", err)
	// The next manager finds it inProgress and runs it again.
	b3 = r.until(rec, "b3", v1.BackupStateCompleted)
	r.g.Expect(b3.Status.Attempts).To(Equal(int32(2)))
	r.g.Expect(b3.Status.Parent).To(Equal("b2"))
	r.g.Expect(r.listed()).To(Equal([]string{"b1", "b2", "b3"}))

	// Deleting b1 deletes it from the target; the others stay.
	r.g.Expect(k8sClient.Delete(context.Background(), r.get("b1"))).To(Succeed())
	r.g.Eventually(func() bool {
		_, _ = rec.Reconcile(context.Background(), ctrl.Request{NamespacedName: client.ObjectKey{Namespace: ns, Name: "b1"}})
		return apierrors.IsNotFound(k8sClient.Get(context.Background(), client.ObjectKey{Namespace: ns, Name: "b1"}, &v1.Backup{}))
	}, timeout, 50*time.Millisecond).Should(BeTrue())
	r.g.Expect(r.listed()).To(Equal([]string{"b2", "b3"}))
	// Its Snapshot goes with it, though the Volume owns it too (the
	// garbage collector would keep it while the Volume exists).
	s := &v1.Snapshot{}
	err = k8sClient.Get(context.Background(), client.ObjectKey{Namespace: ns, Name: "b1"}, s)
	r.g.Expect(apierrors.IsNotFound(err) || !s.DeletionTimestamp.IsZero()).To(BeTrue(), "snapshot b1 is deleted with its Backup: %v %+v", err, s.ObjectMeta)
	r.g.Expect(k8sClient.Get(context.Background(), client.ObjectKey{Namespace: ns, Name: "b2"}, s)).To(Succeed())
	r.g.Expect(s.DeletionTimestamp.IsZero()).To(BeTrue(), "b2's snapshot stays")
}

// TestBackupMissingTarget: a Backup naming no BackupTarget says so and
// starts nothing (no snapshot taken, nothing on the target).
func TestBackupMissingTarget(t *testing.T) {
	r := newRig(t, "vol-notarget")
	rec, _ := r.reconciler()
	r.write(0, mib)
	r.backup("nt", "no-such-target")
	for range 3 {
		r.step(rec, "nt")
	}
	b := r.get("nt")
	c := meta.FindStatusCondition(b.Status.Conditions, v1.BackupConditionCompleted)
	r.g.Expect(c).NotTo(BeNil())
	r.g.Expect(c.Status).To(Equal(metav1.ConditionFalse))
	r.g.Expect(c.Reason).To(Equal(v1.BackupReasonTargetNotFound))
	r.g.Expect(c.Message).To(ContainSubstring("no-such-target"))
	r.g.Expect(b.Status.State).To(Equal(v1.BackupStatePending))
	r.g.Expect(b.Status.Attempts).To(BeZero())
	err := k8sClient.Get(context.Background(), client.ObjectKey{Namespace: ns, Name: "nt"}, &v1.Snapshot{})
	r.g.Expect(apierrors.IsNotFound(err)).To(BeTrue(), "no snapshot taken: %v", err)
	r.g.Expect(r.listed()).To(BeEmpty())
}

func keyOf(b *v1.Backup) client.ObjectKey { return client.ObjectKeyFromObject(b) }

// TestBackupNameConflict: a backup of the same name for the volume on the
// target, written by another Backup object (another namespace's volume of
// the same name, another cluster), is neither overwritten, adopted, retried
// against, nor deleted with this Backup.
func TestBackupNameConflict(t *testing.T) {
	r := newRig(t, "vol-conflict")
	rec, _ := r.reconciler()
	rec.RetryBackoff = 100 * time.Millisecond
	_, err := r.store().Backup(context.Background(), backupstore.BackupOptions{Volume: r.vol, Name: "nc", Size: 2 * mib,
		Source: bytes.NewReader(make([]byte, 2*mib)), Labels: map[string]string{LabelBackupUID: "another-uid", LabelBackup: "elsewhere/nc"}})
	r.g.Expect(err).NotTo(HaveOccurred())
	r.write(0, mib)
	r.backup("nc", r.target)
	b := r.until(rec, "nc", v1.BackupStateFailed)
	c := meta.FindStatusCondition(b.Status.Conditions, v1.BackupConditionCompleted)
	r.g.Expect(c.Reason).To(Equal(v1.BackupReasonNameConflict), c.Message)
	r.g.Expect(c.Message).To(ContainSubstring("elsewhere/nc"))
	// Well past the back-off: still the one attempt.
	r.g.Consistently(func() int32 { r.step(rec, "nc"); return r.get("nc").Status.Attempts }, 2*time.Second, 100*time.Millisecond).
		Should(Equal(int32(1)), "not retried")
	m, err := r.store().Manifest(context.Background(), r.vol, "nc")
	r.g.Expect(err).NotTo(HaveOccurred())
	r.g.Expect(m.Labels[LabelBackupUID]).To(Equal("another-uid"), "not overwritten")

	r.g.Expect(k8sClient.Delete(context.Background(), r.get("nc"))).To(Succeed())
	r.g.Eventually(func() bool {
		_, _ = rec.Reconcile(context.Background(), ctrl.Request{NamespacedName: client.ObjectKey{Namespace: ns, Name: "nc"}})
		return apierrors.IsNotFound(k8sClient.Get(context.Background(), client.ObjectKey{Namespace: ns, Name: "nc"}, &v1.Backup{}))
	}, timeout, 50*time.Millisecond).Should(BeTrue())
	r.g.Expect(r.listed()).To(Equal([]string{"nc"}), "another Backup's backup is not deleted")
}

// TestBackupFoundOnTarget: a backup this Backup wrote on an earlier
// attempt (its manifest there, the manager gone before it recorded the
// outcome) completes without uploading again, and its status says what
// that attempt read (kept in the manifest), not zero.
func TestBackupFoundOnTarget(t *testing.T) {
	r := newRig(t, "vol-found")
	rec, _ := r.reconciler()
	r.backup("fo", r.target)
	b := r.get("fo")
	data := bytes.Repeat([]byte{0x6b}, 3*mib)
	res, err := r.store().Backup(context.Background(), backupstore.BackupOptions{Volume: r.vol, Name: "fo", Size: 4 * mib,
		Source: bytes.NewReader(append(data, make([]byte, mib)...)), Labels: map[string]string{LabelBackupUID: string(b.UID), LabelBackup: ns + "/fo"}})
	r.g.Expect(err).NotTo(HaveOccurred())
	r.g.Expect(res.ReadBytes).To(BeNumerically(">", 0))
	m, err := r.store().Manifest(context.Background(), r.vol, "fo")
	r.g.Expect(err).NotTo(HaveOccurred())
	r.g.Expect(m.ReadBytes).To(Equal(res.ReadBytes), "the manifest keeps what the backup read")

	b = r.until(rec, "fo", v1.BackupStateCompleted)
	r.g.Expect(b.Status.Attempts).To(Equal(int32(1)))
	r.g.Expect(b.Status.BytesTotal).To(Equal(res.ReadBytes), "what the attempt that wrote it read")
	r.g.Expect(b.Status.BytesDone).To(Equal(res.ReadBytes))
	r.g.Expect(b.Status.UploadedBytes).To(Equal(res.Info.NewBytes))
	m2, err := r.store().Manifest(context.Background(), r.vol, "fo")
	r.g.Expect(err).NotTo(HaveOccurred())
	r.g.Expect(m2.Created).To(Equal(m.Created), "not uploaded again")
}

// TestFullBackups: spec.mode full reads every written block again though
// a parent is there, and a target's maxIncrementalBackups makes the
// backup after that many incremental ones in a row full.
func TestFullBackups(t *testing.T) {
	r := newRig(t, "vol-full")
	rec, _ := r.reconciler()
	bt := &v1.BackupTarget{}
	r.g.Expect(k8sClient.Get(context.Background(), client.ObjectKey{Name: r.target}, bt)).To(Succeed())
	bt.Spec.MaxIncrementalBackups = 1
	r.g.Expect(k8sClient.Update(context.Background(), bt)).To(Succeed())

	r.write(0, 4*mib)
	r.g.Expect(r.until(rec, r.backupNow("f1", ""), v1.BackupStateCompleted).Status.Parent).To(BeEmpty(), "the first backup is full")
	r.write(8*mib, mib)
	f2 := r.until(rec, r.backupNow("f2", ""), v1.BackupStateCompleted)
	r.g.Expect(f2.Status.Parent).To(Equal("f1"), "one incremental backup is allowed")
	r.g.Expect(f2.Status.BytesTotal).To(Equal(int64(2 * mib)))
	r.write(8*mib, mib)
	f3 := r.until(rec, r.backupNow("f3", ""), v1.BackupStateCompleted)
	r.g.Expect(f3.Status.Parent).To(BeEmpty(), "f2 ends a run of 1 incremental backup: f3 is full")
	r.g.Expect(f3.Status.BytesTotal).To(Equal(int64(6*mib)), "a full backup reads every written block")
	r.g.Expect(f3.Status.UploadedBytes).To(BeNumerically(">=", 5*mib), "and uploads every one again (4 MiB random, 1 MiB random in a half-zero block), though the target has most of them")

	r.g.Expect(k8sClient.Get(context.Background(), client.ObjectKey{Name: r.target}, bt)).To(Succeed())
	bt.Spec.MaxIncrementalBackups = 0
	r.g.Expect(k8sClient.Update(context.Background(), bt)).To(Succeed())
	r.write(0, mib)
	f4 := r.until(rec, r.backupNow("f4", ""), v1.BackupStateCompleted)
	r.g.Expect(f4.Status.Parent).To(Equal("f3"), "without a bound, incremental")
	f5 := r.until(rec, r.backupNow("f5", v1.BackupModeFull), v1.BackupStateCompleted)
	r.g.Expect(f5.Status.Parent).To(BeEmpty(), "spec.mode full")
	r.g.Expect(f5.Status.BytesTotal).To(Equal(int64(6 * mib)))
}

// backupNow creates a Backup of the rig's volume to its target, in mode,
// and returns its name.
func (r *rig) backupNow(name string, mode v1.BackupMode) string {
	r.t.Helper()
	b := &v1.Backup{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns}, Spec: v1.BackupSpec{Volume: r.vol, Target: r.target, Mode: mode}}
	r.g.Expect(k8sClient.Create(context.Background(), b)).To(Succeed())
	return name
}

// TestBackupWithCRC32C: a target with spec.s3.checksum CRC32C takes
// backups whose puts carry x-amz-checksum-crc32c (versitygw checks it),
// and they read back whole.
func TestBackupWithCRC32C(t *testing.T) {
	r := newRig(t, "vol-crc")
	rec, _ := r.reconciler()
	bt := &v1.BackupTarget{}
	r.g.Expect(k8sClient.Get(context.Background(), client.ObjectKey{Name: r.target}, bt)).To(Succeed())
	bt.Spec.S3.Checksum = v1.S3ChecksumCRC32C
	r.g.Expect(k8sClient.Update(context.Background(), bt)).To(Succeed())

	r.write(0, 4*mib)
	b := r.until(rec, r.backupNow("c1", ""), v1.BackupStateCompleted)
	r.g.Expect(b.Status.BytesTotal).To(Equal(int64(4 * mib)))
	f, err := os.Create(filepath.Join(t.TempDir(), "restored"))
	r.g.Expect(err).NotTo(HaveOccurred())
	defer f.Close()
	_, err = r.store().Restore(context.Background(), backupstore.RestoreOptions{Volume: r.vol, Name: "c1", Dest: f})
	r.g.Expect(err).NotTo(HaveOccurred(), "every block reads back and matches its SHA-256")
}
