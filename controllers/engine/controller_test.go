package engine

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/internal/imtest"
	"github.com/cairn-io/cairn/controllers/internal/process"
	"github.com/cairn-io/cairn/controllers/replica"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

var timeout = deadline.Scale(60 * time.Second)

func readyReason(key client.ObjectKey) string {
	e := &v1.Engine{}
	if err := k8sClient.Get(context.Background(), key, e); err != nil {
		return err.Error()
	}
	if c := meta.FindStatusCondition(e.Status.Conditions, v1.ConditionReady); c != nil {
		return c.Reason
	}
	return ""
}

// createEngine registers im as node's InstanceManager, has a 16 MiB
// replica of vol run there, and creates an Engine of vol on node with that
// replica and frontend.
func createEngine(g *WithT, im *imtest.IM, node, vol string, frontend v1.Frontend) *v1.Engine {
	ctx := context.Background()
	g.Expect(k8sClient.Create(ctx, &v1.InstanceManager{ObjectMeta: metav1.ObjectMeta{Name: "im-" + node, Namespace: "default"},
		Spec: v1.InstanceManagerSpec{NodeName: node, Address: im.Addr}})).To(Succeed())
	rep := &v1.Replica{ObjectMeta: metav1.ObjectMeta{Name: vol + "-r", Namespace: "default"}, Spec: v1.ReplicaSpec{
		VolumeName: vol, NodeName: node, DiskName: "default", DiskPath: im.DataDir, DataDirectoryName: vol + "-r",
		Size: resource.MustParse("16Mi"), DesiredState: v1.DesiredInstanceStateRunning}}
	g.Expect(k8sClient.Create(ctx, rep)).To(Succeed())
	g.Eventually(func() string {
		g.Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(rep), rep)).To(Succeed())
		return rep.Status.ControlAddress
	}, timeout, 50*time.Millisecond).ShouldNot(BeEmpty())
	e := &v1.Engine{ObjectMeta: metav1.ObjectMeta{Name: vol + "-e", Namespace: "default"}, Spec: v1.EngineSpec{
		VolumeName: vol, NodeName: node, DesiredState: v1.DesiredInstanceStateRunning, Size: resource.MustParse("16Mi"),
		Frontend: frontend, ReplicaAddresses: map[string]v1.ReplicaAddress{rep.Name: {Data: rep.Status.Address, Control: rep.Status.ControlAddress}}}}
	g.Expect(k8sClient.Create(ctx, e)).To(Succeed())
	return e
}

// TestEngineLifecycle: an Engine given a running replica's reported
// addresses runs on its node's real instance manager and reports its
// control address, size and endpoint (here the NBD socket, with the
// reason there is no /dev/nbdN); stopped, its process goes; deleted, the
// object goes once the process is gone.
func TestEngineLifecycle(t *testing.T) {
	g := NewWithT(t)
	ctx := context.Background()
	im := imtest.Start(t, "node-e", "", t.TempDir())
	e := createEngine(g, im, "node-e", "vol-e", v1.FrontendNBD)
	get := func() *v1.Engine {
		out := &v1.Engine{}
		g.Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(e), out)).To(Succeed())
		return out
	}
	g.Eventually(func() v1.InstanceState { return get().Status.InstanceState }, timeout, 50*time.Millisecond).Should(Equal(v1.InstanceStateRunning))
	got := get()
	g.Expect(got.Status.Address).NotTo(BeEmpty())
	g.Expect(got.Status.Size.Value()).To(Equal(int64(16 << 20)))
	g.Expect(got.Status.Endpoint).To(BeAnExistingFile())
	ready := meta.FindStatusCondition(got.Status.Conditions, v1.ConditionReady)
	g.Expect(ready).NotTo(BeNil())
	g.Expect(ready.Status).To(Equal(metav1.ConditionTrue))
	if _, err := os.Stat("/sys/module/nbd"); err != nil {
		g.Expect(ready.Message).To(ContainSubstring("no kernel block device"), "the fallback reason reaches the condition")
	}
	c, err := pool.Get(im.Addr)
	g.Expect(err).NotTo(HaveOccurred())
	g.Eventually(func() bool { _, ok, _ := c.Process(process.Name(got)); return ok }, timeout, 50*time.Millisecond).Should(BeTrue())

	// Stopped: the process goes, the status says so.
	before := got.DeepCopy()
	got.Spec.DesiredState = v1.DesiredInstanceStateStopped
	g.Expect(k8sClient.Patch(ctx, got, client.MergeFrom(before))).To(Succeed())
	g.Eventually(func() v1.InstanceState { return get().Status.InstanceState }, timeout, 50*time.Millisecond).Should(Equal(v1.InstanceStateStopped))
	g.Expect(get().Status.Endpoint).To(BeEmpty())

	// Running again, then deleted: the object goes with its process.
	got = get()
	before = got.DeepCopy()
	got.Spec.DesiredState = v1.DesiredInstanceStateRunning
	g.Expect(k8sClient.Patch(ctx, got, client.MergeFrom(before))).To(Succeed())
	g.Eventually(func() v1.InstanceState { return get().Status.InstanceState }, timeout, 50*time.Millisecond).Should(Equal(v1.InstanceStateRunning))
	g.Expect(k8sClient.Delete(ctx, get())).To(Succeed())
	g.Eventually(func() bool {
		return apierrors.IsNotFound(k8sClient.Get(ctx, client.ObjectKeyFromObject(e), &v1.Engine{}))
	}, timeout, 50*time.Millisecond).Should(BeTrue())
	g.Eventually(func() bool { _, ok, _ := c.Process(process.Name(e)); return ok }, timeout, 50*time.Millisecond).Should(BeFalse())
}

// TestEngineNotRunnable: specs that cannot run say why.
func TestEngineNotRunnable(t *testing.T) {
	g := NewWithT(t)
	ctx := context.Background()
	mk := func(name string, mutate func(*v1.Engine)) client.ObjectKey {
		e := &v1.Engine{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default"}, Spec: v1.EngineSpec{
			VolumeName: "v", NodeName: "ghost", DesiredState: v1.DesiredInstanceStateRunning, Size: resource.MustParse("16Mi")}}
		mutate(e)
		g.Expect(k8sClient.Create(ctx, e)).To(Succeed())
		return client.ObjectKeyFromObject(e)
	}
	bad := mk("bad-name", func(e *v1.Engine) { e.Spec.VolumeName = "Not_A_Label" })
	nowhere := mk("nowhere", func(e *v1.Engine) { e.Spec.NodeName = "" })
	ghost := mk("ghost", func(*v1.Engine) {})
	g.Eventually(func() string { return readyReason(bad) }, timeout, 50*time.Millisecond).Should(Equal(v1.ReasonInvalidSpec))
	g.Eventually(func() string { return readyReason(nowhere) }, timeout, 50*time.Millisecond).Should(Equal(v1.EngineReasonNotPlaced))
	g.Eventually(func() string { return readyReason(ghost) }, timeout, 50*time.Millisecond).Should(Equal(v1.ReasonNoInstanceManager))
}

// TestEngineGivesBackRecordedFailures: a replica process killed comes back
// at the address it had (the instance manager hands out the lowest free
// ports), which the engine's spec still names. The engine holds it ERR
// and does not add it again on its own: only once its failure is recorded
// (spec.failedAt, the Volume reconciler's mark) is it given back, and
// rebuilt to RW. Adding it earlier would rebuild it before anyone saw the
// failure.
func TestEngineGivesBackRecordedFailures(t *testing.T) {
	g := NewWithT(t)
	ctx := context.Background()
	im := imtest.Start(t, "node-g", "", t.TempDir())
	g.Expect(k8sClient.Create(ctx, &v1.InstanceManager{ObjectMeta: metav1.ObjectMeta{Name: "im-node-g", Namespace: "default"},
		Spec: v1.InstanceManagerSpec{NodeName: "node-g", Address: im.Addr}})).To(Succeed())
	addrs := map[string]v1.ReplicaAddress{}
	var reps []*v1.Replica
	for _, n := range []string{"vol-g-r1", "vol-g-r2"} {
		rep := &v1.Replica{ObjectMeta: metav1.ObjectMeta{Name: n, Namespace: "default"}, Spec: v1.ReplicaSpec{
			VolumeName: "vol-g", NodeName: "node-g", DiskName: "default", DiskPath: im.DataDir, DataDirectoryName: n,
			Size: resource.MustParse("16Mi"), DesiredState: v1.DesiredInstanceStateRunning}}
		g.Expect(k8sClient.Create(ctx, rep)).To(Succeed())
		g.Eventually(func() string {
			g.Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(rep), rep)).To(Succeed())
			return rep.Status.ControlAddress
		}, timeout, 50*time.Millisecond).ShouldNot(BeEmpty())
		addrs[n] = v1.ReplicaAddress{Data: rep.Status.Address, Control: rep.Status.ControlAddress}
		reps = append(reps, rep)
	}
	e := &v1.Engine{ObjectMeta: metav1.ObjectMeta{Name: "vol-g-e", Namespace: "default"}, Spec: v1.EngineSpec{
		VolumeName: "vol-g", NodeName: "node-g", DesiredState: v1.DesiredInstanceStateRunning, Size: resource.MustParse("16Mi"),
		Frontend: v1.FrontendNBD, ReplicaAddresses: addrs}}
	g.Expect(k8sClient.Create(ctx, e)).To(Succeed())
	defer func() {
		// Everything goes before the instance manager their finalizers
		// need, so the test runs again under -count.
		objs := []client.Object{e, reps[0], reps[1]}
		for _, o := range objs {
			g.Expect(client.IgnoreNotFound(k8sClient.Delete(ctx, o))).To(Succeed())
		}
		for _, o := range objs {
			g.Eventually(func() bool { return apierrors.IsNotFound(k8sClient.Get(ctx, client.ObjectKeyFromObject(o), o)) }, timeout, 50*time.Millisecond).
				Should(BeTrue(), "%s deleted", o.GetName())
		}
		g.Expect(k8sClient.Delete(ctx, &v1.InstanceManager{ObjectMeta: metav1.ObjectMeta{Name: "im-node-g", Namespace: "default"}})).To(Succeed())
	}()
	mode := func(n string) v1.ReplicaMode {
		out := &v1.Engine{}
		g.Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(e), out)).To(Succeed())
		return out.Status.ReplicaModeMap[n]
	}
	g.Eventually(func() []v1.ReplicaMode { return []v1.ReplicaMode{mode("vol-g-r1"), mode("vol-g-r2")} }, timeout, 50*time.Millisecond).
		Should(Equal([]v1.ReplicaMode{v1.ReplicaModeRW, v1.ReplicaModeRW}))

	victim := reps[1]
	g.Expect(syscall.Kill(replicaPID(t, replica.DataDir(victim)), syscall.SIGKILL)).To(Succeed())
	g.Eventually(func() v1.ReplicaMode { return mode(victim.Name) }, timeout, 50*time.Millisecond).Should(Equal(v1.ReplicaModeERR))
	// The Replica reconciler restarts the process at the spec's address.
	g.Eventually(func() v1.ReplicaAddress {
		g.Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(victim), victim)).To(Succeed())
		if victim.Status.InstanceState != v1.InstanceStateRunning {
			return v1.ReplicaAddress{}
		}
		return v1.ReplicaAddress{Data: victim.Status.Address, Control: victim.Status.ControlAddress}
	}, timeout, 50*time.Millisecond).Should(Equal(addrs[victim.Name]), "the restarted replica serves where it did")
	g.Consistently(func() v1.ReplicaMode { return mode(victim.Name) }, 3*time.Second, 100*time.Millisecond).Should(Equal(v1.ReplicaModeERR),
		"not given back before its failure is recorded")

	before := victim.DeepCopy()
	victim.Spec.FailedAt = &metav1.Time{Time: time.Now()}
	g.Expect(k8sClient.Patch(ctx, victim, client.MergeFrom(before))).To(Succeed())
	g.Eventually(func() v1.ReplicaMode { return mode(victim.Name) }, timeout, 50*time.Millisecond).Should(Equal(v1.ReplicaModeRW))
}

// replicaPID is the pid of the replica process serving dataDir.
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
