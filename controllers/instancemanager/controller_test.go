package instancemanager

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/imclient"
	"github.com/cairn-io/cairn/controllers/internal/imtest"
	"github.com/cairn-io/cairn/dataplane"
	imv1 "github.com/cairn-io/cairn/dataplane/api/instancemanager/v1"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// TestInstanceManagerStatus: the status follows a real instance manager:
// running with its version and its processes as they change (from the
// watch, no poll), unknown with the reason when it goes, running again
// when it comes back; an object without an address says so.
func TestInstanceManagerStatus(t *testing.T) {
	g := NewWithT(t)
	ctx := context.Background()
	dir := t.TempDir()
	im := imtest.Start(t, "node-1", "", dir)
	obj := &v1.InstanceManager{ObjectMeta: metav1.ObjectMeta{Name: "im-node-1", Namespace: "default"},
		Spec: v1.InstanceManagerSpec{NodeName: "node-1", Address: im.Addr}}
	g.Expect(k8sClient.Create(ctx, obj)).To(Succeed())
	get := func() *v1.InstanceManager {
		out := &v1.InstanceManager{}
		g.Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(obj), out)).To(Succeed())
		return out
	}
	g.Eventually(func() v1.InstanceManagerState { return get().Status.State }, deadline.Scale(30*time.Second), 50*time.Millisecond).
		Should(Equal(v1.InstanceManagerStateRunning))
	g.Expect(get().Status.Version).To(Equal(dataplane.Version))
	g.Expect(meta.IsStatusConditionTrue(get().Status.Conditions, v1.ConditionReady)).To(BeTrue())

	// A process created behind the reconciler's back shows up through the watch.
	c := imclient.New(imclient.Options{})
	defer c.Close()
	conn, err := c.Get(im.Addr)
	g.Expect(err).NotTo(HaveOccurred())
	_, err = conn.Client.ProcessCreate(ctx, &imv1.ProcessCreateRequest{Name: "default/v-r-0",
		Spec: &imv1.ProcessCreateRequest_Replica{Replica: &imv1.ReplicaSpec{DataDir: filepath.Join(dir, "r0"), SizeBytes: 16 << 20}}})
	g.Expect(err).NotTo(HaveOccurred())
	g.Eventually(func() []v1.ProcessStatus { return get().Status.Processes }, deadline.Scale(30*time.Second), 50*time.Millisecond).Should(ConsistOf(
		And(HaveField("Name", "default/v-r-0"), HaveField("Kind", v1.ProcessKindReplica), HaveField("State", v1.InstanceStateRunning))))

	// The instance manager goes: unknown, with the reason; its processes unknown.
	im.Kill()
	g.Eventually(func() v1.InstanceManagerState { return get().Status.State }, deadline.Scale(30*time.Second), 50*time.Millisecond).
		Should(Equal(v1.InstanceManagerStateUnknown))
	got := get()
	g.Expect(meta.FindStatusCondition(got.Status.Conditions, v1.ConditionReady)).To(And(
		HaveField("Status", metav1.ConditionFalse), HaveField("Reason", v1.InstanceManagerReasonUnreachable)))
	g.Expect(got.Status.Processes).To(ConsistOf(HaveField("State", v1.InstanceStateUnknown)))

	// It comes back on the same address: running, and its (new, empty) process list.
	imtest.Start(t, "node-1", im.Addr, dir)
	g.Eventually(func() v1.InstanceManagerState { return get().Status.State }, deadline.Scale(30*time.Second), 50*time.Millisecond).
		Should(Equal(v1.InstanceManagerStateRunning))
	g.Eventually(func() []v1.ProcessStatus { return get().Status.Processes }, deadline.Scale(30*time.Second), 50*time.Millisecond).Should(BeEmpty())

	// No address: unknown, saying so.
	bare := &v1.InstanceManager{ObjectMeta: metav1.ObjectMeta{Name: "im-node-2", Namespace: "default"}, Spec: v1.InstanceManagerSpec{NodeName: "node-2"}}
	g.Expect(k8sClient.Create(ctx, bare)).To(Succeed())
	g.Eventually(func() string {
		out := &v1.InstanceManager{}
		g.Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(bare), out)).To(Succeed())
		if c := meta.FindStatusCondition(out.Status.Conditions, v1.ConditionReady); c != nil {
			return c.Reason
		}
		return ""
	}, deadline.Scale(30*time.Second), 50*time.Millisecond).Should(Equal(v1.InstanceManagerReasonNoAddress))
}
