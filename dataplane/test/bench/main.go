// Command bench measures the data path with fio against, in one run:
//
//	raw       the raw file on the same disk (io_uring, buffered)
//	qemu-nbd  qemu-nbd serving a file on the same disk (our transport yardstick)
//	cairn-1   the engine with one replica, through its NBD frontend
//	cairn-3   the engine with three replicas (all on this one disk)
//
// for 4 KiB random write and read at QD32, 128 KiB sequential write, and
// 4 KiB QD1 write latency, and prints a table with ratios. Every job runs
// through the page cache and ends with an fsync (end_fsync=1), so all four
// have the same flush semantics. It also times a full rebuild of 1 GiB.
//
// Usage (make bench does this): go run ./test/bench --bin ../bin/cairn-data
package main

import (
	"bufio"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"
)

var (
	bin     = flag.String("bin", "bin/cairn-data", "cairn-data binary")
	dir     = flag.String("dir", "", "work directory on the disk to measure (default: a temporary directory)")
	size    = flag.String("size", "1G", "file and volume size")
	runtime = flag.Duration("runtime", 8*time.Second, "duration of each fio job")
	only    = flag.String("targets", "raw,qemu-nbd,cairn-1,cairn-3", "targets to measure (the ratio columns need all four)")
	rebuild = flag.Bool("rebuild", true, "also time a full rebuild")
)

type workload struct {
	name  string
	args  []string
	field func(fioJob) float64
	unit  string
	lower bool // lower is better (latency)
}

type fioJob struct {
	Read  fioDir `json:"read"`
	Write fioDir `json:"write"`
}

type fioDir struct {
	IOPS float64 `json:"iops"`
	BW   float64 `json:"bw"` // KiB/s
	Lat  struct {
		Mean float64 `json:"mean"` // ns
	} `json:"lat_ns"`
}

var workloads = []workload{
	{"4k randwrite QD32 (IOPS)", []string{"--rw=randwrite", "--bs=4k", "--iodepth=32"}, func(j fioJob) float64 { return j.Write.IOPS }, "IOPS", false},
	{"4k randread QD32 (IOPS)", []string{"--rw=randread", "--bs=4k", "--iodepth=32"}, func(j fioJob) float64 { return j.Read.IOPS }, "IOPS", false},
	{"128k seq write (MiB/s)", []string{"--rw=write", "--bs=128k", "--iodepth=8"}, func(j fioJob) float64 { return j.Write.BW / 1024 }, "MiB/s", false},
	{"4k randwrite QD1 latency (µs)", []string{"--rw=randwrite", "--bs=4k", "--iodepth=1"}, func(j fioJob) float64 { return j.Write.Lat.Mean / 1000 }, "µs", true},
}

type target struct {
	name    string
	engine  []string // fio args selecting the target
	control string   // the engine's control address (cairn targets)
	stop    func()
}

func must(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

// startProc runs cairn-data and returns its ready line's fields.
func startProc(args ...string) (*exec.Cmd, map[string]string) {
	cmd := exec.Command(*bin, args...)
	out, err := cmd.StdoutPipe()
	must(err)
	cmd.Stderr = nil
	must(cmd.Start())
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		must(fmt.Errorf("%s %v did not start: %v", *bin, args, err))
	}
	f := map[string]string{}
	for _, kv := range strings.Fields(line) {
		if k, v, ok := strings.Cut(kv, "="); ok {
			f[k] = v
		}
	}
	return cmd, f
}

func stopAll(cmds ...*exec.Cmd) {
	for _, c := range cmds {
		c.Process.Signal(os.Interrupt)
		c.Wait()
	}
}

func cairn(work string, n int) target {
	var procs []*exec.Cmd
	args := []string{"engine", "--name", "bench", "--frontend", "nbd", "--nbd-socket", filepath.Join(work, fmt.Sprintf("cairn%d.sock", n)), "--listen", "127.0.0.1:0"}
	for i := range n {
		c, f := startProc("replica", "--dir", filepath.Join(work, fmt.Sprintf("c%d-r%d", n, i)), "--size", *size, "--listen", "127.0.0.1:0", "--control-listen", "127.0.0.1:0")
		procs = append(procs, c)
		args = append(args, "--replica", f["data"]+","+f["control"])
	}
	e, f := startProc(args...)
	return target{name: fmt.Sprintf("cairn-%d", n), engine: []string{"--ioengine=nbd", "--uri=nbd+unix:///bench?socket=" + f["endpoint"]},
		control: f["control"], stop: func() { stopAll(append([]*exec.Cmd{e}, procs...)...) }}
}

func qemuNBD(work string) target {
	file := filepath.Join(work, "qemu.img")
	must(exec.Command("truncate", "-s", *size, file).Run())
	sock := filepath.Join(work, "qemu.sock")
	cmd := exec.Command("qemu-nbd", "-f", "raw", "--socket="+sock, "--cache=writeback", "--aio=threads", "--shared=8", "--persistent", file)
	must(cmd.Start())
	for i := 0; i < 100; i++ {
		if _, err := os.Stat(sock); err == nil {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	return target{name: "qemu-nbd", engine: []string{"--ioengine=nbd", "--uri=nbd+unix:///?socket=" + sock}, stop: func() { stopAll(cmd) }}
}

func raw(work string) target {
	file := filepath.Join(work, "raw.img")
	must(exec.Command("truncate", "-s", *size, file).Run())
	return target{name: "raw", engine: []string{"--ioengine=io_uring", "--filename=" + file}, stop: func() {}}
}

func fio(t target, w workload) float64 {
	args := append([]string{"--name=bench", "--output-format=json", "--size=" + *size, "--time_based",
		fmt.Sprintf("--runtime=%ds", int(runtime.Seconds())), "--end_fsync=1", "--randrepeat=0", "--norandommap"}, t.engine...)
	args = append(args, w.args...)
	out, err := exec.Command("fio", args...).Output()
	if err != nil {
		must(fmt.Errorf("fio on %s (%s): %v", t.name, w.name, err))
	}
	var res struct {
		Jobs []fioJob `json:"jobs"`
	}
	// fio's nbd engine prints a line before the JSON document.
	if i := strings.IndexByte(string(out), '{'); i > 0 {
		out = out[i:]
	}
	must(json.Unmarshal(out, &res))
	return w.field(res.Jobs[0])
}

// prefill writes the whole target once so reads hit data.
func prefill(t target) {
	args := append([]string{"--name=fill", "--rw=write", "--bs=1M", "--iodepth=4", "--size=" + *size, "--end_fsync=1"}, t.engine...)
	must(exec.Command("fio", args...).Run())
}

// measureRebuild fills a one-replica volume, adds a fresh replica and
// times the full rebuild (copy and verify) until it is RW.
func measureRebuild(work string) time.Duration {
	t := cairn(work, 1)
	defer t.stop()
	prefill(t)
	c, f := startProc("replica", "--dir", filepath.Join(work, "rebuild-target"), "--size", *size, "--listen", "127.0.0.1:0", "--control-listen", "127.0.0.1:0")
	defer stopAll(c)
	start := time.Now()
	out, err := exec.Command(*bin, "ctl", "--engine", t.control, "add", f["data"]+","+f["control"], "--wait").CombinedOutput()
	if err != nil {
		must(fmt.Errorf("rebuild: %v\n%s", err, out))
	}
	return time.Since(start)
}

func main() {
	flag.Parse()
	work := *dir
	if work == "" {
		var err error
		work, err = os.MkdirTemp("/var/tmp", "cairn-bench-")
		must(err)
		defer os.RemoveAll(work)
	}
	targets := map[string]func(string) target{"raw": raw, "qemu-nbd": qemuNBD,
		"cairn-1": func(w string) target { return cairn(w, 1) }, "cairn-3": func(w string) target { return cairn(w, 3) }}
	results := map[string][]float64{}
	var names []string
	for _, name := range strings.Split(*only, ",") {
		mk := targets[name]
		if mk == nil {
			must(fmt.Errorf("unknown target %q", name))
		}
		t := mk(work)
		names = append(names, t.name)
		fmt.Fprintf(os.Stderr, "bench: %s: prefill\n", t.name)
		prefill(t)
		for _, w := range workloads {
			fmt.Fprintf(os.Stderr, "bench: %s: %s\n", t.name, w.name)
			results[t.name] = append(results[t.name], fio(t, w))
		}
		t.stop()
	}
	fmt.Printf("\n%-32s", "workload")
	for _, n := range names {
		fmt.Printf("%12s", n)
	}
	fmt.Printf("%14s%14s%14s\n", "c1/qemu-nbd", "c3/raw", "c3/(raw/3)")
	for i, w := range workloads {
		fmt.Printf("%-32s", w.name)
		for _, n := range names {
			fmt.Printf("%12.0f", results[n][i])
		}
		if len(names) < 4 {
			fmt.Println()
			continue
		}
		r, q, c1, c3 := results["raw"][i], results["qemu-nbd"][i], results["cairn-1"][i], results["cairn-3"][i]
		if w.lower {
			fmt.Printf("%14.2f%14.2f%14s\n", c1/q, c3/r, "-")
		} else {
			fmt.Printf("%14.2f%14.2f%14.2f\n", c1/q, c3/r, c3/(r/3))
		}
	}
	if !*rebuild {
		return
	}
	rb := measureRebuild(work)
	fmt.Printf("\nfull rebuild of %s (written data) to a new replica: %.1f s\n", *size, rb.Seconds())
}
