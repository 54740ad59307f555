package main

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/cairn-io/cairn/dataplane/testutil/procstat"
)

// The CPU census says where a job's CPU goes on a kind cluster, whose
// nodes are containers on this machine: every process of every node is in
// this machine's /proc. In the middle of each fio job (away from its start
// and end) it reads every process's CPU time and the machine's, twice, and
// charges the difference to a part of the path: fio (with the kernel work
// it does in its own system calls: ext4, the loop device's submission),
// the Cairn engines, the replicas, the instance managers, kernel threads
// (the loop device's workers, softirq threads), interrupts, the node
// agents (kubelet, containerd, kube-proxy, kindnet) and the control plane
// (API server, etcd, controllers, Cairn's manager and CSI). Dividing by the
// I/Os fio did in that window gives µs of CPU per I/O, and the machine's
// busy share says whether the row is bound by CPU.

// cpuParts are the census's parts in the order they are printed.
var cpuParts = []string{"fio", "engine", "replicas", "inst-mgr", "kthreads", "irq", "node-agents", "ctl-plane", "other"}

// cpuSample is one reading: CPU time per process and the machine's
// totals (in clock ticks).
type cpuSample struct {
	at    time.Time
	procs map[int]procCPU
	busy  uint64 // machine ticks not idle or iowait
	total uint64
	irq   uint64 // irq + softirq
}

type procCPU struct {
	part string
	cpu  time.Duration
}

// clockTicks is USER_HZ, the unit of /proc/stat's totals: 100 on every
// Linux architecture Go runs on.
const clockTicks = 100

// censusAvailable says whether the nodes' processes are visible here:
// a kubelet in this machine's /proc.
func censusAvailable() bool {
	dirs, _ := filepath.Glob("/proc/[0-9]*")
	for _, d := range dirs {
		if comm, err := os.ReadFile(d + "/comm"); err == nil && strings.TrimSpace(string(comm)) == "kubelet" {
			return true
		}
	}
	return false
}

func readCPU() cpuSample {
	s := cpuSample{at: time.Now(), procs: map[int]procCPU{}}
	if b, err := os.ReadFile("/proc/stat"); err == nil {
		line, _, _ := bytes.Cut(b, []byte("\n"))
		f := strings.Fields(string(line)) // cpu user nice system idle iowait irq softirq steal ...
		for i := 1; i < len(f) && i <= 8; i++ {
			v, _ := strconv.ParseUint(f[i], 10, 64)
			s.total += v
			if i != 4 && i != 5 {
				s.busy += v
			}
			if i == 6 || i == 7 {
				s.irq += v
			}
		}
	}
	dirs, _ := filepath.Glob("/proc/[0-9]*")
	for _, d := range dirs {
		pid, err := strconv.Atoi(filepath.Base(d))
		if err != nil {
			continue
		}
		st, err := procstat.Read(pid)
		if err != nil {
			continue // gone meanwhile
		}
		s.procs[pid] = procCPU{part: classify(d, st.Comm, st.Flags), cpu: st.CPU}
	}
	return s
}

// classify names the part a process belongs to from its command name and,
// for cairn-data, its subcommand.
func classify(dir, comm string, flags uint64) string {
	if flags&procstat.PFKthread != 0 {
		return "kthreads"
	}
	switch comm {
	case "fio":
		return "fio"
	case "cairn-data":
		cmdline, _ := os.ReadFile(dir + "/cmdline")
		args := strings.Split(string(cmdline), "\x00")
		if len(args) > 1 {
			switch args[1] {
			case "engine":
				return "engine"
			case "replica":
				return "replicas"
			}
		}
		return "inst-mgr" // the instance manager and the device keeper
	case "kubelet", "containerd", "runc", "kube-proxy", "kindnetd", "systemd", "systemd-journal", "pause",
		"dockerd", "docker-proxy":
		return "node-agents"
	case "kube-apiserver", "etcd", "kube-controller", "kube-scheduler", "coredns", "local-path-prov",
		"cairn-manager", "cairn-csi", "csi-provisioner", "csi-attacher", "csi-resizer", "csi-snapshotter",
		"csi-node-driver", "livenessprobe", "snapshot-contro":
		return "ctl-plane"
	}
	if strings.HasPrefix(comm, "containerd-shim") {
		return "node-agents"
	}
	return "other"
}

// cpuWindow is the census of one window: CPU seconds per part and the
// machine's busy share.
type cpuWindow struct {
	seconds float64
	parts   map[string]float64 // CPU seconds
	busy    float64            // share of all the machine's CPUs, 0-1
	cpus    float64            // CPUs busy on average
}

func diffCPU(a, b cpuSample) cpuWindow {
	w := cpuWindow{seconds: b.at.Sub(a.at).Seconds(), parts: map[string]float64{}}
	for pid, pb := range b.procs {
		// A process started in the window counts from zero; one that
		// ended in it is lost (fio's workers live through the window).
		d := pb.cpu
		if pa, ok := a.procs[pid]; ok {
			if pa.cpu > pb.cpu {
				continue // the pid was reused
			}
			d -= pa.cpu
		}
		w.parts[pb.part] += d.Seconds()
	}
	w.parts["irq"] = float64(b.irq-a.irq) / clockTicks
	if t := b.total - a.total; t > 0 {
		w.busy = float64(b.busy-a.busy) / float64(t)
		// total ticks over all CPUs ÷ elapsed ticks = CPUs
		w.cpus = w.busy * float64(t) / clockTicks / w.seconds
	}
	return w
}

// censusDuring reads the census over the middle of a fio job of
// duration run that starts about now: from a fifth of the way in (kubectl
// exec and fio's start behind) to a tenth before its end.
func censusDuring(run time.Duration) <-chan cpuWindow {
	ch := make(chan cpuWindow, 1)
	go func() {
		time.Sleep(run / 5)
		a := readCPU()
		time.Sleep(run * 7 / 10)
		ch <- diffCPU(a, readCPU())
	}()
	return ch
}

// cpuCell is what one job's census leaves for the table: µs of CPU per
// I/O for each part and the machine's busy share.
type cpuCell struct {
	perIO   map[string]float64
	machine float64 // the machine's busy CPU time per I/O, µs
	busy    float64
	cpus    float64
}

func cellOf(w cpuWindow, iops float64) cpuCell {
	c := cpuCell{perIO: map[string]float64{}, busy: w.busy, cpus: w.cpus}
	ios := iops * w.seconds
	if ios <= 0 {
		return c
	}
	for p, s := range w.parts {
		c.perIO[p] = s * 1e6 / ios
	}
	c.machine = w.cpus * w.seconds * 1e6 / ios
	return c
}

// printCensus prints, per workload, each target's median µs of CPU per
// I/O by part, their sum, the machine's busy CPU time per I/O and its busy
// share (a row near 100 %
// is bound by CPU: the total per I/O times the IOPS is all the CPUs).
func printCensus(targets []target, cells map[string][][]cpuCell) {
	fmt.Println("\nCPU per I/O by part, µs (mid-job window of each job, median over rounds; all nodes' processes, which are this machine's; busy = share of this machine's CPUs in use)")
	for wi, w := range workloads {
		fmt.Printf("%s\n  %-14s", w.name, "target")
		for _, p := range cpuParts {
			fmt.Printf(" %11s", p)
		}
		fmt.Printf(" %8s %8s %6s %6s\n", "sum", "machine", "busy", "CPUs")
		for _, t := range targets {
			cs := cells[t.name][wi]
			if len(cs) == 0 {
				continue
			}
			fmt.Printf("  %-14s", t.name)
			total := 0.0
			for _, p := range cpuParts {
				v := median(collect(cs, func(c cpuCell) float64 { return c.perIO[p] }))
				total += v
				fmt.Printf(" %11.1f", v)
			}
			fmt.Printf(" %8.1f %8.1f %5.0f%% %6.2f\n", total,
				median(collect(cs, func(c cpuCell) float64 { return c.machine })),
				100*median(collect(cs, func(c cpuCell) float64 { return c.busy })),
				median(collect(cs, func(c cpuCell) float64 { return c.cpus })))
		}
	}
	fmt.Println("fio includes the kernel's work in its system calls (ext4, the loop device's and FUSE's submission); kthreads the loop workers and softirq threads; irq the machine's interrupt and softirq time,")
	fmt.Println("which a kernel without CONFIG_IRQ_TIME_ACCOUNTING also charges to the process it interrupted: sum (of the parts) may then exceed machine (its busy CPU time per I/O) by up to irq")
}

func collect(cs []cpuCell, f func(cpuCell) float64) []float64 {
	out := make([]float64, 0, len(cs))
	for _, c := range cs {
		out = append(out, f(c))
	}
	return out
}
