package scheduler

import "slices"

// blockSize is what volume sizes are a multiple of.
const blockSize = 4096

// Capacity is what is left for new volumes that ask req (its Size is not
// read) with n replicas each:
//   - largest is the largest size, a whole number of blocks, for which
//     Schedule places all n replicas of a volume that has none yet: the
//     n-th largest room among the disks that may take the volume's
//     replicas (never two on one disk), or 0 when fewer than n may;
//   - available is the room on all those disks, divided by n (each
//     replica takes the volume's size): what volumes could still be
//     given in all, if they fill the disks evenly.
//
// A disk's room is what Schedule checks a replica against: (capacity −
// reserved) × over-provisioning, less the sizes already scheduled there,
// on a disk that is ready, allowed, carries the tags, and has a block
// free beyond the reserve.
func Capacity(req Request, disks []Disk, n int) (available, largest int64) {
	if n <= 0 {
		return 0, 0
	}
	op := OverProvisioning(req.OverProvisioningPercent)
	rooms := make([]int64, 0, len(disks))
	var total int64
	for i := range disks {
		d := &disks[i]
		if reject(Request{Tags: req.Tags}, d, op, nil) != "" {
			continue
		}
		r := room(d, op)
		rooms = append(rooms, r)
		total += r
	}
	if len(rooms) >= n {
		slices.Sort(rooms)
		largest = rooms[len(rooms)-n] / blockSize * blockSize
	}
	return total / int64(n), largest
}
