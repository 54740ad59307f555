package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cairn-io/cairn/dataplane/dataconn"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

func needTool(t *testing.T, tool string) {
	t.Helper()
	if _, err := exec.LookPath(tool); err != nil {
		t.Skipf("%s not installed (make test installs it: hack/install-test-tools.sh)", tool)
	}
}

// volume is replica processes plus an engine process with the NBD frontend.
type volume struct {
	replicas []*proc
	addrs    []string
	dirs     []string // the replicas' data directories
	engine   *proc
	args     []string // the engine's command line
	sock     string
	uri      string
}

func startVolume(t *testing.T, n int, size string) *volume {
	t.Helper()
	return startVolumeUnix(t, n, 0, size)
}

// startVolumeUnix is startVolume with the first nUnix replicas serving
// data on unix sockets (a replica on the engine's node) and, when there are
// any, the last replica with --direct-io.
func startVolumeUnix(t *testing.T, n, nUnix int, size string) *volume {
	t.Helper()
	v := volumeReplicas(t, n, nUnix, size)
	v.engine = start(t, v.args...)
	return v
}

// volumeReplicas is startVolumeUnix without the engine: the replicas run
// and v.args is the engine's command line.
func volumeReplicas(t *testing.T, n, nUnix int, size string) *volume {
	t.Helper()
	dir := t.TempDir()
	v := &volume{sock: filepath.Join(dir, "vol.sock")}
	for i := range n {
		listen := "127.0.0.1:0"
		if i < nUnix {
			listen = "unix:" + filepath.Join(dir, fmt.Sprint("r", i, ".sock"))
		}
		args := []string{"replica", "--dir", filepath.Join(dir, fmt.Sprint("r", i)), "--size", size,
			"--listen", listen, "--control-listen", "127.0.0.1:0"}
		if nUnix > 0 && i == n-1 {
			args = append(args, "--direct-io")
		}
		p := start(t, args...)
		v.replicas = append(v.replicas, p)
		v.addrs = append(v.addrs, p.data+","+p.control)
		v.dirs = append(v.dirs, args[2])
	}
	args := []string{"engine", "--name", "vol", "--frontend", "nbd", "--nbd-socket", v.sock, "--nbd-kernel", "off",
		"--listen", "127.0.0.1:0", "--replica-timeout", "3s"}
	for _, a := range v.addrs {
		args = append(args, "--replica", a)
	}
	v.args = args
	v.uri = "nbd+unix:///vol?socket=" + v.sock
	return v
}

// TestSecondEngineLeavesRunningOneAlone: an engine started again for a
// running volume on the same socket fails, and fails before it opens the
// replicas, which would fence the running engine out (its writes would
// fail from then on).
func TestSecondEngineLeavesRunningOneAlone(t *testing.T) {
	needTool(t, "qemu-io")
	v := startVolume(t, 2, "16Mi")
	qemuIO(t, v.uri, "write -P 0x31 0 1M", "flush")
	code, stderr := runExit(t, v.args...)
	if code == 0 || !strings.Contains(stderr, "another server is listening on it") {
		t.Fatalf("a second engine on the socket: exit %d\n%s", code, stderr)
	}
	if strings.Contains(stderr, "engine opened") {
		t.Fatalf("the second engine opened the replicas before it found the socket taken:\n%s", stderr)
	}
	qemuIO(t, v.uri, "write -P 0x32 1M 1M", "flush")
	qemuIO(t, v.uri, "read -P 0x31 0 1M", "read -P 0x32 1M 1M")
	if r := v.ctl(t, "replicas"); strings.Count(r, "RW") != 2 {
		t.Fatalf("replicas after a second engine was refused:\n%s", r)
	}
}

// memfdMappings counts the mappings of an engine's shared memory (memfds
// named cairn-*) in process pid.
func memfdMappings(t *testing.T, pid int) int {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/maps", pid))
	if err != nil {
		t.Fatal(err)
	}
	return strings.Count(string(b), "/memfd:cairn-")
}

func (v *volume) ctl(t *testing.T, args ...string) string {
	t.Helper()
	cmd := command(append([]string{"ctl", "--engine", v.engine.control}, args...)...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("ctl %v: %v\n%s", args, err, out)
	}
	return string(out)
}

func qemuIO(t *testing.T, uri string, cmds ...string) {
	t.Helper()
	args := []string{"-f", "raw"}
	for _, c := range cmds {
		args = append(args, "-c", c)
	}
	out, err := exec.Command("qemu-io", append(args, uri)...).CombinedOutput()
	if err != nil || strings.Contains(string(out), "Pattern verification failed") || strings.Contains(string(out), "error") {
		t.Fatalf("qemu-io %v: %v\n%s", cmds, err, out)
	}
}

// TestEngineProcessQemuIO writes and reads back patterns with qemu-io
// through the NBD frontend of an engine with three replicas: one reached
// over a unix socket (with shared memory), one over TCP, one over TCP with
// direct I/O. The data is then read back from the unix replica alone.
func TestEngineProcessQemuIO(t *testing.T) {
	needTool(t, "qemu-io")
	v := startVolumeUnix(t, 3, 1, "64Mi")
	if !strings.HasPrefix(v.addrs[0], "unix:") {
		t.Fatalf("replica 0 should serve on a unix socket: %s", v.addrs[0])
	}
	// The unix replica maps the engine's shared memory once per data
	// connection (4); the TCP replicas do not.
	for i, want := range []int{4, 0, 0} {
		if got := memfdMappings(t, v.replicas[i].cmd.Process.Pid); got != want {
			t.Fatalf("replica %d maps the engine's shared memory %d times, want %d", i, got, want)
		}
	}
	if !v.engine.logged("shared memory attached") {
		t.Fatalf("the engine did not report shared memory with the unix replica:\n%s", v.engine.stderr.String())
	}
	qemuIO(t, v.uri, "write -P 0x5a 0 8M", "write -P 0x6b -f 8M 1M", "discard 16M 4M", "flush")
	qemuIO(t, v.uri, "read -P 0x5a 0 8M", "read -P 0x6b 8M 1M", "read -P 0 16M 4M")
	if out := v.ctl(t, "info"); !strings.Contains(out, "healthy") || !strings.Contains(out, v.sock) {
		t.Fatalf("info: %s", out)
	}
	// The metrics count the writes that went through shared memory: most of
	// the unix replica's, none of the TCP replicas'.
	metrics := v.ctl(t, "metrics")
	for i, addr := range v.addrs {
		m := regexp.MustCompile(`replica ` + regexp.QuoteMeta(addr) + `: read ops=\d+ write ops=(\d+) \(shared memory (\d+)\)`).FindStringSubmatch(metrics)
		if m == nil {
			t.Fatalf("metrics show no line for replica %s:\n%s", addr, metrics)
		}
		writes, _ := strconv.Atoi(m[1])
		shared, _ := strconv.Atoi(m[2])
		if i == 0 && (shared == 0 || shared > writes) || i > 0 && shared != 0 || writes == 0 {
			t.Fatalf("replica %d (%s): %d writes, %d through shared memory:\n%s", i, addr, writes, shared, metrics)
		}
	}
	// With both TCP replicas gone, every byte comes from the replica that
	// got its writes through shared memory.
	for _, r := range v.replicas[1:] {
		r.cmd.Process.Kill()
		r.waitExit(t)
	}
	qemuIO(t, v.uri, "write -P 0x7c 4M 64k", "read -P 0x5a 0 4M", "read -P 0x7c 4M 64k", "read -P 0x5a 4259840 4128768", "read -P 0x6b 8M 1M", "read -P 0 16M 4M")
	// SIGTERM: the engine detaches the frontend (the socket goes) and exits 0.
	v.engine.stopClean(t, "engine")
	if _, err := os.Stat(v.sock); !os.IsNotExist(err) {
		t.Fatalf("the NBD socket was left behind: %v", err)
	}
}

// TestEngineRevertRefusedWhileInUse: a revert while an NBD client is
// connected is refused with the reason and changes nothing; once the
// client is gone it goes through.
func TestEngineRevertRefusedWhileInUse(t *testing.T) {
	needTool(t, "qemu-io")
	v := startVolume(t, 2, "16Mi")
	qemuIO(t, v.uri, "write -P 0x11 0 1M", "flush")
	v.ctl(t, "snapshot", "create", "before")
	qemuIO(t, v.uri, "write -P 0x22 0 1M", "flush")

	// A client that has reached the handshake: the server holds it.
	c, err := net.Dial("unix", v.sock)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(c, make([]byte, 18)); err != nil {
		t.Fatal(err)
	}
	out, err := command("ctl", "--engine", v.engine.control, "snapshot", "revert", "before").CombinedOutput()
	if err == nil || !strings.Contains(string(out), "is in use (1 NBD client connection(s))") ||
		!strings.Contains(string(out), "FailedPrecondition") {
		t.Fatalf("revert with a client connected: %v\n%s", err, out)
	}
	c.Close()
	qemuIO(t, v.uri, "read -P 0x22 0 1M") // unchanged

	until := deadline.After(10 * time.Second)
	for {
		out, err := command("ctl", "--engine", v.engine.control, "snapshot", "revert", "before").CombinedOutput()
		if err == nil {
			break
		}
		if time.Now().After(until) {
			t.Fatalf("revert after the client left: %v\n%s", err, out)
		}
		time.Sleep(50 * time.Millisecond)
	}
	qemuIO(t, v.uri, "read -P 0x11 0 1M")
}

// TestEngineNBDKernelModes: --nbd-kernel auto attaches /dev/nbdN where the
// kernel has the nbd driver and otherwise serves the socket and says why;
// --nbd-kernel on fails without the driver.
func TestEngineNBDKernelModes(t *testing.T) {
	dir := t.TempDir()
	r := start(t, "replica", "--dir", filepath.Join(dir, "r"), "--size", "16Mi", "--listen", "127.0.0.1:0", "--control-listen", "127.0.0.1:0")
	sock := filepath.Join(dir, "vol.sock")
	base := []string{"engine", "--name", "vol", "--frontend", "nbd", "--nbd-socket", sock, "--replica", r.data + "," + r.control}
	_, noDriver := os.Stat("/sys/module/nbd")
	if noDriver == nil {
		t.Skip("this host has the nbd driver; TestConnectKernel in frontend/nbd covers the device path")
	}
	e := start(t, append(base, "--nbd-kernel", "auto")...)
	if e.endpoint != sock {
		t.Fatalf("auto without the driver: endpoint %q, want the socket %q", e.endpoint, sock)
	}
	if !e.logged("serving the NBD socket " + sock + " only") {
		t.Fatalf("the engine did not say why there is no /dev/nbdN:\n%s", e.stderr.String())
	}
	e.stopClean(t, "engine")
	code, stderr := runExit(t, append(base, "--nbd-kernel", "on")...)
	if code == 0 || !strings.Contains(stderr, "modprobe nbd") {
		t.Fatalf("--nbd-kernel on without the driver: exit %d\n%s", code, stderr)
	}
	if _, err := os.Stat(sock); !os.IsNotExist(err) {
		t.Fatalf("the failed engine left its socket: %v", err)
	}
	code, stderr = runExit(t, append(base, "--nbd-kernel", "maybe")...)
	if code == 0 || !strings.Contains(stderr, `--nbd-kernel "maybe": use auto, on or off`) {
		t.Fatalf("bad --nbd-kernel: exit %d\n%s", code, stderr)
	}
}

// TestEngineSurvivesReplicaKillUnderFio kills one of three replica
// processes while fio writes continuously with crc32c verification; fio
// must finish without a single error, and the engine must report the
// replica ERR and the volume degraded.
func TestEngineSurvivesReplicaKillUnderFio(t *testing.T) {
	needTool(t, "fio")
	v := startVolume(t, 3, "128Mi")
	fio := exec.Command("fio", "--name=verified", "--ioengine=nbd", "--uri="+v.uri, "--rw=randwrite", "--bs=4k",
		"--size=64M", "--iodepth=16", "--verify=crc32c", "--verify_backlog=256", "--verify_fatal=1",
		"--time_based", "--runtime=8s", "--output-format=terse", "--terse-version=3", "--verify_state_save=0")
	out := &syncBuffer{}
	fio.Stdout, fio.Stderr = out, out
	if err := fio.Start(); err != nil {
		t.Fatal(err)
	}
	// Kill once writes are flowing: a few hundred, early in fio's run, so
	// that most of it (and its verification) comes after the kill even on
	// a loaded machine, where 4 s of fio made fewer than 2,000 writes.
	until := deadline.After(30 * time.Second)
	for !strings.Contains(v.ctl(t, "metrics"), "write  ops=") || metricOps(v.ctl(t, "metrics"), "write") < 200 {
		if time.Now().After(until) {
			t.Fatal("fio never got going")
		}
		time.Sleep(20 * time.Millisecond)
	}
	v.replicas[1].cmd.Process.Kill()
	v.replicas[1].waitExit(t)
	err := fio.Wait()
	if err != nil {
		t.Fatalf("fio failed after a replica was killed: %v\n%s", err, out.String())
	}
	fields := strings.Split(strings.TrimSpace(out.String()), ";")
	if len(fields) < 5 || fields[4] != "0" { // terse v3: field 5 is the error count
		t.Fatalf("fio reported errors: %s", out.String())
	}
	// fio may end before a write reaches the dead replica; the engine then
	// finds it at its next liveness ping (every 2 s).
	until = deadline.After(15 * time.Second)
	for r := v.ctl(t, "replicas"); strings.Count(r, "ERR") != 1 || strings.Count(r, "RW") != 2; r = v.ctl(t, "replicas") {
		if time.Now().After(until) {
			t.Fatalf("replicas after the kill:\n%s", r)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if info := v.ctl(t, "info"); !strings.Contains(info, "degraded") {
		t.Fatalf("info after the kill: %s", info)
	}
}

func metricOps(metrics, op string) int {
	for _, line := range strings.Split(metrics, "\n") {
		if strings.HasPrefix(line, op) {
			var n int
			if _, err := fmt.Sscanf(line[strings.Index(line, "ops=")+4:], "%d", &n); err != nil {
				return 0 // unreadable counts as none yet: the caller waits on
			}
			return n
		}
	}
	return 0
}

// TestStaleSharedWriteIsRepaired: a replica taking writes through shared
// memory is paused (SIGSTOP) with a write queued on its socket; the engine
// fails it, and the next write reuses that write's buffer with other bytes.
// Resumed, the replica applies the queued write from the reused buffer:
// wrong bytes on its disk. Added back, it must be resynced so that, alone,
// it serves exactly what was acknowledged.
func TestStaleSharedWriteIsRepaired(t *testing.T) {
	needTool(t, "qemu-io")
	v := startVolumeUnix(t, 3, 1, "32Mi")
	r0 := v.replicas[0]
	qemuIO(t, v.uri, "write -P 0x11 0 16M", "flush")
	r0.cmd.Process.Signal(syscall.SIGSTOP)
	// This write waits for the paused replica until the engine fails it
	// (--replica-timeout 3s); its frame stays queued on the replica's socket.
	qemuIO(t, v.uri, "write -P 0x22 0 64k")
	if r := v.ctl(t, "replicas"); !strings.Contains(r, "ERR") {
		t.Fatalf("the paused replica was not failed:\n%s", r)
	}
	// Same size, so the same shared buffer (the arena reuses the slot it
	// got back last): now it holds 0x33.
	qemuIO(t, v.uri, "write -P 0x33 8M 64k")
	r0.cmd.Process.Signal(syscall.SIGCONT)
	// The resumed replica applies the queued write with the buffer's bytes
	// now: read its data directly until that write has landed (0x33 at 0).
	landed := func() bool {
		c := dialReplica(t, r0)
		defer c.Close()
		p := make([]byte, 4096)
		for e := uint64(0); e < 64; e++ { // its epoch is the old one; find it
			c.SetEpoch(e)
			if err := c.ReadAt(context.Background(), p, 0); err == nil {
				return p[0] == 0x33
			}
		}
		return false
	}
	until := deadline.After(20 * time.Second)
	for !landed() {
		if time.Now().After(until) {
			t.Fatal("the resumed replica never applied the queued write with the reused bytes: the test no longer sets up what it checks")
		}
		time.Sleep(20 * time.Millisecond)
	}
	// Back into the volume: dirty regions only, which must cover it.
	out := v.ctl(t, "add", v.addrs[0], "--wait")
	if !strings.Contains(out, "complete") {
		t.Fatalf("rejoin: %s", out)
	}
	for _, r := range v.replicas[1:] {
		r.cmd.Process.Kill()
		r.waitExit(t)
	}
	qemuIO(t, v.uri, "read -P 0x22 0 64k", "read -P 0x11 64k 8128k", "read -P 0x33 8M 64k", "read -P 0x11 8256k 8128k")
}

// dialReplica opens a one-connection dataconn client to a replica's data
// address.
func dialReplica(t *testing.T, p *proc) *dataconn.Client {
	t.Helper()
	network, address := dataconn.SplitNetwork(p.data)
	c, err := dataconn.Dial(context.Background(), network, address, dataconn.ClientOptions{Conns: 1, PingInterval: -1})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// TestRebuiltReplicaKeepsSnapshots: processes end to end. A replica added
// to a volume with a snapshot is rebuilt layer by layer (ctl shows the
// layers); with the originals removed it alone serves the data and
// reverts to the snapshot.
func TestRebuiltReplicaKeepsSnapshots(t *testing.T) {
	needTool(t, "qemu-io")
	v := startVolume(t, 2, "32Mi")
	qemuIO(t, v.uri, "write -P 0xa1 0 8M", "flush")
	v.ctl(t, "snapshot", "create", "before")
	qemuIO(t, v.uri, "write -P 0xb2 0 4M", "flush")
	fresh := start(t, "replica", "--dir", filepath.Join(t.TempDir(), "new"), "--size", "32Mi",
		"--listen", "127.0.0.1:0", "--control-listen", "127.0.0.1:0")
	addr := fresh.data + "," + fresh.control
	out := v.ctl(t, "add", addr, "--wait")
	t.Logf("ctl add --wait:\n%s", out)
	if !strings.Contains(out, "full, 2 layers") || !strings.Contains(out, "complete 100%") {
		t.Fatalf("add --wait:\n%s", out)
	}
	for _, a := range v.addrs {
		v.ctl(t, "remove", a)
	}
	if out := v.ctl(t, "replicas"); strings.Count(out, "RW") != 1 || !strings.Contains(out, addr) {
		t.Fatalf("replicas:\n%s", out)
	}
	if out := v.ctl(t, "snapshot", "list"); !strings.Contains(out, "before") || !strings.Contains(out, "user=true") {
		t.Fatalf("the rebuilt replica's snapshots:\n%s", out)
	}
	qemuIO(t, v.uri, "read -P 0xb2 0 4M", "read -P 0xa1 4M 4M", "read -P 0 8M 24M")
	v.ctl(t, "snapshot", "revert", "before")
	qemuIO(t, v.uri, "read -P 0xa1 0 8M", "read -P 0 8M 24M")
}
