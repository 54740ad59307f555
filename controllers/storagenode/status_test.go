package storagenode

import (
	"testing"

	. "github.com/onsi/gomega"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	imv1 "github.com/cairn-io/cairn/dataplane/api/instancemanager/v1"
)

// TestComputeStatus: from what the node's instance manager reports and
// the replicas placed on it to the disks and conditions `kubectl get
// storagenodes` shows.
func TestComputeStatus(t *testing.T) {
	dataDir := &imv1.DataDir{Path: "/var/lib/cairn", TotalBytes: 100 << 30, AvailableBytes: 40 << 30, Filesystem: "ext4"}
	fast := &imv1.DataDir{Path: "/mnt/fast", TotalBytes: 10 << 30, AvailableBytes: 9 << 30, Filesystem: "xfs"}
	node := func(mutate func(*v1.StorageNode)) *v1.StorageNode {
		sn := &v1.StorageNode{ObjectMeta: metav1.ObjectMeta{Name: "n1", Namespace: "default", Generation: 3}, Spec: v1.StorageNodeSpec{NodeName: "n1"}}
		if mutate != nil {
			mutate(sn)
		}
		return sn
	}
	twoDisks := func(sn *v1.StorageNode) {
		sn.Spec.Disks = []v1.DiskSpec{{Name: "main", Path: "/var/lib/cairn"}, {Name: "fast", Path: "/mnt/fast"}}
	}
	type disk struct {
		name, path         string
		ready, schedReason string // reasons of the disk's Ready and Schedulable
		capacity, sched    int64  // bytes; -1: not reported
	}
	for _, tc := range []struct {
		name  string
		sn    *v1.StorageNode
		obs   observed
		ready string // the node's Ready reason
		// sched is the node's Schedulable reason, schedMsg its message.
		sched, schedMsg string
		disks           []disk
		op              int // over-provisioning percentage; 0: the default
	}{
		{name: "no instance manager: the default disk is unknown", sn: node(nil),
			obs:   observed{imReason: v1.ReasonNoInstanceManager, imMessage: "no InstanceManager with an address runs on node n1", scheduled: map[string]int64{}},
			ready: v1.ReasonNoInstanceManager, sched: v1.StorageNodeReasonNoSchedulableDisk},
		{name: "no instance manager, disks listed: each not ready, saying why", sn: node(twoDisks),
			obs:   observed{imReason: v1.ReasonInstanceManagerDown, imMessage: "connection refused", scheduled: map[string]int64{"main": 1 << 30}},
			ready: v1.ReasonInstanceManagerDown, sched: v1.StorageNodeReasonNoSchedulableDisk,
			disks: []disk{{"main", "/var/lib/cairn", v1.ReasonInstanceManagerDown, v1.StorageNodeReasonNoSchedulableDisk, -1, 1 << 30},
				{"fast", "/mnt/fast", v1.ReasonInstanceManagerDown, v1.StorageNodeReasonNoSchedulableDisk, -1, 0}}},
		{name: "the default disk at the first data directory", sn: node(nil),
			obs:   observed{dataDirs: []*imv1.DataDir{dataDir, fast}, scheduled: map[string]int64{DefaultDiskName: 3 << 30}},
			ready: v1.ReasonAsExpected, sched: v1.ReasonAsExpected, schedMsg: "1 of 1 disks take new replicas",
			disks: []disk{{DefaultDiskName, "/var/lib/cairn", v1.ReasonAsExpected, v1.ReasonAsExpected, 100 << 30, 3 << 30}}},
		{name: "a listed disk that is not a data directory", sn: node(func(sn *v1.StorageNode) {
			twoDisks(sn)
			sn.Spec.Disks[1].Path = "/mnt/other"
		}),
			obs:   observed{dataDirs: []*imv1.DataDir{dataDir, fast}, scheduled: map[string]int64{}},
			ready: v1.ReasonAsExpected, sched: v1.ReasonAsExpected, schedMsg: "1 of 2 disks take new replicas",
			disks: []disk{{"main", "/var/lib/cairn", v1.ReasonAsExpected, v1.ReasonAsExpected, 100 << 30, 0},
				{"fast", "/mnt/other", v1.StorageNodeReasonNotADataDirectory, v1.StorageNodeReasonNoSchedulableDisk, -1, 0}}},
		{name: "scheduling disabled on one disk", sn: node(func(sn *v1.StorageNode) {
			twoDisks(sn)
			sn.Spec.Disks[0].AllowScheduling = ptr.To(false)
		}),
			obs:   observed{dataDirs: []*imv1.DataDir{dataDir, fast}, scheduled: map[string]int64{"main": 5 << 30}},
			ready: v1.ReasonAsExpected, sched: v1.ReasonAsExpected, schedMsg: "1 of 2 disks take new replicas",
			disks: []disk{{"main", "/var/lib/cairn", v1.ReasonAsExpected, v1.StorageNodeReasonSchedulingDisabled, 100 << 30, 5 << 30},
				{"fast", "/mnt/fast", v1.ReasonAsExpected, v1.ReasonAsExpected, 10 << 30, 0}}},
		{name: "scheduling disabled on the node", sn: node(func(sn *v1.StorageNode) {
			twoDisks(sn)
			sn.Spec.AllowScheduling = ptr.To(false)
		}),
			obs:   observed{dataDirs: []*imv1.DataDir{dataDir, fast}, scheduled: map[string]int64{}},
			ready: v1.ReasonAsExpected, sched: v1.StorageNodeReasonSchedulingDisabled,
			disks: []disk{{"main", "/var/lib/cairn", v1.ReasonAsExpected, v1.StorageNodeReasonSchedulingDisabled, 100 << 30, 0},
				{"fast", "/mnt/fast", v1.ReasonAsExpected, v1.StorageNodeReasonSchedulingDisabled, 10 << 30, 0}}},
		{name: "a disk full by what is scheduled on it: not schedulable, saying why; the other is", sn: node(twoDisks),
			obs:   observed{dataDirs: []*imv1.DataDir{dataDir, fast}, scheduled: map[string]int64{"fast": 10 << 30}},
			ready: v1.ReasonAsExpected, sched: v1.ReasonAsExpected, schedMsg: "1 of 2 disks take new replicas",
			disks: []disk{{"main", "/var/lib/cairn", v1.ReasonAsExpected, v1.ReasonAsExpected, 100 << 30, 0},
				{"fast", "/mnt/fast", v1.ReasonAsExpected, v1.StorageNodeReasonInsufficientStorage, 10 << 30, 10 << 30}}},
		{name: "the same disk with 200% over-provisioning has room", sn: node(twoDisks), op: 200,
			obs:   observed{dataDirs: []*imv1.DataDir{dataDir, fast}, scheduled: map[string]int64{"fast": 10 << 30}},
			ready: v1.ReasonAsExpected, sched: v1.ReasonAsExpected, schedMsg: "2 of 2 disks take new replicas",
			disks: []disk{{"main", "/var/lib/cairn", v1.ReasonAsExpected, v1.ReasonAsExpected, 100 << 30, 0},
				{"fast", "/mnt/fast", v1.ReasonAsExpected, v1.ReasonAsExpected, 10 << 30, 10 << 30}}},
		{name: "the reserve takes all the free space: no disk has room", sn: node(func(sn *v1.StorageNode) {
			twoDisks(sn)
			sn.Spec.Disks[0].StorageReserved = ptr.To(resource.MustParse("40Gi"))
			sn.Spec.Disks[1].StorageReserved = ptr.To(resource.MustParse("9Gi"))
		}),
			obs:   observed{dataDirs: []*imv1.DataDir{dataDir, fast}, scheduled: map[string]int64{}},
			ready: v1.ReasonAsExpected, sched: v1.StorageNodeReasonNoSchedulableDisk, schedMsg: "with room",
			disks: []disk{{"main", "/var/lib/cairn", v1.ReasonAsExpected, v1.StorageNodeReasonInsufficientStorage, 100 << 30, 0},
				{"fast", "/mnt/fast", v1.ReasonAsExpected, v1.StorageNodeReasonInsufficientStorage, 10 << 30, 0}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			computeStatus(tc.sn, tc.obs, tc.op)
			st := tc.sn.Status
			g.Expect(st.ObservedGeneration).To(Equal(int64(3)))
			ready := meta.FindStatusCondition(st.Conditions, v1.ConditionReady)
			g.Expect(ready.Reason).To(Equal(tc.ready))
			g.Expect(ready.Status == metav1.ConditionTrue).To(Equal(tc.obs.imReason == ""))
			if tc.obs.imReason != "" {
				g.Expect(ready.Message).To(Equal(tc.obs.imMessage), "the node says why its instance manager does not report")
			}
			sched := meta.FindStatusCondition(st.Conditions, v1.StorageNodeConditionSchedulable)
			g.Expect(sched.Reason).To(Equal(tc.sched))
			g.Expect(sched.Status == metav1.ConditionTrue).To(Equal(tc.sched == v1.ReasonAsExpected))
			g.Expect(sched.Message).To(ContainSubstring(tc.schedMsg))
			g.Expect(st.Disks).To(HaveLen(len(tc.disks)))
			for i, want := range tc.disks {
				d := st.Disks[i]
				g.Expect(d.Name).To(Equal(want.name))
				g.Expect(d.Path).To(Equal(want.path))
				g.Expect(meta.FindStatusCondition(d.Conditions, v1.ConditionReady).Reason).To(Equal(want.ready), "disk %s Ready", d.Name)
				g.Expect(meta.FindStatusCondition(d.Conditions, v1.StorageNodeConditionSchedulable).Reason).To(Equal(want.schedReason), "disk %s Schedulable", d.Name)
				g.Expect(d.Scheduled.Value()).To(Equal(want.sched), "disk %s scheduled bytes", d.Name)
				if want.capacity < 0 {
					g.Expect(d.Capacity).To(BeNil(), "disk %s capacity unknown", d.Name)
				} else {
					g.Expect(d.Capacity.Value()).To(Equal(want.capacity))
					g.Expect(d.Available).NotTo(BeNil())
					g.Expect(d.Filesystem).NotTo(BeEmpty())
				}
			}
		})
	}
}

// TestComputeStatusKeepsDiskConditions: a disk's conditions carry over
// from one status to the next, so an unchanged disk keeps its
// lastTransitionTime, and a disk that became ready moves on from it.
func TestComputeStatusKeepsDiskConditions(t *testing.T) {
	g := NewWithT(t)
	sn := &v1.StorageNode{ObjectMeta: metav1.ObjectMeta{Name: "n1", Generation: 1}, Spec: v1.StorageNodeSpec{NodeName: "n1"}}
	up := observed{dataDirs: []*imv1.DataDir{{Path: "/d", TotalBytes: 1 << 30, AvailableBytes: 1 << 29, Filesystem: "ext4"}}, scheduled: map[string]int64{}}
	computeStatus(sn, up, 0)
	c := &sn.Status.Disks[0].Conditions[0]
	c.LastTransitionTime = metav1.Unix(1000, 0)
	computeStatus(sn, up, 0)
	g.Expect(meta.FindStatusCondition(sn.Status.Disks[0].Conditions, c.Type).LastTransitionTime).To(Equal(metav1.Unix(1000, 0)))

	down := observed{imReason: v1.ReasonInstanceManagerDown, imMessage: "unreachable", scheduled: map[string]int64{}}
	computeStatus(sn, down, 0)
	g.Expect(sn.Status.Disks).To(BeEmpty(), "without a report the default disk's path is unknown")
	g.Expect(meta.IsStatusConditionFalse(sn.Status.Conditions, v1.ConditionReady)).To(BeTrue())
}
