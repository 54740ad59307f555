package main

import (
	"bufio"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"k8s.io/apimachinery/pkg/api/resource"
)

// The engine-socket target is the reference the one-replica pod rows are
// measured against: a Cairn engine with one buffered replica, run on this
// machine as `make bench` runs its cairn-1 target (the replica on a unix
// socket beside the engine, as an engine's own node's replica is), with fio
// at the engine's NBD socket. Measured in the same rounds as the pods, it
// says what the data plane does on this machine at that moment, so the
// ratio of a pod on a one-replica claim to it shows what the way from the
// engine to the pod (FUSE, the loop device, ext4, the container) costs,
// plus a network hop when the claim's replica landed on another node than
// its engine (the benchmark prints where each one did).

// hostEngine is the engine-socket target's processes.
type hostEngine struct {
	dir   string
	sock  string
	procs []*exec.Cmd
}

var (
	hostMu sync.Mutex // held while the target's processes start or stop
	host   *hostEngine
)

// stopHost stops the engine-socket target's processes, if it has any;
// main calls it once measured and defers it, fail calls it (from a signal
// handler too), with or without --keep.
func stopHost() {
	hostMu.Lock()
	defer hostMu.Unlock()
	if host != nil {
		host.stop()
		host = nil
	}
}

// startHostEngine starts a replica and an engine of cairnBin in a new
// directory under /var/tmp (on the machine's disk, as the kind nodes'
// data is), size bytes, and fills fileSize of it so reads hit data.
func startHostEngine() {
	if _, err := exec.LookPath(*cairnBin); err != nil {
		fail("target engine-socket: no cairn-data binary at %s (--cairn-data; make bench-cluster builds it): %v", *cairnBin, err)
	}
	if out, err := exec.Command("fio", "--enghelp=nbd").CombinedOutput(); err != nil {
		fail("target engine-socket: this machine's fio has no nbd engine (%v: %s); drop the target with --targets", err, strings.TrimSpace(string(out)))
	}
	dir, err := os.MkdirTemp("/var/tmp", "cairn-bench-cluster-")
	if err != nil {
		fail("target engine-socket: %v", err)
	}
	h := &hostEngine{dir: dir, sock: filepath.Join(dir, "engine.sock")}
	hostMu.Lock()
	host = h
	hostMu.Unlock()
	// The claims' size as Kubernetes reads it (1G is 10^9 bytes, 1Gi
	// 2^30), rounded up to 4 KiB as the CSI driver does, in bytes (which
	// cairn-data reads as written).
	q, err := resource.ParseQuantity(*claimSize)
	if err != nil || q.Value() <= 0 {
		fail("--claim-size %q: give a Kubernetes quantity such as 1Gi (%v)", *claimSize, err)
	}
	size := (q.Value() + 4095) &^ 4095
	f := h.start("replica", "--dir", filepath.Join(dir, "r0"), "--size", strconv.FormatInt(size, 10),
		"--listen", "unix:"+filepath.Join(dir, "r0.sock"), "--control-listen", "127.0.0.1:0")
	h.start("engine", "--name", "bench", "--frontend", "nbd", "--nbd-socket", h.sock, "--nbd-kernel", "off",
		"--listen", "127.0.0.1:0", "--replica", f["data"]+","+f["control"])
	fill := append([]string{"--name=fill", "--size=" + *fileSize, "--rw=write", "--bs=1M", "--iodepth=4", "--end_fsync=1"}, h.fioTarget()...)
	if out, err := exec.Command("fio", fill...).CombinedOutput(); err != nil {
		fail("target engine-socket: filling it: %v: %s", err, out)
	}
}

// fioTarget is fio's arguments that reach the engine: its nbd engine at
// the engine's socket.
func (h *hostEngine) fioTarget() []string {
	return []string{"--ioengine=nbd", "--uri=nbd+unix:///bench?socket=" + h.sock}
}

// start runs cairn-data with args (its standard error to <dir>/<args[0]>.log)
// and returns the fields of its ready line (data=..., control=...).
func (h *hostEngine) start(args ...string) map[string]string {
	cmd := exec.Command(*cairnBin, args...)
	// Ended with the benchmark however it ends (a signal to it alone
	// included); stopHost ends them first when it can.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	out, err := cmd.StdoutPipe()
	if err != nil {
		fail("target engine-socket: %v", err)
	}
	logPath := filepath.Join(h.dir, args[0]+".log")
	logf, err := os.Create(logPath)
	if err != nil {
		fail("target engine-socket: %v", err)
	}
	defer logf.Close() // the child has its own descriptor
	cmd.Stderr = logf
	if err := cmd.Start(); err != nil {
		fail("target engine-socket: %s %s: %v", *cairnBin, args[0], err)
	}
	hostMu.Lock()
	h.procs = append(h.procs, cmd)
	hostMu.Unlock()
	type ready struct {
		line string
		err  error
	}
	ch := make(chan ready, 1)
	go func() {
		line, err := bufio.NewReader(out).ReadString('\n')
		ch <- ready{line, err}
	}()
	var r ready
	select {
	case r = <-ch:
	case <-time.After(time.Minute):
		r.err = errors.New("no ready line within a minute")
	}
	if r.err != nil {
		b, _ := os.ReadFile(logPath)
		if len(b) > 2000 {
			b = b[len(b)-2000:]
		}
		fail("target engine-socket: %s %v did not start: %v; its log ends:\n%s", *cairnBin, args, r.err, b)
	}
	f := map[string]string{}
	for _, kv := range strings.Fields(r.line) {
		if k, v, ok := strings.Cut(kv, "="); ok {
			f[k] = v
		}
	}
	return f
}

// stop ends the processes (SIGTERM, the engine first, then SIGKILL after
// 10 s) and removes their directory.
func (h *hostEngine) stop() {
	for i := len(h.procs) - 1; i >= 0; i-- {
		c := h.procs[i]
		_ = c.Process.Signal(syscall.SIGTERM)
		done := make(chan struct{})
		go func() { _ = c.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = c.Process.Kill()
			<-done
		}
	}
	h.procs = nil
	os.RemoveAll(h.dir)
}
