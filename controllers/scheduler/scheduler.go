// Package scheduler is the one place that decides whether a disk may take
// a replica. Everything that asks calls it: the Volume reconciler and the
// drain controller to place replicas (through a Ledger), the StorageNode
// reconciler for its Schedulable conditions (Usable), and the CSI
// driver's GetCapacity (Capacity).
//
// Schedule, Usable and Capacity are pure functions of what they are given
// (the disks with their capacity and use, the replicas already placed),
// so tests drive them with tables. The Ledger is the one stateful part:
// it serialises placement within the process and counts the bytes
// scheduled on each disk from the Replicas themselves (ledger.go).
//
// Rules, in order of strength:
//   - a disk takes a replica only if it is ready, scheduling is allowed on
//     it and on its node, it carries every tag the volume asks for, and the
//     replica fits: the sizes scheduled on it plus this one stay within
//     (capacity − reserved) × overProvisioningPercent / 100, and its free
//     space beyond the reserve can hold at least the replica's first
//     block (a disk that is full now takes nothing, however provisioned);
//   - never two replicas of a volume on one disk;
//   - a node without a replica of the volume before a node with one
//     (anti-affinity across nodes first, then across disks);
//   - then the disk with the most schedulable room left, then by name, so
//     that the same input always gives the same placement.
//
// There is no silent partial placement: when not every replica finds a
// disk, the result says how many are unplaced and which constraint ruled
// each rejected disk out.
package scheduler

import (
	"fmt"
	"slices"
	"strings"
	"time"
)

// DefaultOverProvisioningPercent lets the sizes scheduled on a disk reach
// its capacity (less the reserve) and no further.
const DefaultOverProvisioningPercent = 100

// Disk is one disk a replica may be placed on, as observed.
type Disk struct {
	Node string
	Name string
	Path string
	// Ready: the disk is mounted and reports its capacity.
	Ready bool
	// NodeAllowScheduling and AllowScheduling: the operator's switches.
	NodeAllowScheduling bool
	AllowScheduling     bool
	Tags                []string
	// Capacity, Available and Reserved are bytes of the filesystem.
	Capacity, Available, Reserved int64
	// Scheduled is the sum of the sizes of the replicas placed on it.
	Scheduled int64
}

// Request is what one volume asks for.
type Request struct {
	// Size of each replica, in bytes.
	Size int64
	// Tags every chosen disk must carry.
	Tags []string
	// OverProvisioningPercent; 0 takes DefaultOverProvisioningPercent.
	OverProvisioningPercent int
}

// Placed is a replica of the volume already on a disk.
type Placed struct {
	Node, Disk string
}

// Placement is where one new replica goes.
type Placement struct {
	Node, Disk, Path string
}

// Result is the outcome of Schedule.
type Result struct {
	// Placements for the replicas that found a disk, in order.
	Placements []Placement
	// Unplaced counts the replicas that did not.
	Unplaced int
	// Reason says, when Unplaced > 0, why the disks were ruled out.
	Reason string
	// RetryAfter, when Unplaced > 0 (Ledger.Place), is when the Ledger
	// forgets the first placement on one of the disks that it wrote and
	// the cache never showed (a Replica deleted before the cache saw it
	// placed): that record may rule the disk out, for this volume or by
	// its bytes, and no watched object changes when it goes. Zero when no
	// such record is on the disks.
	RetryAfter time.Duration
}

// minimumFree is the free space (beyond the reserve) a disk must have to
// take any replica: one block.
const minimumFree = 4096

// Schedule places n new replicas of a volume, given the replicas of it
// already placed.
func Schedule(req Request, disks []Disk, placed []Placed, n int) Result {
	op := OverProvisioning(req.OverProvisioningPercent)
	usedNodes := map[string]bool{}
	usedDisks := map[string]bool{}
	for _, p := range placed {
		usedNodes[p.Node] = true
		usedDisks[p.Node+"/"+p.Disk] = true
	}
	// Work on a copy: each placement adds to its disk's scheduled size.
	ds := append([]Disk(nil), disks...)
	var res Result
	for range n {
		var best *Disk
		bestFresh := false
		reasons := map[Rejection]int{}
		for i := range ds {
			d := &ds[i]
			if why := reject(req, d, op, usedDisks); why != "" {
				reasons[why]++
				continue
			}
			fresh := !usedNodes[d.Node]
			if best == nil || better(d, fresh, best, bestFresh, op) {
				best, bestFresh = d, fresh
			}
		}
		if best == nil {
			res.Unplaced = n - len(res.Placements)
			res.Reason = explain(reasons, len(ds), res.Unplaced, n+len(placed))
			return res
		}
		best.Scheduled += req.Size
		usedNodes[best.Node] = true
		usedDisks[best.Node+"/"+best.Name] = true
		res.Placements = append(res.Placements, Placement{Node: best.Node, Disk: best.Name, Path: best.Path})
	}
	return res
}

// Rejection says why a disk may not take a replica; "" when it may. Its
// text is how Result.Reason names it.
type Rejection string

// Rejections, in the order they are checked.
const (
	RejectNotReady     Rejection = "not ready"
	RejectNodeDisabled Rejection = "scheduling disabled on the node"
	RejectDiskDisabled Rejection = "scheduling disabled on the disk"
	RejectTags         Rejection = "missing a required tag"
	RejectHasReplica   Rejection = "already holds a replica of the volume"
	RejectNoSpace      Rejection = "not enough space"
)

// Usable says whether d may take a replica at all, whatever the volume:
// it is ready, scheduling is allowed on it and its node, and it has room
// for at least one block (within over-provisioning, and free beyond the
// reserve). op is the over-provisioning percentage (0: the default).
func Usable(d *Disk, op int) Rejection {
	if why := allowed(d); why != "" {
		return why
	}
	return fits(d, OverProvisioning(op), minimumFree)
}

// allowed: ready, and scheduling allowed on the disk and its node.
func allowed(d *Disk) Rejection {
	switch {
	case !d.Ready:
		return RejectNotReady
	case !d.NodeAllowScheduling:
		return RejectNodeDisabled
	case !d.AllowScheduling:
		return RejectDiskDisabled
	}
	return ""
}

// fits: the sizes scheduled on d plus size stay within its
// over-provisioned limit, and d has a block free beyond the reserve (a
// disk that is full now takes nothing, however provisioned).
func fits(d *Disk, op int, size int64) Rejection {
	if room(d, op) < size || d.Available-d.Reserved < minimumFree {
		return RejectNoSpace
	}
	return ""
}

// reject says whether d may take a replica of the volume req describes,
// given the disks holding one already.
func reject(req Request, d *Disk, op int, usedDisks map[string]bool) Rejection {
	if why := allowed(d); why != "" {
		return why
	}
	switch {
	case !hasTags(d.Tags, req.Tags):
		return RejectTags
	case usedDisks[d.Node+"/"+d.Name]:
		return RejectHasReplica
	}
	return fits(d, op, req.Size)
}

// OverProvisioning is the percentage op stands for: op, or
// DefaultOverProvisioningPercent when it is 0.
func OverProvisioning(op int) int {
	if op <= 0 {
		return DefaultOverProvisioningPercent
	}
	return op
}

// Limit is how much may be scheduled on d in all: (capacity − reserved)
// × op / 100 (op 0: the default).
func Limit(d *Disk, op int) int64 {
	c, pct := d.Capacity-d.Reserved, int64(OverProvisioning(op))
	return c/100*pct + c%100*pct/100 // c × pct / 100, rounded down, without overflow
}

// room is how much more may be scheduled on a disk.
func room(d *Disk, op int) int64 {
	return Limit(d, op) - d.Scheduled
}

func better(d *Disk, fresh bool, best *Disk, bestFresh bool, op int) bool {
	if fresh != bestFresh {
		return fresh
	}
	if r, br := room(d, op), room(best, op); r != br {
		return r > br
	}
	if d.Node != best.Node {
		return d.Node < best.Node
	}
	return d.Name < best.Name
}

func hasTags(have, want []string) bool {
	for _, w := range want {
		found := false
		for _, h := range have {
			if h == w {
				found = true
				break
			}
		}
		if !found {
			return false
		}
	}
	return true
}

func explain(reasons map[Rejection]int, disks, unplaced, wanted int) string {
	if disks == 0 {
		return fmt.Sprintf("%d of %d replicas unplaced: no StorageNode has a disk", unplaced, wanted)
	}
	keys := make([]Rejection, 0, len(reasons))
	for k := range reasons {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	parts := make([]string, 0, len(keys))
	for _, k := range keys {
		parts = append(parts, fmt.Sprintf("%d %s", reasons[k], k))
	}
	return fmt.Sprintf("%d of %d replicas unplaced: of %d disks, %s", unplaced, wanted, disks, strings.Join(parts, ", "))
}
