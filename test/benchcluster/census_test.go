package main

import (
	"math"
	"os"
	"testing"
	"time"

	"github.com/cairn-io/cairn/dataplane/testutil/procstat"
)

func TestDiffCPUChargesEachPart(t *testing.T) {
	const tick = time.Second / clockTicks
	t0 := time.Unix(1000, 0)
	a := cpuSample{at: t0, total: 1000, busy: 400, irq: 10, procs: map[int]procCPU{
		10: {part: "engine", cpu: 500 * tick},
		11: {part: "replicas", cpu: 100 * tick},
		12: {part: "fio", cpu: 900 * tick}, // its pid is reused by the time of b
		13: {part: "other", cpu: 5 * tick}, // ends in the window
	}}
	b := cpuSample{at: t0.Add(2 * time.Second), total: 1400, busy: 700, irq: 40, procs: map[int]procCPU{
		10: {part: "engine", cpu: 600 * tick},
		11: {part: "replicas", cpu: 130 * tick},
		12: {part: "fio", cpu: 20 * tick},
		14: {part: "replicas", cpu: 20 * tick}, // started in the window
	}}
	w := diffCPU(a, b)
	want := map[string]float64{"engine": 1.0, "replicas": 0.5, "irq": 0.3}
	for p, v := range want {
		if math.Abs(w.parts[p]-v) > 1e-9 {
			t.Errorf("%s: %.3f CPU seconds, want %.3f", p, w.parts[p], v)
		}
	}
	if w.parts["fio"] != 0 || w.parts["other"] != 0 {
		t.Errorf("a reused pid or a process gone in the window was charged: fio %.2f, other %.2f", w.parts["fio"], w.parts["other"])
	}
	// 300 of 400 ticks busy over 2 s: 0.75 of the CPUs, and 400 ticks in 2 s are 2 CPUs.
	if math.Abs(w.busy-0.75) > 1e-9 || math.Abs(w.cpus-1.5) > 1e-9 {
		t.Errorf("busy %.3f, CPUs %.3f; want 0.75 and 1.5", w.busy, w.cpus)
	}
	c := cellOf(w, 1000) // 2,000 I/Os in the window
	if math.Abs(c.perIO["engine"]-500) > 1e-6 {
		t.Errorf("engine %.1f µs per I/O, want 500", c.perIO["engine"])
	}
	if math.Abs(c.machine-1500) > 1e-6 { // 1.5 CPUs for 2 s over 2,000 I/Os
		t.Errorf("machine %.1f µs per I/O, want 1500", c.machine)
	}
}

func TestReadCPUSeesThisProcess(t *testing.T) {
	s := readCPU()
	p, ok := s.procs[os.Getpid()]
	if !ok {
		t.Fatalf("this process (%d) is not among the %d read from /proc", os.Getpid(), len(s.procs))
	}
	if p.part != "other" {
		t.Errorf("the test binary is classed %q, want other", p.part)
	}
	if s.total == 0 || s.busy > s.total || s.irq > s.busy {
		t.Errorf("machine totals: total %d, busy %d, irq %d", s.total, s.busy, s.irq)
	}
	if got := classify("/proc/2", "kthreadd", procstat.PFKthread); got != "kthreads" {
		t.Errorf("a kernel thread is classed %q", got)
	}
}
