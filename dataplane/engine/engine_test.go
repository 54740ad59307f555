package engine_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cairn-io/cairn/dataplane/dataconn"
	"github.com/cairn-io/cairn/dataplane/engine"
	"github.com/cairn-io/cairn/dataplane/engine/replicaclient"
	"github.com/cairn-io/cairn/dataplane/replica"
	"github.com/cairn-io/cairn/dataplane/replica/replicaserver"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// testReplica is a real replica served on loopback in this process.
type testReplica struct {
	t        testing.TB
	dir      string
	addr     string // "data,control"
	data     string
	ctl      string
	run      *replicaserver.Running
	killOnce sync.Once
}

func listenOn(t testing.TB, addr string) net.Listener {
	t.Helper()
	var l net.Listener
	var err error
	until := deadline.After(10 * time.Second)
	for {
		if l, err = net.Listen("tcp", addr); err == nil || time.Now().After(until) {
			break
		}
		time.Sleep(10 * time.Millisecond) // the old socket is still closing
	}
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// startReplica serves a replica in dir; with addr set it reuses those ports
// (a replica coming back at the same address).
func startReplica(t testing.TB, dir string, size int64, addr string) *testReplica {
	t.Helper()
	dataAddr, ctlAddr := "127.0.0.1:0", "127.0.0.1:0"
	if addr != "" {
		dataAddr, ctlAddr, _ = replicaclient.SplitAddress(addr)
	}
	r, err := replica.Open(dir, replica.Options{Size: size, ClearDelay: -1}) // clear bits on the next flushes
	if err != nil {
		t.Fatal(err)
	}
	dl, cl := listenOn(t, dataAddr), listenOn(t, ctlAddr)
	tr := &testReplica{t: t, dir: dir, data: dl.Addr().String(), ctl: cl.Addr().String()}
	tr.addr = tr.data + "," + tr.ctl
	tr.run = replicaserver.Start(r, replicaserver.Options{Data: dl, Control: cl})
	t.Cleanup(tr.kill)
	return tr
}

func (tr *testReplica) kill() { tr.killOnce.Do(tr.run.Kill) }

// dialer dials replicas with the data client's failure detection scaled
// like the tests' deadlines: a replica is failed by these timeouts only
// when it stops answering, which no test that uses dialer relies on (a
// killed replica's connections break at once), and a loaded machine must
// not fail a live one.
func dialer() engine.Dialer {
	return replicaclient.Dialer(replicaclient.Options{Data: dataconn.ClientOptions{
		Conns: 2, RequestTimeout: deadline.Scale(5 * time.Second), PingInterval: 200 * time.Millisecond, PingTimeout: deadline.Scale(2 * time.Second)}})
}

func cluster(t testing.TB, n int, size int64) (*engine.Engine, []*testReplica) {
	t.Helper()
	var reps []*testReplica
	var addrs []string
	for i := range n {
		tr := startReplica(t, filepath.Join(t.TempDir(), fmt.Sprint("r", i)), size, "")
		reps = append(reps, tr)
		addrs = append(addrs, tr.addr)
	}
	e, err := engine.Open(context.Background(), engine.Options{Name: "test", Replicas: addrs, Dial: dialer()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	return e, reps
}

func pattern(seed, n int) []byte {
	p := make([]byte, n)
	r := rand.New(rand.NewPCG(uint64(seed), 3))
	for i := range p {
		p[i] = byte(r.Uint32())
	}
	return p
}

func modes(e *engine.Engine) map[string]string {
	out := map[string]string{}
	for _, r := range e.Replicas() {
		out[r.Address] = r.Mode.String()
	}
	return out
}

// readReplica reads straight from one replica's directory view, bypassing
// the engine (the replica is served; we use its dataconn with its epoch).
func readReplica(t *testing.T, tr *testReplica, epoch uint64, p []byte, off int64) {
	t.Helper()
	c, err := dataconn.Dial(context.Background(), "tcp", tr.data, dataconn.ClientOptions{Conns: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetEpoch(epoch)
	if err := c.ReadAt(context.Background(), p, off); err != nil {
		t.Fatal(err)
	}
}

func TestWritesReachEveryReplica(t *testing.T) {
	ctx := context.Background()
	e, reps := cluster(t, 3, 8<<20)
	data := pattern(1, 1<<20)
	if err := e.WriteAt(ctx, data, 4096, true); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(data))
	if err := e.ReadAt(ctx, got, 4096); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("read through the engine: %v", err)
	}
	for _, tr := range reps {
		readReplica(t, tr, e.Epoch(), got, 4096)
		if !bytes.Equal(got, data) {
			t.Fatalf("replica %s lacks the write", tr.addr)
		}
	}
	if e.Robustness() != "healthy" {
		t.Fatal(e.Robustness())
	}
	if _, err := engine.Open(ctx, engine.Options{Replicas: []string{reps[0].addr, reps[1].addr, reps[2].addr}, Dial: dialer(), Size: 4 << 20}); err == nil {
		t.Fatal("opened a replica of the wrong size")
	}
}

// verifier writes unique data to blocks from several goroutines and checks
// every block it wrote, with zero tolerated errors.
type verifier struct {
	mu      sync.Mutex
	content map[int64][]byte
	errs    atomic.Int64
	ops     atomic.Int64
}

func (v *verifier) run(ctx context.Context, t *testing.T, e *engine.Engine, workers int, blocks int64) *sync.WaitGroup {
	v.content = map[int64][]byte{}
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(w), 5))
			for i := 0; ctx.Err() == nil; i++ {
				b := int64(w) + int64(workers)*r.Int64N(blocks/int64(workers))
				p := pattern(w*1000003+i, 4096)
				if err := e.WriteAt(context.Background(), p, b*4096, false); err != nil {
					v.errs.Add(1)
					t.Errorf("write block %d: %v", b, err)
					return
				}
				got := make([]byte, 4096)
				if err := e.ReadAt(context.Background(), got, b*4096); err != nil || !bytes.Equal(got, p) {
					v.errs.Add(1)
					t.Errorf("read back block %d: %v", b, err)
					return
				}
				v.mu.Lock()
				v.content[b] = p
				v.mu.Unlock()
				v.ops.Add(1)
			}
		}()
	}
	return &wg
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	until := deadline.After(60 * time.Second)
	for !cond() {
		if time.Now().After(until) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestKillRebuildLoseOriginals: kill one of three replicas during
// continuous verified writes (no errors allowed), rebuild a fresh replica
// while the writes go on, then kill both original survivors and read every
// byte back from the rebuilt one.
func TestKillRebuildLoseOriginals(t *testing.T) {
	ctx := context.Background()
	const size = 32 << 20
	e, reps := cluster(t, 3, size)
	base := pattern(7, size)
	if err := e.WriteAt(ctx, base, 0, false); err != nil {
		t.Fatal(err)
	}
	wctx, stop := context.WithCancel(ctx)
	v := &verifier{}
	wg := v.run(wctx, t, e, 4, size/4096)
	waitFor(t, "writes to start", func() bool { return v.ops.Load() > 100 })
	epoch := e.Epoch()
	reps[1].kill()
	waitFor(t, "the killed replica to be ERR", func() bool { return modes(e)[reps[1].addr] == "ERR" })
	// The survivors' epoch is bumped right after (with I/O paused).
	waitFor(t, "the epoch to be bumped", func() bool { return e.Epoch() > epoch })
	if e.Robustness() != "degraded" {
		t.Fatalf("after a failure: %s", e.Robustness())
	}
	n := v.ops.Load()
	waitFor(t, "writes to go on", func() bool { return v.ops.Load() > n+100 })

	fresh := startReplica(t, filepath.Join(t.TempDir(), "fresh"), size, "")
	if err := e.AddReplica(ctx, fresh.addr); err != nil {
		t.Fatal(err)
	}
	if m := modes(e)[fresh.addr]; m != "WO" && m != "RW" {
		t.Fatalf("new replica is %s", m)
	}
	st, err := e.WaitRebuild(ctx, fresh.addr)
	if err != nil || st.State != engine.RebuildComplete {
		t.Fatalf("rebuild: %+v %v", st, err)
	}
	if st.DirtyOnly || st.BytesDone != size || st.BytesTotal != size {
		t.Fatalf("full rebuild status: %+v", st)
	}
	if st.RelayReason != "" {
		t.Fatalf("the rebuild's data went through the engine, not from replica to replica: %s", st.RelayReason)
	}
	stop()
	wg.Wait()
	if v.errs.Load() != 0 {
		t.Fatalf("%d I/O errors", v.errs.Load())
	}
	if modes(e)[fresh.addr] != "RW" {
		t.Fatalf("rebuilt replica is %s: %+v", modes(e)[fresh.addr], e.Replicas())
	}
	// Lose the originals: the rebuilt replica alone must hold everything.
	reps[0].kill()
	reps[2].kill()
	copyBase := append([]byte(nil), base...)
	for b, p := range v.content {
		copy(copyBase[b*4096:], p)
	}
	got := make([]byte, size)
	waitFor(t, "originals to be dropped", func() bool {
		m := modes(e)
		return m[reps[0].addr] == "ERR" && m[reps[2].addr] == "ERR"
	})
	if err := e.ReadAt(ctx, got, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, copyBase) {
		t.Fatal("the rebuilt replica's data differs from what was written")
	}
}

// TestReturningReplicaCopiesOnlyDirtyRegions: a replica that goes away and
// comes back with its data resyncs only the regions written meanwhile,
// whether it comes back at its old address or (a restarted replica process
// given other ports) at a new one: it is recognised by its ID.
func TestReturningReplicaCopiesOnlyDirtyRegions(t *testing.T) {
	for _, sameAddress := range []bool{true, false} {
		t.Run(fmt.Sprintf("sameAddress=%v", sameAddress), func(t *testing.T) { testReturningReplica(t, sameAddress) })
	}
}

func testReturningReplica(t *testing.T, sameAddress bool) {
	ctx := context.Background()
	const size = 64 << 20
	e, reps := cluster(t, 3, size)
	if err := e.WriteAt(ctx, pattern(1, size), 0, false); err != nil {
		t.Fatal(err)
	}
	// Let the set settle clean: flushes clear the write-intent bits.
	waitFor(t, "bits to clear", func() bool {
		return e.Flush(ctx) == nil && dirtyCount(t, reps[0])+dirtyCount(t, reps[1])+dirtyCount(t, reps[2]) == 0
	})
	r1 := reps[1]
	r1.kill()
	waitFor(t, "ERR", func() bool { return modes(e)[r1.addr] == "ERR" })
	// Write to 3 regions while it is away.
	for _, off := range []int64{5 << 20, 20<<20 + 4096, 40 << 20} {
		if err := e.WriteAt(ctx, pattern(int(off), 8192), off, false); err != nil {
			t.Fatal(err)
		}
	}
	backAt := r1.addr
	if !sameAddress {
		backAt = ""
	}
	back := startReplica(t, r1.dir, 0, backAt)
	if !sameAddress && back.addr == r1.addr {
		t.Fatalf("the returning replica got its old address %s; the test needs another", back.addr)
	}
	if err := e.AddReplica(ctx, back.addr); err != nil {
		t.Fatal(err)
	}
	st, err := e.WaitRebuild(ctx, back.addr)
	if err != nil || st.State != engine.RebuildComplete {
		t.Fatalf("rebuild: %+v %v", st, err)
	}
	if !st.DirtyOnly {
		t.Fatalf("a returning replica (back at %s, was %s) was fully rebuilt", back.addr, r1.addr)
	}
	if st.RelayReason != "" {
		t.Fatalf("the resync's data went through the engine, not from replica to replica: %s", st.RelayReason)
	}
	// 3 regions of 1 MiB written while away (plus at most a few regions the
	// returning replica itself marked dirty before it died).
	if st.BytesCopied < 3<<20 || st.BytesCopied > 8<<20 {
		t.Fatalf("copied %d bytes, want about 3 MiB of %d", st.BytesCopied, size)
	}
	t.Logf("returning replica: copied %d of %d bytes", st.BytesCopied, size)
	// Only the returning replica left: it must be right everywhere.
	reps[0].kill()
	reps[2].kill()
	waitFor(t, "originals dropped", func() bool { return modes(e)[reps[0].addr] == "ERR" && modes(e)[reps[2].addr] == "ERR" })
	if m := modes(e)[back.addr]; m != "RW" {
		t.Fatalf("the returning replica is %s, want RW", m)
	}
	want := pattern(1, size)
	for _, off := range []int64{5 << 20, 20<<20 + 4096, 40 << 20} {
		copy(want[off:], pattern(int(off), 8192))
	}
	got := make([]byte, size)
	if err := e.ReadAt(ctx, got, 0); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("returning replica's data is wrong: %v", err)
	}
}

func dirtyCount(t *testing.T, tr *testReplica) int64 {
	in, err := tr.run.Replica.Info()
	if err != nil {
		t.Fatal(err)
	}
	return in.Dirty.Dirty()
}

func TestSnapshotRevertRoundTrip(t *testing.T) {
	ctx := context.Background()
	e, _ := cluster(t, 2, 4<<20)
	a := pattern(1, 1<<20)
	if err := e.WriteAt(ctx, a, 0, false); err != nil {
		t.Fatal(err)
	}
	if err := e.Snapshot(ctx, "before"); err != nil {
		t.Fatal(err)
	}
	if err := e.WriteAt(ctx, pattern(2, 1<<20), 0, false); err != nil {
		t.Fatal(err)
	}
	snaps, err := e.Snapshots(ctx)
	if err != nil || len(snaps) != 1 || snaps[0].Name != "before" || !snaps[0].UserCreated {
		t.Fatalf("snapshots: %+v %v", snaps, err)
	}
	if err := e.Revert(ctx, "before"); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 1<<20)
	if err := e.ReadAt(ctx, got, 0); err != nil || !bytes.Equal(got, a) {
		t.Fatalf("after revert: %v", err)
	}
	if err := e.DeleteSnapshot(ctx, "before"); err != nil {
		t.Fatal(err)
	}
	if err := e.ReadAt(ctx, got, 0); err != nil || !bytes.Equal(got, a) {
		t.Fatalf("after delete: %v", err)
	}
	if err := e.Expand(ctx, 8<<20); err != nil || e.Size() != 8<<20 {
		t.Fatalf("expand: %v", err)
	}
	if err := e.WriteAt(ctx, a, 7<<20, false); err != nil {
		t.Fatal(err)
	}
	if e.Robustness() != "healthy" {
		t.Fatal(e.Robustness(), modes(e))
	}
}

// TestStaleReplicaLeftOutAtOpen: a replica that missed an epoch change is
// never served: a new engine leaves it out.
func TestStaleReplicaLeftOutAtOpen(t *testing.T) {
	ctx := context.Background()
	e, reps := cluster(t, 3, 4<<20)
	reps[2].kill() // misses the epoch bump that follows
	waitFor(t, "ERR", func() bool { return modes(e)[reps[2].addr] == "ERR" })
	if err := e.WriteAt(ctx, pattern(3, 4096), 0, false); err != nil {
		t.Fatal(err)
	}
	e.Close()
	back := startReplica(t, reps[2].dir, 0, reps[2].addr)
	e2, err := engine.Open(ctx, engine.Options{Replicas: []string{reps[0].addr, reps[1].addr, back.addr}, Dial: dialer()})
	if err != nil {
		t.Fatal(err)
	}
	defer e2.Close()
	if m := modes(e2); m[back.addr] != "ERR" || m[reps[0].addr] != "RW" {
		t.Fatalf("modes at reopen: %v", m)
	}
	for _, r := range e2.Replicas() {
		if r.Address == back.addr && r.Error == "" {
			t.Fatal("no reason given for leaving the stale replica out")
		}
	}
}

// TestOverlappingWritesKeepReplicasIdentical hammers a few blocks with
// concurrent writes and checks that every replica ends with the same data.
func TestOverlappingWritesKeepReplicasIdentical(t *testing.T) {
	ctx := context.Background()
	e, reps := cluster(t, 3, 1<<20)
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 200 {
				off := int64((w+i)%4) * 2048 // overlapping, unaligned
				if err := e.WriteAt(ctx, pattern(w*1000+i, 6144), off, false); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	want := make([]byte, 16384)
	readReplica(t, reps[0], e.Epoch(), want, 0)
	for _, tr := range reps[1:] {
		got := make([]byte, len(want))
		readReplica(t, tr, e.Epoch(), got, 0)
		if !bytes.Equal(got, want) {
			t.Fatalf("replica %s diverged", tr.addr)
		}
	}
}

func TestRemoveLastReplicaRefused(t *testing.T) {
	e, reps := cluster(t, 1, 1<<20)
	if err := e.RemoveReplica(context.Background(), reps[0].addr); !errors.Is(err, engine.ErrInvalid) {
		t.Fatalf("removing the last RW replica: %v", err)
	}
}

// TestNewReplicaAtOldAddressGetsFullRebuild: an empty replica started at
// the address of a failed one must not be taken for the one that failed
// (it would get only the dirty regions and miss everything else).
func TestNewReplicaAtOldAddressGetsFullRebuild(t *testing.T) {
	ctx := context.Background()
	const size = 16 << 20
	e, reps := cluster(t, 3, size)
	data := pattern(9, size)
	if err := e.WriteAt(ctx, data, 0, false); err != nil {
		t.Fatal(err)
	}
	r1 := reps[1]
	r1.kill()
	waitFor(t, "ERR", func() bool { return modes(e)[r1.addr] == "ERR" })
	if err := e.WriteAt(ctx, pattern(10, 4096), 0, false); err != nil {
		t.Fatal(err)
	}
	copy(data, pattern(10, 4096))
	fresh := startReplica(t, filepath.Join(t.TempDir(), "new-disk"), size, r1.addr) // same address, new data
	if err := e.AddReplica(ctx, fresh.addr); err != nil {
		t.Fatal(err)
	}
	st, err := e.WaitRebuild(ctx, fresh.addr)
	if err != nil || st.State != engine.RebuildComplete || st.DirtyOnly {
		t.Fatalf("rebuild of a new replica at an old address: %+v %v", st, err)
	}
	if n := len(e.Replicas()); n != 3 {
		t.Fatalf("%d members after replacing one, want 3: %+v", n, e.Replicas())
	}
	reps[0].kill()
	reps[2].kill()
	waitFor(t, "originals dropped", func() bool { return modes(e)[reps[0].addr] == "ERR" && modes(e)[reps[2].addr] == "ERR" })
	got := make([]byte, size)
	if err := e.ReadAt(ctx, got, 0); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("the replacement's data is incomplete: %v", err)
	}
}

// TestUnfinishedRebuildLeftOutAtOpen: a replica whose rebuild never
// completed (the engine died) is never opened as a healthy member.
func TestUnfinishedRebuildLeftOutAtOpen(t *testing.T) {
	ctx := context.Background()
	e, reps := cluster(t, 2, 4<<20)
	epoch := e.Epoch()
	e.Close()
	// What an engine leaves on a replica it was rebuilding when it died:
	// the current epoch, marked rebuilding.
	if err := reps[1].run.Replica.Fence(replica.FenceOptions{Epoch: epoch, Degraded: true, Rebuilding: true}); err != nil {
		t.Fatal(err)
	}
	e2, err := engine.Open(ctx, engine.Options{Replicas: []string{reps[0].addr, reps[1].addr}, Dial: dialer()})
	if err != nil {
		t.Fatal(err)
	}
	defer e2.Close()
	for _, r := range e2.Replicas() {
		if r.Address == reps[1].addr && (r.Mode != engine.ModeERR || !strings.Contains(r.Error, "rebuild")) {
			t.Fatalf("half-rebuilt replica at open: %+v", r)
		}
	}
}

// TestFullRebuildOverStaleData: a full rebuild onto a replica that still
// holds old data (not eligible for a dirty-only resync, e.g. after an
// engine restart) must not let that data show where the source has holes.
func TestFullRebuildOverStaleData(t *testing.T) {
	ctx := context.Background()
	const size = 8 << 20
	e, reps := cluster(t, 2, size)
	if err := e.WriteAt(ctx, pattern(1, size), 0, false); err != nil {
		t.Fatal(err)
	}
	r1 := reps[1]
	r1.kill()
	waitFor(t, "ERR", func() bool { return modes(e)[r1.addr] == "ERR" })
	if err := e.Unmap(ctx, 0, size); err != nil { // the source now has holes everywhere
		t.Fatal(err)
	}
	e.Close()
	// A new engine knows nothing of the failure, and serves a set that is
	// not degraded (one replica wanted): the survivor keeps no record of
	// its bits, so the returning replica (with its old data) gets a full
	// rebuild.
	e2, err := engine.Open(ctx, engine.Options{Replicas: []string{reps[0].addr}, Dial: dialer(), Wanted: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer e2.Close()
	back := startReplica(t, r1.dir, 0, r1.addr)
	if err := e2.AddReplica(ctx, back.addr); err != nil {
		t.Fatal(err)
	}
	st, err := e2.WaitRebuild(ctx, back.addr)
	if err != nil || st.State != engine.RebuildComplete || st.DirtyOnly || st.BytesCopied != 0 {
		t.Fatalf("rebuild: %+v %v", st, err)
	}
	reps[0].kill()
	waitFor(t, "source dropped", func() bool { return modes(e2)[reps[0].addr] == "ERR" })
	got := make([]byte, size)
	if err := e2.ReadAt(ctx, got, 0); err != nil || !bytes.Equal(got, make([]byte, size)) {
		t.Fatalf("old data shows through after a full rebuild: %v", err)
	}
}

// TestReadsNeverTorn: reads racing overlapping writes return one whole
// write's data, never a mixture.
func TestReadsNeverTorn(t *testing.T) {
	ctx := context.Background()
	e, _ := cluster(t, 2, 1<<20)
	a, b := bytes.Repeat([]byte{0xaa}, 64<<10), bytes.Repeat([]byte{0xbb}, 64<<10)
	wctx, stop := context.WithTimeout(ctx, 2*time.Second)
	defer stop()
	wrote := make(chan error, 1) // the writer's first error: reads alongside failed writes prove nothing
	go func() {
		var err error
		for i := 0; wctx.Err() == nil && err == nil; i++ {
			p := a
			if i%2 == 1 {
				p = b
			}
			err = e.WriteAt(ctx, p, 0, false)
		}
		wrote <- err
	}()
	got := make([]byte, 64<<10)
	reads := 0
	for wctx.Err() == nil {
		if err := e.ReadAt(ctx, got, 0); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, a) && !bytes.Equal(got, b) && !bytes.Equal(got, make([]byte, len(got))) {
			t.Fatalf("read %d returned a mixture of two writes", reads)
		}
		reads++
	}
	if err := <-wrote; err != nil {
		t.Fatalf("a concurrent write: %v", err)
	}
	t.Logf("%d reads, none torn", reads)
}

// tailGate wraps the replica being rebuilt: the rebuild's copy into its
// layers at or past from waits until release is called (or its context
// ends), and held records that such a copy came.
type tailGate struct {
	engine.Replica
	from    int64
	gate    chan struct{}
	release func()
	held    atomic.Bool
}

func newTailGate(from int64) *tailGate {
	g := &tailGate{from: from, gate: make(chan struct{})}
	g.release = sync.OnceFunc(func() { close(g.gate) })
	return g
}

func (g *tailGate) WriteLayer(ctx context.Context, name string, p []byte, off int64) error {
	if off+int64(len(p)) > g.from {
		g.held.Store(true)
		select {
		case <-g.gate:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return g.Replica.WriteLayer(ctx, name, p, off)
}

// TestTrimAndPartialWriteDuringRebuild: a trim and a sub-block write that
// reach the new replica before the rebuild copy has reached those blocks
// must win over the older data copied in afterwards. The copy of the end
// of the volume is held until both are acknowledged, so they come first
// however fast or slow the machine is.
func TestTrimAndPartialWriteDuringRebuild(t *testing.T) {
	ctx := context.Background()
	const size = 16 << 20 // four rebuild chunks
	trimAt, partAt := int64(size-8192), int64(size-16384+100)
	var reps []*testReplica
	var addrs []string
	for i := range 2 {
		reps = append(reps, startReplica(t, filepath.Join(t.TempDir(), fmt.Sprint("r", i)), size, ""))
		addrs = append(addrs, reps[i].addr)
	}
	fresh := startReplica(t, filepath.Join(t.TempDir(), "fresh"), size, "")
	gate := newTailGate(partAt - partAt%4096)
	t.Cleanup(gate.release) // before the engine is closed
	dial := dialer()
	e, err := engine.Open(ctx, engine.Options{Name: "test", Replicas: addrs, Dial: func(ctx context.Context, addr string) (engine.Replica, error) {
		r, err := dial(ctx, addr)
		if err != nil || addr != fresh.addr {
			return r, err
		}
		gate.Replica = r
		return gate, nil
	}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	old := pattern(3, size)
	if err := e.WriteAt(ctx, old, 0, false); err != nil {
		t.Fatal(err)
	}
	if err := e.AddReplica(ctx, fresh.addr); err != nil {
		t.Fatal(err)
	}
	if err := e.Unmap(ctx, trimAt, 8192); err != nil {
		t.Fatal(err)
	}
	part := []byte("partial block write during the rebuild")
	if err := e.WriteAt(ctx, part, partAt, false); err != nil {
		t.Fatal(err)
	}
	if m := modes(e)[fresh.addr]; m != "WO" {
		t.Fatalf("the new replica is %s while its copy is held, want WO (being rebuilt)", m)
	}
	gate.release()
	wctx, cancel := context.WithTimeout(ctx, deadline.Scale(60*time.Second))
	defer cancel()
	st, err := e.WaitRebuild(wctx, fresh.addr)
	if err != nil || st.State != engine.RebuildComplete {
		t.Fatalf("rebuild: %+v %v", st, err)
	}
	if !gate.held.Load() {
		t.Fatal("the rebuild copied nothing into the blocks trimmed and written: the test checks nothing")
	}
	want := append([]byte(nil), old...)
	clear(want[trimAt:])
	copy(want[partAt:], part)
	for _, r := range reps {
		r.kill()
	}
	waitFor(t, "originals dropped", func() bool {
		return e.Robustness() == "degraded" && modes(e)[fresh.addr] == "RW" && modes(e)[reps[0].addr] == "ERR" && modes(e)[reps[1].addr] == "ERR"
	})
	got := make([]byte, 32768)
	if err := e.ReadAt(ctx, got, size-32768); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want[size-32768:]) {
		t.Fatal("older data copied in by the rebuild shows through a trim or a partial write made during it")
	}
}

// TestCallerGivingUpDoesNotFailReplicas: a request whose caller's context
// is cancelled or past its deadline must not mark any replica failed.
func TestCallerGivingUpDoesNotFailReplicas(t *testing.T) {
	e, reps := cluster(t, 2, 4<<20)
	for range 50 {
		ctx, cancel := context.WithCancel(context.Background())
		go cancel()
		// Each call may fail (its caller gave up); the test checks the
		// replicas' modes after, not the calls' results.
		_ = e.WriteAt(ctx, pattern(1, 1<<20), 0, false)
		e.Flush(ctx)
		dctx, dcancel := context.WithTimeout(context.Background(), time.Microsecond)
		_ = e.ReadAt(dctx, make([]byte, 1<<20), 0)
		_ = e.AddReplica(dctx, reps[0].addr) // refused (already a member); must not hurt it
		dcancel()
		sctx, scancel := context.WithCancel(context.Background())
		go scancel()
		_ = e.Snapshot(sctx, fmt.Sprintf("s-%d", time.Now().UnixNano())) // SetEpoch/snapshot calls must not be cancelled
	}
	// An add whose caller gives up half way must not fail the members.
	for range 10 {
		extra := startReplica(t, filepath.Join(t.TempDir(), "x"), 4<<20, "")
		actx, acancel := context.WithCancel(context.Background())
		go func() { time.Sleep(time.Duration(rand.IntN(3000)) * time.Microsecond); acancel() }()
		// The add may fail half way, and the wait and remove with it.
		_ = e.AddReplica(actx, extra.addr)
		_, _ = e.WaitRebuild(context.Background(), extra.addr)
		_ = e.RemoveReplica(context.Background(), extra.addr)
		extra.kill()
	}
	if m := modes(e); m[reps[0].addr] != "RW" || m[reps[1].addr] != "RW" {
		t.Fatalf("callers giving up failed replicas: %v", m)
	}
}

// openWrapped starts n replicas of 1 MiB and opens an engine on them
// whose dialer passes every replica it dials, those added later too,
// through wrap (one call at a time). The engine is
// closed when the test ends.
func openWrapped(t *testing.T, n int, wrap func(addr string, r engine.Replica) engine.Replica) (*engine.Engine, []string) {
	t.Helper()
	return openWrappedWith(t, n, engine.Options{}, wrap)
}

// openWrappedWith is openWrapped with opts (Name, Replicas and Dial are
// set here).
func openWrappedWith(t *testing.T, n int, opts engine.Options, wrap func(addr string, r engine.Replica) engine.Replica) (*engine.Engine, []string) {
	t.Helper()
	e, reps := startWrapped(t, n, opts, wrap)
	var addrs []string
	for _, tr := range reps {
		addrs = append(addrs, tr.addr)
	}
	return e, addrs
}

// startWrapped is openWrappedWith returning the replicas.
func startWrapped(t *testing.T, n int, opts engine.Options, wrap func(addr string, r engine.Replica) engine.Replica) (*engine.Engine, []*testReplica) {
	t.Helper()
	var addrs []string
	var reps []*testReplica
	for i := range n {
		reps = append(reps, startReplica(t, filepath.Join(t.TempDir(), fmt.Sprint("r", i)), 1<<20, ""))
		addrs = append(addrs, reps[i].addr)
	}
	var mu sync.Mutex
	dial := dialer()
	opts.Name, opts.Replicas = "test", addrs
	opts.Dial = func(ctx context.Context, addr string) (engine.Replica, error) {
		r, err := dial(ctx, addr)
		if err != nil {
			return nil, err
		}
		mu.Lock()
		defer mu.Unlock()
		return wrap(addr, r), nil
	}
	e, err := engine.Open(context.Background(), opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	return e, reps
}

// switchable wraps a real replica client: failWrite makes its writes fail,
// failSetEpoch its SetEpoch calls. It does not implement WriteStarter, so
// the engine writes to it synchronously.
type switchable struct {
	engine.Replica
	failWrite, failSetEpoch atomic.Bool
}

func (s *switchable) WriteAt(ctx context.Context, p []byte, off int64, fua bool) error {
	if s.failWrite.Load() {
		return errors.New("injected write failure")
	}
	return s.Replica.WriteAt(ctx, p, off, fua)
}

func (s *switchable) SetEpoch(ctx context.Context, st engine.EpochState) error {
	if s.failSetEpoch.Load() {
		return errors.New("injected set-epoch failure")
	}
	return s.Replica.SetEpoch(ctx, st)
}

// TestNoAckWhenFencingFails: a write that one replica fails and the other
// takes must not be acknowledged when the epoch bump that fences the
// failed replica off cannot be made (here: the other replica refuses it
// and fails too). Otherwise the unfenced replica, without the write, keeps
// the newest epoch and the next engine may serve it: an acknowledged write
// lost (found by chaos seed 68014).
func TestNoAckWhenFencingFails(t *testing.T) {
	wrapped := map[string]*switchable{}
	e, addrs := openWrapped(t, 2, func(addr string, r engine.Replica) engine.Replica {
		s := &switchable{Replica: r}
		wrapped[addr] = s
		return s
	})
	ctx := context.Background()
	if err := e.WriteAt(ctx, pattern(1, 4096), 0, false); err != nil {
		t.Fatal(err)
	}
	wrapped[addrs[0]].failWrite.Store(true)    // r0 fails the write
	wrapped[addrs[1]].failSetEpoch.Store(true) // r1 takes it, then refuses the bump
	if err := e.WriteAt(ctx, pattern(2, 4096), 0, false); err == nil {
		t.Fatal("a write was acknowledged although the failed replica could not be fenced off")
	}
}

// lateWriter wraps the replica being added: right after it takes its
// rebuild snapshot (a returning replica) or its new chain (a full rebuild)
// it receives a write carrying its old epoch, as a returning replica that
// was paused with a write queued would apply it.
type lateWriter struct {
	engine.Replica
	data    string // the replica's data address
	lateErr chan error
}

func (l *lateWriter) Snapshot(ctx context.Context, sn engine.SnapshotInfo) error {
	if err := l.Replica.Snapshot(ctx, sn); err != nil {
		return err
	}
	return l.writeLate(ctx)
}

func (l *lateWriter) ReplaceChain(ctx context.Context, snaps []engine.SnapshotInfo) error {
	if err := l.Replica.ReplaceChain(ctx, snaps); err != nil {
		return err
	}
	return l.writeLate(ctx)
}

func (l *lateWriter) writeLate(ctx context.Context) error {
	c, err := dataconn.Dial(ctx, "tcp", l.data, dataconn.ClientOptions{Conns: 1, PingInterval: -1})
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetEpoch(0) // the epoch it had before it was added
	l.lateErr <- c.WriteAt(ctx, pattern(9, 4096), 0, false)
	return nil
}

// TestAddFencesTargetBeforeSnapshot: a write of the target's old epoch
// arriving between its rebuild snapshot and the new epoch is refused, and
// the rebuilt target holds the volume's data (chaos seed 320047: such a
// write landed in the target's new head, above the copied data).
func TestAddFencesTargetBeforeSnapshot(t *testing.T) {
	extra := startReplica(t, filepath.Join(t.TempDir(), "x"), 1<<20, "")
	late := &lateWriter{data: extra.data, lateErr: make(chan error, 1)}
	e, addrs := openWrapped(t, 2, func(addr string, r engine.Replica) engine.Replica {
		if addr != extra.addr {
			return r
		}
		late.Replica = r
		return late
	})
	ctx := context.Background()
	if err := e.WriteAt(ctx, pattern(1, 4096), 0, false); err != nil {
		t.Fatal(err)
	}
	if err := e.AddReplica(ctx, extra.addr); err != nil {
		t.Fatal(err)
	}
	if err := <-late.lateErr; err == nil {
		t.Fatal("the target took a write of its old epoch after its rebuild snapshot")
	}
	if st, err := e.WaitRebuild(ctx, extra.addr); err != nil || st.State != engine.RebuildComplete {
		t.Fatalf("rebuild: %+v, %v", st, err)
	}
	for _, a := range addrs {
		if err := e.RemoveReplica(ctx, a); err != nil {
			t.Fatal(err)
		}
	}
	got := make([]byte, 4096)
	if err := e.ReadAt(ctx, got, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, pattern(1, 4096)) {
		t.Fatal("the rebuilt replica alone does not read back the volume's data")
	}
}

// snapshotHistory writes three generations of data with a snapshot after
// the first two (and calls between after s1), returning each snapshot's
// expected content and the current one.
func snapshotHistory(t *testing.T, e *engine.Engine, size int, between func()) (s1, s2, now []byte) {
	t.Helper()
	ctx := context.Background()
	s1 = pattern(1, size)
	if err := e.WriteAt(ctx, s1, 0, false); err != nil {
		t.Fatal(err)
	}
	if err := e.Snapshot(ctx, "s1"); err != nil {
		t.Fatal(err)
	}
	between()
	s2 = append([]byte(nil), s1...)
	copy(s2, pattern(2, size/2))
	if err := e.WriteAt(ctx, s2[:size/2], 0, false); err != nil {
		t.Fatal(err)
	}
	if err := e.Unmap(ctx, int64(size)-8192, 8192); err != nil { // zeros over older data
		t.Fatal(err)
	}
	clear(s2[size-8192:])
	if err := e.Snapshot(ctx, "s2"); err != nil {
		t.Fatal(err)
	}
	now = append([]byte(nil), s2...)
	copy(now[size/4:], pattern(3, 1<<20))
	if err := e.WriteAt(ctx, now[size/4:size/4+1<<20], int64(size/4), false); err != nil {
		t.Fatal(err)
	}
	return s1, s2, now
}

// checkHistory removes every replica but only, then reads the volume and
// reverts to s2 and s1 in turn, checking each.
func checkHistory(t *testing.T, e *engine.Engine, only string, s1, s2, now []byte) {
	t.Helper()
	ctx := context.Background()
	for _, r := range e.Replicas() {
		if r.Address != only {
			if err := e.RemoveReplica(ctx, r.Address); err != nil {
				t.Fatal(err)
			}
		}
	}
	snaps, err := e.Snapshots(ctx)
	if err != nil || len(snaps) != 2 || snaps[0].Name != "s1" || snaps[1].Name != "s2" || snaps[1].Parent != "s1" || !snaps[0].UserCreated {
		t.Fatalf("the rebuilt replica's snapshots: %+v %v", snaps, err)
	}
	got := make([]byte, len(now))
	for _, step := range []struct {
		revert string
		want   []byte
	}{{"", now}, {"s2", s2}, {"s1", s1}} {
		if step.revert != "" {
			if err := e.Revert(ctx, step.revert); err != nil {
				t.Fatal(err)
			}
		}
		if err := e.ReadAt(ctx, got, 0); err != nil || !bytes.Equal(got, step.want) {
			t.Fatalf("the rebuilt replica alone, reverted to %q: wrong data (%v)", step.revert, err)
		}
	}
}

// TestRebuildKeepsSnapshotHistory: a new replica rebuilt in full gets every
// snapshot, layer by layer, with its name, time and flag: once the
// originals are gone it still reverts to each one.
func TestRebuildKeepsSnapshotHistory(t *testing.T) {
	ctx := context.Background()
	const size = 8 << 20
	e, _ := cluster(t, 2, size)
	s1, s2, now := snapshotHistory(t, e, size, func() {})
	want, err := e.Snapshots(ctx)
	if err != nil {
		t.Fatal(err)
	}
	fresh := startReplica(t, filepath.Join(t.TempDir(), "new"), size, "")
	if err := e.AddReplica(ctx, fresh.addr); err != nil {
		t.Fatal(err)
	}
	st, err := e.WaitRebuild(ctx, fresh.addr)
	if err != nil || st.State != engine.RebuildComplete || st.DirtyOnly {
		t.Fatalf("rebuild: %+v %v", st, err)
	}
	if len(st.Layers) != 3 || st.Layers[0] != "s1" || st.Layers[1] != "s2" || st.Layers[2] != st.Snapshot {
		t.Fatalf("layers copied: %v", st.Layers)
	}
	// Every layer's own data, no more: s1 whole, half in s2 plus the
	// zeros over older data, 1 MiB in the rebuild snapshot.
	if wantBytes := int64(size + size/2 + 8192 + 1<<20); st.BytesCopied != wantBytes || st.BytesDone != st.BytesTotal || st.BytesTotal != wantBytes {
		t.Fatalf("copied %d, done %d of %d; want %d", st.BytesCopied, st.BytesDone, st.BytesTotal, wantBytes)
	}
	in, err := fresh.run.Replica.Info()
	if err != nil || len(in.Snapshots) != 2 {
		t.Fatalf("the new replica's chain (the rebuild snapshot should be merged away): %+v %v", in.Snapshots, err)
	}
	for i, s := range in.Snapshots {
		if s.Name != want[i].Name || !s.Created.Equal(want[i].Created) || s.UserCreated != want[i].UserCreated {
			t.Fatalf("snapshot %d on the new replica: %+v, want %+v", i, s, want[i])
		}
	}
	checkHistory(t, e, fresh.addr, s1, s2, now)
}

// TestReturningReplicaMissingASnapshot: a snapshot taken while a replica
// was away is taken on it too when it returns, and it still copies only
// its dirty regions (into that snapshot and the rebuild snapshot): alone
// it then reverts to every snapshot correctly.
func TestReturningReplicaMissingASnapshot(t *testing.T) {
	ctx := context.Background()
	const size = 16 << 20
	e, reps := cluster(t, 2, size)
	r1 := reps[1]
	s1, s2, now := snapshotHistory(t, e, size, func() { // s2 is taken on the survivor only
		waitFor(t, "bits to clear", func() bool {
			return e.Flush(ctx) == nil && dirtyCount(t, reps[0])+dirtyCount(t, r1) == 0
		})
		r1.kill()
		waitFor(t, "ERR", func() bool { return modes(e)[r1.addr] == "ERR" })
	})
	back := startReplica(t, r1.dir, 0, r1.addr)
	if err := e.AddReplica(ctx, back.addr); err != nil {
		t.Fatal(err)
	}
	st, err := e.WaitRebuild(ctx, back.addr)
	// Written while away: half the volume, 8 KiB trimmed, 1 MiB; each
	// dirty region goes into s2 and the rebuild snapshot.
	if err != nil || st.State != engine.RebuildComplete || !st.DirtyOnly || st.BytesCopied > 2*(size/2+2<<20) {
		t.Fatalf("rebuild (want dirty regions only): %+v %v", st, err)
	}
	checkHistory(t, e, back.addr, s1, s2, now)
}

// holdLayers wraps a rebuild target: its layer writes wait until release
// is closed, so a test can act while the rebuild is in progress.
type holdLayers struct {
	engine.Replica
	release chan struct{}
}

func (h *holdLayers) WriteLayer(ctx context.Context, name string, p []byte, off int64) error {
	<-h.release
	return h.Replica.WriteLayer(ctx, name, p, off)
}

// openWithHeldTarget opens a one-replica volume holding 8 KiB of data,
// and a replica to add whose layer writes wait for hold.release: a
// rebuild to it stays in progress until the test lets it go.
func openWithHeldTarget(t *testing.T) (*engine.Engine, *testReplica, *holdLayers) {
	t.Helper()
	extra := startReplica(t, filepath.Join(t.TempDir(), "x"), 1<<20, "")
	hold := &holdLayers{release: make(chan struct{})}
	e, _ := openWrapped(t, 1, func(addr string, r engine.Replica) engine.Replica {
		if addr != extra.addr {
			return r
		}
		hold.Replica = r
		return hold
	})
	if err := e.WriteAt(context.Background(), pattern(1, 8192), 0, false); err != nil {
		t.Fatal(err)
	}
	return e, extra, hold
}

// TestCancelledRebuildLeavesNoSnapshot: a rebuild cancelled halfway
// leaves the replica ERR and its rebuild snapshot deleted from the
// members, not kept as a layer for good.
func TestCancelledRebuildLeavesNoSnapshot(t *testing.T) {
	ctx := context.Background()
	e, extra, hold := openWithHeldTarget(t)
	if err := e.AddReplica(ctx, extra.addr); err != nil {
		t.Fatal(err)
	}
	if snaps, err := e.Snapshots(ctx); err != nil || len(snaps) != 1 {
		t.Fatalf("snapshots during the rebuild: %+v %v; want its rebuild snapshot", snaps, err)
	}
	cancelled := make(chan error, 1)
	go func() { cancelled <- e.CancelRebuild(extra.addr) }()
	close(hold.release)
	if err := <-cancelled; err != nil {
		t.Fatal(err)
	}
	if st, err := e.WaitRebuild(ctx, extra.addr); err != nil || st.State != engine.RebuildCancelled {
		t.Fatalf("rebuild: %+v %v", st, err)
	}
	waitFor(t, "no rebuild snapshot left", func() bool {
		snaps, err := e.Snapshots(ctx)
		return err == nil && len(snaps) == 0
	})
	if err := e.WriteAt(ctx, pattern(2, 4096), 0, false); err != nil {
		t.Fatalf("the volume after the cancelled rebuild: %v", err)
	}
}

// TestSnapshotsInUseByARebuildKept: while a rebuild copies the layers,
// deleting one of those snapshots is refused with the reason (the copy
// would lose its place); afterwards it works.
func TestSnapshotsInUseByARebuildKept(t *testing.T) {
	ctx := context.Background()
	e, extra, hold := openWithHeldTarget(t)
	if err := e.Snapshot(ctx, "s1"); err != nil {
		t.Fatal(err)
	}
	if err := e.AddReplica(ctx, extra.addr); err != nil {
		t.Fatal(err)
	}
	err := e.DeleteSnapshot(ctx, "s1")
	if !errors.Is(err, engine.ErrInvalid) || !strings.Contains(err.Error(), "in use by the rebuild") {
		t.Fatalf("deleting a snapshot a rebuild copies: %v", err)
	}
	close(hold.release)
	if st, err := e.WaitRebuild(ctx, extra.addr); err != nil || st.State != engine.RebuildComplete {
		t.Fatalf("rebuild: %+v %v", st, err)
	}
	if err := e.DeleteSnapshot(ctx, "s1"); err != nil {
		t.Fatal(err)
	}
	if in, _ := extra.run.Replica.Info(); len(in.Snapshots) != 0 {
		t.Fatalf("snapshots left on the rebuilt replica: %+v", in.Snapshots)
	}
}

// TestReturningReplicaAfterSnapshotDeleteCopiesOnlyDirty: a snapshot
// deleted while a replica was away is deleted on it too when it returns,
// and it still copies only its dirty regions; alone it then serves the
// volume and reverts to the remaining snapshot correctly.
func TestReturningReplicaAfterSnapshotDeleteCopiesOnlyDirty(t *testing.T) {
	ctx := context.Background()
	const size = 16 << 20
	e, reps := cluster(t, 2, size)
	r1 := reps[1]
	_, s2, _ := snapshotHistory(t, e, size, func() {})
	waitFor(t, "bits to clear", func() bool {
		return e.Flush(ctx) == nil && dirtyCount(t, reps[0])+dirtyCount(t, r1) == 0
	})
	r1.kill()
	waitFor(t, "ERR", func() bool { return modes(e)[r1.addr] == "ERR" })
	if err := e.DeleteSnapshot(ctx, "s1"); err != nil { // on the survivor only
		t.Fatal(err)
	}
	now := pattern(4, 8192)
	if err := e.WriteAt(ctx, now, 12<<20, false); err != nil {
		t.Fatal(err)
	}
	back := startReplica(t, r1.dir, 0, r1.addr)
	if err := e.AddReplica(ctx, back.addr); err != nil {
		t.Fatal(err)
	}
	st, err := e.WaitRebuild(ctx, back.addr)
	if err != nil || st.State != engine.RebuildComplete || !st.DirtyOnly || st.BytesCopied > 2<<20 {
		t.Fatalf("rebuild (want dirty regions only, about 1 MiB): %+v %v", st, err)
	}
	if err := e.RemoveReplica(ctx, reps[0].addr); err != nil {
		t.Fatal(err)
	}
	snaps, err := e.Snapshots(ctx)
	if err != nil || len(snaps) != 1 || snaps[0].Name != "s2" {
		t.Fatalf("the returning replica's snapshots: %+v %v", snaps, err)
	}
	got := make([]byte, 8192)
	if err := e.ReadAt(ctx, got, 12<<20); err != nil || !bytes.Equal(got, now) {
		t.Fatalf("a write made while it was away: %v", err)
	}
	if err := e.Revert(ctx, "s2"); err != nil {
		t.Fatal(err)
	}
	all := make([]byte, size)
	if err := e.ReadAt(ctx, all, 0); err != nil || !bytes.Equal(all, s2) {
		t.Fatalf("reverted to s2 on the returning replica alone: wrong data (%v)", err)
	}
}

// holdDelete wraps a replica: its snapshot deletions wait until release
// is closed, as a long merge would.
type holdDelete struct {
	engine.Replica
	started chan struct{}
	release chan struct{}
}

func (h *holdDelete) DeleteSnapshot(ctx context.Context, name string) error {
	h.started <- struct{}{}
	<-h.release
	return h.Replica.DeleteSnapshot(ctx, name)
}

// TestDeleteSnapshotKeepsIOGoing: while the replicas merge a deleted
// snapshot, writes and reads go on; a snapshot asked for meanwhile waits
// for the deletion instead of pausing I/O; deleting a snapshot no replica
// has is NotFound.
func TestDeleteSnapshotKeepsIOGoing(t *testing.T) {
	ctx := context.Background()
	var holds []*holdDelete
	e, _ := openWrapped(t, 2, func(addr string, r engine.Replica) engine.Replica {
		h := &holdDelete{Replica: r, started: make(chan struct{}, 1), release: make(chan struct{})}
		holds = append(holds, h)
		return h
	})
	if err := e.WriteAt(ctx, pattern(1, 8192), 0, false); err != nil {
		t.Fatal(err)
	}
	if err := e.Snapshot(ctx, "s1"); err != nil {
		t.Fatal(err)
	}
	deleted := make(chan error, 1)
	go func() { deleted <- e.DeleteSnapshot(ctx, "s1") }()
	for _, h := range holds {
		<-h.started
	}
	// Both replicas are "merging": I/O must not wait for them.
	if err := e.WriteAt(ctx, pattern(2, 4096), 4096, false); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 8192)
	if err := e.ReadAt(ctx, got, 0); err != nil || !bytes.Equal(got[:4096], pattern(1, 4096)) || !bytes.Equal(got[4096:], pattern(2, 4096)) {
		t.Fatalf("read during the deletion: %v", err)
	}
	snapped := make(chan error, 1)
	go func() { snapped <- e.Snapshot(ctx, "s2") }()
	if err := e.WriteAt(ctx, pattern(3, 4096), 0, false); err != nil { // a snapshot waiting does not pause I/O either
		t.Fatal(err)
	}
	select {
	case err := <-snapped:
		t.Fatalf("a snapshot was taken in the middle of a deletion: %v", err)
	default:
	}
	for _, h := range holds {
		close(h.release)
	}
	if err := <-deleted; err != nil {
		t.Fatal(err)
	}
	if err := <-snapped; err != nil {
		t.Fatal(err)
	}
	snaps, err := e.Snapshots(ctx)
	if err != nil || len(snaps) != 1 || snaps[0].Name != "s2" {
		t.Fatalf("snapshots: %+v %v", snaps, err)
	}
	for _, h := range holds {
		h.release = make(chan struct{})
		close(h.release)
	}
	go func() {
		for _, h := range holds {
			<-h.started
		}
	}()
	if err := e.DeleteSnapshot(ctx, "nope"); !errors.Is(err, engine.ErrSnapshotNotFound) {
		t.Fatalf("deleting a snapshot nobody has: %v", err)
	}
	if e.Robustness() != "healthy" {
		t.Fatal(modes(e))
	}
}

// TestSnapshotTakenAgainUnderTheSameName: while a replica is away, a
// snapshot is deleted and another taken under the same name. The returning
// replica's old one must not pass for it: reverting to that name on the
// returning replica alone gives the new snapshot's data.
func TestSnapshotTakenAgainUnderTheSameName(t *testing.T) {
	ctx := context.Background()
	const size = 8 << 20
	e, reps := cluster(t, 2, size)
	r1 := reps[1]
	old := pattern(1, size)
	if err := e.WriteAt(ctx, old, 0, false); err != nil {
		t.Fatal(err)
	}
	if err := e.Snapshot(ctx, "daily"); err != nil {
		t.Fatal(err)
	}
	r1.kill()
	waitFor(t, "ERR", func() bool { return modes(e)[r1.addr] == "ERR" })
	again := append([]byte(nil), old...)
	copy(again, pattern(2, size/2))
	if err := e.WriteAt(ctx, again[:size/2], 0, false); err != nil {
		t.Fatal(err)
	}
	if err := e.DeleteSnapshot(ctx, "daily"); err != nil {
		t.Fatal(err)
	}
	if err := e.Snapshot(ctx, "daily"); err != nil {
		t.Fatal(err)
	}
	if err := e.WriteAt(ctx, pattern(3, 1<<20), 0, false); err != nil {
		t.Fatal(err)
	}
	back := startReplica(t, r1.dir, 0, r1.addr)
	if err := e.AddReplica(ctx, back.addr); err != nil {
		t.Fatal(err)
	}
	if st, err := e.WaitRebuild(ctx, back.addr); err != nil || st.State != engine.RebuildComplete {
		t.Fatalf("rebuild: %+v %v", st, err)
	}
	if err := e.RemoveReplica(ctx, reps[0].addr); err != nil {
		t.Fatal(err)
	}
	if err := e.Revert(ctx, "daily"); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, size)
	if err := e.ReadAt(ctx, got, 0); err != nil || !bytes.Equal(got, again) {
		t.Fatalf("the returning replica reverted to the old snapshot of that name (%v)", err)
	}
}

// TestOverlappingRebuildsLeaveNoSnapshot: a rebuild that completes while
// another, started after it, still copies its snapshot as a layer cannot
// delete that snapshot then; the later rebuild deletes it when it ends.
func TestOverlappingRebuildsLeaveNoSnapshot(t *testing.T) {
	ctx := context.Background()
	a := startReplica(t, filepath.Join(t.TempDir(), "a"), 1<<20, "")
	b := startReplica(t, filepath.Join(t.TempDir(), "b"), 1<<20, "")
	holds := map[string]*holdLayers{a.addr: {release: make(chan struct{})}, b.addr: {release: make(chan struct{})}}
	e, _ := openWrapped(t, 1, func(addr string, r engine.Replica) engine.Replica {
		if h := holds[addr]; h != nil {
			h.Replica = r
			return h
		}
		return r
	})
	if err := e.WriteAt(ctx, pattern(1, 8192), 0, false); err != nil {
		t.Fatal(err)
	}
	if err := e.AddReplica(ctx, a.addr); err != nil {
		t.Fatal(err)
	}
	if err := e.AddReplica(ctx, b.addr); err != nil { // copies a's rebuild snapshot as a layer
		t.Fatal(err)
	}
	close(holds[a.addr].release)
	if st, err := e.WaitRebuild(ctx, a.addr); err != nil || st.State != engine.RebuildComplete {
		t.Fatalf("first rebuild: %+v %v", st, err)
	}
	close(holds[b.addr].release)
	if st, err := e.WaitRebuild(ctx, b.addr); err != nil || st.State != engine.RebuildComplete {
		t.Fatalf("second rebuild: %+v %v", st, err)
	}
	waitFor(t, "no rebuild snapshot left", func() bool {
		snaps, err := e.Snapshots(ctx)
		return err == nil && len(snaps) == 0
	})
	for _, tr := range []*testReplica{a, b} {
		if in, _ := tr.run.Replica.Info(); len(in.Snapshots) != 0 {
			t.Fatalf("snapshots left on %s: %+v", tr.addr, in.Snapshots)
		}
	}
}

// TestReturningReplicaAfterAReplacementJoinedIsRebuiltInFull: B fails, a
// region is written (A and C mark it dirty), C fails, D joins by a full
// rebuild (no write-intent bits for that region; the set stays degraded,
// so B's failure record is kept), A fails. B comes back: its only
// possible source is D, whose bits do not cover the region written while
// B was away, so a dirty-only resync would leave B stale there. It must be
// rebuilt in full, and then serve every byte right alone.
func TestReturningReplicaAfterAReplacementJoinedIsRebuiltInFull(t *testing.T) {
	ctx := context.Background()
	const size = 16 << 20
	e, reps := cluster(t, 3, size)
	if err := e.WriteAt(ctx, pattern(1, size), 0, false); err != nil {
		t.Fatal(err)
	}
	a, b, c := reps[0], reps[1], reps[2]
	b.kill()
	waitFor(t, "B ERR", func() bool { return modes(e)[b.addr] == "ERR" })
	const off = 5 << 20
	if err := e.WriteAt(ctx, pattern(off, 8192), off, false); err != nil {
		t.Fatal(err)
	}
	c.kill()
	waitFor(t, "C ERR", func() bool { return modes(e)[c.addr] == "ERR" })
	d := startReplica(t, t.TempDir(), size, "")
	if err := e.AddReplica(ctx, d.addr); err != nil {
		t.Fatal(err)
	}
	if st, err := e.WaitRebuild(ctx, d.addr); err != nil || st.State != engine.RebuildComplete {
		t.Fatalf("D's rebuild: %+v %v", st, err)
	}
	a.kill()
	waitFor(t, "A ERR", func() bool { return modes(e)[a.addr] == "ERR" })
	back := startReplica(t, b.dir, 0, "")
	if err := e.AddReplica(ctx, back.addr); err != nil {
		t.Fatal(err)
	}
	st, err := e.WaitRebuild(ctx, back.addr)
	if err != nil || st.State != engine.RebuildComplete {
		t.Fatalf("B's rebuild: %+v %v", st, err)
	}
	if st.DirtyOnly {
		t.Fatal("B resynced dirty regions only from a replica that joined after it failed")
	}
	d.kill()
	waitFor(t, "D ERR", func() bool { return modes(e)[d.addr] == "ERR" })
	want := pattern(1, size)
	copy(want[off:], pattern(off, 8192))
	got := make([]byte, size)
	if err := e.ReadAt(ctx, got, 0); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("B alone serves wrong data: %v", err)
	}
}
