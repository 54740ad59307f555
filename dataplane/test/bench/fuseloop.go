package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
)

// The FUSE/loop table: the path every node without nbd uses (the kind
// cluster's too). The same engine is measured through its NBD socket
// (fio's nbd engine, as the other cairn targets) and through the loop
// device of its FUSE frontend (fio with libaio and O_DIRECT on
// /dev/loopN, as a filesystem on it would be), with one replica over
// loopback TCP (cairn-1-tcp, fuse-1-tcp) and one local replica over a
// unix socket (cairn-1, fuse-1), plus the raw file for reference, in the
// same rounds, with the loop/nbd ratios. The replicas write through this
// node's page cache (buffered), as in the buffered table.

var fuseLoopTable = flag.Bool("fuse-loop", true, "also a table of the FUSE frontend's loop device (fio libaio, O_DIRECT on /dev/loopN) against the same engine's NBD socket, one replica over TCP and one local, 4 KiB random and 1 MiB sequential I/O (needs root, /dev/fuse and loop devices)")

// fuseLoopWorkloads adds 1 MiB sequential write and read to the 4 KiB
// random ones at QD32.
var fuseLoopWorkloads = []workload{
	{"1M seq write QD8 (MiB/s)", []string{"--rw=write", "--bs=1M", "--iodepth=8"}, func(j fioJob) float64 { return j.Write.BW / 1024 }, "MiB/s", false},
	{"1M seq read QD8 (MiB/s)", []string{"--rw=read", "--bs=1M", "--iodepth=8"}, func(j fioJob) float64 { return j.Read.BW / 1024 }, "MiB/s", false},
}

// fuseLoop is an engine with n replicas (the first local ones on unix
// sockets) serving its volume through the FUSE frontend; fio reads and
// writes its loop device with O_DIRECT. The engine reports the device
// through --ready-fd, as to the instance manager.
func fuseLoop(work, name string, n, local int) target {
	r, w, err := os.Pipe()
	must(err)
	defer r.Close()
	t := cairnWith(work, name, n, local, func() ([]string, []*os.File) {
		// Later flags win: these replace cairnWith's nbd frontend.
		return []string{"--frontend", "fuse", "--fuse-dir", filepath.Join(work, name+"-fuse"), "--ready-fd", "3"}, []*os.File{w}
	}, nil)
	b, err := io.ReadAll(r) // EOF once the engine wrote its report and closed it
	must(err)
	var report struct {
		Endpoint string `json:"endpoint"`
	}
	if err := json.Unmarshal(b, &report); err != nil || !strings.HasPrefix(report.Endpoint, "/dev/loop") {
		t.stop()
		must(fmt.Errorf("%s: the engine's ready report %q names no loop device (%v)", name, b, err)) //nolint:errorlint // err may be nil (a report without a loop device)
	}
	t.name = name
	t.engine = []string{"--ioengine=libaio", "--direct=1", "--filename=" + report.Endpoint}
	return t
}

// fuseLoopMissing says why this node cannot run the FUSE frontend ("" if
// it can).
func fuseLoopMissing() string {
	if os.Geteuid() != 0 {
		return "needs root (a FUSE mount and loop devices)"
	}
	for _, dev := range []string{"/dev/fuse", "/dev/loop-control"} {
		if _, err := os.Stat(dev); errors.Is(err, os.ErrNotExist) {
			return dev + " is missing"
		}
	}
	return ""
}

// fuseLoopCompare measures the loop devices against the NBD sockets.
func fuseLoopCompare(work string, targets map[string]func(string) target) {
	if why := fuseLoopMissing(); why != "" {
		fmt.Printf("\nno FUSE/loop table: %s\n", why)
		return
	}
	saved, savedDirect := workloads, direct
	defer func() { workloads, direct = saved, savedDirect }()
	workloads, direct = nil, false
	for _, w := range saved {
		if strings.HasPrefix(w.name, "4k rand") && strings.Contains(w.name, "QD32") {
			workloads = append(workloads, w)
		}
	}
	for _, w := range fuseLoopWorkloads {
		if strings.Contains(w.name, *filter) {
			workloads = append(workloads, w)
		}
	}
	if len(workloads) == 0 {
		return // --workloads left none of them
	}
	names := []string{"raw", "cairn-1-tcp", "fuse-1-tcp", "cairn-1", "fuse-1"}
	if *baseBin != "" {
		names = append(names, "fuse-1-base") // the same through an older build
	}
	table(work, "FUSE frontend's loop device (libaio, O_DIRECT) and NBD socket of the same engine, replicas buffered", names, targets)
}
