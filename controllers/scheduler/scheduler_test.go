package scheduler

import (
	"testing"

	. "github.com/onsi/gomega"
)

const gi = int64(1) << 30

func disk(node, name string, capacity int64) Disk {
	return Disk{Node: node, Name: name, Path: "/var/lib/cairn/" + name, Ready: true, NodeAllowScheduling: true, AllowScheduling: true,
		Capacity: capacity, Available: capacity}
}

func nodes(p []Placement) []string {
	out := make([]string, len(p))
	for i := range p {
		out[i] = p[i].Node + "/" + p[i].Disk
	}
	return out
}

func TestSchedule(t *testing.T) {
	big := func(d Disk) Disk { d.Capacity, d.Available = 100*gi, 100*gi; return d }
	with := func(d Disk, f func(*Disk)) Disk { f(&d); return d }
	cases := []struct {
		name    string
		req     Request
		disks   []Disk
		placed  []Placed
		n       int
		want    []string
		reason  string // a substring of Reason; "" when all are placed
		unplace int
	}{
		{
			name:  "three nodes, one replica each",
			req:   Request{Size: 10 * gi},
			disks: []Disk{disk("a", "d1", 50*gi), disk("b", "d1", 50*gi), disk("c", "d1", 50*gi)},
			n:     3, want: []string{"a/d1", "b/d1", "c/d1"},
		},
		{
			name:  "other nodes before a roomier disk on a used node",
			req:   Request{Size: 10 * gi},
			disks: []Disk{big(disk("a", "d1", 0)), big(disk("a", "d2", 0)), disk("b", "d1", 20*gi)},
			n:     2, want: []string{"a/d1", "b/d1"},
		},
		{
			name:  "one node: different disks, never the same disk twice",
			req:   Request{Size: gi},
			disks: []Disk{disk("a", "d1", 50*gi), disk("a", "d2", 40*gi)},
			n:     3, want: []string{"a/d1", "a/d2"}, unplace: 1, reason: "1 of 3 replicas unplaced: of 2 disks, 2 already holds a replica",
		},
		{
			name:   "the count covers the replicas placed earlier",
			req:    Request{Size: gi},
			disks:  []Disk{disk("a", "d1", 50*gi), disk("b", "d1", 50*gi)},
			placed: []Placed{{"a", "d1"}, {"b", "d1"}},
			n:      1, unplace: 1, reason: "1 of 3 replicas unplaced: of 2 disks, 2 already holds a replica",
		},
		{
			name:   "replacement avoids the nodes of the replicas still there",
			req:    Request{Size: gi},
			disks:  []Disk{big(disk("a", "d1", 0)), disk("b", "d1", 10*gi), disk("c", "d1", 10*gi)},
			placed: []Placed{{"a", "d1"}, {"b", "d1"}},
			n:      1, want: []string{"c/d1"},
		},
		{
			name:  "most room first, then by name",
			req:   Request{Size: gi},
			disks: []Disk{disk("b", "d1", 20*gi), disk("a", "d1", 20*gi), disk("c", "d1", 30*gi)},
			n:     3, want: []string{"c/d1", "a/d1", "b/d1"},
		},
		{
			name: "scheduled sizes, reserve and over-provisioning",
			req:  Request{Size: 10 * gi},
			disks: []Disk{
				with(disk("a", "d1", 100*gi), func(d *Disk) { d.Scheduled = 95 * gi }),
				with(disk("b", "d1", 100*gi), func(d *Disk) { d.Reserved = 95 * gi }),
				disk("c", "d1", 100*gi),
			},
			n: 2, want: []string{"c/d1"}, unplace: 1, reason: "2 not enough space",
		},
		{
			name: "over-provisioning 200% lets a full schedule grow, a full disk takes nothing",
			req:  Request{Size: 10 * gi, OverProvisioningPercent: 200},
			disks: []Disk{
				with(disk("a", "d1", 100*gi), func(d *Disk) { d.Scheduled = 150 * gi; d.Available = 50 * gi }),
				with(disk("b", "d1", 100*gi), func(d *Disk) { d.Available = 0 }),
			},
			n: 2, want: []string{"a/d1"}, unplace: 1, reason: "1 not enough space",
		},
		{
			name: "switches, readiness and tags",
			req:  Request{Size: gi, Tags: []string{"ssd"}},
			disks: []Disk{
				with(disk("a", "d1", 10*gi), func(d *Disk) { d.Ready = false; d.Tags = []string{"ssd"} }),
				with(disk("b", "d1", 10*gi), func(d *Disk) { d.NodeAllowScheduling = false; d.Tags = []string{"ssd"} }),
				with(disk("c", "d1", 10*gi), func(d *Disk) { d.AllowScheduling = false; d.Tags = []string{"ssd"} }),
				with(disk("d", "d1", 10*gi), func(d *Disk) { d.Tags = []string{"hdd"} }),
				with(disk("e", "d1", 10*gi), func(d *Disk) { d.Tags = []string{"fast", "ssd"} }),
			},
			n: 2, want: []string{"e/d1"}, unplace: 1,
			reason: "of 5 disks, 1 already holds a replica of the volume, 1 missing a required tag, 1 not ready, 1 scheduling disabled on the disk, 1 scheduling disabled on the node",
		},
		{
			name: "no disks at all",
			req:  Request{Size: gi},
			n:    3, unplace: 3, reason: "3 of 3 replicas unplaced: no StorageNode has a disk",
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			g := NewWithT(t)
			in := append([]Disk(nil), c.disks...)
			res := Schedule(c.req, c.disks, c.placed, c.n)
			g.Expect(nodes(res.Placements)).To(Equal(append([]string{}, c.want...)))
			g.Expect(res.Unplaced).To(Equal(c.unplace))
			if c.reason == "" {
				g.Expect(res.Reason).To(BeEmpty())
			} else {
				g.Expect(res.Reason).To(ContainSubstring(c.reason))
			}
			g.Expect(c.disks).To(Equal(in), "Schedule must not change its input")
		})
	}
}
