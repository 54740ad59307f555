package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	enginev1 "github.com/cairn-io/cairn/dataplane/api/engine/v1"
	replicav1 "github.com/cairn-io/cairn/dataplane/api/replica/v1"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// outage is how a replica leaves the volume and comes back.
type outage int

const (
	// processRestart: the replica process is killed and started again on
	// its directory, at its old ports.
	processRestart outage = iota
	// newAddress: the replica process is killed and started again on its
	// directory at other ports, as a replaced instance manager (or a
	// rebooted node's) starts it.
	newAddress
	// engineRestart: as newAddress, and the engine is killed and started
	// again while the replica is away.
	engineRestart
	// oldMetadata: as engineRestart, and the other replicas are restarted
	// too, their metadata without the epoch since which they kept their
	// write-intent bits (as a replica binary from before that record
	// wrote it): which writes the returning one missed is not known.
	oldMetadata
)

func (o outage) String() string {
	return [...]string{"process restart", "new address", "engine restart", "old metadata"}[o]
}

const (
	resyncVolume    = 128 << 20
	resyncWritten   = 8 << 20 // written while the replica is away
	resyncRegion    = 1 << 20 // the replicas' write-intent region
	resyncVolumeArg = "128Mi"
)

// TestReturningReplicaCopiesWhatChanged: a three-replica volume of
// replica and engine processes is written whole, then left idle (no
// flush from the application) until every replica's write-intent bitmap
// is clean. One replica goes away, 8 MiB are written to the 128 MiB
// volume, and the replica comes back on its directory. Whether its
// process restarted at its old ports or at new ones, and whether the
// engine restarted while it was away (the new engine has no record of
// it leaving: the survivors' write-intent bits, kept since it left, tell
// what it missed), its resync copies the regions written meanwhile, not
// the volume. If the survivors cannot tell since when they kept their
// bits (metadata from before that record), it is rebuilt in full, saying
// why in the rebuild's status. Either way, the returned replica alone
// then serves every byte right.
func TestReturningReplicaCopiesWhatChanged(t *testing.T) {
	needTool(t, "qemu-io")
	for _, o := range []outage{processRestart, newAddress, engineRestart, oldMetadata} {
		t.Run(o.String(), func(t *testing.T) { testResync(t, o) })
	}
}

func testResync(t *testing.T, o outage) {
	v := resyncVolumeProcs(t)
	qemuIO(t, v.uri, "write -P 0x11 0 128M", "flush")
	waitBitmapsClean(t, v)

	gone := v.replicas[1]
	gone.cmd.Process.Kill()
	gone.waitExit(t)
	waitMode(t, v.engine.control, v.addrs[1], "ERR")
	// 8 MiB while it is away, in two places, region-aligned.
	qemuIO(t, v.uri, "write -P 0x22 32M 4M", "write -P 0x33 96M 4M", "flush")

	if o == engineRestart || o == oldMetadata {
		v.engine.cmd.Process.Kill()
		v.engine.waitExit(t)
		if o == oldMetadata {
			restartWithoutKeptSince(t, v, 0, 2)
		}
		v.engine = start(t, v.args...)
		waitMode(t, v.engine.control, v.addrs[1], "ERR")
	}
	listen, control := "127.0.0.1:0", "127.0.0.1:0"
	if o == processRestart {
		listen, control = gone.data, gone.control
	}
	back := start(t, "replica", "--dir", v.dirs[1], "--listen", listen, "--control-listen", control, "--dirty-clear-delay", "1s")
	addr := back.data + "," + back.control
	if o != processRestart && addr == v.addrs[1] {
		t.Fatalf("the replica came back at its old address %s; the test needs another", addr)
	}
	out := v.ctl(t, "add", addr, "--wait")
	t.Logf("ctl add --wait:\n%s", out)
	rb := rebuildOf(t, v.engine.control, addr)
	if rb.State != "complete" {
		t.Fatalf("rebuild: %+v", rb)
	}
	checkCopied(t, o, rb)
	waitMode(t, v.engine.control, addr, "RW")

	// The returned replica alone: every byte as written.
	for _, i := range []int{0, 2} {
		v.ctl(t, "remove", v.addrs[i])
	}
	if out := v.ctl(t, "replicas"); strings.Count(out, "RW") != 1 || !strings.Contains(out, addr) {
		t.Fatalf("replicas:\n%s", out)
	}
	qemuIO(t, v.uri, "read -P 0x11 0 32M", "read -P 0x22 32M 4M", "read -P 0x11 36M 60M", "read -P 0x33 96M 4M", "read -P 0x11 100M 28M")
}

// checkCopied: a returning replica copies what was written while it was
// away, rounded to regions (plus at most one region either side of each
// write); when the survivors cannot tell since when they kept their bits
// it copies everything, and says why.
func checkCopied(t *testing.T, o outage, rb *enginev1.Rebuild) {
	t.Helper()
	if o == oldMetadata {
		if rb.DirtyOnly || !strings.Contains(rb.FullReason, "history unknown") || !strings.Contains(rb.FullReason, "engine restarted") ||
			!strings.Contains(rb.FullReason, "kept its write-intent bits only since epoch") {
			t.Fatalf("with the survivors' record of kept bits lost, the rebuild is dirty-only %v, reason %q; want full, history unknown, saying why", rb.DirtyOnly, rb.FullReason)
		}
		if rb.BytesCopied < resyncVolume {
			t.Fatalf("a full rebuild copied %d bytes of a volume of %d", rb.BytesCopied, resyncVolume)
		}
		return
	}
	if !rb.DirtyOnly || rb.FullReason != "" {
		t.Fatalf("the returning replica was rebuilt in full (%q): %+v", rb.FullReason, rb)
	}
	if rb.BytesCopied < resyncWritten || rb.BytesCopied > resyncWritten+4*resyncRegion {
		t.Fatalf("copied %d bytes after %d were written to a %d-byte volume while the replica was away", rb.BytesCopied, resyncWritten, resyncVolume)
	}
	t.Logf("%s: copied %d bytes of %d written while away, volume %d", o, rb.BytesCopied, resyncWritten, resyncVolume)
}

// restartWithoutKeptSince kills v's replicas idx, removes from their
// metadata the epoch since which they kept their write-intent bits (which
// each must have recorded: the set was degraded), and starts them again
// on their directories at their old ports.
func restartWithoutKeptSince(t *testing.T, v *volume, idx ...int) {
	t.Helper()
	for _, i := range idx {
		p := v.replicas[i]
		p.cmd.Process.Kill()
		p.waitExit(t)
		path := filepath.Join(v.dirs[i], "volume.meta")
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		var m map[string]any
		if err := json.Unmarshal(b, &m); err != nil {
			t.Fatal(err)
		}
		if k, _ := m["dirtyKeptSince"].(float64); k == 0 {
			t.Fatalf("replica %d, in a degraded set, records no epoch since which it kept its write-intent bits: %s", i, b)
		}
		delete(m, "dirtyKeptSince")
		if b, err = json.Marshal(m); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, b, 0o600); err != nil {
			t.Fatal(err)
		}
		v.replicas[i] = start(t, "replica", "--dir", v.dirs[i], "--listen", p.data, "--control-listen", p.control, "--dirty-clear-delay", "1s")
	}
}

// resyncVolumeProcs starts three replica processes (a bit may be cleared
// 1 s after its region was written) and an engine over them that flushes
// an idle volume every 1.2 s.
func resyncVolumeProcs(t *testing.T) *volume {
	t.Helper()
	return resyncVolumeProcsWith(t, "1s")
}

// resyncVolumeProcsWith is resyncVolumeProcs with the replicas' clear
// delay.
func resyncVolumeProcsWith(t *testing.T, clearDelay string) *volume {
	t.Helper()
	dir := t.TempDir()
	v := &volume{sock: filepath.Join(dir, "vol.sock")}
	for i := range 3 {
		d := filepath.Join(dir, fmt.Sprint("r", i))
		p := start(t, "replica", "--dir", d, "--size", resyncVolumeArg, "--listen", "127.0.0.1:0",
			"--control-listen", "127.0.0.1:0", "--dirty-clear-delay", clearDelay)
		v.replicas = append(v.replicas, p)
		v.addrs = append(v.addrs, p.data+","+p.control)
		v.dirs = append(v.dirs, d)
	}
	v.args = []string{"engine", "--name", "vol", "--frontend", "nbd", "--nbd-socket", v.sock, "--nbd-kernel", "off",
		"--listen", "127.0.0.1:0", "--replica-timeout", "3s", "--idle-flush", "1200ms"}
	for _, a := range v.addrs {
		v.args = append(v.args, "--replica", a)
	}
	v.uri = "nbd+unix:///vol?socket=" + v.sock
	v.engine = start(t, v.args...)
	return v
}

// waitBitmapsClean waits until no replica marks a region dirty, with no
// flush from the client: the engine flushes the replicas once the volume
// has gone idle.
func waitBitmapsClean(t *testing.T, v *volume) {
	t.Helper()
	until := deadline.After(60 * time.Second)
	for {
		dirty := dirtyRegions(t, v)
		if dirty == 0 {
			return
		}
		if time.Now().After(until) {
			t.Fatalf("the idle replicas still mark %d regions dirty", dirty)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// dirtyRegions is the number of regions v's replicas mark dirty, summed.
func dirtyRegions(t *testing.T, v *volume) int64 {
	t.Helper()
	dirty := int64(0)
	for _, p := range v.replicas {
		in, err := dialControl(t, p.control).Info(context.Background(), &replicav1.InfoRequest{})
		if err != nil {
			t.Fatal(err)
		}
		dirty += in.GetDirty().GetDirty()
	}
	return dirty
}

func engineClient(t *testing.T, control string) enginev1.EngineServiceClient {
	t.Helper()
	cc, err := grpc.NewClient(control, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return enginev1.NewEngineServiceClient(cc)
}

// waitMode waits until the engine lists the replica at addr in mode.
func waitMode(t *testing.T, control, addr, mode string) {
	t.Helper()
	c := engineClient(t, control)
	until := deadline.After(30 * time.Second)
	for {
		l, err := c.ReplicaList(context.Background(), &enginev1.ReplicaListRequest{})
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range l.Replicas {
			if r.Address == addr && r.Mode == mode {
				return
			}
		}
		if time.Now().After(until) {
			t.Fatalf("replica %s never %s: %v", addr, mode, l.Replicas)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// rebuildOf returns the engine's rebuild record of the replica at addr.
func rebuildOf(t *testing.T, control, addr string) *enginev1.Rebuild {
	t.Helper()
	st, err := engineClient(t, control).RebuildStatus(context.Background(), &enginev1.RebuildStatusRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range st.Rebuilds {
		if r.Replica == addr {
			return r
		}
	}
	t.Fatalf("no rebuild of %s: %v", addr, st.Rebuilds)
	return nil
}

// TestReturningReplicaGetsWriteInFlightWhenItHung: a replica that hangs
// (SIGSTOP) with writes in flight to it is failed only when the engine
// gives up on it; meanwhile the other replicas completed the write, and
// flushes from the client (each waiting for the hung replica too) cleared
// its write-intent bit on them: the set was not degraded yet. The hung
// replica never applied the write and has no bit for it either. When it
// comes back after a restart, its changed-regions resync must still copy
// that region: the engine noted the write that failed on it, and had the
// survivors mark it again in their bitmaps before acknowledging it, so
// the region is copied also when the engine restarted while the replica
// was away. Read from the returned replica alone, the write is there.
func TestReturningReplicaGetsWriteInFlightWhenItHung(t *testing.T) {
	needTool(t, "qemu-io")
	t.Run("same engine", func(t *testing.T) { testHungWrite(t, false) })
	t.Run("engine restart", func(t *testing.T) { testHungWrite(t, true) })
}

func testHungWrite(t *testing.T, restartEngine bool) {
	v := resyncVolumeProcsWith(t, "1ms")
	qemuIO(t, v.uri, "write -P 0x11 0 128M", "flush")
	waitBitmapsClean(t, v)

	hung := v.replicas[1]
	if err := hung.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	// Two writes in flight to it, in two regions: both fail on it at
	// once, and both must be marked on the others.
	type inFlight struct {
		out  *syncBuffer
		done chan error
	}
	var writes []inFlight
	for _, cmd := range []string{"write -P 0x44 64M 4k", "write -P 0x55 100M 4k"} {
		out, done := background(t, v.uri, cmd)
		writes = append(writes, inFlight{out, done})
	}
	// The others complete the writes; flushes clear their bits on them
	// (two flushes after a write clear it with this clear delay), while
	// the engine still waits for the hung replica.
	survivors := &volume{replicas: []*proc{v.replicas[0], v.replicas[2]}}
	until := deadline.After(30 * time.Second)
	for dirty := dirtyRegions(t, survivors); dirty > 0; dirty = dirtyRegions(t, survivors) {
		for _, w := range writes {
			select {
			case err := <-w.done:
				t.Fatalf("a write completed (%v) while the survivors still marked %d regions: the test no longer sets up what it checks\n%s", err, dirty, w.out.String())
			default:
			}
		}
		if time.Now().After(until) {
			t.Fatalf("the survivors still mark %d regions", dirty)
		}
		background(t, v.uri, "flush")
		time.Sleep(50 * time.Millisecond)
	}
	for _, w := range writes {
		select {
		case err := <-w.done:
			if err != nil {
				t.Fatalf("a write failed: %v\n%s", err, w.out.String())
			}
		case <-time.After(deadline.Scale(60 * time.Second)):
			t.Fatal("a write never completed")
		}
	}
	waitMode(t, v.engine.control, v.addrs[1], "ERR")
	hung.cmd.Process.Kill()
	hung.waitExit(t)
	if restartEngine {
		v.engine.cmd.Process.Kill()
		v.engine.waitExit(t)
		v.engine = start(t, v.args...)
		waitMode(t, v.engine.control, v.addrs[1], "ERR")
	}

	back := start(t, "replica", "--dir", v.dirs[1], "--listen", "127.0.0.1:0", "--control-listen", "127.0.0.1:0")
	addr := back.data + "," + back.control
	t.Logf("ctl add --wait:\n%s", v.ctl(t, "add", addr, "--wait"))
	if rb := rebuildOf(t, v.engine.control, addr); rb.State != "complete" || !rb.DirtyOnly {
		t.Fatalf("rebuild: %+v", rb)
	}
	for _, i := range []int{0, 2} {
		v.ctl(t, "remove", v.addrs[i])
	}
	qemuIO(t, v.uri, "read -P 0x11 0 64M", "read -P 0x44 64M 4k", "read -P 0x11 67112960 37744640",
		"read -P 0x55 100M 4k", "read -P 0x11 104861696 29356032")
}

// background runs qemu-io with one command on uri without waiting; the
// channel gets its exit.
func background(t *testing.T, uri, cmd string) (*syncBuffer, chan error) {
	t.Helper()
	c := exec.Command("qemu-io", "-f", "raw", "-c", cmd, uri)
	out := &syncBuffer{}
	c.Stdout, c.Stderr = out, out
	if err := c.Start(); err != nil {
		t.Fatal(err)
	}
	done, exited := make(chan error, 1), make(chan struct{})
	go func() { done <- c.Wait(); close(exited) }()
	t.Cleanup(func() { c.Process.Kill(); <-exited })
	return out, done
}
