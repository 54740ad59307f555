package engine_test

import (
	"bytes"
	"context"
	"errors"
	"net"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/go-logr/logr/funcr"

	"github.com/cairn-io/cairn/dataplane/engine"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// logRecorder keeps what a logger was given, one line per call.
type logRecorder struct {
	mu    sync.Mutex
	lines []string
}

func (r *logRecorder) logger() logr.Logger {
	return funcr.New(func(prefix, args string) {
		r.mu.Lock()
		defer r.mu.Unlock()
		r.lines = append(r.lines, prefix+" "+args)
	}, funcr.Options{})
}

// find returns the first line holding every one of words, or "".
func (r *logRecorder) find(words ...string) string {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, l := range r.lines {
		if !slices.ContainsFunc(words, func(w string) bool { return !strings.Contains(l, w) }) {
			return l
		}
	}
	return ""
}

func (r *logRecorder) String() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return strings.Join(r.lines, "\n")
}

// blackHole is a replica address ("data,control") whose two listeners
// accept connections and never answer on them: what an engine meets at a
// stale address taken over by something that does not speak to it.
type blackHole struct {
	addr      string
	ls        []net.Listener
	mu        sync.Mutex
	conns     []net.Conn
	closeOnce sync.Once
}

func startBlackHole(t *testing.T) *blackHole {
	t.Helper()
	h := &blackHole{}
	var addrs []string
	for range 2 {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		h.ls = append(h.ls, l)
		addrs = append(addrs, l.Addr().String())
		go func() {
			for {
				c, err := l.Accept()
				if err != nil {
					return
				}
				h.mu.Lock()
				h.conns = append(h.conns, c)
				h.mu.Unlock()
			}
		}()
	}
	h.addr = strings.Join(addrs, ",")
	t.Cleanup(h.close)
	return h
}

// close stops listening and drops the connections it holds, freeing its
// ports for a replica to start on.
func (h *blackHole) close() {
	h.closeOnce.Do(func() {
		for _, l := range h.ls {
			l.Close()
		}
		h.mu.Lock()
		defer h.mu.Unlock()
		for _, c := range h.conns {
			c.Close()
		}
	})
}

// failAllBut kills every replica of reps but the one at keep while the
// engine serves, waits until the engine has them ERR (and the epoch moved
// past them), and writes p at 0: a write acknowledged by the survivor
// alone.
func failAllBut(t *testing.T, e *engine.Engine, reps []*testReplica, keep int, p []byte) {
	t.Helper()
	ctx := context.Background()
	for i, tr := range reps {
		if i != keep {
			tr.kill()
		}
	}
	// A write notices the dead replicas (if their pings have not yet) and
	// is acknowledged only once the survivor's epoch moved past them.
	if err := e.WriteAt(ctx, p, 0, false); err != nil {
		t.Fatal(err)
	}
	for i, tr := range reps {
		if i != keep {
			waitFor(t, tr.addr+" ERR", func() bool { return modes(e)[tr.addr] == "ERR" })
		}
	}
	if err := e.WriteAt(ctx, p, 0, false); err != nil {
		t.Fatal(err)
	}
}

// TestOpenWithoutUnreachableReplicasWhenSafe: the volume was served from
// one replica alone after the two others failed. An engine then given
// that replica, an address that accepts and never answers and a closed
// port opens within its connect timeout (the two are tried at once, each
// attempt bounded), logs which address it is still waiting for, serves
// the survivor's data, reads and writes, and has the other two ERR. The
// address that was closed then gets a replica again, which is added back
// and rebuilt. (The engine used to connect one replica after the other,
// each as long as the transport allowed, and said nothing meanwhile.)
func TestOpenWithoutUnreachableReplicasWhenSafe(t *testing.T) {
	ctx := context.Background()
	const size = 1 << 20
	e, reps := cluster(t, 3, size)
	if err := e.WriteAt(ctx, pattern(1, 8192), 0, false); err != nil {
		t.Fatal(err)
	}
	newest := pattern(2, 8192)
	failAllBut(t, e, reps, 0, newest)
	e.Close()

	hole := startBlackHole(t)
	closed := closedPort(t) + "," + closedPort(t)
	var rec logRecorder
	const connectTimeout = 3 * time.Second
	began := time.Now()
	e2, err := engine.Open(ctx, engine.Options{Name: "test", Replicas: []string{reps[0].addr, hole.addr, closed}, Dial: dialer(),
		Logger: rec.logger(), ConnectTimeout: connectTimeout, WaitInterval: 500 * time.Millisecond})
	if err != nil {
		t.Fatalf("open: %v\nlog:\n%s", err, rec.String())
	}
	t.Cleanup(func() { e2.Close() })
	// Bounded by the connect timeout; the limit is generous for a loaded
	// machine, far below what a hung connect would take.
	if took := time.Since(began); took > deadline.Scale(10*connectTimeout) {
		t.Fatalf("open took %v with a connect timeout of %v", took, connectTimeout)
	}
	if l := rec.find("still connecting", hole.addr); l == "" || strings.Contains(l, closed) {
		t.Fatalf("no log line saying it waits for %s alone (the closed port answers at once):\n%s", hole.addr, rec.String())
	}
	if rec.find("opening without", hole.addr, closed) == "" {
		t.Fatalf("no log line naming the replicas it opened without:\n%s", rec.String())
	}
	got := make([]byte, len(newest))
	if err := e2.ReadAt(ctx, got, 0); err != nil || !bytes.Equal(got, newest) {
		t.Fatalf("read after open: %v; the data is the newest write: %v", err, bytes.Equal(got, newest))
	}
	m := modes(e2)
	if m[reps[0].addr] != "RW" || m[hole.addr] != "ERR" || m[closed] != "ERR" {
		t.Fatalf("modes: %v", m)
	}
	later := pattern(3, 4096)
	if err := e2.WriteAt(ctx, later, 8192, false); err != nil {
		t.Fatal(err)
	}

	// The closed address gets a replica (on the data directory of one that
	// failed: stale, so rebuilt in full) and is given back.
	back := startReplica(t, reps[1].dir, size, closed)
	if err := e2.AddReplica(ctx, back.addr); err != nil {
		t.Fatal(err)
	}
	if st, err := e2.WaitRebuild(ctx, back.addr); err != nil || st.State != engine.RebuildComplete {
		t.Fatalf("rebuild of the returning replica: %+v, %v", st, err)
	}
	if m := modes(e2); m[back.addr] != "RW" {
		t.Fatalf("modes after the rebuild: %v", m)
	}
	want := append(append([]byte{}, newest...), later...)
	got = make([]byte, len(want))
	readReplica(t, back, e2.Epoch(), got, 0)
	if !bytes.Equal(got, want) {
		t.Fatal("the rebuilt replica does not hold the volume's data")
	}
}

// TestOpenWaitsForReplicaThatMayHoldNewestData: the volume was served
// from one replica alone, which then became unreachable (its address
// accepts and never answers). The two others answer, but their newest
// epoch's set names the missing one, which may hold writes they lack: the
// engine does not serve from them. It reports whom it waits for (the
// Waiting given to OnWait, the log), an Open whose context ends gives up
// with ErrReplicasMissing having changed nothing on the replicas, and
// once the replica answers at that address the engine opens and serves
// its data, with the two others ERR. (The engine used to serve the older
// data of the two.)
func TestOpenWaitsForReplicaThatMayHoldNewestData(t *testing.T) {
	ctx := context.Background()
	const size = 1 << 20
	e, reps := cluster(t, 3, size)
	if err := e.WriteAt(ctx, pattern(1, 8192), 0, false); err != nil {
		t.Fatal(err)
	}
	newest := pattern(2, 8192)
	failAllBut(t, e, reps, 2, newest)
	e.Close()
	info, err := reps[2].run.Replica.Info()
	if err != nil {
		t.Fatal(err)
	}
	survivor := info.ID
	reps[2].kill()
	var stale []*testReplica
	for i := range 2 {
		stale = append(stale, startReplica(t, reps[i].dir, size, ""))
	}
	hole := startBlackHole(t)
	addrs := []string{stale[0].addr, stale[1].addr, hole.addr}
	opts := func(rec *logRecorder, waits chan<- engine.Waiting) engine.Options {
		return engine.Options{Name: "test", Replicas: addrs, Dial: dialer(), Logger: rec.logger(),
			ConnectTimeout: 2 * time.Second, WaitInterval: 300 * time.Millisecond,
			OnWait: func(w engine.Waiting) {
				select {
				case waits <- w:
				default:
				}
			}}
	}

	// Given up when its context ends: nothing served, nothing changed.
	before, err := stale[0].run.Replica.Info()
	if err != nil {
		t.Fatal(err)
	}
	var rec logRecorder
	short, cancel := context.WithTimeout(ctx, deadline.Scale(3*time.Second))
	_, err = engine.Open(short, opts(&rec, make(chan engine.Waiting, 1)))
	cancel()
	if !errors.Is(err, engine.ErrReplicasMissing) || !strings.Contains(err.Error(), hole.addr) || !strings.Contains(err.Error(), survivor) {
		t.Fatalf("open with the newest replica missing: %v; want ErrReplicasMissing naming %s and replica %s", err, hole.addr, survivor)
	}
	if after, _ := stale[0].run.Replica.Info(); after.Epoch != before.Epoch {
		t.Fatalf("an Open that gave up changed the epoch of a replica: %d -> %d", before.Epoch, after.Epoch)
	}

	// Waits, saying for whom, until the replica answers.
	rec = logRecorder{}
	waits := make(chan engine.Waiting, 64)
	type result struct {
		e   *engine.Engine
		err error
	}
	opened := make(chan result, 1)
	go func() {
		e, err := engine.Open(ctx, opts(&rec, waits))
		opened <- result{e, err}
	}()
	giveUp := time.After(deadline.Scale(60 * time.Second))
	for seen := false; !seen; {
		select {
		case w := <-waits:
			seen = strings.Contains(w.Reason, survivor) && len(w.Unanswered) == 1 && w.Unanswered[0].Address == hole.addr
		case r := <-opened:
			if r.e != nil {
				r.e.Close()
			}
			t.Fatalf("Open returned (%v) while the replica that may hold the newest data did not answer", r.err)
		case <-giveUp:
			t.Fatalf("no Waiting naming %s and replica %s; log:\n%s", hole.addr, survivor, rec.String())
		}
	}
	if rec.find("cannot serve the volume yet", hole.addr, survivor) == "" {
		t.Fatalf("the log does not say whom it waits for:\n%s", rec.String())
	}
	hole.close()
	startReplica(t, reps[2].dir, size, hole.addr)
	var r result
	select {
	case r = <-opened:
	case <-time.After(deadline.Scale(60 * time.Second)):
		t.Fatalf("Open did not return once the replica answered; log:\n%s", rec.String())
	}
	if r.err != nil {
		t.Fatal(r.err)
	}
	t.Cleanup(func() { r.e.Close() })
	got := make([]byte, len(newest))
	if err := r.e.ReadAt(ctx, got, 0); err != nil || !bytes.Equal(got, newest) {
		t.Fatalf("read after open: %v; the data is the newest write: %v", err, bytes.Equal(got, newest))
	}
	if m := modes(r.e); m[hole.addr] != "RW" || m[stale[0].addr] != "ERR" || m[stale[1].addr] != "ERR" {
		t.Fatalf("modes: %v", m)
	}
}
