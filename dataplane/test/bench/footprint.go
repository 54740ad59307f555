package main

import (
	"bufio"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	goruntime "runtime"
	"strconv"
	"strings"
	"time"
)

// The footprint table (--footprint N) answers what an attached volume costs
// a node while its application does nothing: N volumes of three replicas
// each (one over a unix socket, two over loopback TCP, as cairn-3), each
// written --footprint-write through its engine, then left idle: memory is
// read again after --footprint-settle, when the processes have given back
// their spare heap, then their CPU time is counted over --footprint-idle.
// Memory is read
// from /proc: RSS split into anonymous memory (heaps, stacks, buffers),
// file pages (the binary's text, shared by every process of it) and shared
// memory, and PSS, which charges shared pages to each process in part. The
// yardstick, measured in the same run on the same disk, is qemu-nbd serving
// a file after the same writes: one small C process per volume.
var (
	footprintN      = flag.Int("footprint", 0, "instead of the fio tables: start N three-replica volumes, write --footprint-write to each, and print memory, threads, descriptors and idle CPU per volume")
	footprintWrite  = flag.String("footprint-write", "64M", "bytes written to each volume before the idle measurement")
	footprintSettle = flag.Duration("footprint-settle", 65*time.Second, "idle time after the writes before memory is read again and the idle CPU counted (an engine or replica gives its spare heap back after 30 to 60 s without I/O)")
	footprintIdle   = flag.Duration("footprint-idle", 30*time.Second, "idle window over which CPU time is counted, after --footprint-settle")
)

// footprintGoals are the performance issue's goals per attached
// three-replica volume.
const (
	footprintGoalMiB = 40.0
	footprintGoalCPU = 0.1 // percent of one core
)

// procMem is what /proc says about one process's memory and handles.
type procMem struct {
	rss, anon, file, shmem, pss float64 // MiB
	threads, fds                float64
}

func (m *procMem) add(o procMem) {
	m.rss += o.rss
	m.anon += o.anon
	m.file += o.file
	m.shmem += o.shmem
	m.pss += o.pss
	m.threads += o.threads
	m.fds += o.fds
}

func (m procMem) scaled(f float64) procMem {
	return procMem{m.rss * f, m.anon * f, m.file * f, m.shmem * f, m.pss * f, m.threads * f, m.fds * f}
}

// kibFields reads "Key: N kB" lines of a /proc file into MiB by key.
func kibFields(path string) map[string]float64 {
	f, err := os.Open(path)
	must(err)
	defer f.Close()
	out := map[string]float64{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if !ok {
			continue
		}
		fs := strings.Fields(v)
		if len(fs) == 0 {
			continue
		}
		n, err := strconv.ParseFloat(fs[0], 64)
		if err != nil {
			continue
		}
		if len(fs) > 1 && fs[1] == "kB" {
			n /= 1024
		}
		out[k] = n
	}
	must(sc.Err())
	return out
}

func readProcMem(pid int) procMem {
	st := kibFields(fmt.Sprintf("/proc/%d/status", pid))
	roll := kibFields(fmt.Sprintf("/proc/%d/smaps_rollup", pid))
	fds, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	must(err)
	return procMem{rss: st["VmRSS"], anon: st["RssAnon"], file: st["RssFile"], shmem: st["RssShmem"],
		pss: roll["Pss"], threads: st["Threads"], fds: float64(len(fds))}
}

// roleMem is the mean over the volumes of the engine's and of one
// replica's figures.
type roleMem struct{ engine, replica procMem }

func (r roleMem) perVolume() procMem {
	v := r.engine
	v.add(r.replica.scaled(3))
	return v
}

// pids are each volume's process ids, engine first, as the measurements
// below take them.
func pids(vols []target) [][]int {
	out := make([][]int, len(vols))
	for i, t := range vols {
		for _, c := range t.procs {
			out[i] = append(out[i], c.Process.Pid)
		}
	}
	return out
}

// measureRoles reads the memory of every volume's processes (engine
// first) and returns the means per role.
func measureRoles(vols [][]int) roleMem {
	var r roleMem
	replicas := 0
	for _, v := range vols {
		r.engine.add(readProcMem(v[0]))
		for _, pid := range v[1:] {
			r.replica.add(readProcMem(pid))
			replicas++
		}
	}
	r.engine = r.engine.scaled(1 / float64(len(vols)))
	r.replica = r.replica.scaled(1 / float64(replicas))
	return r
}

// writeVolume writes --footprint-write sequentially through the frontend
// the fio arguments select, and flushes it.
func writeVolume(target []string) {
	args := append([]string{"--name=fill", "--rw=write", "--bs=1M", "--iodepth=4", "--size=" + *footprintWrite, "--end_fsync=1"}, target...)
	if out, err := exec.Command("fio", args...).CombinedOutput(); err != nil {
		must(fmt.Errorf("fio %v: %w: %s", target, err, out))
	}
}

// idleUse is what the engines and the replicas use over the idle window:
// CPU in percent of one core, and wake-ups (voluntary context switches of
// all their threads) per second, each per engine and per replica. Wake-ups
// count what an idle process does independently of how fast the machine
// is that day; the CPU each costs is what varies.
type idleUse struct {
	engCPU, repCPU   float64
	engWake, repWake float64
}

func idleCPU(vols [][]int) idleUse {
	var engines, replicas []int
	for _, v := range vols {
		engines = append(engines, v[0])
		replicas = append(replicas, v[1:]...)
	}
	e0, r0, start := cpuTimePids(engines), cpuTimePids(replicas), time.Now()
	ew0, rw0 := wakeupsPids(engines), wakeupsPids(replicas)
	time.Sleep(*footprintIdle) // the measurement window itself, not a wait for an event
	wall := time.Since(start)
	pct := func(d time.Duration, n int) float64 { return 100 * float64(d) / float64(wall) / float64(n) }
	rate := func(n uint64, procs int) float64 { return float64(n) / wall.Seconds() / float64(procs) }
	return idleUse{engCPU: pct(cpuTimePids(engines)-e0, len(engines)), repCPU: pct(cpuTimePids(replicas)-r0, len(replicas)),
		engWake: rate(wakeupsPids(engines)-ew0, len(engines)), repWake: rate(wakeupsPids(replicas)-rw0, len(replicas))}
}

// wakeupsPids sums the voluntary context switches of every thread of the
// processes: each is a thread that slept and was woken.
func wakeupsPids(pids []int) uint64 {
	var n uint64
	for _, pid := range pids {
		tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
		must(err)
		for _, t := range tasks {
			b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/status", pid, t.Name()))
			if err != nil {
				continue // the thread ended
			}
			for line := range strings.Lines(string(b)) {
				if v, ok := strings.CutPrefix(line, "voluntary_ctxt_switches:"); ok {
					var k uint64
					_, _ = fmt.Sscan(strings.TrimSpace(v), &k)
					n += k
				}
			}
		}
	}
	return n
}

// qemuYardstick is qemu-nbd's mean RSS over a few processes, each serving
// a file after the same writes.
func qemuYardstick(work string) float64 {
	const n = 3
	var rss float64
	for i := range n {
		sub := filepath.Join(work, fmt.Sprintf("qemu-%d", i))
		must(os.MkdirAll(sub, 0o755))
		t := qemuNBD(sub)
		writeVolume(t.engine)
		rss += readProcMem(t.procs[0].Process.Pid).rss
		t.stop()
	}
	return rss / n
}

func footprintTable(work string, n int) {
	fmt.Printf("\nfootprint: %d attached three-replica volumes (engine + 3 replicas each, %s each), %s written to each, idle %s; %d CPUs\n",
		n, *size, *footprintWrite, *footprintIdle, goruntime.NumCPU())
	vols := make([]target, 0, n)
	defer func() {
		for _, t := range vols {
			t.stop()
		}
	}()
	for i := range n {
		vols = append(vols, cairn(work, fmt.Sprintf("fp-%03d", i), 3, 1))
	}
	all := pids(vols)
	started := measureRoles(all)
	for _, t := range vols {
		writeVolume(t.engine)
	}
	written := measureRoles(all)
	time.Sleep(*footprintSettle) // an idle stretch is what is measured, not a wait for an event
	idle := measureRoles(all)
	use := idleCPU(all)
	qemu := qemuYardstick(work)
	printFootprint(started, written, idle, use, qemu)
}

func printFootprint(started, written, idle roleMem, use idleUse, qemu float64) {
	row := func(label string, f func(procMem) float64, r roleMem, unit string) {
		fmt.Printf("  %-34s %10.1f %10.1f %12.1f  %s\n", label, f(r.engine), f(r.replica), f(r.perVolume()), unit)
	}
	fmt.Printf("  %-34s %10s %10s %12s\n", "", "engine", "replica", "per volume")
	row("RSS after start", func(m procMem) float64 { return m.rss }, started, "MiB")
	row("  anonymous", func(m procMem) float64 { return m.anon }, started, "MiB")
	row("PSS after start", func(m procMem) float64 { return m.pss }, started, "MiB")
	row("RSS after the writes", func(m procMem) float64 { return m.rss }, written, "MiB")
	row("  anonymous (heap, stacks, buffers)", func(m procMem) float64 { return m.anon }, written, "MiB")
	row("  file (binary text, shared)", func(m procMem) float64 { return m.file }, written, "MiB")
	row("  shared memory", func(m procMem) float64 { return m.shmem }, written, "MiB")
	row("PSS after the writes", func(m procMem) float64 { return m.pss }, written, "MiB")
	idleLabel := "after " + footprintSettle.String() + " idle"
	row("RSS "+idleLabel, func(m procMem) float64 { return m.rss }, idle, "MiB")
	row("  anonymous", func(m procMem) float64 { return m.anon }, idle, "MiB")
	row("PSS "+idleLabel, func(m procMem) float64 { return m.pss }, idle, "MiB")
	row("threads", func(m procMem) float64 { return m.threads }, written, "")
	row("descriptors", func(m procMem) float64 { return m.fds }, written, "")
	perVol := use.engCPU + 3*use.repCPU
	fmt.Printf("  %-34s %10.2f %10.2f %12.2f  %% of a core\n", "idle CPU", use.engCPU, use.repCPU, perVol)
	fmt.Printf("  %-34s %10.1f %10.1f %12.1f  per second\n", "idle wake-ups", use.engWake, use.repWake, use.engWake+3*use.repWake)
	w := idle.perVolume()
	fmt.Printf("  per volume %s: RSS %.1f MiB = %.2f x the goal (%.0f MiB), PSS %.1f MiB = %.2f x the goal, RSS %.1f x qemu-nbd's %.1f MiB per process x 4 processes; idle CPU %.2f %% of a core = %.2f x the goal (%.1f %%)\n",
		idleLabel, w.rss, w.rss/footprintGoalMiB, footprintGoalMiB, w.pss, w.pss/footprintGoalMiB, w.rss/(4*qemu), qemu, perVol, perVol/footprintGoalCPU, footprintGoalCPU)
}
