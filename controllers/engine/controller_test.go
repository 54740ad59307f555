package engine

import (
	"context"
	"os"
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
	"github.com/cairn-io/cairn/controllers/replica"
)

const timeout = 60 * time.Second

func readyReason(g *WithT, key client.ObjectKey) string {
	e := &v1.Engine{}
	if err := k8sClient.Get(context.Background(), key, e); err != nil {
		return err.Error()
	}
	if c := meta.FindStatusCondition(e.Status.Conditions, v1.ConditionReady); c != nil {
		return c.Reason
	}
	return ""
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
	g.Expect(k8sClient.Create(ctx, &v1.InstanceManager{ObjectMeta: metav1.ObjectMeta{Name: "im-node-e", Namespace: "default"},
		Spec: v1.InstanceManagerSpec{NodeName: "node-e", Address: im.Addr}})).To(Succeed())
	rep := &v1.Replica{ObjectMeta: metav1.ObjectMeta{Name: "vol-e-r", Namespace: "default"}, Spec: v1.ReplicaSpec{
		VolumeName: "vol-e", NodeName: "node-e", DiskName: "default", DiskPath: im.DataDir, DataDirectoryName: "vol-e-r",
		Size: resource.MustParse("16Mi"), DesiredState: v1.DesiredInstanceStateRunning}}
	g.Expect(k8sClient.Create(ctx, rep)).To(Succeed())
	g.Eventually(func() string {
		g.Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(rep), rep)).To(Succeed())
		return rep.Status.ControlAddress
	}, timeout, 50*time.Millisecond).ShouldNot(BeEmpty())

	e := &v1.Engine{ObjectMeta: metav1.ObjectMeta{Name: "vol-e-e", Namespace: "default"}, Spec: v1.EngineSpec{
		VolumeName: "vol-e", NodeName: "node-e", DesiredState: v1.DesiredInstanceStateRunning, Size: resource.MustParse("16Mi"),
		Frontend: v1.FrontendNBD, ReplicaAddresses: map[string]v1.ReplicaAddress{rep.Name: {Data: rep.Status.Address, Control: rep.Status.ControlAddress}}}}
	g.Expect(k8sClient.Create(ctx, e)).To(Succeed())
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
	g.Eventually(func() bool { _, ok, _ := c.Process(replica.ProcessName(got)); return ok }, timeout, 50*time.Millisecond).Should(BeTrue())

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
	g.Eventually(func() bool { _, ok, _ := c.Process(replica.ProcessName(e)); return ok }, timeout, 50*time.Millisecond).Should(BeFalse())
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
	g.Eventually(func() string { return readyReason(g, bad) }, timeout, 50*time.Millisecond).Should(Equal(v1.ReasonInvalidSpec))
	g.Eventually(func() string { return readyReason(g, nowhere) }, timeout, 50*time.Millisecond).Should(Equal(ReasonNotPlaced))
	g.Eventually(func() string { return readyReason(g, ghost) }, timeout, 50*time.Millisecond).Should(Equal(ReasonNoInstanceManager))
}
