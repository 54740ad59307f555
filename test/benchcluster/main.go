// Command benchcluster measures what a pod sees of a Cairn volume on a
// real cluster (make bench-cluster, on the e2e kind cluster): fio in a pod
// on a Cairn claim (ext4 and raw block, one and three replicas, through
// the frontend the nodes use) against fio in a pod on a hostPath directory
// of the same node's disk, in the same run. Every target's pod runs on one
// node and stays up for the whole run; the workloads go round the targets
// in --rounds interleaved rounds and each figure is the median. Then it
// times a claim from creation to its pod Running, for one claim and for
// --provision claims at once. The target engine-socket (socket.go) is the
// same data plane on this machine with fio at the engine's NBD socket, the
// reference for the one-replica claims.
//
// Usage: go run ./test/benchcluster --context kind-cairn-e2e
package main

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"slices"
	"strings"
	"syscall"
	"time"
)

var (
	kubeContext = flag.String("context", "kind-cairn-e2e", "kubectl context of the cluster")
	node        = flag.String("node", "", "node the pods run on (default: the first worker)")
	image       = flag.String("image", "cairn-e2e-fio:local", "image with sh and fio, present on the nodes")
	rounds      = flag.Int("rounds", 3, "interleaved rounds; each figure is the median")
	runtime     = flag.Duration("runtime", 10*time.Second, "duration of each fio job")
	fileSize    = flag.String("size", "512M", "bytes each job covers (the file, or the start of the block device)")
	claimSize   = flag.String("claim-size", "1Gi", "size of each benchmark claim")
	only        = flag.String("targets", "hostpath,cairn-1,cairn-3,cairn-1-block,cairn-3-block,engine-socket", "targets to measure")
	cairnBin    = flag.String("cairn-data", "bin/cairn-data", "cairn-data binary of the tree deployed, for the target engine-socket (an engine with one buffered replica on this machine, fio at its NBD socket)")
	provisionN  = flag.Int("provision", 20, "claims created at once for the provisioning time (0: skip it)")
	keep        = flag.Bool("keep", false, "keep the namespace and its objects afterwards")
	cpuCensus   = flag.Bool("cpu", true, "count where each job's CPU goes (fio, engine, replicas, kernel threads, node agents...) from this machine's /proc: a kind cluster's nodes are containers here; skipped, saying so, where no kubelet runs on this machine")
)

const ns = "cairn-bench"

// target is one way for a pod to reach a disk, or (host) the engine's
// socket on this machine.
type target struct {
	name  string
	class string // StorageClass; empty for hostPath and engine-socket
	block bool
	host  bool // engine-socket: no pod; fio runs here (socket.go)
}

var allTargets = []target{
	{name: "hostpath"},
	{name: "cairn-1", class: "cairn-bench-1"},
	{name: "cairn-3", class: "cairn"},
	{name: "cairn-1-block", class: "cairn-bench-1-block", block: true},
	{name: "cairn-3-block", class: "cairn-block", block: true},
	{name: "engine-socket", host: true},
}

// path is where the pod's fio job reads and writes.
func (t target) path() string {
	if t.block {
		return "/dev/xvda"
	}
	return "/data/fio"
}

func (t target) pod() string { return "bench-" + t.name }

// workload is one fio job and the figure taken from its result.
type workload struct {
	name  string
	args  string
	unit  string
	lower bool // lower is better (latency)
	field func(fioDir) float64
}

type fioDir struct {
	IOPS     float64 `json:"iops"`
	BwBytes  float64 `json:"bw_bytes"`
	ClatNano struct {
		Mean float64 `json:"mean"`
	} `json:"clat_ns"`
}

type fioResult struct {
	Jobs []struct {
		Read  fioDir `json:"read"`
		Write fioDir `json:"write"`
	} `json:"jobs"`
}

var workloads = []workload{
	{"4k randwrite QD16", "--rw=randwrite --bs=4k --iodepth=16", "IOPS", false, func(d fioDir) float64 { return d.IOPS }},
	{"4k randread QD16", "--rw=randread --bs=4k --iodepth=16", "IOPS", false, func(d fioDir) float64 { return d.IOPS }},
	{"1M write QD4", "--rw=write --bs=1M --iodepth=4", "MiB/s", false, func(d fioDir) float64 { return d.BwBytes / (1 << 20) }},
	{"4k randwrite QD1 latency", "--rw=randwrite --bs=4k --iodepth=1", "µs", true, func(d fioDir) float64 { return d.ClatNano.Mean / 1000 }},
}

func fail(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "bench-cluster: "+format+"\n", args...)
	stopHost()
	os.Exit(1)
}

// kubectl runs kubectl on the benchmark's context with stdin in.
func kubectl(in string, args ...string) (string, error) {
	cmd := exec.Command("kubectl", append([]string{"--context", *kubeContext}, args...)...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	cmd.Stdin = strings.NewReader(in)
	if err := cmd.Run(); err != nil {
		return out.String(), fmt.Errorf("kubectl %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(errb.String()))
	}
	return strings.TrimSpace(out.String()), nil
}

func must(in string, args ...string) string {
	out, err := kubectl(in, args...)
	if err != nil {
		fail("%v", err)
	}
	return out
}

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func selectedTargets() []target {
	var out []target
	for _, name := range strings.Split(*only, ",") {
		i := slices.IndexFunc(allTargets, func(t target) bool { return t.name == name })
		if i < 0 {
			fail("unknown target %q", name)
		}
		out = append(out, allTargets[i])
	}
	return out
}

func main() {
	flag.Parse()
	if *node == "" {
		*node = must("", "get", "nodes", "-l", "!node-role.kubernetes.io/control-plane", "-o", "jsonpath={.items[0].metadata.name}")
	}
	targets := selectedTargets()
	defer stopHost()
	go func() {
		// Interrupted: the engine-socket processes and their directory
		// go too (the namespace stays, as with --keep).
		sig := make(chan os.Signal, 1)
		signal.Notify(sig, os.Interrupt, syscall.SIGTERM)
		fail("interrupted (%v)", <-sig)
	}()
	setup(targets)
	if !*keep {
		defer teardown()
	}
	fmt.Printf("bench-cluster: node %s, %d rounds of %s per job on %s, median; %s\n", *node, *rounds, *runtime, *fileSize, describeNodes())
	for _, t := range targets {
		switch {
		case t.class != "":
			fmt.Printf("  %s: %s\n", t.name, placement(t))
		case t.host:
			fmt.Printf("  %s: an engine and one buffered replica (unix socket) on this machine, %s, fio's nbd engine at the engine's socket\n", t.name, *cairnBin)
		}
	}
	census := *cpuCensus && censusAvailable()
	if *cpuCensus && !census {
		fmt.Println("  CPU census skipped: no kubelet among this machine's processes (the nodes are not kind containers here)")
	}
	results, cells := measure(targets, census)
	stopHost() // not needed for the provisioning times
	printTable(targets, results)
	if census {
		printCensus(targets, cells)
	}
	if *provisionN > 0 {
		provisioning(1)
		provisioning(*provisionN)
	}
}

// describeNodes says what the nodes are: their count, CPUs and kernel.
func describeNodes() string {
	out := must("", "get", "nodes", "-o", `jsonpath={range .items[*]}{.status.capacity.cpu} {.status.nodeInfo.kernelVersion}{"\n"}{end}`)
	lines := strings.Split(out, "\n")
	return fmt.Sprintf("%d nodes (%s CPUs each as the kubelet reports them, kernel %s)", len(lines), strings.Fields(lines[0])[0], strings.Fields(lines[0])[1])
}

// measure runs every workload on every target, round after round, and
// returns each target's samples per workload and, with census, where the
// CPU of each job went.
func measure(targets []target, census bool) (map[string][][]float64, map[string][][]cpuCell) {
	res := map[string][][]float64{}
	cells := map[string][][]cpuCell{}
	for _, t := range targets {
		res[t.name] = make([][]float64, len(workloads))
		cells[t.name] = make([][]cpuCell, len(workloads))
	}
	for r := range *rounds {
		for wi, w := range workloads {
			for _, t := range targets {
				var window <-chan cpuWindow
				if census {
					window = censusDuring(*runtime)
				}
				v, iops := runFio(t, w)
				res[t.name][wi] = append(res[t.name][wi], v)
				fmt.Printf("  round %d %-26s %-14s %10.1f %s", r+1, w.name, t.name, v, w.unit)
				if census {
					c := cellOf(<-window, iops)
					cells[t.name][wi] = append(cells[t.name][wi], c)
					fmt.Printf("  (%.0f µs CPU per I/O, %.0f%% busy)", sum(c.perIO), 100*c.busy)
				}
				fmt.Println()
			}
		}
	}
	return res, cells
}

func sum(m map[string]float64) float64 {
	t := 0.0
	for _, v := range m {
		t += v
	}
	return t
}

// runFio runs one job in the target's pod and returns its figure and its
// I/Os per second.
func runFio(t target, w workload) (float64, float64) {
	args := fioArgs(t, w)
	var out string
	if t.host {
		c := exec.Command("fio", args...)
		var errb bytes.Buffer
		c.Stderr = &errb
		b, err := c.Output()
		if err != nil {
			fail("fio on %s (%s): %v: %.300s", t.name, w.name, err, errb.String())
		}
		out = string(b)
	} else {
		out = must("", append([]string{"-n", ns, "exec", t.pod(), "--", "fio"}, args...)...)
	}
	var r fioResult
	if i := strings.IndexByte(out, '{'); i > 0 {
		out = out[i:]
	}
	if err := json.Unmarshal([]byte(out), &r); err != nil || len(r.Jobs) == 0 {
		fail("fio on %s (%s): cannot read its result (%v): %.300s", t.name, w.name, err, out)
	}
	d := r.Jobs[0].Write
	if strings.Contains(w.args, "read") {
		d = r.Jobs[0].Read
	}
	return w.field(d), d.IOPS
}

// fioArgs is fio's command line for workload w on target t: the same job
// everywhere, on the pod's file or device with libaio and O_DIRECT, or at
// the engine-socket target's NBD socket with fio's nbd engine.
func fioArgs(t target, w workload) []string {
	where := []string{"--filename=" + t.path(), "--direct=1", "--ioengine=libaio"}
	if t.host {
		where = host.fioTarget()
	}
	args := append([]string{"--name=b", "--output-format=json", "--size=" + *fileSize}, where...)
	args = append(args, "--time_based", fmt.Sprintf("--runtime=%ds", int(runtime.Seconds())), "--randrepeat=0", "--norandommap")
	return append(args, strings.Fields(w.args)...)
}

func printTable(targets []target, res map[string][][]float64) {
	fmt.Printf("\n%-26s", "median")
	for _, t := range targets {
		fmt.Printf(" %14s", t.name)
	}
	ratios := ratioColumns(targets)
	for _, rc := range ratios {
		fmt.Printf(" %*s", ratioWidth(rc), rc[0]+"÷"+rc[1])
	}
	fmt.Println()
	for wi, w := range workloads {
		fmt.Printf("%-26s", w.name+" ("+w.unit+")")
		for _, t := range targets {
			fmt.Printf(" %14.1f", median(res[t.name][wi]))
		}
		for _, rc := range ratios {
			fmt.Printf(" %*.2f", ratioWidth(rc), median(res[rc[0]][wi])/median(res[rc[1]][wi]))
		}
		fmt.Println()
	}
	fmt.Println("ratios: higher is better for IOPS and MiB/s; for latency it is how many times the second target's it takes")
}

// ratioWidth is the width of a ratio column: its heading's, at least 14.
func ratioWidth(rc [2]string) int { return max(14, len([]rune(rc[0]+"÷"+rc[1]))) }

// ratioColumns pairs every Cairn claim measured with hostpath, and the
// one-replica claims with engine-socket, when both of a pair were
// measured.
func ratioColumns(targets []target) [][2]string {
	has := func(name string) bool {
		return slices.ContainsFunc(targets, func(t target) bool { return t.name == name })
	}
	var out [][2]string
	for _, t := range targets {
		if t.class != "" && has("hostpath") {
			out = append(out, [2]string{t.name, "hostpath"})
		}
	}
	for _, t := range targets {
		if (t.name == "cairn-1" || t.name == "cairn-1-block") && has("engine-socket") {
			out = append(out, [2]string{t.name, "engine-socket"})
		}
	}
	return out
}
