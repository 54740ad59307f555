package replica

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
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
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// TestReplicaLifecycle: a scheduled Replica asked to run gets a process on
// its node's real instance manager, reports its addresses, stops when
// asked, and on deletion its data directory goes with it.
func TestReplicaLifecycle(t *testing.T) {
	g := NewWithT(t)
	ctx := context.Background()
	disk := t.TempDir()
	im := imtest.Start(t, "node-r", "", disk)
	g.Expect(k8sClient.Create(ctx, &v1.InstanceManager{ObjectMeta: metav1.ObjectMeta{Name: "im-node-r", Namespace: "default"},
		Spec: v1.InstanceManagerSpec{NodeName: "node-r", Address: im.Addr}})).To(Succeed())
	rep := &v1.Replica{ObjectMeta: metav1.ObjectMeta{Name: "vol-r-abc", Namespace: "default"}, Spec: v1.ReplicaSpec{
		VolumeName: "vol", NodeName: "node-r", DiskName: "default", DiskPath: disk, DataDirectoryName: "vol-r-abc",
		Size: resource.MustParse("16Mi"), DesiredState: v1.DesiredInstanceStateRunning}}
	g.Expect(k8sClient.Create(ctx, rep)).To(Succeed())
	get := func() *v1.Replica {
		out := &v1.Replica{}
		g.Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(rep), out)).To(Succeed())
		return out
	}
	g.Eventually(func() v1.InstanceState { return get().Status.InstanceState }, deadline.Scale(60*time.Second), 50*time.Millisecond).Should(Equal(v1.InstanceStateRunning))
	got := get()
	g.Expect(meta.IsStatusConditionTrue(got.Status.Conditions, v1.ConditionReady)).To(BeTrue())
	g.Expect(got.Finalizers).To(ContainElement(Finalizer))
	g.Expect(got.Status.InstanceManagerName).To(Equal("im-node-r"))
	for _, addr := range []string{got.Status.Address, got.Status.ControlAddress} {
		c, err := net.Dial("tcp", addr)
		g.Expect(err).NotTo(HaveOccurred(), "reported address %s", addr)
		c.Close()
	}
	dataDir := filepath.Join(disk, "vol-r-abc")
	g.Expect(filepath.Join(dataDir, "volume.meta")).To(BeAnExistingFile())

	// Stop: the process goes, the data stays.
	before := got.DeepCopy()
	got.Spec.DesiredState = v1.DesiredInstanceStateStopped
	g.Expect(k8sClient.Patch(ctx, got, client.MergeFrom(before))).To(Succeed())
	g.Eventually(func() v1.InstanceState { return get().Status.InstanceState }, deadline.Scale(60*time.Second), 50*time.Millisecond).Should(Equal(v1.InstanceStateStopped))
	g.Expect(get().Status.Address).To(BeEmpty())
	g.Expect(dataDir).To(BeADirectory())

	// Delete: the data goes, then the object.
	g.Expect(k8sClient.Delete(ctx, get())).To(Succeed())
	g.Eventually(func() bool {
		err := k8sClient.Get(ctx, client.ObjectKeyFromObject(rep), &v1.Replica{})
		return apierrors.IsNotFound(err)
	}, deadline.Scale(60*time.Second), 50*time.Millisecond).Should(BeTrue())
	_, err := os.Stat(dataDir)
	g.Expect(errors.Is(err, os.ErrNotExist)).To(BeTrue(), "data directory after deletion: %v", err)
}

// TestReplicaNotRunnable: an unscheduled replica and one on a node without
// an instance manager say so.
func TestReplicaNotRunnable(t *testing.T) {
	g := NewWithT(t)
	ctx := context.Background()
	reason := func(name string) string {
		out := &v1.Replica{}
		if err := k8sClient.Get(ctx, client.ObjectKey{Namespace: "default", Name: name}, out); err != nil {
			return err.Error()
		}
		if c := meta.FindStatusCondition(out.Status.Conditions, v1.ConditionReady); c != nil {
			return c.Reason
		}
		return ""
	}
	for _, r := range []*v1.Replica{
		{ObjectMeta: metav1.ObjectMeta{Name: "unscheduled", Namespace: "default"}, Spec: v1.ReplicaSpec{VolumeName: "v", Size: resource.MustParse("16Mi"), DesiredState: v1.DesiredInstanceStateRunning}},
		{ObjectMeta: metav1.ObjectMeta{Name: "nowhere", Namespace: "default"}, Spec: v1.ReplicaSpec{VolumeName: "v", NodeName: "ghost", DiskPath: "/x", DataDirectoryName: "r",
			Size: resource.MustParse("16Mi"), DesiredState: v1.DesiredInstanceStateRunning}},
	} {
		g.Expect(k8sClient.Create(ctx, r)).To(Succeed())
	}
	g.Eventually(func() string { return reason("unscheduled") }, deadline.Scale(30*time.Second), 50*time.Millisecond).Should(Equal(v1.ReplicaReasonNotScheduled))
	g.Eventually(func() string { return reason("nowhere") }, deadline.Scale(30*time.Second), 50*time.Millisecond).Should(Equal(v1.ReasonNoInstanceManager))
}

// TestReplicaBackOff: a replica process that keeps exiting (its data
// directory is a file) is started again with a growing wait, and Ready
// says so (ProcessBackOff, with the exit and the count); once the cause
// is gone it runs, and Ready is True again.
func TestReplicaBackOff(t *testing.T) {
	g := NewWithT(t)
	ctx := context.Background()
	disk := t.TempDir()
	im := imtest.Start(t, "node-bo", "", disk)
	g.Expect(k8sClient.Create(ctx, &v1.InstanceManager{ObjectMeta: metav1.ObjectMeta{Name: "im-node-bo", Namespace: "default"},
		Spec: v1.InstanceManagerSpec{NodeName: "node-bo", Address: im.Addr}})).To(Succeed())
	bad := filepath.Join(disk, "vol-bo-r")
	g.Expect(os.WriteFile(bad, []byte("not a directory"), 0o600)).To(Succeed())
	rep := &v1.Replica{ObjectMeta: metav1.ObjectMeta{Name: "vol-bo-r", Namespace: "default"}, Spec: v1.ReplicaSpec{
		VolumeName: "vol-bo", NodeName: "node-bo", DiskName: "default", DiskPath: disk, DataDirectoryName: "vol-bo-r",
		Size: resource.MustParse("16Mi"), DesiredState: v1.DesiredInstanceStateRunning}}
	g.Expect(k8sClient.Create(ctx, rep)).To(Succeed())
	defer func() {
		g.Expect(client.IgnoreNotFound(k8sClient.Delete(ctx, rep))).To(Succeed())
		g.Eventually(func() bool {
			return apierrors.IsNotFound(k8sClient.Get(ctx, client.ObjectKeyFromObject(rep), &v1.Replica{}))
		}, deadline.Scale(60*time.Second), 50*time.Millisecond).Should(BeTrue())
	}()
	ready := func() metav1.Condition {
		out := &v1.Replica{}
		g.Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(rep), out)).To(Succeed())
		if c := meta.FindStatusCondition(out.Status.Conditions, v1.ConditionReady); c != nil {
			return *c
		}
		return metav1.Condition{}
	}
	var c metav1.Condition
	g.Eventually(func() string { c = ready(); return c.Reason }, deadline.Scale(60*time.Second), 20*time.Millisecond).Should(Equal(v1.ReasonProcessBackOff))
	g.Expect(c.Status).To(Equal(metav1.ConditionFalse))
	g.Expect(c.Message).To(And(ContainSubstring("times in a row"), ContainSubstring("exited (code"), ContainSubstring("started again at")),
		"the message names the count, the last exit and the next start")

	g.Expect(os.Remove(bad)).To(Succeed())
	g.Eventually(func() metav1.ConditionStatus { return ready().Status }, deadline.Scale(60*time.Second), 50*time.Millisecond).Should(Equal(metav1.ConditionTrue),
		"once the cause is gone the back-off ends and the process runs")
}
