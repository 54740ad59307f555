package main

import (
	"fmt"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

// stopKind is how the engine of a volume goes away in
// TestCleanStopLeavesNothingToReconcile.
type stopKind int

const (
	stopTerm     stopKind = iota // SIGTERM: the volume is detached here
	stopHandOver                 // SIGUSR1: its instance manager is going away
	stopKill                     // SIGKILL: it dies
	stopDegraded                 // SIGTERM, with a replica gone before the writes
)

func (k stopKind) String() string {
	return [...]string{"stopped", "handed over", "killed", "stopped degraded"}[k]
}

const cleanStopRegions = 64 // 64 MiB volume, 1 MiB regions

// TestCleanStopLeavesNothingToReconcile: a three-replica volume is
// written whole and flushed, and its engine goes away at once, long
// before the replicas' clear windows (30 s here) would let a flush clear
// the bits of those writes. An engine stopped cleanly (SIGTERM, or
// SIGUSR1 as when its instance manager goes away) has every write it
// completed on every replica: its final flush has the replicas clear
// every bit, and the next engine opens without copying anything. An
// engine that dies, or stops while a replica is missing, leaves the bits:
// the next engine reconciles what it wrote (or the missing replica will
// resync it). Either way the next engine reads every byte as written.
func TestCleanStopLeavesNothingToReconcile(t *testing.T) {
	needTool(t, "qemu-io")
	for _, k := range []stopKind{stopTerm, stopHandOver, stopKill, stopDegraded} {
		t.Run(k.String(), func(t *testing.T) { testCleanStop(t, k) })
	}
}

func testCleanStop(t *testing.T, k stopKind) {
	v := cleanStopVolume(t)
	if k == stopDegraded {
		v.replicas[2].cmd.Process.Kill()
		v.replicas[2].waitExit(t)
		waitMode(t, v.engine.control, v.addrs[2], "ERR")
	}
	qemuIO(t, v.uri, "write -P 0x5a 0 64M", "flush")
	live := v.replicas
	if k == stopDegraded {
		live = live[:2]
	}
	lv := &volume{replicas: live}
	if n := dirtyRegions(t, lv); n < int64(len(live))*cleanStopRegions {
		t.Fatalf("after writing the whole volume the replicas mark %d regions, want %d each: the test no longer sets up what it checks", n, cleanStopRegions)
	}
	sig := map[stopKind]syscall.Signal{stopTerm: syscall.SIGTERM, stopHandOver: syscall.SIGUSR1, stopKill: syscall.SIGKILL, stopDegraded: syscall.SIGTERM}[k]
	if err := v.engine.cmd.Process.Signal(sig); err != nil {
		t.Fatal(err)
	}
	v.engine.waitExit(t)
	dirty := dirtyRegions(t, lv)
	t.Logf("%s: %d regions marked on the replicas after the engine went away", k, dirty)
	switch k {
	case stopTerm, stopHandOver:
		if dirty != 0 {
			t.Fatalf("after a clean stop the replicas still mark %d regions dirty\n%s", dirty, v.engine.stderr.String())
		}
	default:
		if want := int64(len(live)) * cleanStopRegions; dirty < want {
			t.Fatalf("the engine %s, and the replicas mark %d regions: want the %d of its writes kept\n%s", k, dirty, want, v.engine.stderr.String())
		}
	}

	args := v.args
	if k == stopDegraded {
		args = withoutReplica(args, v.addrs[2])
	}
	next := start(t, args...)
	if !next.logged("engine opened") {
		t.Fatalf("the next engine did not open:\n%s", next.stderr.String())
	}
	reconciled := strings.Contains(next.stderr.String(), "reconciling regions")
	switch {
	case (k == stopTerm || k == stopHandOver) && reconciled:
		t.Fatalf("after a clean stop the next engine reconciled regions:\n%s", next.stderr.String())
	case k == stopKill && !reconciled:
		t.Fatalf("after the engine died the next engine reconciled nothing:\n%s", next.stderr.String())
	}
	qemuIO(t, v.uri, "read -P 0x5a 0 64M")
}

// cleanStopVolume starts three replica processes that clear a bit only
// 30 s after its region was last written, and an engine over them that
// sends no idle flush: within the test only a final flush clears bits.
func cleanStopVolume(t *testing.T) *volume {
	t.Helper()
	dir := t.TempDir()
	v := &volume{sock: filepath.Join(dir, "vol.sock")}
	for i := range 3 {
		d := filepath.Join(dir, fmt.Sprint("r", i))
		p := start(t, "replica", "--dir", d, "--size", "64Mi", "--listen", "127.0.0.1:0",
			"--control-listen", "127.0.0.1:0", "--dirty-clear-delay", "30s")
		v.replicas = append(v.replicas, p)
		v.addrs = append(v.addrs, p.data+","+p.control)
		v.dirs = append(v.dirs, d)
	}
	v.args = []string{"engine", "--name", "vol", "--frontend", "nbd", "--nbd-socket", v.sock, "--nbd-kernel", "off",
		"--listen", "127.0.0.1:0", "--replica-timeout", "3s", "--idle-flush", "-1s", "--wanted", "3"}
	for _, a := range v.addrs {
		v.args = append(v.args, "--replica", a)
	}
	v.uri = "nbd+unix:///vol?socket=" + v.sock
	v.engine = start(t, v.args...)
	return v
}

// withoutReplica is an engine command line without --replica addr.
func withoutReplica(args []string, addr string) []string {
	var out []string
	for i := 0; i < len(args); i++ {
		if args[i] == "--replica" && i+1 < len(args) && args[i+1] == addr {
			i++
			continue
		}
		out = append(out, args[i])
	}
	return out
}
