// Package chaos tests the data plane the way Jepsen tests databases: real
// engine and replica processes, several clients doing reads, writes,
// trims and flushes through the NBD frontend, a nemesis injecting faults
// on a random schedule drawn from a seed, and checkers that prove the
// history linearizable per block, the replicas identical after healing,
// the volume healthy, a fenced-out engine unable to change the replicas,
// and the host left as it was.
package chaos

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/anishathalye/porcupine"

	enginev1 "github.com/cairn-io/cairn/dataplane/api/engine/v1"
	replicav1 "github.com/cairn-io/cairn/dataplane/api/replica/v1"
	"github.com/cairn-io/cairn/dataplane/dataconn"
	"github.com/cairn-io/cairn/dataplane/engine"
)

// Fault is a kind of fault the nemesis injects.
type Fault string

// Faults.
const (
	FaultKillReplica      Fault = "kill-replica"      // SIGKILL a replica
	FaultPauseReplica     Fault = "pause-replica"     // SIGSTOP, SIGCONT later: a hung peer
	FaultPartitionReplica Fault = "partition-replica" // drop its packets (iptables), heal later
	FaultFillDisk         Fault = "fill-disk"         // its disk (a tmpfs) fills up: ENOSPC
	FaultKillEngine       Fault = "kill-engine"       // SIGKILL the engine, start a new one on the survivors
	FaultReplaceReplica   Fault = "replace-replica"   // swap a replica for an empty one: full rebuild
	FaultRejoinReplica    Fault = "rejoin-replica"    // bring a failed replica back: stale, then resynced
	// Not faults, but operations that change the snapshot chains while the
	// faults go on: rebuilds then copy several layers, and deletions merge
	// while clients write.
	FaultSnapshot       Fault = "snapshot"        // take a snapshot through the engine
	FaultDeleteSnapshot Fault = "delete-snapshot" // delete one (in the background: it runs while I/O goes on)
)

// AllFaults lists every fault kind.
var AllFaults = []Fault{FaultKillReplica, FaultPauseReplica, FaultPartitionReplica, FaultFillDisk,
	FaultKillEngine, FaultReplaceReplica, FaultRejoinReplica, FaultSnapshot, FaultDeleteSnapshot}

// Config describes one schedule.
type Config struct {
	Bin          string        // cairn-data
	Work         string        // parent of the schedule's directory
	Seed         uint64        // drives the workload and the nemesis
	Duration     time.Duration // workload time, default 3s
	Clients      int           // default 4
	Replicas     int           // default 3
	Blocks       int           // blocks the clients contend on, default 48
	Size         int64         // volume size, default 16 MiB
	Faults       []Fault       // default AllFaults
	FaultEvery   time.Duration // mean time between faults, default 250ms
	DiskFaults   bool          // put the last replica on a small tmpfs (needs root)
	UnsafeEngine bool          // run the deliberately broken engine
	Verbose      io.Writer
}

func (c *Config) defaults() {
	if c.Duration <= 0 {
		c.Duration = 3 * time.Second
	}
	if c.Clients <= 0 {
		c.Clients = 4
	}
	if c.Replicas <= 0 {
		c.Replicas = 3
	}
	if c.Blocks <= 0 {
		c.Blocks = 48
	}
	if c.Size <= 0 {
		c.Size = 16 << 20
	}
	if len(c.Faults) == 0 {
		c.Faults = AllFaults
	}
	if c.FaultEvery <= 0 {
		c.FaultEvery = 250 * time.Millisecond
	}
	if c.Verbose == nil {
		c.Verbose = io.Discard
	}
}

// Result is what one schedule did and found.
type Result struct {
	Seed     uint64
	Ops      int
	Faults   map[Fault]int
	Elapsed  time.Duration
	Problems []string // violations; empty means the schedule passed
	// Setup is why the schedule never ran (Problems holds it too, as
	// "setup: ..."): nothing was checked, so it is no violation found.
	// errEngineStart marks the first engine's start. Nil once it ran.
	Setup error
	// Linearizability is the checker's verdict on the history, final
	// reads included: porcupine.Illegal is a lost acknowledged write or a
	// read of a value no order of the operations explains. Empty if the
	// schedule never got that far.
	Linearizability porcupine.CheckResult
	// Visualization is a porcupine HTML file for a linearizability
	// violation; Dir keeps the schedule's logs when something failed.
	Visualization string
	Dir           string
	// Explanation is the minimal history around a linearizability violation.
	Explanation string
}

// Line is the one-line summary of a schedule.
func (r Result) Line() string {
	var fs []string
	for f, n := range r.Faults {
		fs = append(fs, fmt.Sprintf("%s=%d", f, n))
	}
	sort.Strings(fs)
	verdict := "ok"
	if len(r.Problems) > 0 {
		verdict = "VIOLATION: " + strings.Join(r.Problems, "; ")
	}
	return fmt.Sprintf("seed=%d ops=%d faults[%s] %.1fs %s", r.Seed, r.Ops, strings.Join(fs, " "), r.Elapsed.Seconds(), verdict)
}

// errEngineStart marks a Result.Setup that failed at starting the
// schedule's first engine (the replicas were up).
var errEngineStart = errors.New("starting the engine")

func (c *cluster) blockOffset(b int) int64 {
	stride := c.cfg.Size / int64(c.cfg.Blocks)
	stride -= stride % BlockSize
	return int64(b) * stride
}

// Run runs one schedule. If ctx ends (an interrupt), the workload stops
// early and the schedule is healed, checked and torn down as usual, so
// nothing is left on the host.
func Run(ctx context.Context, cfg Config) (res Result) {
	cfg.defaults()
	start := time.Now()
	res = Result{Seed: cfg.Seed, Faults: map[Fault]int{}}
	defer func() { res.Elapsed = time.Since(start) }()
	setupFailed := func(err error) Result {
		res.Setup = err
		res.Problems = append(res.Problems, "setup: "+err.Error())
		return res
	}
	work, err := os.MkdirTemp(cfg.Work, fmt.Sprintf("seed-%d-", cfg.Seed))
	if err != nil {
		return setupFailed(err)
	}
	res.Dir = work
	c, err := newCluster(cfg, work)
	if err != nil {
		return setupFailed(err)
	}
	defer func() {
		c.teardown()
		if l := c.leaks(); len(l) > 0 {
			res.Problems = append(res.Problems, "leaked: "+strings.Join(l, ", "))
		}
		if len(res.Problems) == 0 {
			os.RemoveAll(work)
			res.Dir = ""
		}
	}()
	for _, n := range c.nodes {
		if err := c.startNode(n); err != nil {
			return setupFailed(err)
		}
	}
	// An engine that the schedule's first engine fences out at its open.
	stale, err := c.newStaleEngine(ctx)
	if err != nil {
		return setupFailed(err)
	}
	defer stale.close()
	if err := c.startEngine(c.nodes); err != nil {
		return setupFailed(fmt.Errorf("%w: %w", errEngineStart, err))
	}

	h := newHistory()
	ctx, stop := context.WithTimeout(ctx, cfg.Duration)
	var wg sync.WaitGroup
	for id := range cfg.Clients {
		wg.Add(1)
		go func() { defer wg.Done(); c.client(ctx, id, h, rand.New(rand.NewPCG(cfg.Seed, uint64(id)))) }()
	}
	c.nemesis(ctx, rand.New(rand.NewPCG(cfg.Seed, 1<<32)), res.Faults)
	wg.Wait()
	stop()

	if err := c.healAll(context.Background()); err != nil {
		res.Problems = append(res.Problems, "heal: "+err.Error())
	} else {
		// Before the final reads: a change that got through (a revert)
		// would show there too.
		res.Problems = append(res.Problems, stale.try(context.Background(), c)...)
	}
	c.finalReads(h)
	res.Ops = h.len()

	result, info := h.check(60 * time.Second)
	res.Linearizability = result
	switch result {
	case porcupine.Illegal:
		res.Problems = append(res.Problems, "history is not linearizable")
		res.Explanation = h.explain()
		viz := filepath.Join(work, "history.html")
		if err := porcupine.VisualizePath(registerModel, info, viz); err == nil {
			res.Visualization = viz
		}
	case porcupine.Unknown:
		res.Problems = append(res.Problems, "linearizability check timed out")
	}
	if p := c.checkReplicasIdentical(context.Background()); p != "" {
		res.Problems = append(res.Problems, p)
	}
	return res
}

// client is one workload client: writes of unique values, reads, trims and
// flushes on the shared blocks, each recorded with its invoke and
// completion times. A write whose outcome is unknown (connection lost,
// error reply) stays open forever in the history.
func (c *cluster) client(ctx context.Context, id int, h *history, rng *rand.Rand) {
	var conn *nbdClient
	defer func() {
		if conn != nil {
			conn.close()
		}
	}()
	seq := uint64(0)
	for ctx.Err() == nil {
		if conn == nil {
			var err error
			if conn, err = dialNBD(c.sock, "chaos", time.Second); err != nil {
				conn = nil
				time.Sleep(10 * time.Millisecond) // the engine is restarting: retry shortly
				continue
			}
		}
		b := rng.IntN(c.cfg.Blocks)
		off := c.blockOffset(b)
		call := h.now()
		var err error
		switch r := rng.IntN(100); {
		case r < 45 || r >= 95 && r < 97: // write (or trim: value 0)
			seq++
			v := uint64(id+1)<<32 | seq
			typ := uint16(nbdWrite)
			var payload []byte
			if r >= 95 {
				v, typ = 0, nbdTrim
			} else {
				payload = encode(b, v)
			}
			_, err = conn.do(typ, off, BlockSize, payload, 10*time.Second)
			ret := h.now()
			if err != nil {
				ret = forever
			}
			h.add(id, input{kind: opWrite, block: b, value: v}, output{}, call, ret)
		case r < 95:
			var data []byte
			data, err = conn.do(nbdRead, off, BlockSize, nil, 10*time.Second)
			if err == nil {
				h.add(id, input{kind: opRead, block: b}, output{value: decode(b, data)}, call, h.now())
			}
		default:
			_, err = conn.do(nbdFlush, 0, 0, nil, 10*time.Second)
		}
		if err != nil {
			conn.c.Close()
			conn = nil
		}
	}
}

// healTimer is a fault on a node to undo at a time.
type healTimer struct {
	n  *node
	at time.Time
}

// nemesis injects faults until ctx ends, never taking the last healthy
// replica: the guarantee under test holds while one RW replica survives.
func (c *cluster) nemesis(ctx context.Context, rng *rand.Rand, count map[Fault]int) {
	var toHeal []healTimer
	for ctx.Err() == nil {
		select {
		case <-ctx.Done():
		case <-time.After(time.Duration(rng.Int64N(int64(2 * c.cfg.FaultEvery)))):
		}
		now := time.Now()
		toHeal = c.healDue(toHeal, now)
		if ctx.Err() != nil {
			break
		}
		f := c.cfg.Faults[rng.IntN(len(c.cfg.Faults))]
		n, ok := c.target(ctx, rng, f)
		if !ok {
			continue
		}
		healAt := now.Add(time.Duration(300+rng.IntN(900)) * time.Millisecond)
		var injected bool
		switch f {
		case FaultKillReplica, FaultPauseReplica, FaultPartitionReplica, FaultFillDisk, FaultReplaceReplica:
			var heal bool
			if injected, heal = c.replicaFault(ctx, f, n); heal {
				toHeal = append(toHeal, healTimer{n, healAt})
			}
		case FaultKillEngine:
			injected = c.restartEngine(ctx)
		case FaultSnapshot:
			injected = c.snapshot(ctx)
		case FaultDeleteSnapshot:
			injected = c.deleteSnapshot(ctx, rng)
		case FaultRejoinReplica:
			injected = c.rejoinFailed(ctx, n)
		}
		if !injected {
			continue
		}
		count[f]++
		fmt.Fprintf(c.cfg.Verbose, "nemesis: %s replica %d\n", f, n.idx)
	}
	for _, t := range toHeal {
		c.heal(t.n)
	}
}

// healDue heals the faults whose time came and returns the others.
func (c *cluster) healDue(toHeal []healTimer, now time.Time) []healTimer {
	kept := toHeal[:0]
	for _, t := range toHeal {
		if now.After(t.at) {
			c.heal(t.n)
		} else {
			kept = append(kept, t)
		}
	}
	return kept
}

// target picks the node fault f hits; false: none fits (no failed node to
// rejoin).
func (c *cluster) target(ctx context.Context, rng *rand.Rand, f Fault) (*node, bool) {
	n := c.nodes[rng.IntN(len(c.nodes))]
	switch f {
	case FaultFillDisk: // only the tmpfs node's disk can fill
		n = c.nodes[len(c.nodes)-1]
	case FaultPartitionReplica: // iptables cannot cut a unix socket
		if n.sock != "" && len(c.nodes) > 1 {
			n = c.nodes[1+rng.IntN(len(c.nodes)-1)]
		}
	case FaultRejoinReplica: // a node that is down or failed, if any
		m, _ := c.modes(ctx)
		var failed []*node
		for _, x := range c.nodes {
			if !x.paused && !x.partitioned && x.ballast == "" && (!x.alive() || m[x.addr()] == "ERR" || m[x.addr()] == "") {
				failed = append(failed, x)
			}
		}
		if len(failed) == 0 {
			return nil, false
		}
		n = failed[rng.IntN(len(failed))]
	}
	return n, true
}

// replicaFault kills, pauses, partitions, fills the disk of or replaces
// replica n, unless that would take the last healthy replica; heal: the
// fault is one to undo later (pause, partition, full disk).
func (c *cluster) replicaFault(ctx context.Context, f Fault, n *node) (injected, heal bool) {
	if f == FaultFillDisk && (n.tmpfs == "" || n.ballast != "") {
		return false, false
	}
	if !n.reachable() || c.healthy(ctx, n) < 1 {
		return false, false // would take the last healthy replica
	}
	var err error
	switch f {
	case FaultKillReplica:
		c.killNode(n)
	case FaultPauseReplica:
		err = n.cmd.Process.Signal(syscall.SIGSTOP)
		n.paused = true
		heal = true
	case FaultPartitionReplica:
		err, heal = c.partition(n), true
	case FaultFillDisk:
		err, heal = c.fillDisk(n), true
	case FaultReplaceReplica:
		err = c.replace(ctx, n)
	}
	if err != nil {
		fmt.Fprintf(c.cfg.Verbose, "nemesis: %s on replica %d: %v\n", f, n.idx, err)
		return false, heal
	}
	return true, heal
}

// restartEngine kills the engine and starts a new one on the reachable
// replicas. A new engine needs a reachable replica that the old one had
// RW, and serves without the others only if none of them was RW (it may
// hold writes the survivors lack: docs/engine.md, "Opening with replicas
// that do not answer"); else it waits, so the fault is not injected.
func (c *cluster) restartEngine(ctx context.Context) bool {
	m, err := c.modes(ctx)
	if err != nil {
		return false
	}
	var up []*node
	ok := true
	rw := false
	for _, x := range c.nodes {
		if x.reachable() {
			up = append(up, x)
			if m[x.addr()] == "RW" && x.ballast == "" {
				rw = true
			}
		} else if m[x.addr()] == "RW" {
			ok = false
		}
	}
	if !ok || !rw || !c.recordedIn(ctx, up) {
		return false
	}
	c.killEngine()
	if err := c.startEngine(up); err != nil {
		fmt.Fprintf(c.cfg.Verbose, "nemesis: restarting the engine: %v\n", err)
		return false
	}
	return true
}

// recordedIn applies the engine's open rule (engine.ServesAtOnce) to
// what the replicas in up recorded: an engine given them serves at once.
// The modes the engine reports are not enough: a replica it failed a
// moment ago is ERR in its memory before the others record the next epoch
// without it (a paused peer holds that up), and an engine started without
// it would wait for it.
func (c *cluster) recordedIn(ctx context.Context, up []*node) bool {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	var infos []engine.ReplicaInfo
	for _, n := range up {
		rc, done, err := n.control()
		if err != nil {
			return false
		}
		in, err := rc.Info(ctx, &replicav1.InfoRequest{})
		done()
		if err != nil {
			return false
		}
		infos = append(infos, engine.ReplicaInfo{ID: in.GetId(), Rebuilding: in.GetRebuilding(), Epoch: in.GetEpoch(), EpochMembers: in.GetEpochMembers()})
	}
	ok, _ := engine.ServesAtOnce(infos)
	return ok
}

// snapshot takes a snapshot chaos-N.
func (c *cluster) snapshot(ctx context.Context) bool {
	c.snapSeq++
	sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	_, err := c.ctl.SnapshotCreate(sctx, &enginev1.SnapshotCreateRequest{Name: fmt.Sprintf("chaos-%d", c.snapSeq)})
	cancel()
	if err != nil {
		fmt.Fprintf(c.cfg.Verbose, "nemesis: snapshot: %v\n", err)
		return false
	}
	return true
}

// deleteSnapshot starts deleting one of the chaos snapshots, in the
// background (healAll waits for it).
func (c *cluster) deleteSnapshot(ctx context.Context, rng *rand.Rand) bool {
	sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	list, err := c.ctl.SnapshotList(sctx, &enginev1.SnapshotListRequest{})
	cancel()
	var names []string
	for _, sn := range list.GetSnapshots() {
		if strings.HasPrefix(sn.Name, "chaos-") {
			names = append(names, sn.Name)
		}
	}
	if err != nil || len(names) == 0 {
		return false
	}
	name := names[rng.IntN(len(names))]
	c.bg.Add(1)
	go func() {
		defer c.bg.Done()
		dctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if _, err := c.ctl.SnapshotDelete(dctx, &enginev1.SnapshotDeleteRequest{Name: name}); err != nil {
			fmt.Fprintf(c.cfg.Verbose, "nemesis: delete snapshot %s: %v\n", name, err)
		}
	}()
	return true
}

// rejoinFailed brings back replica n if it is down or failed (and not
// paused, partitioned or on a full disk).
func (c *cluster) rejoinFailed(ctx context.Context, n *node) bool {
	m, err := c.modes(ctx)
	if err != nil || (n.alive() && m[n.addr()] != "ERR" && m[n.addr()] != "") || n.paused || n.partitioned || n.ballast != "" {
		return false
	}
	if err := c.rejoin(ctx, n); err != nil {
		fmt.Fprintf(c.cfg.Verbose, "nemesis: rejoin replica %d: %v\n", n.idx, err)
		return false
	}
	return true
}

// healAll undoes every fault and brings every replica back as RW.
func (c *cluster) healAll(ctx context.Context) error {
	c.bg.Wait() // snapshot deletions still running
	for _, n := range c.nodes {
		c.heal(n)
	}
	if !c.engineAlive() {
		if err := c.startEngineOnAll(); err != nil {
			return err
		}
	}
	deadline := time.Now().Add(90 * time.Second)
	lastTry := map[*node]time.Time{}
	for {
		m, err := c.modes(ctx)
		if err == nil {
			rw, busy := 0, false
			for _, n := range c.nodes {
				switch m[n.addr()] {
				case "RW":
					if n.alive() {
						rw++
					} else {
						// Killed, and the engine has not noticed yet: an idle
						// engine finds a lost replica at its next liveness
						// ping (docs/dataconn.md); then it is rejoined.
						busy = true
					}
				case "WO":
					busy = true // rebuilding
				default: // ERR or not a member
					busy = true
					if time.Since(lastTry[n]) < time.Second {
						continue // the engine may not have noticed a failure yet; do not hammer it
					}
					lastTry[n] = time.Now()
					if err := c.rejoin(ctx, n); err != nil {
						fmt.Fprintf(c.cfg.Verbose, "heal: rejoin replica %d: %v\n", n.idx, err)
					}
				}
			}
			if rw == 0 && c.engineAlive() {
				// Faulted (can only follow faults nobody could survive): do
				// what the control plane's salvage does, start a new engine
				// on every replica; it serves from those with the newest
				// epoch, which hold every acknowledged write.
				fmt.Fprintf(c.cfg.Verbose, "heal: the volume is faulted; restarting the engine\n")
				c.killEngine()
			}
			if !c.engineAlive() {
				if err := c.startEngineOnAll(); err != nil {
					return err
				}
				continue
			}
			if rw == len(c.nodes) && !busy {
				in, err := c.ctl.VolumeInfo(ctx, &enginev1.VolumeInfoRequest{})
				if err == nil && in.Robustness == "healthy" {
					return nil
				}
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the volume did not become healthy: %v %v", m, err) //nolint:errorlint // err may be nil (the volume answered, not healthy)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// startEngineOnAll runs every replica whose process is gone and starts
// an engine on all of them, as the control plane's salvage does: a
// replica killed a moment ago may be ERR in the old engine's memory and
// still a member at the newest epoch the others recorded (a peer that was
// paused had not recorded the next one yet), and an engine not given it
// waits for it, rightly, since it could hold writes the others lack.
func (c *cluster) startEngineOnAll() error {
	for _, n := range c.nodes {
		if !n.alive() {
			if err := c.startNode(n); err != nil {
				return err
			}
			n.healedAt = time.Now()
		}
	}
	return c.startEngine(c.nodes)
}

// finalReads reads every block once the schedule has healed: every
// acknowledged write must still be there.
func (c *cluster) finalReads(h *history) {
	conn, err := dialNBD(c.sock, "chaos", 5*time.Second)
	if err != nil {
		return
	}
	defer conn.close()
	for b := range c.cfg.Blocks {
		call := h.now()
		data, err := conn.do(nbdRead, c.blockOffset(b), BlockSize, nil, 10*time.Second)
		if err == nil {
			h.add(c.cfg.Clients, input{kind: opRead, block: b}, output{value: decode(b, data)}, call, h.now())
		}
	}
}

// checkReplicasIdentical reads the whole volume from every replica
// directly and compares region checksums.
func (c *cluster) checkReplicasIdentical(ctx context.Context) string {
	in, err := c.ctl.VolumeInfo(ctx, &enginev1.VolumeInfoRequest{})
	if err != nil {
		return "volume info: " + err.Error()
	}
	if in.Robustness != "healthy" {
		return "volume is " + in.Robustness + " after healing"
	}
	const region = 1 << 20
	var ref [][32]byte
	for _, n := range c.nodes {
		network, address := dataconn.SplitNetwork(n.dataListen())
		d, err := dataconn.Dial(ctx, network, address, dataconn.ClientOptions{Conns: 1})
		if err != nil {
			return fmt.Sprintf("replica %d: %v", n.idx, err)
		}
		d.SetEpoch(in.Epoch)
		buf := make([]byte, region)
		var sums [][32]byte
		for off := int64(0); off < c.cfg.Size; off += region {
			if err := d.ReadAt(ctx, buf, off); err != nil {
				d.Close()
				return fmt.Sprintf("replica %d: read: %v", n.idx, err)
			}
			sums = append(sums, sha256.Sum256(buf))
		}
		d.Close()
		if ref == nil {
			ref = sums
			continue
		}
		for i := range sums {
			if !bytes.Equal(sums[i][:], ref[i][:]) {
				return fmt.Sprintf("replica %d differs from replica 0 in region %d (bytes %d..%d)", n.idx, i, i*region, (i+1)*region)
			}
		}
	}
	return c.checkSnapshotsIdentical(ctx)
}

// checkSnapshotsIdentical compares every replica's snapshots: the same
// names in the same order, and the same data in the view at each.
func (c *cluster) checkSnapshotsIdentical(ctx context.Context) string {
	var refNames []string
	var refSums []uint32
	for _, n := range c.nodes {
		rc, done, err := n.control()
		if err != nil {
			return fmt.Sprintf("replica %d: %v", n.idx, err)
		}
		list, err := rc.SnapshotList(ctx, &replicav1.SnapshotListRequest{})
		var names []string
		var sums []uint32
		for _, sn := range list.GetSnapshots() {
			names = append(names, sn.Name)
			if err == nil {
				var sum *replicav1.ChecksumResponse
				sum, err = rc.Checksum(ctx, &replicav1.ChecksumRequest{Snapshot: sn.Name, Length: c.cfg.Size})
				sums = append(sums, sum.GetCrc32C())
			}
		}
		done()
		if err != nil {
			return fmt.Sprintf("replica %d: snapshots: %v", n.idx, err)
		}
		if n == c.nodes[0] {
			refNames, refSums = names, sums
			continue
		}
		if !slices.Equal(names, refNames) {
			return fmt.Sprintf("replica %d has snapshots %v, replica 0 %v", n.idx, names, refNames)
		}
		for i := range sums {
			if sums[i] != refSums[i] {
				return fmt.Sprintf("snapshot %s differs between replica %d and replica 0", names[i], n.idx)
			}
		}
	}
	return ""
}
