package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// device emulates a device-bound disk: a cgroup (v1 blkio) whose
// throttle caps the IOPS and bytes per second of every process in it on
// the disk under the work directory. The processes that touch the disk
// for a target go in it (fio for raw, qemu-nbd, the replicas), so three
// replicas share one budget as they would share one disk, and CPU stops
// being what limits the figures. cgroup v1 throttles direct I/O only
// (buffered writeback is not charged to the writer), so this table is
// measured with direct I/O. The throttle paces I/O to the rates; it does
// not add a device's latency, and at queue depth 1 three copies wait for
// three slots in turn, so the latency row means little here.
type device struct {
	iops, bps int64
	dir       string // the cgroup
	disk      string // MAJ:MIN of the whole disk
}

// parseDeviceLimit reads "iops=N,bps=SIZE" (SIZE as 125M or 1G, bytes
// per second, each direction).
func parseDeviceLimit(s string) (iops, bps int64, err error) {
	for _, kv := range strings.Split(s, ",") {
		k, v, _ := strings.Cut(kv, "=")
		switch k {
		case "iops":
			iops, err = strconv.ParseInt(v, 10, 64)
		case "bps":
			bps, err = parseBytes(v)
		default:
			err = fmt.Errorf("unknown key %q", k)
		}
		if err != nil || iops < 0 || bps < 0 {
			return 0, 0, fmt.Errorf("--device %q: give iops=N,bps=SIZE (e.g. iops=3000,bps=125M): %w", s, err)
		}
	}
	if iops == 0 || bps == 0 {
		return 0, 0, fmt.Errorf("--device %q: give both iops=N and bps=SIZE", s)
	}
	return iops, bps, nil
}

func parseBytes(v string) (int64, error) {
	mult := int64(1)
	switch {
	case strings.HasSuffix(v, "K"):
		mult, v = 1<<10, strings.TrimSuffix(v, "K")
	case strings.HasSuffix(v, "M"):
		mult, v = 1<<20, strings.TrimSuffix(v, "M")
	case strings.HasSuffix(v, "G"):
		mult, v = 1<<30, strings.TrimSuffix(v, "G")
	}
	n, err := strconv.ParseInt(v, 10, 64)
	return n * mult, err
}

// newDevice makes the cgroup for the disk holding work.
func newDevice(work string, iops, bps int64) (*device, error) {
	var st unix.Stat_t
	if err := unix.Stat(work, &st); err != nil {
		return nil, err
	}
	disk := fmt.Sprintf("%d:%d", unix.Major(st.Dev), unix.Minor(st.Dev))
	// Throttle rules name a whole disk; a partition's parent has it.
	sys := "/sys/dev/block/" + disk
	if _, err := os.Stat(sys + "/partition"); err == nil {
		b, err := os.ReadFile(sys + "/../dev")
		if err != nil {
			return nil, fmt.Errorf("the disk of partition %s: %w", disk, err)
		}
		disk = strings.TrimSpace(string(b))
	} else if _, err := os.Stat(sys); err != nil {
		return nil, fmt.Errorf("%s is not on a block device (%s): an emulated device needs a real disk under --dir", work, disk)
	}
	root := "/sys/fs/cgroup/blkio"
	if _, err := os.Stat(root + "/blkio.throttle.write_iops_device"); err != nil {
		return nil, fmt.Errorf("--device needs the cgroup v1 blkio controller at %s (and root): %w", root, err)
	}
	d := &device{iops: iops, bps: bps, dir: filepath.Join(root, fmt.Sprintf("cairn-bench-%d", os.Getpid())), disk: disk}
	if err := os.Mkdir(d.dir, 0o755); err != nil {
		return nil, err
	}
	for file, v := range map[string]int64{"read_iops_device": iops, "write_iops_device": iops, "read_bps_device": bps, "write_bps_device": bps} {
		if err := os.WriteFile(filepath.Join(d.dir, "blkio.throttle."+file), []byte(fmt.Sprintf("%s %d", disk, v)), 0o644); err != nil {
			d.close()
			return nil, fmt.Errorf("throttling %s: %w", disk, err)
		}
	}
	return d, nil
}

// enter moves a process (all its threads) into the device.
func (d *device) enter(pid int) {
	must(os.WriteFile(d.procs(), []byte(strconv.Itoa(pid)), 0o644))
}

// procs is the file a shell writes its pid to, to enter the device
// before it execs the program that does the I/O.
func (d *device) procs() string { return filepath.Join(d.dir, "cgroup.procs") }

func (d *device) String() string {
	return fmt.Sprintf("%d IOPS and %d MiB/s each way, disk %s", d.iops, d.bps>>20, d.disk)
}

// close removes the cgroup; its processes have exited by then.
func (d *device) close() { os.Remove(d.dir) }
