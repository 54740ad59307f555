package scheduler

import (
	"testing"

	. "github.com/onsi/gomega"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
)

// TestCapacity: what GetCapacity reports is Schedule's rule. For each
// cluster, the largest volume Capacity reports gets all its replicas
// placed by Schedule, and a volume one block larger does not; the
// available figure is the disks' room divided by the replica count.
func TestCapacity(t *testing.T) {
	with := func(d Disk, f func(*Disk)) Disk { f(&d); return d }
	const mi = int64(1) << 20
	cases := []struct {
		name             string
		req              Request
		disks            []Disk
		n                int
		largest, perRepl int64 // perRepl: the sum of the rooms; available is perRepl / n
	}{
		{name: "three free disks, three replicas: the smallest room",
			disks: []Disk{disk("a", "d1", 50*gi), disk("b", "d1", 40*gi), disk("c", "d1", 30*gi)}, n: 3,
			largest: 30 * gi, perRepl: 120 * gi},
		{name: "one replica: the largest room",
			disks: []Disk{disk("a", "d1", 50*gi), disk("b", "d1", 40*gi)}, n: 1,
			largest: 50 * gi, perRepl: 90 * gi},
		{name: "scheduled bytes, not free space, bound the room (the disks are empty but promised)",
			disks: []Disk{with(disk("a", "d1", 50*gi), func(d *Disk) { d.Scheduled = 45 * gi }), disk("b", "d1", 40*gi)}, n: 2,
			largest: 5 * gi, perRepl: 45 * gi},
		{name: "the reserve comes off the room",
			disks: []Disk{with(disk("a", "d1", 50*gi), func(d *Disk) { d.Reserved = 20 * gi }), disk("b", "d1", 40*gi)}, n: 2,
			largest: 30 * gi, perRepl: 70 * gi},
		{name: "over-provisioning 200% doubles the room",
			req:   Request{OverProvisioningPercent: 200},
			disks: []Disk{disk("a", "d1", 50*gi), disk("b", "d1", 40*gi)}, n: 2,
			largest: 80 * gi, perRepl: 180 * gi},
		{name: "a disk with nothing free beyond its reserve takes nothing, however provisioned",
			req:   Request{OverProvisioningPercent: 500},
			disks: []Disk{with(disk("a", "d1", 50*gi), func(d *Disk) { d.Available = 1024 }), disk("b", "d1", 40*gi)}, n: 1,
			largest: 200 * gi, perRepl: 200 * gi},
		{name: "two disks of one node count as two (never two replicas on one disk, but one node may hold two)",
			disks: []Disk{disk("a", "d1", 50*gi), disk("a", "d2", 40*gi)}, n: 2,
			largest: 40 * gi, perRepl: 90 * gi},
		{name: "fewer usable disks than replicas: no volume fits",
			disks: []Disk{disk("a", "d1", 50*gi), with(disk("b", "d1", 40*gi), func(d *Disk) { d.Ready = false }),
				with(disk("c", "d1", 40*gi), func(d *Disk) { d.AllowScheduling = false }),
				with(disk("d", "d1", 40*gi), func(d *Disk) { d.NodeAllowScheduling = false })}, n: 2,
			largest: 0, perRepl: 50 * gi},
		{name: "tags: only the disks carrying them",
			req: Request{Tags: []string{"ssd"}},
			disks: []Disk{with(disk("a", "d1", 50*gi), func(d *Disk) { d.Tags = []string{"ssd", "fast"} }),
				with(disk("b", "d1", 40*gi), func(d *Disk) { d.Tags = []string{"hdd"} }), disk("c", "d1", 30*gi)}, n: 1,
			largest: 50 * gi, perRepl: 50 * gi},
		{name: "rooms that are not whole blocks round down",
			disks: []Disk{with(disk("a", "d1", 10*mi+1000), func(d *Disk) { d.Scheduled = 1 })}, n: 1,
			largest: 10 * mi, perRepl: 10*mi + 999},
		{name: "an over-committed disk has no room, and takes none off the others",
			disks: []Disk{with(disk("a", "d1", 10*gi), func(d *Disk) { d.Scheduled = 12 * gi }), disk("b", "d1", 10*gi)}, n: 1,
			largest: 10 * gi, perRepl: 10 * gi},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			g := NewWithT(t)
			available, largest := Capacity(c.req, c.disks, c.n)
			g.Expect(largest).To(Equal(c.largest), "largest volume")
			g.Expect(available).To(Equal(c.perRepl/int64(c.n)), "available")
			req := c.req
			if largest > 0 {
				req.Size = largest
				res := Schedule(req, c.disks, nil, c.n)
				g.Expect(res.Unplaced).To(BeZero(), "a volume of the largest size reported is placed: %s", res.Reason)
			}
			req.Size = largest + blockSize
			res := Schedule(req, c.disks, nil, c.n)
			g.Expect(res.Unplaced).To(BeNumerically(">", 0), "a volume one block larger than reported is not placed")
		})
	}
}

// TestUsable: the disk-level part of the rule, which the StorageNode
// reconciler's Schedulable conditions show.
func TestUsable(t *testing.T) {
	with := func(d Disk, f func(*Disk)) Disk { f(&d); return d }
	for _, c := range []struct {
		name string
		d    Disk
		op   int
		want Rejection
	}{
		{"free", disk("a", "d1", 10*gi), 0, ""},
		{"not ready", with(disk("a", "d1", 10*gi), func(d *Disk) { d.Ready = false }), 0, RejectNotReady},
		{"node disabled", with(disk("a", "d1", 10*gi), func(d *Disk) { d.NodeAllowScheduling = false }), 0, RejectNodeDisabled},
		{"disk disabled", with(disk("a", "d1", 10*gi), func(d *Disk) { d.AllowScheduling = false }), 0, RejectDiskDisabled},
		{"fully scheduled", with(disk("a", "d1", 10*gi), func(d *Disk) { d.Scheduled = 10 * gi }), 0, RejectNoSpace},
		{"fully scheduled, over-provisioned", with(disk("a", "d1", 10*gi), func(d *Disk) { d.Scheduled = 10 * gi }), 150, ""},
		{"nothing free beyond the reserve", with(disk("a", "d1", 10*gi), func(d *Disk) { d.Reserved = 10 * gi }), 300, RejectNoSpace},
		{"filesystem full", with(disk("a", "d1", 10*gi), func(d *Disk) { d.Available = 0 }), 0, RejectNoSpace},
	} {
		t.Run(c.name, func(t *testing.T) {
			NewWithT(t).Expect(Usable(&c.d, c.op)).To(Equal(c.want))
		})
	}
}

// TestFromStorageNodes: a StorageNode's spec and status as the scheduler's
// disks, and ScheduledBytes from the Replicas.
func TestFromStorageNodes(t *testing.T) {
	g := NewWithT(t)
	ready := []metav1.Condition{{Type: v1.ConditionReady, Status: metav1.ConditionTrue}}
	q := func(n int64) *resource.Quantity { return resource.NewQuantity(n, resource.BinarySI) }
	sns := []v1.StorageNode{
		{Spec: v1.StorageNodeSpec{NodeName: "a"}, Status: v1.StorageNodeStatus{Disks: []v1.DiskStatus{
			{Name: v1.DefaultDiskName, Path: "/var/lib/cairn", Capacity: q(100), Available: q(80), Scheduled: q(10), Conditions: ready}}}},
		{Spec: v1.StorageNodeSpec{NodeName: "b", AllowScheduling: ptr.To(false), Disks: []v1.DiskSpec{
			{Name: "ssd", Path: "/mnt/ssd", AllowScheduling: ptr.To(false), StorageReserved: q(5), Tags: []string{"fast"}}}},
			Status: v1.StorageNodeStatus{Disks: []v1.DiskStatus{
				{Name: "ssd", Path: "/mnt/ssd", Capacity: q(50)},
				{Name: "gone", Path: "/mnt/gone", Capacity: q(50), Conditions: ready}}}},
	}
	g.Expect(FromStorageNodes(sns)).To(Equal([]Disk{
		{Node: "a", Name: v1.DefaultDiskName, Path: "/var/lib/cairn", Ready: true, NodeAllowScheduling: true, AllowScheduling: true,
			Capacity: 100, Available: 80, Scheduled: 10},
		{Node: "b", Name: "ssd", Path: "/mnt/ssd", Tags: []string{"fast"}, Reserved: 5, Capacity: 50},
	}), "a disk no longer in the spec is left out; one without a Ready condition is not ready")

	rep := func(node, disk string, size int64) v1.Replica {
		return v1.Replica{Spec: v1.ReplicaSpec{NodeName: node, DiskName: disk, Size: *q(size)}}
	}
	g.Expect(ScheduledBytes([]v1.Replica{rep("a", "d1", 1), rep("a", "d1", 2), rep("b", "d1", 4), rep("", "", 8)})).To(Equal(
		map[DiskKey]int64{{Node: "a", Disk: "d1"}: 3, {Node: "b", Disk: "d1"}: 4}), "unplaced replicas count nowhere")
}
