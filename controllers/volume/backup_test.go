package volume

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/dataplane/backupstore"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// TestBackupOfDetachedVolume: a Backup of a volume that no node has
// attached runs the volume's replicas and an engine without a device for
// the upload (the Volume's condition says so), completes, and stops them
// again; the backup restored into a new volume reads what was written
// before the volume was detached.
func TestBackupOfDetachedVolume(t *testing.T) {
	if _, err := exec.LookPath("qemu-io"); err != nil {
		t.Skip("qemu-io is not installed (make test-tools installs it)")
	}
	g := NewWithT(t)
	ctx := context.Background()
	startNodes(t, g, "bd-a", "bd-b")
	f := startBackupTarget(t, g, "bd-target", "")

	vol := &v1.Volume{ObjectMeta: metav1.ObjectMeta{Name: "bd-src", Namespace: "default"}, Spec: v1.VolumeSpec{
		Size: resource.MustParse("16Mi"), NumberOfReplicas: 2, Frontend: v1.FrontendNBD, NodeName: "bd-a"}}
	g.Expect(k8sClient.Create(ctx, vol)).To(Succeed())
	key := client.ObjectKeyFromObject(vol)
	cleanupVolume(t, vol)
	sock := waitAttached(t, g, key).Status.Endpoint
	qemuIO(t, vol.Name, sock, "write -P 0x42 3M 1M", "write -P 0x24 15M 4k", "flush")
	setNode(g, key, "")
	waitDetached(t, g, key)
	g.Eventually(func() bool { return processesStopped(g, vol) }, timeout, 100*time.Millisecond).Should(BeTrue(), "detached: no process runs")

	b := &v1.Backup{ObjectMeta: metav1.ObjectMeta{Name: "bd-b1", Namespace: "default"}, Spec: v1.BackupSpec{Volume: vol.Name, Target: f.target}}
	g.Expect(k8sClient.Create(ctx, b)).To(Succeed())
	t.Cleanup(func() { _ = k8sClient.Delete(context.Background(), b) })
	// The volume says why its processes run while the backup waits for
	// them or uploads.
	g.Eventually(func() string {
		c := getVolume(g, key).Status.Conditions
		for _, c := range c {
			if c.Type == v1.ConditionReady {
				return c.Message
			}
		}
		return ""
	}, timeout, 20*time.Millisecond).Should(ContainSubstring("backup bd-b1"), func() string { return describeKey(key) })
	g.Eventually(func() v1.BackupState {
		g.Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(b), b)).To(Succeed())
		return b.Status.State
	}, timeout, 100*time.Millisecond).Should(Equal(v1.BackupStateCompleted), func() string { return b.Status.Message + "; " + describeKey(key) })
	g.Expect(b.Status.BytesTotal).To(BeNumerically(">=", 1<<20), "the written blocks were read")
	g.Eventually(func() bool {
		return processesStopped(g, vol) && getVolume(g, key).Status.State == v1.VolumeStateDetached
	}, timeout, 100*time.Millisecond).
		Should(BeTrue(), "the processes stop once the backup is done: %s", describeKey(key))

	rkey := restoreVolume(t, g, "bd-restored", "16Mi", "bd-b", v1.VolumeBackupSource{Target: f.target, Volume: vol.Name, Name: b.Status.BackupName}, nil)
	r := waitAttached(t, g, rkey)
	want := make([]byte, 16<<20)
	copy(want[3<<20:4<<20], bytes.Repeat([]byte{0x42}, 1<<20))
	copy(want[15<<20:15<<20+4096], bytes.Repeat([]byte{0x24}, 4096))
	got := readDevice(t, r.Name, r.Status.Endpoint)
	g.Expect(bytes.Equal(got, want)).To(BeTrue(), "restored volume: %s", firstDiff(got, want))
}

// TestRestoresWaitForASlot: with every restore slot of the manager taken,
// restores read their manifest, run their replicas and wait, saying so in
// their status, without writing; once the slots are free they complete,
// and each volume reads the backup.
func TestRestoresWaitForASlot(t *testing.T) {
	if _, err := exec.LookPath("qemu-io"); err != nil {
		t.Skip("qemu-io is not installed (make test-tools installs it)")
	}
	g := NewWithT(t)
	ctx := context.Background()
	startNodes(t, g, "rq-a", "rq-b")
	f := startBackupTarget(t, g, "rq-target", "")
	src := &v1.Volume{ObjectMeta: metav1.ObjectMeta{Name: "rq-src", Namespace: "default"}, Spec: v1.VolumeSpec{
		Size: resource.MustParse("8Mi"), NumberOfReplicas: 2, Frontend: v1.FrontendNBD, NodeName: "rq-a"}}
	g.Expect(k8sClient.Create(ctx, src)).To(Succeed())
	cleanupVolume(t, src)
	sock := waitAttached(t, g, client.ObjectKeyFromObject(src)).Status.Endpoint
	qemuIO(t, src.Name, sock, "write -P 0x6b 1M 1M", "flush")
	createSnapshot(g, "rq-src-s1", src.Name)
	g.Eventually(func() bool { return getSnapshot(g, "rq-src-s1").Status.ReadyToUse }, timeout, 100*time.Millisecond).Should(BeTrue())
	f.backUp(g, src, "rq-src-s1", "rq1", map[string]string{v1.BackupLabelKeyCheck: ""})

	slots := volumeReconciler.restores.slots
	held := 0
	release := func() {
		for ; held > 0; held-- {
			<-slots
		}
	}
	for range cap(slots) {
		slots <- struct{}{}
		held++
	}
	t.Cleanup(release)
	var keys []client.ObjectKey
	for _, name := range []string{"rq-r1", "rq-r2"} {
		keys = append(keys, restoreVolume(t, g, name, "8Mi", "rq-b", v1.VolumeBackupSource{Target: f.target, Volume: src.Name, Name: "rq1"}, nil))
	}
	for _, key := range keys {
		g.Eventually(func() string {
			if c := getVolume(g, key).Status.Clone; c != nil {
				return c.Message
			}
			return ""
		}, timeout, 50*time.Millisecond).Should(ContainSubstring("waiting to restore"), func() string { return describeKey(key) })
		v := getVolume(g, key)
		g.Expect(v.Status.Clone.State).NotTo(Equal(v1.CloneStateCopying), "nothing written while queued")
		g.Expect(v.Status.State).NotTo(Equal(v1.VolumeStateAttached))
	}

	release()
	want := make([]byte, 8<<20)
	copy(want[1<<20:2<<20], bytes.Repeat([]byte{0x6b}, 1<<20))
	for _, key := range keys {
		v := waitAttached(t, g, key)
		got := readDevice(t, v.Name, v.Status.Endpoint)
		g.Expect(bytes.Equal(got, want)).To(BeTrue(), "restored volume %s: %s", v.Name, firstDiff(got, want))
	}
}

// TestBackupSurvivesManagerKill: the cairn-manager process uploading a
// backup is killed (SIGKILL) while the Backup is inProgress. The target
// holds no manifest of it then, unless the upload had already finished;
// a new manager runs it again (or finds its manifest) and reports it
// completed, and the volume restored from it reads what was written.
func TestBackupSurvivesManagerKill(t *testing.T) {
	for _, tool := range []string{"qemu-io", "qemu-img"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("%s is not installed (make test-tools installs it)", tool)
		}
	}
	g := NewWithT(t)
	ctx := context.Background()
	startNodes(t, g, "bk-a", "bk-b")
	f := startBackupTarget(t, g, "bk-target", "")
	const size = 256 << 20
	vol := &v1.Volume{ObjectMeta: metav1.ObjectMeta{Name: "bk-src", Namespace: "default"}, Spec: v1.VolumeSpec{
		Size: resource.MustParse("256Mi"), NumberOfReplicas: 2, Frontend: v1.FrontendNBD, NodeName: "bk-a"}}
	g.Expect(k8sClient.Create(ctx, vol)).To(Succeed())
	key := client.ObjectKeyFromObject(vol)
	cleanupVolume(t, vol)
	sock := waitAttached(t, g, key).Status.Endpoint
	qemuIO(t, vol.Name, sock, "write -P 0x3c 0 96M", "write -P 0xc3 96M 96M", "flush")
	want := make([]byte, size)
	copy(want[:96<<20], bytes.Repeat([]byte{0x3c}, 96<<20))
	copy(want[96<<20:192<<20], bytes.Repeat([]byte{0xc3}, 96<<20))

	// The in-process manager gives way to a cairn-manager process.
	testEnv.StopManager()
	restarted := false
	defer func() {
		if !restarted {
			g.Expect(testEnv.StartManager()).To(Succeed())
		}
	}()
	bin := managerBinary(t)
	kubeconfig := filepath.Join(t.TempDir(), "kubeconfig")
	kc, err := testEnv.KubeConfig()
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(os.WriteFile(kubeconfig, kc, 0o600)).To(Succeed())
	cmd := exec.Command(bin, "--kubeconfig", kubeconfig, "--discover-instance-managers=false", "--namespace", "default",
		"--instance-manager-tls=false", "--metrics-bind-address", "0", "--health-probe-bind-address", "0")
	var logs lockedBuffer
	cmd.Stdout, cmd.Stderr = io.Discard, &logs
	g.Expect(cmd.Start()).To(Succeed())
	killed := false
	defer func() {
		if !killed {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	}()

	b := &v1.Backup{ObjectMeta: metav1.ObjectMeta{Name: "bk-1", Namespace: "default"}, Spec: v1.BackupSpec{Volume: vol.Name, Target: f.target}}
	g.Expect(k8sClient.Create(ctx, b)).To(Succeed())
	t.Cleanup(func() { _ = k8sClient.Delete(context.Background(), b) })
	g.Eventually(func() v1.BackupState {
		g.Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(b), b)).To(Succeed())
		return b.Status.State
	}, deadline.Scale(3*time.Minute), 10*time.Millisecond).Should(Equal(v1.BackupStateInProgress), func() string {
		return b.Status.Message + "\ncairn-manager's log, last lines:\n" + logs.tail(4000)
	})
	g.Expect(cmd.Process.Signal(syscall.SIGKILL)).To(Succeed())
	_ = cmd.Wait()
	killed = true
	_, err = f.store.Manifest(ctx, vol.Name, b.Name)
	finished := err == nil
	if !finished {
		g.Expect(errors.Is(err, backupstore.ErrBackupNotFound)).To(BeTrue(), "%v", err)
	}
	t.Logf("killed while inProgress; the upload had finished: %v", finished)

	g.Expect(testEnv.StartManager()).To(Succeed())
	restarted = true
	g.Eventually(func() v1.BackupState {
		g.Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(b), b)).To(Succeed())
		return b.Status.State
	}, timeout, 100*time.Millisecond).Should(Equal(v1.BackupStateCompleted), func() string { return b.Status.Message })
	if !finished {
		g.Expect(b.Status.Attempts).To(BeNumerically(">=", 2), "the killed upload was run again")
	}
	rkey := restoreVolume(t, g, "bk-restored", "256Mi", "bk-b", v1.VolumeBackupSource{Target: f.target, Volume: vol.Name, Name: b.Status.BackupName}, nil)
	r := waitAttached(t, g, rkey)
	got := readDevice(t, r.Name, r.Status.Endpoint)
	g.Expect(bytes.Equal(got, want)).To(BeTrue(), "restored volume: %s", firstDiff(got, want))
}

// lockedBuffer collects a process's output for a failure message.
type lockedBuffer struct {
	mu sync.Mutex
	b  []byte
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.b = append(l.b, p...)
	return len(p), nil
}

// tail is the last n bytes written.
func (l *lockedBuffer) tail(n int) string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return string(l.b[max(0, len(l.b)-n):])
}
