package scheduler

import (
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
)

// DiskKey names a disk in the cluster: its node and its name there.
type DiskKey struct {
	Node, Disk string
}

// String is the key's form in the Replica field index: node/disk.
func (k DiskKey) String() string { return k.Node + "/" + k.Disk }

// Key is the disk's DiskKey.
func (d *Disk) Key() DiskKey { return DiskKey{Node: d.Node, Disk: d.Name} }

// DiskOf is the disk a Replica is placed on; ok is false while it is
// unplaced.
func DiskOf(rep *v1.Replica) (key DiskKey, ok bool) {
	if rep.Spec.NodeName == "" || rep.Spec.DiskName == "" {
		return DiskKey{}, false
	}
	return DiskKey{Node: rep.Spec.NodeName, Disk: rep.Spec.DiskName}, true
}

// ScheduledBytes sums the sizes of the replicas placed on each disk. A
// replica being deleted still counts: its data is on the disk until it
// is gone.
func ScheduledBytes(replicas []v1.Replica) map[DiskKey]int64 {
	out := map[DiskKey]int64{}
	for i := range replicas {
		if k, ok := DiskOf(&replicas[i]); ok {
			out[k] += replicas[i].Spec.Size.Value()
		}
	}
	return out
}

// FromStorageNodes turns StorageNodes into the scheduler's disks: each
// disk the status reports that the spec still lists (or the default disk
// of a node whose spec lists none), with the operator's switches, tags
// and reserve from the spec and capacity, free space and scheduled bytes
// from the status. A disk is ready when its Ready condition is true.
// Callers that know the scheduled bytes better (a Ledger, from the
// Replicas) overwrite Scheduled.
func FromStorageNodes(sns []v1.StorageNode) []Disk {
	var out []Disk
	for i := range sns {
		out = append(out, fromStorageNode(&sns[i])...)
	}
	return out
}

func fromStorageNode(sn *v1.StorageNode) []Disk {
	specs := map[string]v1.DiskSpec{}
	for _, d := range sn.Spec.Disks {
		specs[d.Name] = d
	}
	var out []Disk
	for _, ds := range sn.Status.Disks {
		spec, ok := specs[ds.Name]
		if !ok && ds.Name != v1.DefaultDiskName {
			continue // removed from the spec: takes no new replicas
		}
		d := FromSpec(sn, spec)
		d.Name, d.Path = ds.Name, ds.Path
		d.Ready = meta.IsStatusConditionTrue(ds.Conditions, v1.ConditionReady) && ds.Path != ""
		d.Capacity, d.Available, d.Scheduled = value(ds.Capacity), value(ds.Available), value(ds.Scheduled)
		out = append(out, d)
	}
	return out
}

// FromSpec is what a StorageNode's spec says of one of its disks: the
// node, the disk's name and path, whether scheduling is allowed on the
// node and on the disk, its tags and its reserve. (A disk that is not in
// spec.disks, the default disk, is passed as a zero DiskSpec: allowed,
// no tags, no reserve.) Ready, sizes and use are left for the caller.
func FromSpec(sn *v1.StorageNode, spec v1.DiskSpec) Disk {
	d := Disk{Node: sn.Spec.NodeName, Name: spec.Name, Path: spec.Path,
		NodeAllowScheduling: sn.Spec.AllowScheduling == nil || *sn.Spec.AllowScheduling,
		AllowScheduling:     spec.AllowScheduling == nil || *spec.AllowScheduling,
		Tags:                spec.Tags}
	if spec.StorageReserved != nil {
		d.Reserved = spec.StorageReserved.Value()
	}
	return d
}

func value(q *resource.Quantity) int64 {
	if q == nil {
		return 0
	}
	return q.Value()
}
