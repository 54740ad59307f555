package volume

import (
	"context"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/internal/volumes"
	replicav1 "github.com/cairn-io/cairn/dataplane/api/replica/v1"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// replicaSnapshots asks every running replica process of vol for its
// snapshots, by Replica name; it fails the test unless every replica of
// the volume runs.
func replicaSnapshots(t *testing.T, g *WithT, vol *v1.Volume) map[string][]string {
	t.Helper()
	out := map[string][]string{}
	for _, r := range listReplicas(g, vol) {
		g.Expect(r.Status.InstanceState).To(Equal(v1.InstanceStateRunning), "replica %s", r.Name)
		cc, err := grpc.NewClient(r.Status.ControlAddress, grpc.WithTransportCredentials(insecure.NewCredentials()))
		g.Expect(err).NotTo(HaveOccurred())
		ctx, cancel := context.WithTimeout(context.Background(), deadline.Scale(10*time.Second))
		list, err := replicav1.NewReplicaServiceClient(cc).SnapshotList(ctx, &replicav1.SnapshotListRequest{})
		cancel()
		cc.Close()
		g.Expect(err).NotTo(HaveOccurred(), "snapshot list of replica %s", r.Name)
		names := []string{}
		for _, s := range list.GetSnapshots() {
			names = append(names, s.GetName())
		}
		out[r.Name] = names
	}
	return out
}

// everyReplicaHas reports whether every replica lists (has) or lacks
// (!has) snapshot name.
func everyReplicaHas(snaps map[string][]string, name string, has bool) bool {
	for _, names := range snaps {
		if slices.Contains(names, name) != has {
			return false
		}
	}
	return len(snaps) > 0
}

func getSnapshot(g *WithT, name string) *v1.Snapshot {
	s := &v1.Snapshot{}
	g.Expect(k8sClient.Get(context.Background(), client.ObjectKey{Namespace: "default", Name: name}, s)).To(Succeed())
	return s
}

func createSnapshot(g *WithT, name, vol string) {
	g.Expect(k8sClient.Create(context.Background(), &v1.Snapshot{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default"},
		Spec: v1.SnapshotSpec{Volume: vol}})).To(Succeed())
}

func snapshotGone(name string) func() bool {
	return func() bool {
		err := k8sClient.Get(context.Background(), client.ObjectKey{Namespace: "default", Name: name}, &v1.Snapshot{})
		return apierrors.IsNotFound(err)
	}
}

// waitAttached waits for the volume to be attached, checking at every
// look that a volume with a data source is never attached before its
// Cloned condition is True.
func waitAttached(t *testing.T, g *WithT, key client.ObjectKey) *v1.Volume {
	t.Helper()
	var v *v1.Volume
	ok := poll(func() bool {
		v = getVolume(g, key)
		if v.Status.State == v1.VolumeStateAttached && v.Spec.DataSource != nil {
			g.Expect(meta.IsStatusConditionTrue(v.Status.Conditions, v1.VolumeConditionCloned)).To(BeTrue(),
				"volume %s attached before its clone completed: %+v", key.Name, v.Status)
		}
		return v.Status.State == v1.VolumeStateAttached
	})
	if !ok {
		t.Fatalf("volume %s not attached: %s", key.Name, describeKey(key))
	}
	return v
}

// processesStopped reports whether the volume's engine and every one of
// its replicas read stopped.
func processesStopped(g *WithT, vol *v1.Volume) bool {
	e := &v1.Engine{}
	g.Expect(k8sClient.Get(context.Background(), client.ObjectKey{Namespace: vol.Namespace, Name: EngineName(vol)}, e)).To(Succeed())
	if e.Status.InstanceState != v1.InstanceStateStopped {
		return false
	}
	for _, r := range listReplicas(g, vol) {
		if r.Status.InstanceState != v1.InstanceStateStopped {
			return false
		}
	}
	return true
}

func describeKey(key client.ObjectKey) string {
	v := &v1.Volume{}
	if err := k8sClient.Get(context.Background(), key, v); err != nil {
		return err.Error()
	}
	return describe(context.Background(), v)
}

// cleanupVolume deletes v when the test ends and waits until it is gone
// (its processes and data with it), so a test run again (-count) can
// use its names.
func cleanupVolume(t *testing.T, v *v1.Volume) {
	t.Cleanup(func() {
		ctx := context.Background()
		_ = k8sClient.Delete(ctx, v)
		if !poll(func() bool {
			return apierrors.IsNotFound(k8sClient.Get(ctx, client.ObjectKeyFromObject(v), &v1.Volume{}))
		}) {
			t.Errorf("volume %s not deleted: %s", v.Name, describeKey(client.ObjectKeyFromObject(v)))
		}
	})
}

// waitDetached waits until the volume reads detached.
func waitDetached(t *testing.T, g *WithT, key client.ObjectKey) {
	t.Helper()
	if !poll(func() bool { return getVolume(g, key).Status.State == v1.VolumeStateDetached }) {
		t.Fatalf("volume %s not %s: %s", key.Name, v1.VolumeStateDetached, describeKey(key))
	}
}

// TestSnapshots: a Snapshot of an attached volume and one of a detached
// volume both become ready and exist on every replica; deleting them,
// attached and detached, removes them from every replica. A detached
// volume's processes run only while the work is pending, and it reads
// detached meanwhile.
func TestSnapshots(t *testing.T) {
	if _, err := exec.LookPath("qemu-io"); err != nil {
		t.Skip("qemu-io is not installed (make test-tools installs it)")
	}
	g := NewWithT(t)
	ctx := context.Background()
	startNodes(t, g, "sn-a", "sn-b", "sn-c")
	vol := &v1.Volume{ObjectMeta: metav1.ObjectMeta{Name: "snapped", Namespace: "default"}, Spec: v1.VolumeSpec{
		Size: resource.MustParse("16Mi"), NumberOfReplicas: 3, Frontend: v1.FrontendNBD}}
	g.Expect(k8sClient.Create(ctx, vol)).To(Succeed())
	key := client.ObjectKeyFromObject(vol)
	cleanupVolume(t, vol)
	waitDetached(t, g, key)

	// Attached.
	setNode(g, key, "sn-a")
	sock := waitAttached(t, g, key).Status.Endpoint
	qemuIO(t, vol.Name, sock, "write -P 0x11 0 1M", "flush")
	createSnapshot(g, "snap-att", vol.Name)
	g.Eventually(func() bool { return getSnapshot(g, "snap-att").Status.ReadyToUse }, timeout, 100*time.Millisecond).Should(BeTrue())
	s := getSnapshot(g, "snap-att")
	g.Expect(s.Status.CreationTime).NotTo(BeNil())
	g.Expect(s.Status.Size.Value()).To(Equal(int64(16 << 20)))
	g.Expect(meta.IsStatusConditionTrue(s.Status.Conditions, v1.SnapshotConditionReady)).To(BeTrue())
	g.Expect(s.Labels[LabelVolume]).To(Equal(vol.Name))
	g.Expect(everyReplicaHas(replicaSnapshots(t, g, vol), "snap-att", true)).To(BeTrue(), "%v", replicaSnapshots(t, g, vol))

	// Detached: the snapshot is taken by a maintenance engine, and the
	// processes stop again once it is.
	setNode(g, key, "")
	waitDetached(t, g, key)
	createSnapshot(g, "snap-det", vol.Name)
	g.Eventually(func() bool { return getSnapshot(g, "snap-det").Status.ReadyToUse }, timeout, 100*time.Millisecond).Should(BeTrue(),
		func() string { return describeKey(key) })
	g.Eventually(func() bool {
		return processesStopped(g, vol) && getVolume(g, key).Status.State == v1.VolumeStateDetached
	}, timeout, 100*time.Millisecond).Should(BeTrue(), "the maintenance processes stop once the snapshot is taken")

	// Deleted while detached: gone from every replica.
	g.Expect(k8sClient.Delete(ctx, getSnapshot(g, "snap-det"))).To(Succeed())
	g.Eventually(snapshotGone("snap-det"), timeout, 100*time.Millisecond).Should(BeTrue(), func() string { return describeKey(key) })

	// Attached again: snap-det was on every replica and is gone from
	// every one; snap-att is still there; the data is intact.
	setNode(g, key, "sn-b")
	sock = waitAttached(t, g, key).Status.Endpoint
	snaps := replicaSnapshots(t, g, vol)
	g.Expect(everyReplicaHas(snaps, "snap-att", true)).To(BeTrue(), "%v", snaps)
	g.Expect(everyReplicaHas(snaps, "snap-det", false)).To(BeTrue(), "%v", snaps)
	qemuIO(t, vol.Name, sock, "read -P 0x11 0 1M")

	// Deleted while attached: gone from every replica.
	g.Expect(k8sClient.Delete(ctx, getSnapshot(g, "snap-att"))).To(Succeed())
	g.Eventually(snapshotGone("snap-att"), timeout, 100*time.Millisecond).Should(BeTrue())
	snaps = replicaSnapshots(t, g, vol)
	g.Expect(everyReplicaHas(snaps, "snap-att", false)).To(BeTrue(), "%v", snaps)

	// A snapshot of a volume that does not exist says so.
	createSnapshot(g, "snap-orphan", "no-such-volume")
	g.Eventually(func() string {
		c := meta.FindStatusCondition(getSnapshot(g, "snap-orphan").Status.Conditions, v1.SnapshotConditionReady)
		if c == nil {
			return ""
		}
		return c.Reason
	}, timeout, 100*time.Millisecond).Should(Equal(v1.SnapshotReasonVolumeNotFound))
	g.Expect(k8sClient.Delete(ctx, getSnapshot(g, "snap-orphan"))).To(Succeed())
	g.Eventually(snapshotGone("snap-orphan"), timeout, 100*time.Millisecond).Should(BeTrue())

	// A volume deleted with a Snapshot: both go (no garbage collector here).
	createSnapshot(g, "snap-last", vol.Name)
	g.Eventually(func() bool { return getSnapshot(g, "snap-last").Status.ReadyToUse }, timeout, 100*time.Millisecond).Should(BeTrue())
	g.Expect(k8sClient.Delete(ctx, vol)).To(Succeed())
	g.Eventually(snapshotGone("snap-last"), timeout, 100*time.Millisecond).Should(BeTrue())
	g.Eventually(func() bool { return apierrors.IsNotFound(k8sClient.Get(ctx, key, &v1.Volume{})) }, timeout, 100*time.Millisecond).Should(BeTrue())
}

// clonedCondition returns the volume's Cloned condition's reason and
// message.
func clonedCondition(g *WithT, key client.ObjectKey) (string, string) {
	c := meta.FindStatusCondition(getVolume(g, key).Status.Conditions, v1.VolumeConditionCloned)
	if c == nil {
		return "", ""
	}
	return c.Reason, c.Message
}

// TestClones: pattern A written, snapshot, pattern B written; a clone of
// the snapshot, attached as soon as it is created, becomes attached only
// once its copy is verified, and reads A. A clone of the whole (detached)
// volume reads B over A; the snapshot it took of the source is deleted
// after the copy, and the source goes back to rest. Clones of a missing
// volume or snapshot fail with the cause.
func TestClones(t *testing.T) {
	if _, err := exec.LookPath("qemu-io"); err != nil {
		t.Skip("qemu-io is not installed (make test-tools installs it)")
	}
	g := NewWithT(t)
	ctx := context.Background()
	startNodes(t, g, "cl-a", "cl-b", "cl-c")
	var encryption *v1.VolumeEncryption // of the next volume mkSized makes
	mkSized := func(name, size string, ds *v1.VolumeDataSource, node string) *v1.Volume {
		v := &v1.Volume{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default"}, Spec: v1.VolumeSpec{
			Size: resource.MustParse(size), NumberOfReplicas: 2, Frontend: v1.FrontendNBD, DataSource: ds, NodeName: node,
			Encryption: encryption}}
		g.Expect(k8sClient.Create(ctx, v)).To(Succeed())
		cleanupVolume(t, v)
		return v
	}
	mk := func(name string, ds *v1.VolumeDataSource, node string) *v1.Volume {
		return mkSized(name, "16Mi", ds, node)
	}
	src := mk("origin", nil, "cl-a")
	skey := client.ObjectKeyFromObject(src)
	sock := waitAttached(t, g, skey).Status.Endpoint
	qemuIO(t, src.Name, sock, "write -P 0x11 0 2M", "write -P 0x33 12M 64k", "flush")
	createSnapshot(g, "origin-s1", src.Name)
	g.Eventually(func() bool { return getSnapshot(g, "origin-s1").Status.ReadyToUse }, timeout, 100*time.Millisecond).Should(BeTrue())
	qemuIO(t, src.Name, sock, "write -P 0x22 0 1M", "flush")

	// From the snapshot, attached at once on another node.
	c1 := mk("from-snap", &v1.VolumeDataSource{Volume: src.Name, Snapshot: "origin-s1"}, "cl-b")
	c1key := client.ObjectKeyFromObject(c1)
	v := waitAttached(t, g, c1key)
	g.Expect(v.Status.Clone).NotTo(BeNil())
	g.Expect(v.Status.Clone.State).To(Equal(v1.CloneStateCompleted))
	g.Expect(v.Status.Clone.Progress).To(Equal(int32(100)))
	g.Expect(v.Status.Clone.SourceVolume).To(Equal(src.Name))
	reason, _ := clonedCondition(g, c1key)
	g.Expect(reason).To(Equal(v1.VolumeReasonCloneCompleted))
	g.Expect(v.Annotations).To(HaveKeyWithValue("storage.cairn.io/cloned", "origin/origin-s1"))
	ce := &v1.Engine{}
	g.Expect(k8sClient.Get(ctx, client.ObjectKey{Namespace: "default", Name: EngineName(c1)}, ce)).To(Succeed())
	g.Expect(ce.Spec.Maintenance).To(BeFalse(), "the user's engine has a device")
	g.Expect(ce.Spec.CloneFrom).To(BeNil(), "the user's engine never copies")
	qemuIO(t, c1.Name, v.Status.Endpoint, "read -P 0x11 0 2M", "read -P 0x33 12M 64k", "read -P 0 2M 10M")
	// Written by its user, detached and attached again: never copied
	// again over the user's data.
	qemuIO(t, c1.Name, v.Status.Endpoint, "write -P 0x44 0 1M", "flush")
	setNode(g, c1key, "")
	waitDetached(t, g, c1key)
	setNode(g, c1key, "cl-c")
	v = waitAttached(t, g, c1key)
	qemuIO(t, c1.Name, v.Status.Endpoint, "read -P 0x44 0 1M", "read -P 0x11 1M 1M")

	// The whole source volume, detached.
	setNode(g, skey, "")
	waitDetached(t, g, skey)
	c2 := mk("from-volume", &v1.VolumeDataSource{Volume: src.Name}, "cl-c")
	c2key := client.ObjectKeyFromObject(c2)
	// A snapshot of the clone asked for at once is taken only once the
	// clone is filled.
	createSnapshot(g, "from-volume-s", c2.Name)
	g.Eventually(func() bool { return getSnapshot(g, "from-volume-s").Status.ReadyToUse }, timeout, 100*time.Millisecond).Should(BeTrue())
	// The copy's completion is recorded first in the Volume's annotation
	// (the Cloned condition follows in the same reconcile's status
	// patch, which may land after the snapshot is taken).
	g.Expect(volumes.Cloned(getVolume(g, c2key))).To(BeTrue(), "a snapshot of a clone is taken after the copy")
	v = waitAttached(t, g, c2key)
	g.Expect(v.Status.Clone.Snapshot).To(Equal(CloneSnapshotName(c2)))
	qemuIO(t, c2.Name, v.Status.Endpoint, "read -P 0x22 0 1M", "read -P 0x11 1M 1M", "read -P 0x33 12M 64k")
	g.Eventually(snapshotGone(CloneSnapshotName(c2)), timeout, 100*time.Millisecond).Should(BeTrue(), "the snapshot taken for the clone is deleted after the copy")
	waitDetached(t, g, skey)
	g.Eventually(func() bool {
		for _, r := range listReplicas(g, src) {
			if r.Status.InstanceState != v1.InstanceStateStopped {
				return false
			}
		}
		return true
	}, timeout, 100*time.Millisecond).Should(BeTrue(), "the source's processes stop once nothing reads it")

	// Missing or unfit sources fail with the cause, and never attach.
	for _, tc := range []struct {
		name, size string
		ds         v1.VolumeDataSource
		enc        *v1.VolumeEncryption
		msg        string
	}{
		{"no-source", "16Mi", v1.VolumeDataSource{Volume: "does-not-exist"}, nil, "source volume does-not-exist does not exist"},
		{"no-snapshot", "16Mi", v1.VolumeDataSource{Volume: src.Name, Snapshot: "nope"}, nil, "snapshot nope does not exist"},
		{"too-small", "8Mi", v1.VolumeDataSource{Volume: src.Name, Snapshot: "origin-s1"}, nil, "with a size of at least 16Mi"},
		{"encrypted-from-plain", "16Mi", v1.VolumeDataSource{Volume: src.Name, Snapshot: "origin-s1"},
			&v1.VolumeEncryption{KeySecret: "k", KeyCheck: strings.Repeat("ab", 16)}, "not encrypted with the same key"},
	} {
		encryption = tc.enc
		c := mkSized(tc.name, tc.size, &tc.ds, "cl-a")
		encryption = nil
		ckey := client.ObjectKeyFromObject(c)
		g.Eventually(func() string { r, _ := clonedCondition(g, ckey); return r }, timeout, 100*time.Millisecond).Should(Equal(v1.VolumeReasonCloneFailed))
		_, msg := clonedCondition(g, ckey)
		g.Expect(msg).To(ContainSubstring(tc.msg))
		vv := getVolume(g, ckey)
		g.Expect(vv.Status.State).NotTo(Equal(v1.VolumeStateAttached))
		g.Expect(vv.Status.Clone.State).To(Equal(v1.CloneStateFailed))
	}
	// A clone that cannot copy does not keep its source running.
	g.Consistently(func() v1.DesiredInstanceState {
		e := &v1.Engine{}
		g.Expect(k8sClient.Get(ctx, client.ObjectKey{Namespace: "default", Name: EngineName(src)}, e)).To(Succeed())
		return e.Spec.DesiredState
	}, 2*time.Second, 100*time.Millisecond).Should(Equal(v1.DesiredInstanceStateStopped))
}

// TestSnapshotAndCloneAcrossManagerRestart stops the manager inside a
// snapshot of a detached volume (as soon as its reconciler has seen it)
// and inside a clone's copy (as soon as the clone reports a state), and
// starts a new one: the snapshot is taken once and is on every replica,
// the clone completes, attaches and reads the snapshot's data. The
// snapshot, deleted as soon as the clone was created, goes only after
// the copy, from every replica.
func TestSnapshotAndCloneAcrossManagerRestart(t *testing.T) {
	if _, err := exec.LookPath("qemu-io"); err != nil {
		t.Skip("qemu-io is not installed (make test-tools installs it)")
	}
	g := NewWithT(t)
	ctx := context.Background()
	startNodes(t, g, "rs-a", "rs-b")
	mk := func(name string, ds *v1.VolumeDataSource, node string) *v1.Volume {
		v := &v1.Volume{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default"}, Spec: v1.VolumeSpec{
			Size: resource.MustParse("128Mi"), NumberOfReplicas: 2, Frontend: v1.FrontendNBD, DataSource: ds, NodeName: node}}
		g.Expect(k8sClient.Create(ctx, v)).To(Succeed())
		cleanupVolume(t, v)
		return v
	}
	restartWhen := func(what string, cond func() bool) {
		t.Helper()
		if !poll(cond) {
			t.Fatalf("never saw %s", what)
		}
		testEnv.StopManager()
		g.Expect(testEnv.StartManager()).To(Succeed())
	}
	src := mk("rs-origin", nil, "rs-a")
	skey := client.ObjectKeyFromObject(src)
	sock := waitAttached(t, g, skey).Status.Endpoint
	qemuIO(t, src.Name, sock, "write -P 0x5a 0 64M", "flush")
	setNode(g, skey, "")
	waitDetached(t, g, skey)

	createSnapshot(g, "rs-snap", src.Name)
	restartWhen("the snapshot labelled", func() bool { return getSnapshot(g, "rs-snap").Labels[LabelVolume] != "" })
	g.Eventually(func() bool { return getSnapshot(g, "rs-snap").Status.ReadyToUse }, timeout, 100*time.Millisecond).Should(BeTrue(),
		func() string { return describeKey(skey) })

	// The source attached: the snapshot is on both replicas, once.
	setNode(g, skey, "rs-a")
	waitAttached(t, g, skey)
	for name, snaps := range replicaSnapshots(t, g, src) {
		n := 0
		for _, s := range snaps {
			if s == "rs-snap" {
				n++
			}
		}
		g.Expect(n).To(Equal(1), "replica %s: %v", name, snaps)
	}

	// A clone of it, and the snapshot deleted at once: the deletion waits
	// for the copy, which completes across a restart.
	c := mk("rs-clone", &v1.VolumeDataSource{Volume: src.Name, Snapshot: "rs-snap"}, "rs-b")
	ckey := client.ObjectKeyFromObject(c)
	g.Expect(k8sClient.Delete(ctx, getSnapshot(g, "rs-snap"))).To(Succeed())
	restartWhen("the clone's state", func() bool { return getVolume(g, ckey).Status.Clone != nil })
	v := waitAttached(t, g, ckey)
	qemuIO(t, c.Name, v.Status.Endpoint, "read -P 0x5a 0 64M", "read -P 0 64M 64M")
	g.Eventually(snapshotGone("rs-snap"), timeout, 100*time.Millisecond).Should(BeTrue())
	g.Expect(everyReplicaHas(replicaSnapshots(t, g, src), "rs-snap", false)).To(BeTrue())
}
