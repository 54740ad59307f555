package storagenode

import (
	"context"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/internal/imtest"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

func cond(conds []metav1.Condition, typ string) string {
	if c := meta.FindStatusCondition(conds, typ); c != nil {
		return string(c.Status) + "/" + c.Reason
	}
	return ""
}

// TestStorageNodeStatus: disks report the capacity the node's real
// instance manager measures, the space scheduled by the replicas placed on
// them, and conditions that say why a disk cannot be used.
func TestStorageNodeStatus(t *testing.T) {
	g := NewWithT(t)
	ctx := context.Background()
	im := imtest.Start(t, "node-a", "", t.TempDir())
	sn := &v1.StorageNode{ObjectMeta: metav1.ObjectMeta{Name: "node-a", Namespace: "default"}, Spec: v1.StorageNodeSpec{NodeName: "node-a"}}
	g.Expect(k8sClient.Create(ctx, sn)).To(Succeed())
	get := func() *v1.StorageNode {
		out := &v1.StorageNode{}
		g.Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(sn), out)).To(Succeed())
		return out
	}
	// No instance manager on the node yet.
	g.Eventually(func() string { return cond(get().Status.Conditions, v1.ConditionReady) }, deadline.Scale(30*time.Second), 50*time.Millisecond).
		Should(Equal("False/" + v1.ReasonNoInstanceManager))

	g.Expect(k8sClient.Create(ctx, &v1.InstanceManager{ObjectMeta: metav1.ObjectMeta{Name: "im-node-a", Namespace: "default"},
		Spec: v1.InstanceManagerSpec{NodeName: "node-a", Address: im.Addr}})).To(Succeed())
	g.Eventually(func() string { return cond(get().Status.Conditions, v1.StorageNodeConditionSchedulable) }, deadline.Scale(30*time.Second), 50*time.Millisecond).
		Should(Equal("True/" + v1.ReasonAsExpected))
	d := get().Status.Disks
	g.Expect(d).To(HaveLen(1))
	g.Expect(d[0].Name).To(Equal(DefaultDiskName))
	g.Expect(d[0].Capacity.Value()).To(BeNumerically(">", 0))
	g.Expect(d[0].Available.Value()).To(BeNumerically(">", 0))
	g.Expect(d[0].Filesystem).NotTo(BeEmpty())
	g.Expect(d[0].Scheduled.Value()).To(BeZero())

	// A replica placed on the disk counts as scheduled there.
	rep := &v1.Replica{ObjectMeta: metav1.ObjectMeta{Name: "v-r-0", Namespace: "default"}, Spec: v1.ReplicaSpec{
		VolumeName: "v", NodeName: "node-a", DiskName: DefaultDiskName, DiskPath: im.DataDir, Size: resource.MustParse("1Gi")}}
	g.Expect(k8sClient.Create(ctx, rep)).To(Succeed())
	g.Eventually(func() int64 { return get().Status.Disks[0].Scheduled.Value() }, deadline.Scale(30*time.Second), 50*time.Millisecond).Should(Equal(int64(1 << 30)))

	// A disk that is not one of the instance manager's data directories,
	// and the node switched off for scheduling.
	cur := get()
	before := cur.DeepCopy()
	cur.Spec.Disks = []v1.DiskSpec{{Name: DefaultDiskName, Path: im.DataDir}, {Name: "other", Path: "/not/a/data/dir"}}
	cur.Spec.AllowScheduling = ptr.To(false)
	g.Expect(k8sClient.Patch(ctx, cur, client.MergeFrom(before))).To(Succeed())
	g.Eventually(func() []string {
		var out []string
		for _, ds := range get().Status.Disks {
			out = append(out, ds.Name+":"+cond(ds.Conditions, v1.ConditionReady)+":"+cond(ds.Conditions, v1.StorageNodeConditionSchedulable))
		}
		return out
	}, deadline.Scale(30*time.Second), 50*time.Millisecond).Should(Equal([]string{
		"default:True/AsExpected:False/" + v1.StorageNodeReasonSchedulingDisabled,
		"other:False/" + v1.StorageNodeReasonNotADataDirectory + ":False/" + v1.StorageNodeReasonNoSchedulableDisk,
	}))
	g.Expect(cond(get().Status.Conditions, v1.StorageNodeConditionSchedulable)).To(Equal("False/" + v1.StorageNodeReasonSchedulingDisabled))

	// The instance manager goes: the node is not ready, and says why.
	im.Kill()
	g.Eventually(func() string { return cond(get().Status.Conditions, v1.ConditionReady) }, deadline.Scale(30*time.Second), 50*time.Millisecond).
		Should(Equal("False/" + v1.ReasonInstanceManagerDown))
}
