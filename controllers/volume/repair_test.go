package volume

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	eventsv1 "k8s.io/api/events/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/internal/imtest"
	"github.com/cairn-io/cairn/controllers/replica"
)

// qemuIO runs qemu-io commands against the volume's NBD socket and fails
// on any error or pattern mismatch.
func qemuIO(t *testing.T, vol, sock string, cmds ...string) {
	t.Helper()
	args := []string{"-f", "raw"}
	for _, c := range cmds {
		args = append(args, "-c", c)
	}
	out, err := exec.Command("qemu-io", append(args, "nbd+unix:///"+vol+"?socket="+sock)...).CombinedOutput()
	if err != nil || bytes.Contains(out, []byte("Pattern verification failed")) || bytes.Contains(out, []byte("error")) {
		t.Fatalf("qemu-io %v: %v\n%s", cmds, err, out)
	}
}

// replicaPID finds the replica process serving dataDir.
func replicaPID(t *testing.T, dataDir string) int {
	t.Helper()
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		var pid int
		if _, err := fmt.Sscanf(e.Name(), "%d", &pid); err != nil {
			continue
		}
		cmd, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err == nil && bytes.Contains(cmd, []byte("\x00replica\x00")) && bytes.Contains(cmd, []byte("\x00--dir\x00"+dataDir+"\x00")) {
			return pid
		}
	}
	t.Fatalf("no replica process serves %s", dataDir)
	return 0
}

// waitPlaced waits until a new volume is detached with every replica
// placed. Detached alone does not say so: the manager's cache may not show
// a node's disk yet when the volume is first reconciled (startNodes reads
// the StorageNodes from the API server), and an unplaced replica is placed
// only when the cache does.
func waitPlaced(g *WithT, key client.ObjectKey) {
	g.Eventually(func() v1.VolumeState { return getVolume(g, key).Status.State }, timeout, 100*time.Millisecond).Should(Equal(v1.VolumeStateDetached))
	g.Eventually(func() bool {
		return meta.IsStatusConditionTrue(getVolume(g, key).Status.Conditions, v1.VolumeConditionScheduled)
	}, timeout, 100*time.Millisecond).Should(BeTrue(), "every replica of %s placed", key.Name)
}

// TestVolumeRepair: on four simulated nodes a volume with three replicas
// is attached and written to with qemu-io. A replica process killed with
// SIGKILL makes the volume degraded; it is restarted, given back to the
// engine, resyncs only the regions written meanwhile, and the volume is
// healthy again. Then a whole instance manager is killed for longer than
// the replenishment wait: a replacement replica is placed on the spare
// node and rebuilt in full, the volume is healthy, and the failed replica
// is deleted with its data once its node is back. Every byte written is
// read back, also after moving the volume to another node.
func TestVolumeRepair(t *testing.T) {
	if _, err := exec.LookPath("qemu-io"); err != nil {
		t.Skip("qemu-io is not installed (make test-tools installs it)")
	}
	g := NewWithT(t)
	ctx := context.Background()
	names := []string{"rp-a", "rp-b", "rp-c", "rp-d"}
	dirs, ims := startNodes(t, g, names...)
	const size = 64 << 20
	vol := &v1.Volume{ObjectMeta: metav1.ObjectMeta{Name: "repair", Namespace: "default"}, Spec: v1.VolumeSpec{
		Size: *resource.NewQuantity(size, resource.BinarySI), NumberOfReplicas: 3, Frontend: v1.FrontendNBD}}
	g.Expect(k8sClient.Create(ctx, vol)).To(Succeed())
	get := func() *v1.Volume { return getVolume(g, client.ObjectKeyFromObject(vol)) }
	engine := func() *v1.Engine { return getEngine(g, vol) }
	replicas := func() map[string]v1.Replica {
		out := map[string]v1.Replica{}
		for _, r := range listReplicas(g, vol) {
			out[r.Name] = r
		}
		return out
	}
	robustness := func() v1.VolumeRobustness { return get().Status.Robustness }
	waitPlaced(g, client.ObjectKeyFromObject(vol))

	// Attach on a node that holds a replica; the spare node holds none.
	// The Scheduled condition can be read before every replica read here
	// shows its node: wait for three replicas on three of the nodes.
	onNode := map[string]string{}
	g.Eventually(func() map[string]string {
		onNode = map[string]string{}
		for name, r := range replicas() {
			if slices.Contains(names, r.Spec.NodeName) {
				onNode[r.Spec.NodeName] = name
			}
		}
		return onNode
	}, timeout, 100*time.Millisecond).Should(HaveLen(3), "three replicas on three nodes")
	var spare, attachTo string
	var others []string
	for _, n := range names {
		switch {
		case onNode[n] == "":
			spare = n
		case attachTo == "":
			attachTo = n
		default:
			others = append(others, n)
		}
	}
	setNode(g, client.ObjectKeyFromObject(vol), attachTo)
	g.Eventually(func() v1.VolumeState { return get().Status.State }, timeout, 100*time.Millisecond).Should(Equal(v1.VolumeStateAttached))
	g.Eventually(robustness, timeout, 100*time.Millisecond).Should(Equal(v1.VolumeRobustnessHealthy))
	sock := get().Status.Endpoint
	qemuIO(t, vol.Name, sock, "write -P 0x11 0 4M", "flush")

	// 1. A replica process killed: degraded, then the same replica back
	// with a delta resync.
	victim := onNode[others[0]]
	vrep := replicas()[victim]
	g.Expect(syscall.Kill(replicaPID(t, replica.DataDir(&vrep)), syscall.SIGKILL)).To(Succeed())
	g.Eventually(func() v1.ReplicaMode { return engine().Status.ReplicaModeMap[victim] }, timeout, 20*time.Millisecond).ShouldNot(Equal(v1.ReplicaModeRW))
	qemuIO(t, vol.Name, sock, "write -P 0x22 8M 2M", "flush")
	g.Eventually(func() *metav1.Time { r := replicas()[victim]; return r.Spec.FailedAt }, timeout, 50*time.Millisecond).ShouldNot(BeNil(),
		"the killed replica is marked failed")
	g.Eventually(robustness, timeout, 100*time.Millisecond).Should(Equal(v1.VolumeRobustnessHealthy))
	// The engine makes a rebuilt replica RW, then marks its rebuild
	// complete: a status sampled in between shows both.
	var rb v1.RebuildStatus
	g.Eventually(func() v1.RebuildState { rb = engine().Status.RebuildStatus[victim]; return rb.State }, timeout, 50*time.Millisecond).Should(Equal(v1.RebuildStateComplete))
	g.Expect(rb.DirtyOnly).To(BeTrue(), "the returning replica resyncs only what it missed: %+v", rb)
	g.Expect(rb.BytesTotal).To(BeNumerically("<", size/4), "a delta resync copies the regions written while it was away, not the volume")
	t.Logf("returning replica %s: %s rebuild of %d bytes from %s", victim, rb.State, rb.BytesTotal, rb.SourceReplica)
	// The Volume reconciler clears failedAt when it sees the completed
	// rebuild, which may be after this read of the engine.
	g.Eventually(func() *metav1.Time { r := replicas()[victim]; return r.Spec.FailedAt }, timeout, 50*time.Millisecond).Should(BeNil(),
		"a replica RW again is no longer failed")
	g.Expect(replicas()).To(HaveLen(3), "no replacement for a replica that came back in time")
	qemuIO(t, vol.Name, sock, "read -P 0x11 0 4M", "read -P 0x22 8M 2M")

	// 2. A whole instance manager killed for longer than the wait: a
	// replacement on the spare node, rebuilt in full.
	downNode := others[1]
	lost := onNode[downNode]
	ims[downNode].Kill()
	qemuIO(t, vol.Name, sock, "write -P 0x33 16M 4M", "flush")
	g.Eventually(robustness, timeout, 100*time.Millisecond).Should(Equal(v1.VolumeRobustnessDegraded))
	start := time.Now()
	var replacement string
	g.Eventually(func() string {
		for name, r := range replicas() {
			if name != lost && r.Spec.NodeName == spare {
				replacement = name
			}
		}
		return replacement
	}, timeout+replenishmentWait, 100*time.Millisecond).ShouldNot(BeEmpty(), "a replacement replica is placed on the spare node")
	g.Expect(time.Since(start)).To(BeNumerically(">", replenishmentWait/2), "no replacement before the replenishment wait")
	g.Eventually(func() v1.ReplicaMode { return engine().Status.ReplicaModeMap[replacement] }, timeout, 100*time.Millisecond).Should(Equal(v1.ReplicaModeRW))
	g.Eventually(robustness, timeout, 100*time.Millisecond).Should(Equal(v1.VolumeRobustnessHealthy))
	g.Eventually(func() v1.RebuildState { rb = engine().Status.RebuildStatus[replacement]; return rb.State }, timeout, 50*time.Millisecond).Should(Equal(v1.RebuildStateComplete))
	g.Expect(rb.DirtyOnly).To(BeFalse())
	t.Logf("replacement %s on %s: %s rebuild of %d bytes from %s, %s after the instance manager died", replacement, spare, rb.State, rb.BytesTotal, rb.SourceReplica, time.Since(start).Round(time.Millisecond))
	g.Eventually(func() bool { return meta.IsStatusConditionTrue(get().Status.Conditions, v1.VolumeConditionRebuilding) }, timeout, 50*time.Millisecond).Should(BeFalse())
	qemuIO(t, vol.Name, sock, "read -P 0x11 0 4M", "read -P 0x22 8M 2M", "read -P 0x33 16M 4M", "read -P 0 4M 4M")
	// The lost replica is being deleted; its data goes once its node's
	// instance manager is back.
	g.Eventually(func() bool { r, ok := replicas()[lost]; return ok && !r.DeletionTimestamp.IsZero() }, timeout, 100*time.Millisecond).Should(BeTrue())
	lostDir := filepath.Join(dirs[downNode], lost)
	g.Expect(lostDir).To(BeADirectory())
	ims[downNode] = imtest.Start(t, downNode, ims[downNode].Addr, dirs[downNode])
	g.Eventually(func() bool { _, ok := replicas()[lost]; return ok }, timeout, 100*time.Millisecond).Should(BeFalse())
	_, err := os.Stat(lostDir)
	g.Expect(os.IsNotExist(err)).To(BeTrue(), "the failed replica's data is deleted: %v", err)

	// What happened is in the volume's events.
	var evs eventsv1.EventList
	g.Expect(k8sClient.List(ctx, &evs, client.InNamespace("default"))).To(Succeed())
	reasons := map[string]int{}
	for _, ev := range evs.Items {
		if ev.Regarding.Name == vol.Name && ev.Regarding.Kind == "Volume" {
			reasons[ev.Reason]++
		}
	}
	for _, r := range []string{EventAttached, EventReplicaFailed, EventReplicaHealthy, EventReplicaReplaced, EventReplicaDeleted, "RobustnessDegraded", "RobustnessHealthy"} {
		g.Expect(reasons).To(HaveKey(r), "events of the volume: %v", reasons)
	}

	// Moved to another node, the data reads back from the new replica set.
	setNode(g, client.ObjectKeyFromObject(vol), "")
	g.Eventually(func() v1.VolumeState { return get().Status.State }, timeout, 100*time.Millisecond).Should(Equal(v1.VolumeStateDetached))
	setNode(g, client.ObjectKeyFromObject(vol), spare)
	g.Eventually(func() v1.VolumeState { return get().Status.State }, timeout, 100*time.Millisecond).Should(Equal(v1.VolumeStateAttached))
	g.Eventually(robustness, timeout, 100*time.Millisecond).Should(Equal(v1.VolumeRobustnessHealthy))
	qemuIO(t, vol.Name, get().Status.Endpoint, "read -P 0x11 0 4M", "read -P 0x22 8M 2M", "read -P 0x33 16M 4M")

	g.Expect(k8sClient.Delete(ctx, get())).To(Succeed())
	g.Eventually(func() bool {
		return apierrors.IsNotFound(k8sClient.Get(ctx, client.ObjectKeyFromObject(vol), &v1.Volume{}))
	}, timeout, 100*time.Millisecond).Should(BeTrue())
	for _, n := range names {
		ents, _ := os.ReadDir(dirs[n])
		for _, e := range ents {
			g.Expect(strings.HasPrefix(e.Name(), vol.Name+"-r-")).To(BeFalse(), "replica data left on %s: %s", n, e.Name())
		}
	}
}

// TestVolumeSalvage: a volume whose every replica failed is salvaged from
// the replica that was RW last, never from one with older data. With two
// replicas, the first one's node goes down; writes go on to the second
// alone; then the second's process is killed: no replica is RW. The first
// node comes back first, but the volume waits for both (the newest data
// may be on either), restarts the engine, and the engine serves from the
// replica with the newest epoch: the writes made while the first was away
// read back.
func TestVolumeSalvage(t *testing.T) {
	if _, err := exec.LookPath("qemu-io"); err != nil {
		t.Skip("qemu-io is not installed (make test-tools installs it)")
	}
	g := NewWithT(t)
	ctx := context.Background()
	names := []string{"sv-a", "sv-b", "sv-c"}
	dirs, ims := startNodes(t, g, names...)
	vol := &v1.Volume{ObjectMeta: metav1.ObjectMeta{Name: "salvage", Namespace: "default"}, Spec: v1.VolumeSpec{
		Size: resource.MustParse("16Mi"), NumberOfReplicas: 2, Frontend: v1.FrontendNBD}}
	g.Expect(k8sClient.Create(ctx, vol)).To(Succeed())
	get := func() *v1.Volume { return getVolume(g, client.ObjectKeyFromObject(vol)) }
	replicas := func() map[string]v1.Replica {
		out := map[string]v1.Replica{}
		for _, r := range listReplicas(g, vol) {
			out[r.Spec.NodeName] = r
		}
		return out
	}
	robustness := func() v1.VolumeRobustness { return get().Status.Robustness }
	waitPlaced(g, client.ObjectKeyFromObject(vol))
	reps := replicas()
	var engineNode string
	var repNodes []string
	for _, n := range names {
		if _, ok := reps[n]; ok {
			repNodes = append(repNodes, n)
		} else {
			engineNode = n
		}
	}
	var where []string
	for _, r := range listReplicas(g, vol) {
		where = append(where, r.Name+" on "+r.Spec.NodeName+"/"+r.Spec.DiskName)
	}
	g.Expect(repNodes).To(HaveLen(2), "the two replicas on two nodes: %v", where)
	setNode(g, client.ObjectKeyFromObject(vol), engineNode)
	g.Eventually(robustness, timeout, 100*time.Millisecond).Should(Equal(v1.VolumeRobustnessHealthy))
	qemuIO(t, vol.Name, get().Status.Endpoint, "write -P 0x11 0 4M", "flush")

	// The first replica's node goes; the second alone takes new writes.
	first, second := repNodes[0], repNodes[1]
	ims[first].Kill()
	g.Eventually(robustness, timeout, 100*time.Millisecond).Should(Equal(v1.VolumeRobustnessDegraded))
	qemuIO(t, vol.Name, get().Status.Endpoint, "write -P 0x22 0 2M", "flush")
	// Then the second's process dies too: nothing is RW.
	sec := reps[second]
	g.Expect(syscall.Kill(replicaPID(t, replica.DataDir(&sec)), syscall.SIGKILL)).To(Succeed())
	g.Eventually(robustness, timeout, 50*time.Millisecond).Should(Equal(v1.VolumeRobustnessFaulted))
	// The second runs again at once, but the first may hold newer data as
	// far as the manager knows: the volume waits for it and says so.
	g.Eventually(func() string {
		c := meta.FindStatusCondition(get().Status.Conditions, v1.ConditionReady)
		if c == nil {
			return ""
		}
		return c.Message
	}, timeout, 100*time.Millisecond).Should(And(ContainSubstring("salvage waits"), ContainSubstring(first)))
	g.Expect(robustness()).To(Equal(v1.VolumeRobustnessFaulted))

	// The first node back: salvaged from the second (newest epoch), the
	// first rebuilt from it.
	ims[first] = imtest.Start(t, first, ims[first].Addr, dirs[first])
	// Healthy as the restarted engine's own stream reports it: until the
	// stream has reported, robustness counts running replica processes.
	g.Eventually(func() int { return rwReplicas(g, vol) }, 2*timeout, 100*time.Millisecond).Should(Equal(2))
	g.Eventually(robustness, timeout, 100*time.Millisecond).Should(Equal(v1.VolumeRobustnessHealthy))
	qemuIO(t, vol.Name, get().Status.Endpoint, "read -P 0x22 0 2M", "read -P 0x11 2M 2M")
	var evs eventsv1.EventList
	g.Expect(k8sClient.List(ctx, &evs, client.InNamespace("default"))).To(Succeed())
	salvaged := false
	for _, ev := range evs.Items {
		salvaged = salvaged || (ev.Regarding.Name == vol.Name && ev.Reason == EventSalvage)
	}
	g.Expect(salvaged).To(BeTrue(), "a Salvage event is recorded")
	g.Expect(k8sClient.Delete(ctx, get())).To(Succeed())
	g.Eventually(func() bool {
		return apierrors.IsNotFound(k8sClient.Get(ctx, client.ObjectKeyFromObject(vol), &v1.Volume{}))
	}, timeout, 100*time.Millisecond).Should(BeTrue())
}

// TestVolumeExpand: spec.size grown on an attached volume expands the
// engine online (status.size follows, the new space takes writes, the
// replicas' spec.size follows so they restart at their new size); grown
// on a detached volume, the engine starts at its replicas' size at the
// next attach and is expanded then. The data written before reads back.
func TestVolumeExpand(t *testing.T) {
	if _, err := exec.LookPath("qemu-io"); err != nil {
		t.Skip("qemu-io is not installed (make test-tools installs it)")
	}
	g := NewWithT(t)
	ctx := context.Background()
	nodes(t, g, "ex-a", "ex-b")
	vol := &v1.Volume{ObjectMeta: metav1.ObjectMeta{Name: "expand", Namespace: "default"}, Spec: v1.VolumeSpec{
		Size: resource.MustParse("16Mi"), NumberOfReplicas: 2, Frontend: v1.FrontendNBD}}
	g.Expect(k8sClient.Create(ctx, vol)).To(Succeed())
	get := func() *v1.Volume { return getVolume(g, client.ObjectKeyFromObject(vol)) }
	update := func(mutate func(*v1.Volume)) { updateVolume(g, client.ObjectKeyFromObject(vol), mutate) }
	size := func() int64 {
		if s := get().Status.Size; s != nil {
			return s.Value()
		}
		return 0
	}
	g.Eventually(func() v1.VolumeState { return get().Status.State }, timeout, 100*time.Millisecond).Should(Equal(v1.VolumeStateDetached))
	update(func(v *v1.Volume) { v.Spec.NodeName = "ex-a" })
	g.Eventually(func() v1.VolumeRobustness { return get().Status.Robustness }, timeout, 100*time.Millisecond).Should(Equal(v1.VolumeRobustnessHealthy))
	qemuIO(t, vol.Name, get().Status.Endpoint, "write -P 0x44 0 1M", "flush")

	// Online.
	update(func(v *v1.Volume) { v.Spec.Size = resource.MustParse("32Mi") })
	g.Eventually(size, timeout, 100*time.Millisecond).Should(Equal(int64(32 << 20)))
	qemuIO(t, vol.Name, get().Status.Endpoint, "write -P 0x55 31M 1M", "flush", "read -P 0x44 0 1M")
	g.Eventually(func() []int64 {
		var out []int64
		for _, r := range listReplicas(g, vol) {
			out = append(out, r.Spec.Size.Value())
		}
		return out
	}, timeout, 100*time.Millisecond).Should(Equal([]int64{32 << 20, 32 << 20}))

	// Offline: detached, grown, attached elsewhere.
	update(func(v *v1.Volume) { v.Spec.NodeName = "" })
	g.Eventually(func() v1.VolumeState { return get().Status.State }, timeout, 100*time.Millisecond).Should(Equal(v1.VolumeStateDetached))
	update(func(v *v1.Volume) { v.Spec.Size = resource.MustParse("48Mi") })
	update(func(v *v1.Volume) { v.Spec.NodeName = "ex-b" })
	g.Eventually(func() v1.VolumeState { return get().Status.State }, timeout, 100*time.Millisecond).Should(Equal(v1.VolumeStateAttached))
	g.Eventually(size, timeout, 100*time.Millisecond).Should(Equal(int64(48 << 20)))
	g.Eventually(func() v1.VolumeRobustness { return get().Status.Robustness }, timeout, 100*time.Millisecond).Should(Equal(v1.VolumeRobustnessHealthy))
	qemuIO(t, vol.Name, get().Status.Endpoint, "read -P 0x44 0 1M", "read -P 0x55 31M 1M", "write -P 0x66 47M 1M", "read -P 0x66 47M 1M")

	g.Expect(k8sClient.Delete(ctx, get())).To(Succeed())
	g.Eventually(func() bool {
		return apierrors.IsNotFound(k8sClient.Get(ctx, client.ObjectKeyFromObject(vol), &v1.Volume{}))
	}, timeout, 100*time.Millisecond).Should(BeTrue())
}

// updateVolume applies mutate to the volume's latest version, again on a
// conflict (the reconciler writes the object too).
func updateVolume(g *WithT, key client.ObjectKey, mutate func(*v1.Volume)) {
	g.Expect(retry.RetryOnConflict(retry.DefaultRetry, func() error {
		cur := &v1.Volume{}
		if err := k8sClient.Get(context.Background(), key, cur); err != nil {
			return err
		}
		mutate(cur)
		return k8sClient.Update(context.Background(), cur)
	})).To(Succeed())
}

// setNode attaches the volume to node ("" detaches it).
func setNode(g *WithT, key client.ObjectKey, node string) {
	updateVolume(g, key, func(v *v1.Volume) { v.Spec.NodeName = node })
}

// TestVolumeGivenBackWhenNoReplacementFits: three nodes, three replicas.
// A node's instance manager is down for longer than the replenishment
// wait: the replacement has nowhere to go (every node holds a replica of
// the volume). When the node comes back, its replica is given back with a
// delta resync, the volume is healthy again with the writes made
// meanwhile, and the unplaced replacement is deleted.
func TestVolumeGivenBackWhenNoReplacementFits(t *testing.T) {
	if _, err := exec.LookPath("qemu-io"); err != nil {
		t.Skip("qemu-io is not installed (make test-tools installs it)")
	}
	g := NewWithT(t)
	ctx := context.Background()
	names := []string{"gb-a", "gb-b", "gb-c"}
	dirs, ims := startNodes(t, g, names...)
	vol := &v1.Volume{ObjectMeta: metav1.ObjectMeta{Name: "given-back", Namespace: "default"}, Spec: v1.VolumeSpec{
		Size: resource.MustParse("32Mi"), NumberOfReplicas: 3, Frontend: v1.FrontendNBD}}
	g.Expect(k8sClient.Create(ctx, vol)).To(Succeed())
	key := client.ObjectKeyFromObject(vol)
	cleanupVolume(t, vol)
	engine := func() *v1.Engine { return getEngine(g, vol) }
	robustness := func() v1.VolumeRobustness { return getVolume(g, key).Status.Robustness }
	setNode(g, key, "gb-a")
	sock := waitAttached(t, g, key).Status.Endpoint
	g.Eventually(robustness, timeout, 100*time.Millisecond).Should(Equal(v1.VolumeRobustnessHealthy))
	qemuIO(t, vol.Name, sock, "write -P 0x11 0 4M", "flush")
	var lost string
	for _, r := range listReplicas(g, vol) {
		if r.Spec.NodeName == "gb-c" {
			lost = r.Name
		}
	}
	g.Expect(lost).NotTo(BeEmpty())

	ims["gb-c"].Kill()
	qemuIO(t, vol.Name, sock, "write -P 0x22 8M 2M", "flush")
	g.Eventually(robustness, timeout, 100*time.Millisecond).Should(Equal(v1.VolumeRobustnessDegraded))
	// Past the wait: a replacement is asked for, and stays unplaced.
	g.Eventually(func() int { return len(listReplicas(g, vol)) }, timeout+replenishmentWait, 100*time.Millisecond).Should(Equal(4))
	g.Consistently(func() bool {
		for _, r := range listReplicas(g, vol) {
			if r.Name != lost && r.Spec.NodeName == "" {
				return true
			}
		}
		return false
	}, 2*time.Second, 200*time.Millisecond).Should(BeTrue(), "the replacement has no node to go to")

	ims["gb-c"] = imtest.Start(t, "gb-c", ims["gb-c"].Addr, dirs["gb-c"])
	g.Eventually(robustness, timeout, 100*time.Millisecond).Should(Equal(v1.VolumeRobustnessHealthy))
	var rb v1.RebuildStatus
	g.Eventually(func() v1.RebuildState { rb = engine().Status.RebuildStatus[lost]; return rb.State }, timeout, 50*time.Millisecond).Should(Equal(v1.RebuildStateComplete))
	g.Expect(rb.DirtyOnly).To(BeTrue(), "given back with a delta resync: %+v", rb)
	g.Eventually(func() []string {
		var out []string
		for _, r := range listReplicas(g, vol) {
			out = append(out, r.Name)
		}
		return out
	}, timeout, 100*time.Millisecond).Should(HaveLen(3), "the unplaced replacement is deleted")
	g.Expect(engine().Status.ReplicaModeMap[lost]).To(Equal(v1.ReplicaModeRW))
	qemuIO(t, vol.Name, sock, "read -P 0x11 0 4M", "read -P 0x22 8M 2M")

	// Deleted here, while the restarted instance manager still runs (its
	// cleanup comes before cleanupVolume's).
	g.Expect(k8sClient.Delete(ctx, getVolume(g, key))).To(Succeed())
	g.Eventually(func() bool { return apierrors.IsNotFound(k8sClient.Get(ctx, key, &v1.Volume{})) }, timeout, 100*time.Millisecond).Should(BeTrue())
}
