package chaos

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	enginev1 "github.com/cairn-io/cairn/dataplane/api/engine/v1"
	replicav1 "github.com/cairn-io/cairn/dataplane/api/replica/v1"
)

// iptPrefix starts the comment on every firewall rule the harness adds;
// each cluster adds its own name, so teardown and the leak check find
// exactly its rules even when several runs share the host.
const iptPrefix = "cairn-chaos:"

type node struct {
	idx         int
	base        string // directory holding this node's generations
	dir         string
	data, ctl   int
	cmd         *exec.Cmd
	exited      chan struct{}
	paused      bool
	partitioned bool
	tmpfs       string // mount point when the node's disk is a small tmpfs
	ballast     string // file filling that tmpfs, while the disk is "full"
	gen         int
	healedAt    time.Time // when a partition, pause or full disk was last undone
	direct      bool      // the replica runs with --direct-io
	sock        string    // data on this unix socket (the engine's node), not on TCP port data
}

func (n *node) addr() string {
	if n.sock != "" {
		return fmt.Sprintf("unix:%s,127.0.0.1:%d", n.sock, n.ctl)
	}
	return fmt.Sprintf("127.0.0.1:%d,127.0.0.1:%d", n.data, n.ctl)
}

// dataListen is the replica's --listen.
func (n *node) dataListen() string {
	if n.sock != "" {
		return "unix:" + n.sock
	}
	return fmt.Sprintf("127.0.0.1:%d", n.data)
}

func (n *node) alive() bool {
	if n.cmd == nil {
		return false
	}
	select {
	case <-n.exited:
		return false
	default:
		return true
	}
}

// reachable: alive and answering (not paused, not partitioned).
// control dials the node's replica control server; done closes the
// connection.
func (n *node) control() (rc replicav1.ReplicaServiceClient, done func(), err error) {
	cc, err := grpc.NewClient(fmt.Sprintf("127.0.0.1:%d", n.ctl), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, nil, err
	}
	return replicav1.NewReplicaServiceClient(cc), func() { cc.Close() }, nil
}

func (n *node) reachable() bool { return n.alive() && !n.paused && !n.partitioned }

type cluster struct {
	cfg     Config
	work    string
	iptTag  string
	nodes   []*node
	engine  *exec.Cmd
	engDone chan struct{}
	engPort int
	sock    string
	cc      *grpc.ClientConn
	ctl     enginev1.EngineServiceClient
	logs    []*os.File
	snapSeq int            // snapshots taken
	bg      sync.WaitGroup // snapshot deletions running
}

// freePort picks a free port below the kernel's ephemeral range
// (/proc/sys/net/ipv4/ip_local_port_range starts at 32768 by default), so
// that no outgoing connection can take it before the process binds it.
func freePort(taken map[int]bool) (int, error) {
	for range 200 {
		p := 20000 + rand.IntN(12000)
		if taken[p] {
			continue // drawn already for this cluster (its probe listener is closed by now)
		}
		l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", p))
		if err == nil {
			l.Close()
			taken[p] = true
			return p, nil
		}
	}
	return 0, errors.New("no free port in 20000-31999")
}

func newCluster(cfg Config, work string) (*cluster, error) {
	c := &cluster{cfg: cfg, work: work, sock: filepath.Join(work, "engine.sock"), iptTag: iptPrefix + filepath.Base(work)}
	var err error
	taken := map[int]bool{}
	if c.engPort, err = freePort(taken); err != nil {
		return nil, err
	}
	for i := range cfg.Replicas {
		n := &node{idx: i, base: filepath.Join(work, fmt.Sprintf("r%d", i))}
		if n.data, err = freePort(taken); err != nil {
			return nil, err
		}
		if n.ctl, err = freePort(taken); err != nil {
			return nil, err
		}
		if err := os.MkdirAll(n.base, 0o700); err != nil {
			return nil, err
		}
		if i == cfg.Replicas-1 && cfg.DiskFaults {
			// The last node's disk is a small tmpfs that the nemesis can fill.
			n.tmpfs = n.base
			size := cfg.Size*6 + 8<<20 // room for a head, a rebuild layer and the metadata
			if err := unix.Mount("tmpfs", n.tmpfs, "tmpfs", 0, fmt.Sprintf("size=%d", size)); err != nil {
				return nil, fmt.Errorf("mount tmpfs for the disk-full fault: %w", err)
			}
		}
		n.dir = filepath.Join(n.base, "gen0")
		// Bit i of the seed picks direct or buffered I/O for node i, so a
		// replayed seed runs the same mix (the tmpfs node stays buffered).
		n.direct = (cfg.Seed>>i)&1 == 1 && n.tmpfs == ""
		if i == 0 {
			// The first replica is on the engine's node: data on a unix
			// socket, writes through the memory the engine shares with it.
			// Partitions (iptables) pass it by.
			n.sock = filepath.Join(work, "r0.sock")
		}
		c.nodes = append(c.nodes, n)
	}
	c.cc, err = grpc.NewClient(fmt.Sprintf("127.0.0.1:%d", c.engPort), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	c.ctl = enginev1.NewEngineServiceClient(c.cc)
	return c, nil
}

func (c *cluster) logFile(name string) io.Writer {
	f, err := os.OpenFile(filepath.Join(c.work, name+".log"), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return io.Discard
	}
	c.logs = append(c.logs, f)
	return f
}

// start runs cairn-data and waits for its ready line.
func (c *cluster) start(logName string, env []string, args ...string) (*exec.Cmd, chan struct{}, error) {
	cmd := exec.Command(c.cfg.Bin, args...)
	cmd.Env = append(os.Environ(), env...)
	cmd.Stderr = c.logFile(logName)
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, nil, err
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return nil, nil, err
	}
	done := make(chan struct{})
	ready := make(chan string, 1)
	go func() {
		line, _ := bufio.NewReader(out).ReadString('\n')
		ready <- line
		_, _ = io.Copy(io.Discard, out) // keep the pipe drained until the process exits
	}()
	go func() {
		_ = cmd.Wait() // how it exited is in its log
		close(done)
	}()
	select {
	case line := <-ready:
		if !strings.HasPrefix(line, "ready ") {
			cmd.Process.Kill()
			<-done
			return nil, nil, fmt.Errorf("%s did not start (see %s.log)%s", args[0], logName, c.lastWords(logName))
		}
	case <-time.After(60 * time.Second):
		cmd.Process.Kill()
		<-done
		return nil, nil, fmt.Errorf("%s did not become ready", args[0])
	}
	return cmd, done, nil
}

// lastWords is ": " and the last line a process that has exited wrote to
// its log (its stderr), which says why it exited; empty if there is none.
func (c *cluster) lastWords(logName string) string {
	b, err := os.ReadFile(filepath.Join(c.work, logName+".log"))
	if err != nil {
		return ""
	}
	s := strings.TrimSpace(string(b))
	if s == "" {
		return ""
	}
	return ": " + s[strings.LastIndexByte(s, '\n')+1:]
}

func (c *cluster) startNode(n *node) error {
	args := []string{"replica", "--dir", n.dir, "--size", strconv.FormatInt(c.cfg.Size, 10),
		"--listen", n.dataListen(), "--control-listen", fmt.Sprintf("127.0.0.1:%d", n.ctl)}
	if n.direct {
		args = append(args, "--direct-io")
	}
	cmd, done, err := c.start(fmt.Sprintf("replica%d", n.idx), nil, args...)
	if err != nil {
		return err
	}
	n.cmd, n.exited, n.paused = cmd, done, false
	return nil
}

// startEngine runs an engine on the given nodes.
func (c *cluster) startEngine(nodes []*node) error {
	args := []string{"engine", "--name", "chaos", "--frontend", "nbd", "--nbd-socket", c.sock, "--nbd-kernel", "off",
		"--listen", fmt.Sprintf("127.0.0.1:%d", c.engPort), "--replica-timeout", "1s", "--wanted", strconv.Itoa(len(c.nodes))}
	for _, n := range nodes {
		args = append(args, "--replica", n.addr())
	}
	var env []string
	if c.cfg.UnsafeEngine {
		env = append(env, "CAIRN_UNSAFE_ACK_EARLY=1")
	}
	cmd, done, err := c.start("engine", env, args...)
	if err != nil {
		return err
	}
	c.engine, c.engDone = cmd, done
	return nil
}

func (c *cluster) engineAlive() bool {
	if c.engine == nil {
		return false
	}
	select {
	case <-c.engDone:
		return false
	default:
		return true
	}
}

func (c *cluster) killEngine() {
	if c.engineAlive() {
		c.engine.Process.Kill()
		<-c.engDone
	}
}

func (c *cluster) killNode(n *node) {
	if n.alive() {
		if n.paused {
			n.cmd.Process.Signal(syscall.SIGCONT)
		}
		n.cmd.Process.Kill()
		<-n.exited
	}
	n.paused = false
}

// modes returns the engine's view: address → RW/WO/ERR.
func (c *cluster) modes(ctx context.Context) (map[string]string, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	rs, err := c.ctl.ReplicaList(ctx, &enginev1.ReplicaListRequest{})
	if err != nil {
		return nil, err
	}
	out := map[string]string{}
	for _, r := range rs.Replicas {
		out[r.Address] = r.Mode
	}
	return out, nil
}

// settle is how long a healed or restarted node stays suspect: requests
// sent while it was partitioned or paused can still time out (1 s) after
// the heal, and the engine may not have noticed a restart yet.
const settle = 2 * time.Second

// healthy counts nodes that are reachable and RW, other than skip, and not
// just healed (see settle).
func (c *cluster) healthy(ctx context.Context, skip *node) int {
	m, err := c.modes(ctx)
	if err != nil {
		return 0
	}
	k := 0
	for _, n := range c.nodes {
		if n != skip && n.reachable() && n.ballast == "" && m[n.addr()] == "RW" && time.Since(n.healedAt) > settle {
			k++
		}
	}
	return k
}

func ipt(args ...string) error {
	out, err := exec.Command("iptables", args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("iptables %s: %w: %s", strings.Join(args, " "), err, out)
	}
	return nil
}

func (c *cluster) partitionRules(n *node) [][]string {
	var rules [][]string
	for _, p := range []int{n.data, n.ctl} {
		ps := strconv.Itoa(p)
		rules = append(rules,
			[]string{"INPUT", "-i", "lo", "-p", "tcp", "--dport", ps, "-m", "comment", "--comment", c.iptTag, "-j", "DROP"},
			[]string{"OUTPUT", "-o", "lo", "-p", "tcp", "--sport", ps, "-m", "comment", "--comment", c.iptTag, "-j", "DROP"})
	}
	return rules
}

func (c *cluster) partition(n *node) error {
	for _, r := range c.partitionRules(n) {
		if err := ipt(append([]string{"-A"}, r...)...); err != nil {
			return err
		}
	}
	n.partitioned = true
	return nil
}

func (c *cluster) heal(n *node) {
	if n.partitioned || n.paused || n.ballast != "" {
		n.healedAt = time.Now()
	}
	if n.partitioned {
		for _, r := range c.partitionRules(n) {
			if err := ipt(append([]string{"-D"}, r...)...); err != nil {
				fmt.Fprintf(c.cfg.Verbose, "heal replica %d: %v\n", n.idx, err)
			}
		}
		n.partitioned = false
	}
	if n.paused && n.alive() {
		n.cmd.Process.Signal(syscall.SIGCONT)
	}
	n.paused = false
	if n.ballast != "" {
		os.Remove(n.ballast)
		n.ballast = ""
	}
}

// fillDisk fills the node's tmpfs so its next allocation fails (ENOSPC).
func (c *cluster) fillDisk(n *node) error {
	var st unix.Statfs_t
	if err := unix.Statfs(n.tmpfs, &st); err != nil {
		return err
	}
	n.ballast = filepath.Join(n.tmpfs, "ballast")
	f, err := os.Create(n.ballast)
	if err != nil {
		return err
	}
	defer f.Close()
	return unix.Fallocate(int(f.Fd()), 0, 0, int64(st.Bavail)*st.Bsize)
}

// rejoin brings a failed node back into the engine: restart it if it died,
// then add it (a returning replica resyncs its dirty regions; a fresh one
// is rebuilt in full).
func (c *cluster) rejoin(ctx context.Context, n *node) error {
	if !n.alive() {
		if err := c.startNode(n); err != nil {
			return err
		}
		// Suspect for a while, like a healed node: the engine may still
		// hold a connection to the process that died and call the node RW
		// until it notices (and then refuses this add, leaving the new
		// process running). Counting it healthy let the nemesis take the
		// last replica the engine could use (seed 799679798: faulted).
		n.healedAt = time.Now()
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	_, err := c.ctl.ReplicaAdd(ctx, &enginev1.ReplicaAddRequest{Address: n.addr()})
	return err
}

// replace swaps a node for an empty replica at the same address.
func (c *cluster) replace(ctx context.Context, n *node) error {
	c.killNode(n)
	rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	// The engine may have dropped the killed replica already.
	_, _ = c.ctl.ReplicaRemove(rctx, &enginev1.ReplicaRemoveRequest{Address: n.addr()})
	cancel()
	n.gen++
	os.RemoveAll(n.dir)
	n.dir = filepath.Join(n.base, fmt.Sprintf("gen%d", n.gen))
	return c.rejoin(ctx, n)
}

// teardown stops everything and undoes every change to the host.
func (c *cluster) teardown() {
	for _, n := range c.nodes {
		c.heal(n)
	}
	if c.engineAlive() {
		c.engine.Process.Signal(syscall.SIGTERM)
		select {
		case <-c.engDone:
		case <-time.After(10 * time.Second):
			c.killEngine()
		}
	}
	for _, n := range c.nodes {
		c.killNode(n)
		if n.tmpfs != "" {
			if err := unix.Unmount(n.tmpfs, unix.MNT_DETACH); err != nil {
				fmt.Fprintf(c.cfg.Verbose, "teardown: unmount %s: %v\n", n.tmpfs, err)
			}
		}
	}
	if c.cc != nil {
		c.cc.Close()
	}
	for _, f := range c.logs {
		f.Close()
	}
}

// leaks reports anything the schedule left behind on the host.
func (c *cluster) leaks() []string {
	var out []string
	for _, n := range c.nodes {
		if n.alive() {
			out = append(out, fmt.Sprintf("replica %d still running", n.idx))
		}
	}
	if c.engineAlive() {
		out = append(out, "engine still running")
	}
	if b, err := exec.Command("iptables", "-S").Output(); err == nil && strings.Contains(string(b), c.iptTag) {
		out = append(out, "firewall rules left")
	}
	if b, err := os.ReadFile("/proc/self/mountinfo"); err == nil && strings.Contains(string(b), c.work) {
		out = append(out, "mounts left under "+c.work)
	}
	if _, err := os.Stat(c.sock); err == nil {
		out = append(out, "NBD socket left")
	}
	return out
}
