// Command bench measures the data path with fio against, in one run:
//
//	raw          the raw file on the same disk (io_uring, buffered)
//	qemu-nbd     qemu-nbd serving a file on the same disk (our transport yardstick)
//	cairn-1         the engine with one local replica (unix socket), through its NBD frontend
//	cairn-1-tcp  the same with the replica reached over loopback TCP
//	cairn-3      the engine with three replicas (all on this one disk): one
//	             local (unix socket), two over loopback TCP as if remote
//	cairn-3-enc  cairn-3 encrypting the volume at rest (only in its own
//	             table unless --targets names it; see encryption.go)
//	cairn-3-base cairn-3 run by another cairn-data binary (--base-bin), an
//	             older build, to tell whether a change made cairn-3 cost more
//	             (only when --targets names it)
//	fuse-1, fuse-1-tcp  cairn-1 and cairn-1-tcp through the FUSE frontend's
//	             loop device (only in their own table unless --targets
//	             names them; see fuseloop.go)
//	fuse-1-base  fuse-1 run by the --base-bin binary (in the FUSE table
//	             when --base-bin is given)
//
// for 4 KiB random write and read at QD32 and QD16, 128 KiB sequential
// write, and 4 KiB QD1 write latency, and prints a table with ratios: with buffered
// I/O everywhere (the page cache of this node takes the writes), and with
// --io buffered,direct also with O_DIRECT everywhere (raw with direct=1,
// qemu-nbd --cache=none, replicas --direct-io: every write reaches the
// disk; qemu-nbd then with --aio=native). Every job ends with
// an fsync (end_fsync=1), so within a table all targets have the same
// flush semantics. Each figure is the median of --rounds interleaved
// rounds. It also times a full rebuild of 1 GiB, buffered and with
// --direct-io replicas.
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
	"slices"
	"strings"
	"time"

	"github.com/cairn-io/cairn/dataplane/testutil/procstat"
)

var (
	bin      = flag.String("bin", "bin/cairn-data", "cairn-data binary")
	baseBin  = flag.String("base-bin", "", "for the targets cairn-3-base and fuse-1-base: another cairn-data binary (e.g. an older commit's build) measured beside cairn-3 and fuse-1 in the same rounds")
	dir      = flag.String("dir", "", "work directory on the disk to measure (default: a temporary directory)")
	size     = flag.String("size", "1G", "file and volume size")
	runtime  = flag.Duration("runtime", 8*time.Second, "duration of each fio job")
	only     = flag.String("targets", "raw,qemu-nbd,cairn-1,cairn-1-tcp,cairn-3", "targets to measure (a ratio column is printed when both its targets were)")
	rebuild  = flag.Bool("rebuild", true, "also time a full rebuild, buffered and with --direct-io replicas")
	rounds   = flag.Int("rounds", 3, "rounds over all targets; the table shows each figure's median")
	modes    = flag.String("io", "buffered,direct", "I/O modes, a table each: buffered (page cache everywhere) and/or direct (O_DIRECT everywhere: raw, qemu-nbd --cache=none, replicas --direct-io); none: only the device-bound table")
	filter   = flag.String("workloads", "", "only the workloads whose name contains this text (default: all)")
	procLogs = flag.Bool("proc-logs", false, "pass the cairn-data processes' logs through to standard error (a rebuild logs the time of its copy and of its final sync there); by default they are dropped")
	devFlag  = flag.String("device", "iops=3000,bps=125M", "after the --io tables, one more with direct I/O on an emulated device-bound disk, iops=N,bps=SIZE each way (the default is a cloud SSD's), shared by the processes that touch the disk for each target (cgroup v1 blkio throttle, root); off: no such table")
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

func (j fioJob) ios() float64 { return j.Read.TotalIOs + j.Write.TotalIOs }

type fioDir struct {
	IOPS     float64 `json:"iops"`
	TotalIOs float64 `json:"total_ios"`
	BW       float64 `json:"bw"` // KiB/s
	Lat      struct {
		Mean float64 `json:"mean"` // ns
	} `json:"lat_ns"`
}

var workloads = []workload{
	{"4k randwrite QD32 (IOPS)", []string{"--rw=randwrite", "--bs=4k", "--iodepth=32"}, func(j fioJob) float64 { return j.Write.IOPS }, "IOPS", false},
	{"4k randread QD32 (IOPS)", []string{"--rw=randread", "--bs=4k", "--iodepth=32"}, func(j fioJob) float64 { return j.Read.IOPS }, "IOPS", false},
	{"4k randwrite QD16 (IOPS)", []string{"--rw=randwrite", "--bs=4k", "--iodepth=16"}, func(j fioJob) float64 { return j.Write.IOPS }, "IOPS", false},
	{"4k randread QD16 (IOPS)", []string{"--rw=randread", "--bs=4k", "--iodepth=16"}, func(j fioJob) float64 { return j.Read.IOPS }, "IOPS", false},
	{"128k seq write (MiB/s)", []string{"--rw=write", "--bs=128k", "--iodepth=8"}, func(j fioJob) float64 { return j.Write.BW / 1024 }, "MiB/s", false},
	{"4k randwrite QD1 latency (µs)", []string{"--rw=randwrite", "--bs=4k", "--iodepth=1"}, func(j fioJob) float64 { return j.Write.Lat.Mean / 1000 }, "µs", true},
}

type target struct {
	name    string
	fioDisk bool        // fio itself does the target's disk I/O (raw)
	engine  []string    // fio args selecting the target
	control string      // the engine's control address (cairn targets)
	procs   []*exec.Cmd // the target's processes, for their CPU time
	stop    func()
}

func must(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		for i := len(atExit) - 1; i >= 0; i-- {
			atExit[i]()
		}
		os.Exit(1)
	}
}

// atExit are stops must runs before it exits, last registered first: an
// instance manager started by the bench would otherwise outlive it with
// its children, mounts and ports.
var atExit []func()

// startProc runs cairn-data and returns its ready line's fields.
func startProc(args ...string) (*exec.Cmd, map[string]string) {
	return startProcFiles(nil, args...)
}

// startProcFiles is startProc with files inherited as descriptors 3, 4, ...
func startProcFiles(files []*os.File, args ...string) (*exec.Cmd, map[string]string) {
	cmd := exec.Command(procBin, args...)
	cmd.ExtraFiles = files
	out, err := cmd.StdoutPipe()
	must(err)
	if *procLogs {
		cmd.Stderr = os.Stderr
	}
	must(cmd.Start())
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		must(fmt.Errorf("%s %v did not start: %w", procBin, args, err))
	}
	f := map[string]string{}
	for _, kv := range strings.Fields(line) {
		if k, v, ok := strings.Cut(kv, "="); ok {
			f[k] = v
		}
	}
	return cmd, f
}

// procBin is the binary startProc runs: --bin, or --base-bin while
// cairn-3-base starts (withBin).
var procBin string

// withBin runs start with startProc running binary b.
func withBin(b string, start func() target) target {
	old := procBin
	procBin = b
	defer func() { procBin = old }()
	return start()
}

// direct is whether the table being measured uses O_DIRECT everywhere.
var direct bool

// dev is the emulated device (--device), nil without one.
var dev *device

// fioCmd is fio with args, inside the emulated device when it is the
// process that touches the disk.
func fioCmd(t target, args []string) *exec.Cmd {
	if dev != nil && t.fioDisk {
		return exec.Command("sh", append([]string{"-c", `echo $$ > "$0" && exec fio "$@"`, dev.procs()}, args...)...)
	}
	return exec.Command("fio", args...)
}

func stopAll(cmds ...*exec.Cmd) {
	for _, c := range cmds {
		c.Process.Signal(os.Interrupt)
		_ = c.Wait() // interrupted: it exits with an error by design
	}
}

// cairn starts an engine with n replicas, the first local ones reached over
// unix sockets (a replica on the engine's node), the rest over loopback TCP
// (standing in for replicas on other nodes).
func cairn(work, name string, n, local int) target {
	return cairnWith(work, name, n, local, nil, nil)
}

// cairnWith is cairn with engine arguments and the files they name
// (descriptors 3, ...).
func cairnWith(work, name string, n, local int, extra, replicaExtra func() ([]string, []*os.File)) target {
	var procs []*exec.Cmd
	sock := filepath.Join(work, name+".sock")
	args := []string{"engine", "--name", "bench", "--frontend", "nbd", "--nbd-socket", sock, "--nbd-kernel", "off", "--listen", "127.0.0.1:0"}
	for i := range n {
		listen := "127.0.0.1:0"
		if i < local {
			listen = "unix:" + filepath.Join(work, fmt.Sprintf("%s-r%d.sock", name, i))
		}
		rargs := []string{"replica", "--dir", filepath.Join(work, fmt.Sprintf("%s-r%d", name, i)), "--size", *size, "--listen", listen, "--control-listen", "127.0.0.1:0"}
		if direct {
			rargs = append(rargs, "--direct-io")
		}
		var rfiles []*os.File
		if replicaExtra != nil {
			more, fs := replicaExtra()
			rargs, rfiles = append(rargs, more...), fs
		}
		c, f := startProcFiles(rfiles, rargs...)
		for _, fl := range rfiles {
			fl.Close()
		}
		if dev != nil {
			dev.enter(c.Process.Pid)
		}
		procs = append(procs, c)
		args = append(args, "--replica", f["data"]+","+f["control"])
	}
	var files []*os.File
	if extra != nil {
		more, fs := extra()
		args, files = append(args, more...), fs
	}
	e, f := startProcFiles(files, args...)
	for _, fl := range files {
		fl.Close() // the engine has its copy
	}
	return target{name: name, engine: []string{"--ioengine=nbd", "--uri=nbd+unix:///bench?socket=" + sock},
		control: f["control"], procs: append([]*exec.Cmd{e}, procs...), stop: func() { stopAll(append([]*exec.Cmd{e}, procs...)...) }}
}

func qemuNBD(work string) target {
	file := filepath.Join(work, "qemu.img")
	must(exec.Command("truncate", "-s", *size, file).Run())
	sock := filepath.Join(work, "qemu.sock")
	cache, aio := "--cache=writeback", "--aio=threads"
	if direct {
		// O_DIRECT, submitted through Linux AIO: qemu's fastest setting
		// for a raw file without the page cache.
		cache, aio = "--cache=none", "--aio=native"
	}
	cmd := exec.Command("qemu-nbd", "-f", "raw", "--socket="+sock, cache, aio, "--shared=8", "--persistent", file)
	must(cmd.Start())
	if dev != nil {
		dev.enter(cmd.Process.Pid)
	}
	for i := 0; i < 100; i++ {
		if _, err := os.Stat(sock); err == nil {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	return target{name: "qemu-nbd", engine: []string{"--ioengine=nbd", "--uri=nbd+unix:///?socket=" + sock}, procs: []*exec.Cmd{cmd}, stop: func() { stopAll(cmd) }}
}

func raw(work string) target {
	file := filepath.Join(work, "raw.img")
	must(exec.Command("truncate", "-s", *size, file).Run())
	args := []string{"--ioengine=io_uring", "--filename=" + file}
	if direct {
		args = append(args, "--direct=1")
	}
	return target{name: "raw", engine: args, fioDisk: true, stop: func() {}}
}

// cpuTime is the CPU time (user and system) the processes used so far.
func cpuTime(procs []*exec.Cmd) time.Duration {
	pids := make([]int, len(procs))
	for i, c := range procs {
		pids[i] = c.Process.Pid
	}
	return cpuTimePids(pids)
}

// cpuTimePids is the user and system CPU time the processes have used.
func cpuTimePids(pids []int) time.Duration {
	var total time.Duration
	for _, pid := range pids {
		st, err := procstat.Read(pid)
		must(err)
		total += st.CPU
	}
	return total
}

// fio runs one job and returns its figure and the CPU time per I/O that
// fio and the target's processes used for it.
func fio(t target, w workload) (float64, time.Duration) {
	args := append([]string{"--name=bench", "--output-format=json", "--size=" + *size, "--time_based",
		fmt.Sprintf("--runtime=%ds", int(runtime.Seconds())), "--end_fsync=1", "--randrepeat=0", "--norandommap"}, t.engine...)
	args = append(args, w.args...)
	before := cpuTime(t.procs)
	cmd := fioCmd(t, args)
	out, err := cmd.Output()
	if err != nil {
		must(fmt.Errorf("fio on %s (%s): %w", t.name, w.name, err))
	}
	cpu := cpuTime(t.procs) - before + cmd.ProcessState.UserTime() + cmd.ProcessState.SystemTime()
	var res struct {
		Jobs []fioJob `json:"jobs"`
	}
	// fio's nbd engine prints a line before the JSON document.
	if i := strings.IndexByte(string(out), '{'); i > 0 {
		out = out[i:]
	}
	must(json.Unmarshal(out, &res))
	j := res.Jobs[0]
	return w.field(j), time.Duration(float64(cpu) / max(j.ios(), 1))
}

// syncDisk writes back what earlier jobs left dirty, so that no job pays
// for another's writeback.
func syncDisk() { must(exec.Command("sync").Run()) }

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// prefill writes the whole target once so reads hit data.
func prefill(t target) {
	args := append([]string{"--name=fill", "--rw=write", "--bs=1M", "--iodepth=4", "--size=" + *size, "--end_fsync=1"}, t.engine...)
	must(fioCmd(t, args).Run())
}

// rebuildGoals are the performance issue's goals for a full rebuild of
// 1 GiB, verification included: buffered replicas, and replicas with
// --direct-io.
var rebuildGoals = map[bool]float64{false: 2, true: 3}

// measureRebuild fills a one-replica volume, adds a fresh replica and
// times the full rebuild (copy and verify) until it is RW, with every
// replica on --direct-io when direct is set. It returns the wall time and
// the CPU time the engine and both replicas used meanwhile (the figure a
// busy machine disturbs least).
func measureRebuild(work, name string) (time.Duration, time.Duration) {
	target := filepath.Join(work, name+"-target")
	defer func() { // each run writes two volumes: leave no gigabytes behind
		os.RemoveAll(target)
		os.RemoveAll(filepath.Join(work, name+"-r0"))
	}()
	t := cairn(work, name, 1, 1)
	defer t.stop()
	prefill(t)
	syncDisk()
	args := []string{"replica", "--dir", target, "--size", *size, "--listen", "127.0.0.1:0", "--control-listen", "127.0.0.1:0"}
	if direct {
		args = append(args, "--direct-io")
	}
	c, f := startProc(args...)
	defer stopAll(c)
	procs := append([]*exec.Cmd{c}, t.procs...)
	cpu, start := cpuTime(procs), time.Now()
	out, err := exec.Command(*bin, "ctl", "--engine", t.control, "add", f["data"]+","+f["control"], "--wait").CombinedOutput()
	if err != nil {
		must(fmt.Errorf("rebuild: %w\n%s", err, out))
	}
	return time.Since(start), cpuTime(procs) - cpu
}

// measureDiskFloor times what any rebuild of the volume must at least
// do on this disk: write its size into a new file and make it durable
// (fio, 4 MiB O_DIRECT writes, four in flight, then fsync; the file not
// preallocated, as a replica's layers are sparse), measured
// beside the rebuilds so the shared machine's state applies to both.
func measureDiskFloor(work string) time.Duration {
	file := filepath.Join(work, "rebuild-floor")
	defer os.Remove(file)
	syncDisk()
	start := time.Now()
	if out, err := exec.Command("fio", "--name=floor", "--filename="+file, "--rw=write", "--bs=4M", "--size="+*size,
		"--direct=1", "--ioengine=libaio", "--iodepth=4", "--end_fsync=1", "--fallocate=none", "--output-format=terse").CombinedOutput(); err != nil {
		must(fmt.Errorf("disk floor: %w\n%s", err, out))
	}
	return time.Since(start)
}

// rebuildTable times full rebuilds, buffered and with --direct-io
// replicas, interleaved over the rounds with the disk's floor
// (measureDiskFloor), and prints each one's median beside its goal and
// as a multiple of the floor's.
func rebuildTable(work string) {
	samples, cpus := map[bool][]float64{}, map[bool][]float64{}
	var floor []float64
	for round := 1; round <= *rounds; round++ {
		fmt.Fprintf(os.Stderr, "bench: rebuild: round %d/%d: the disk's floor\n", round, *rounds)
		floor = append(floor, measureDiskFloor(work).Seconds())
		for _, d := range []bool{false, true} {
			direct = d
			mode := map[bool]string{false: "buffered", true: "direct"}[d]
			fmt.Fprintf(os.Stderr, "bench: rebuild: round %d/%d: %s\n", round, *rounds, mode)
			wall, cpu := measureRebuild(work, "rebuild-"+mode)
			samples[d], cpus[d] = append(samples[d], wall.Seconds()), append(cpus[d], cpu.Seconds())
		}
	}
	direct = false
	f := median(floor)
	fmt.Printf("\nfull rebuild of %s (written data) to a new replica, copy and verify (median of %d; goal for 1 GiB; CPU: engine and both replicas;\n", *size, *rounds)
	fmt.Printf("floor: %s written to a new file on the same disk with O_DIRECT and made durable, which every rebuild must at least do):\n", *size)
	fmt.Printf("  %-22s %5.1f s\n", "floor", f)
	for _, d := range []bool{false, true} {
		name := map[bool]string{false: "buffered", true: "--direct-io replicas"}[d]
		m := median(samples[d])
		fmt.Printf("  %-22s %5.1f s   goal ≤ %.0f s   CPU %4.1f s   %4.2f× the floor\n", name, m, rebuildGoals[d], median(cpus[d]), m/f)
	}
}

// table measures every target in rounds and prints the medians with
// ratios.
// table measures the targets in one I/O mode, prints its tables and
// returns the median CPU per I/O by target and workload.
func table(work, mode string, names []string, targets map[string]func(string) target) map[string][]float64 {
	// samples[target][workload] holds one figure per round; the rounds
	// interleave the targets so that a slow spell of the shared machine
	// does not land on one target only. The table shows medians.
	samples := map[string][][]float64{}
	cpuSamples := map[string][][]float64{} // CPU µs per I/O
	for round := 1; round <= *rounds; round++ {
		for _, name := range names {
			tdir := filepath.Join(work, name)
			must(os.MkdirAll(tdir, 0o755))
			t := targets[name](tdir)
			fmt.Fprintf(os.Stderr, "bench: %s: round %d/%d: %s: prefill\n", mode, round, *rounds, name)
			prefill(t)
			if samples[name] == nil {
				samples[name] = make([][]float64, len(workloads))
				cpuSamples[name] = make([][]float64, len(workloads))
			}
			for i, w := range workloads {
				fmt.Fprintf(os.Stderr, "bench: %s: round %d/%d: %s: %s\n", mode, round, *rounds, name, w.name)
				syncDisk()
				v, cpu := fio(t, w)
				samples[name][i] = append(samples[name][i], v)
				cpuSamples[name][i] = append(cpuSamples[name][i], float64(cpu)/float64(time.Microsecond))
			}
			t.stop()
			os.RemoveAll(tdir)
		}
	}
	title := mode + " I/O"
	if dev != nil {
		title = "direct I/O on an emulated device-bound disk (" + dev.String() + ")"
	}
	printTable(fmt.Sprintf("%s, median of %d rounds", title, *rounds), names, medians(samples),
		func(w workload) string { return w.name }, 0, ratios)
	var plain []ratio // a CPU cost against a third of another's means nothing
	for _, r := range ratios {
		if r.div == 1 {
			plain = append(plain, r)
		}
	}
	// cairn-3 keeps three copies: its cost per copy against qemu-nbd's one.
	plain = append(plain, ratio{"c3/3/qemu", "cairn-3", "qemu-nbd", 1.0 / 3})
	cpu := medians(cpuSamples)
	printTable(fmt.Sprintf("CPU time per I/O (fio and the target's processes; µs), median of %d rounds", *rounds), names, cpu,
		func(w workload) string { return strings.TrimSuffix(w.name, " ("+w.unit+")") }, 1, plain)
	return cpu
}

// directCPUGoal is the performance issue's goal for the CPU a 4 KiB
// random write costs on --direct-io replicas against buffered ones, three
// replicas, measured in the same run.
const directCPUGoal = 1.5

// printDirectOverBuffered prints, per target and workload, the CPU per I/O
// of the direct table divided by the buffered table's.
func printDirectOverBuffered(names []string, buffered, direct map[string][]float64) {
	fmt.Printf("\nCPU per I/O, direct I/O ÷ buffered (same run; goal for cairn-3's 4 KiB random writes: <= %.1f)\n%-32s", directCPUGoal, "workload")
	for _, n := range names {
		fmt.Printf("%13s", n)
	}
	fmt.Println()
	for i, w := range workloads {
		fmt.Printf("%-32s", strings.TrimSuffix(w.name, " ("+w.unit+")"))
		for _, n := range names {
			b, d := buffered[n], direct[n]
			if i >= len(b) || i >= len(d) || b[i] == 0 {
				fmt.Printf("%13s", "-")
				continue
			}
			fmt.Printf("%13.2f", d[i]/b[i])
		}
		fmt.Println()
	}
}

// ratios are the ratio columns a table shows when both their targets
// were measured.
var ratios = []ratio{{"c1/qemu-nbd", "cairn-1", "qemu-nbd", 1}, {"c1tcp/qemu", "cairn-1-tcp", "qemu-nbd", 1},
	{"c3/raw", "cairn-3", "raw", 1}, {"c3/base", "cairn-3", "cairn-3-base", 1}, {"c3/(raw/3)", "cairn-3", "raw", 3}, {"enc/c3", "cairn-3-enc", "cairn-3", 1},
	{"key/tcp", "cairn-1-key", "cairn-1-tcp", 1}, {"tls/tcp", "cairn-1-tls", "cairn-1-tcp", 1},
	{"f1tcp/c1tcp", "fuse-1-tcp", "cairn-1-tcp", 1}, {"f1/c1", "fuse-1", "cairn-1", 1}, {"f1/base", "fuse-1", "fuse-1-base", 1}}

// ratio is a column dividing one target's figures by another's (by a
// fraction div of them).
type ratio struct {
	name, num, den string
	div            float64
}

// printTable prints one row per workload: each target's value with prec
// decimals, then every ratio whose two targets were measured.
func printTable(title string, names []string, values map[string][]float64, label func(workload) string, prec int, ratios []ratio) {
	var shown []ratio
	for _, r := range ratios {
		if values[r.num] != nil && values[r.den] != nil {
			shown = append(shown, r)
		}
	}
	fmt.Printf("\n%s\n%-32s", title, "workload")
	for _, n := range names {
		fmt.Printf("%13s", n)
	}
	for _, r := range shown {
		fmt.Printf("%13s", r.name)
	}
	fmt.Println()
	for i, w := range workloads {
		fmt.Printf("%-32s", label(w))
		for _, n := range names {
			fmt.Printf("%13.*f", prec, values[n][i])
		}
		for _, r := range shown {
			if w.lower && r.div != 1 {
				fmt.Printf("%13s", "-") // latency against a third of raw means nothing
				continue
			}
			fmt.Printf("%13.2f", values[r.num][i]/(values[r.den][i]/r.div))
		}
		fmt.Println()
	}
}

// medians maps each target's samples to their medians, per workload.
func medians(samples map[string][][]float64) map[string][]float64 {
	m := map[string][]float64{}
	for name, ws := range samples {
		for _, xs := range ws {
			m[name] = append(m[name], median(xs))
		}
	}
	return m
}

// deviceTable measures the targets with direct I/O on the emulated
// device (--device), or says why it cannot.
func deviceTable(work string, names []string, targets map[string]func(string) target) {
	iops, bps, err := parseDeviceLimit(*devFlag)
	must(err)
	d, err := newDevice(work, iops, bps)
	if err != nil {
		fmt.Printf("\nno device-bound table: %v\n", err)
		return
	}
	defer d.close()
	// The throttle, not the shared CPUs, sets these figures, and they
	// repeat to within a few IOPS: one round is enough.
	saved := *rounds
	dev, direct, *rounds = d, true, 1
	defer func() { dev, direct, *rounds = nil, false, saved }()
	table(work, "device", names, targets)
}

// benchTargets are the targets --targets can name, each started in a
// work directory.
func benchTargets() map[string]func(string) target {
	return map[string]func(string) target{"raw": raw, "qemu-nbd": qemuNBD,
		"cairn-1":     func(w string) target { return cairn(w, "cairn-1", 1, 1) },
		"cairn-1-tcp": func(w string) target { return cairn(w, "cairn-1-tcp", 1, 0) },
		"cairn-3":     func(w string) target { return cairn(w, "cairn-3", 3, 1) },
		"cairn-3-enc": encrypted,
		"cairn-3-base": func(w string) target {
			if *baseBin == "" {
				must(fmt.Errorf("target cairn-3-base needs --base-bin"))
			}
			return withBin(*baseBin, func() target { return cairn(w, "cairn-3-base", 3, 1) })
		},
		"cairn-1-key": func(w string) target { return secured(w, "cairn-1-key", false) },
		"cairn-1-tls": func(w string) target { return secured(w, "cairn-1-tls", true) },
		"fuse-1":      func(w string) target { return fuseLoop(w, "fuse-1", 1, 1) },
		"fuse-1-tcp":  func(w string) target { return fuseLoop(w, "fuse-1-tcp", 1, 0) },
		"fuse-1-base": func(w string) target {
			if *baseBin == "" {
				must(fmt.Errorf("target fuse-1-base needs --base-bin"))
			}
			return withBin(*baseBin, func() target { return fuseLoop(w, "fuse-1-base", 1, 1) })
		}}
}

func main() {
	flag.Parse()
	procBin = *bin
	if *filter != "" {
		var keep []workload
		for _, w := range workloads {
			if strings.Contains(w.name, *filter) {
				keep = append(keep, w)
			}
		}
		if len(keep) == 0 {
			must(fmt.Errorf("no workload name contains %q", *filter))
		}
		workloads = keep
	}
	work := *dir
	if work == "" {
		var err error
		work, err = os.MkdirTemp("/var/tmp", "cairn-bench-")
		must(err)
		defer os.RemoveAll(work)
	}
	if *footprintN > 0 && *footprintIM {
		footprintIMTable(work, *footprintN)
		return
	}
	if *footprintN > 0 {
		footprintTable(work, *footprintN)
		return
	}
	targets := benchTargets()
	names := strings.Split(*only, ",")
	for _, name := range names {
		if targets[name] == nil {
			must(fmt.Errorf("unknown target %q", name))
		}
	}
	cpuByMode := map[string]map[string][]float64{}
	for _, mode := range strings.Split(*modes, ",") {
		if mode == "none" {
			continue
		}
		switch mode {
		case "buffered", "direct":
			direct = mode == "direct"
		default:
			must(fmt.Errorf("--io %q: use buffered and/or direct", mode))
		}
		cpuByMode[mode] = table(work, mode, names, targets)
	}
	if cpuByMode["buffered"] != nil && cpuByMode["direct"] != nil {
		printDirectOverBuffered(names, cpuByMode["buffered"], cpuByMode["direct"])
	}
	if *devFlag != "off" {
		deviceTable(work, names, targets)
	}
	if *encTable {
		encryptionTable(work, targets)
	}
	if *dataPortTable {
		dataPort(work, targets)
	}
	if *fuseLoopTable {
		fuseLoopCompare(work, targets)
	}
	if !*rebuild {
		return
	}
	rebuildTable(work)
}
