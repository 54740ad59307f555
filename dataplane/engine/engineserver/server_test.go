package engineserver

import (
	"bytes"
	"context"
	"errors"
	"net"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"

	enginev1 "github.com/cairn-io/cairn/dataplane/api/engine/v1"
	"github.com/cairn-io/cairn/dataplane/dataconn"
	"github.com/cairn-io/cairn/dataplane/engine"
	"github.com/cairn-io/cairn/dataplane/engine/replicaclient"
	"github.com/cairn-io/cairn/dataplane/internal/ready"
	"github.com/cairn-io/cairn/dataplane/replica"
	"github.com/cairn-io/cairn/dataplane/replica/replicaserver"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// These tests run the control API as the engine process serves it: real
// replicas on loopback, a real engine over them, and this server on a
// gRPC connection (bufconn) the test calls as a client would.

// within bounds every wait: generous, for a loaded machine.
var within = deadline.Scale(60 * time.Second)

const size = 8 << 20

// startReplica serves a replica in a new directory on loopback and returns
// its address as the engine takes it ("DATA,CONTROL").
func startReplica(t *testing.T) string {
	t.Helper()
	r, err := replica.Open(filepath.Join(t.TempDir(), "r"), replica.Options{Size: size})
	if err != nil {
		t.Fatal(err)
	}
	dl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	cl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	run := replicaserver.Start(r, replicaserver.Options{Data: dl, Control: cl})
	t.Cleanup(run.Kill)
	return dl.Addr().String() + "," + cl.Addr().String()
}

func dialer() engine.Dialer {
	return replicaclient.Dialer(replicaclient.Options{Data: dataconn.ClientOptions{Conns: 2, RequestTimeout: deadline.Scale(10 * time.Second)}})
}

// resizer records the sizes the server asks the frontend's device to
// show, and fails while failing is set.
type resizer struct {
	mu      sync.Mutex
	sizes   []int64
	failing bool
}

func (r *resizer) resize(_ context.Context, size int64) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.sizes = append(r.sizes, size)
	if r.failing {
		return errors.New("BLKRESIZE: device busy")
	}
	return nil
}

type rig struct {
	e      *engine.Engine
	srv    *Server
	c      enginev1.EngineServiceClient
	inUse  func() string
	resize *resizer
}

// newRig opens an engine over n fresh replicas and serves it.
func newRig(t *testing.T, n int) *rig {
	t.Helper()
	var addrs []string
	for range n {
		addrs = append(addrs, startReplica(t))
	}
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	e, err := engine.Open(ctx, engine.Options{Name: "vol", Replicas: addrs, Dial: dialer()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	r := &rig{e: e, resize: &resizer{}}
	r.srv = &Server{E: e, Name: "vol", Frontend: "nbd", Endpoint: "/run/vol.sock", EndpointKind: ready.EndpointNBDSocket,
		Socket: "/run/vol.sock", InUse: func() string { return r.inUse() }, Resize: r.resize.resize}
	r.inUse = func() string { return "" }
	l := bufconn.Listen(1 << 20)
	gs := grpc.NewServer()
	enginev1.RegisterEngineServiceServer(gs, r.srv)
	go func() { _ = gs.Serve(l) }() // nil after Stop at cleanup; a failure shows as the calls failing
	t.Cleanup(gs.Stop)
	cc, err := grpc.NewClient("passthrough:///bufnet", grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) {
		return l.DialContext(ctx)
	}), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	r.c = enginev1.NewEngineServiceClient(cc)
	return r
}

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), within)
	t.Cleanup(cancel)
	return c
}

func code(err error) codes.Code { return status.Code(err) }

// openWatch opens a status stream and returns it with its first status.
func openWatch(t *testing.T, r *rig, c context.Context) (grpc.ServerStreamingClient[enginev1.VolumeStatus], *enginev1.VolumeStatus) {
	t.Helper()
	w, err := r.c.Watch(c, &enginev1.WatchRequest{})
	if err != nil {
		t.Fatal(err)
	}
	first, err := w.Recv()
	if err != nil {
		t.Fatal(err)
	}
	return w, first
}

// TestVolumeInfo: what the engine serves, as a client reads it.
func TestVolumeInfo(t *testing.T) {
	r := newRig(t, 2)
	info, err := r.c.VolumeInfo(ctx(t), &enginev1.VolumeInfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if info.GetName() != "vol" || info.GetSize() != size || info.GetFrontend() != "nbd" || info.GetEndpoint() != "/run/vol.sock" ||
		info.GetEndpointKind() != string(ready.EndpointNBDSocket) || info.GetRobustness() != "healthy" || info.GetEpoch() == 0 {
		t.Fatalf("volume info %v", info)
	}
	list, err := r.c.ReplicaList(ctx(t), &enginev1.ReplicaListRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if len(list.GetReplicas()) != 2 {
		t.Fatalf("replicas %v", list.GetReplicas())
	}
	for _, rep := range list.GetReplicas() {
		if rep.GetMode() != "RW" || rep.GetSinceUnixNano() == 0 {
			t.Fatalf("replica %v", rep)
		}
	}
}

// TestBadRequests: requests that cannot be carried out get the code that
// says why, and change nothing.
func TestBadRequests(t *testing.T) {
	r := newRig(t, 1)
	c := ctx(t)
	if _, err := r.c.SnapshotCreate(c, &enginev1.SnapshotCreateRequest{Name: "kept"}); err != nil {
		t.Fatal(err)
	}
	only := r.e.Replicas()[0].Address
	for _, tc := range []struct {
		name string
		call func() error
		want codes.Code
	}{
		{"add without address", func() error { _, err := r.c.ReplicaAdd(c, &enginev1.ReplicaAddRequest{}); return err }, codes.InvalidArgument},
		{"remove a stranger", func() error {
			_, err := r.c.ReplicaRemove(c, &enginev1.ReplicaRemoveRequest{Address: "127.0.0.1:1,127.0.0.1:2"})
			return err
		}, codes.InvalidArgument},
		{"remove the last RW replica", func() error {
			_, err := r.c.ReplicaRemove(c, &enginev1.ReplicaRemoveRequest{Address: only})
			return err
		}, codes.InvalidArgument},
		{"cancel no rebuild", func() error {
			_, err := r.c.RebuildCancel(c, &enginev1.RebuildCancelRequest{Replica: only})
			return err
		}, codes.InvalidArgument},
		{"snapshot without name", func() error { _, err := r.c.SnapshotCreate(c, &enginev1.SnapshotCreateRequest{}); return err }, codes.InvalidArgument},
		{"snapshot twice", func() error {
			_, err := r.c.SnapshotCreate(c, &enginev1.SnapshotCreateRequest{Name: "kept"})
			return err
		}, codes.AlreadyExists},
		{"delete a missing snapshot", func() error {
			_, err := r.c.SnapshotDelete(c, &enginev1.SnapshotDeleteRequest{Name: "nope"})
			return err
		}, codes.NotFound},
		{"revert to a missing snapshot", func() error {
			_, err := r.c.SnapshotRevert(c, &enginev1.SnapshotRevertRequest{Name: "nope"})
			return err
		}, codes.NotFound},
		{"shrink", func() error { _, err := r.c.Expand(c, &enginev1.ExpandRequest{Size: size / 2}); return err }, codes.InvalidArgument},
		{"grow by a part of a block", func() error { _, err := r.c.Expand(c, &enginev1.ExpandRequest{Size: size + 100}); return err }, codes.InvalidArgument},
		{"clone without a source", func() error {
			_, err := r.c.CloneFrom(c, &enginev1.CloneFromRequest{Snapshot: "s"})
			return err
		}, codes.InvalidArgument},
		{"clone without a way to other volumes", func() error {
			_, err := r.c.CloneFrom(c, &enginev1.CloneFromRequest{Source: "127.0.0.1:1", Snapshot: "s"})
			return err
		}, codes.Unimplemented},
	} {
		if got := code(tc.call()); got != tc.want {
			t.Errorf("%s: %s, want %s", tc.name, got, tc.want)
		}
		if rob := r.e.Robustness(); rob != "healthy" {
			t.Fatalf("%s: the volume is %s after it", tc.name, rob)
		}
	}
	if info, _ := r.c.VolumeInfo(c, &enginev1.VolumeInfoRequest{}); info.GetSize() != size || info.GetRobustness() != "healthy" {
		t.Fatalf("after the refused requests: %v", info)
	}
	snaps, err := r.c.SnapshotList(c, &enginev1.SnapshotListRequest{})
	if err != nil || len(snaps.GetSnapshots()) != 1 || snaps.GetSnapshots()[0].GetName() != "kept" {
		t.Fatalf("snapshots after the refused requests: %v %v", snaps, err)
	}
	if len(r.resize.sizes) != 0 {
		t.Fatalf("a refused expand resized the device to %v", r.resize.sizes)
	}
}

// TestSnapshots: taken, listed as the user's, reverted to (refused while
// the volume is in use, the data untouched), deleted.
func TestSnapshots(t *testing.T) {
	r := newRig(t, 2)
	c := ctx(t)
	old := bytes.Repeat([]byte{0x11}, 4096)
	if err := r.e.WriteAt(c, old, 0, true); err != nil {
		t.Fatal(err)
	}
	if _, err := r.c.SnapshotCreate(c, &enginev1.SnapshotCreateRequest{Name: "s1"}); err != nil {
		t.Fatal(err)
	}
	if err := r.e.WriteAt(c, bytes.Repeat([]byte{0x22}, 4096), 0, true); err != nil {
		t.Fatal(err)
	}
	list, err := r.c.SnapshotList(c, &enginev1.SnapshotListRequest{})
	if err != nil {
		t.Fatal(err)
	}
	i := slices.IndexFunc(list.GetSnapshots(), func(s *enginev1.Snapshot) bool { return s.GetName() == "s1" })
	if i < 0 || !list.GetSnapshots()[i].GetUserCreated() || list.GetSnapshots()[i].GetCreatedUnixNano() == 0 {
		t.Fatalf("snapshots %v", list.GetSnapshots())
	}
	read := func() byte {
		p := make([]byte, 4096)
		if err := r.e.ReadAt(c, p, 0); err != nil {
			t.Fatal(err)
		}
		return p[0]
	}
	r.inUse = func() string { return "mounted at /mnt" }
	if _, err := r.c.SnapshotRevert(c, &enginev1.SnapshotRevertRequest{Name: "s1"}); code(err) != codes.FailedPrecondition {
		t.Fatalf("revert while in use: %v", err)
	}
	if got := read(); got != 0x22 {
		t.Fatalf("a refused revert changed the data: %#x", got)
	}
	r.inUse = func() string { return "" }
	if _, err := r.c.SnapshotRevert(c, &enginev1.SnapshotRevertRequest{Name: "s1"}); err != nil {
		t.Fatal(err)
	}
	if got := read(); got != 0x11 {
		t.Fatalf("after the revert: %#x, want the snapshot's 0x11", got)
	}
	if _, err := r.c.SnapshotDelete(c, &enginev1.SnapshotDeleteRequest{Name: "s1"}); err != nil {
		t.Fatal(err)
	}
	list, err = r.c.SnapshotList(c, &enginev1.SnapshotListRequest{})
	if err != nil || slices.ContainsFunc(list.GetSnapshots(), func(s *enginev1.Snapshot) bool { return s.GetName() == "s1" }) {
		t.Fatalf("after the delete: %v %v", list.GetSnapshots(), err)
	}
}

// TestExpand: the replicas grow, then the device is resized to the
// engine's size; a device that cannot be resized is an Internal error
// that says so, and the same expand again retries it.
func TestExpand(t *testing.T) {
	r := newRig(t, 2)
	c := ctx(t)
	r.resize.failing = true
	_, err := r.c.Expand(c, &enginev1.ExpandRequest{Size: 2 * size})
	if code(err) != codes.Internal {
		t.Fatalf("expand with a failing resize: %v", err)
	}
	if info, _ := r.c.VolumeInfo(c, &enginev1.VolumeInfoRequest{}); info.GetSize() != 2*size {
		t.Fatalf("size %d after the replicas grew", info.GetSize())
	}
	r.resize.failing = false
	if _, err := r.c.Expand(c, &enginev1.ExpandRequest{Size: 2 * size}); err != nil {
		t.Fatalf("the same expand again: %v", err)
	}
	if want := []int64{2 * size, 2 * size}; !slices.Equal(r.resize.sizes, want) {
		t.Fatalf("device resized to %v, want %v", r.resize.sizes, want)
	}
}

// TestWatch: the status comes at once, and again, with a higher seq, when
// a call changes what it holds (a snapshot, a replica added and rebuilt);
// the rebuild and the I/O show in RebuildStatus and Metrics.
func TestWatch(t *testing.T) {
	r := newRig(t, 1)
	c := ctx(t)
	if err := r.e.WriteAt(c, bytes.Repeat([]byte{0x5a}, 64<<10), 0, true); err != nil {
		t.Fatal(err)
	}
	w, first := openWatch(t, r, c)
	if first.GetSeq() == 0 || first.GetName() != "vol" || first.GetSize() != size || len(first.GetReplicas()) != 1 || first.GetActualSize() < 64<<10 {
		t.Fatalf("first status %v", first)
	}
	if _, err := r.c.SnapshotCreate(c, &enginev1.SnapshotCreateRequest{Name: "w1"}); err != nil {
		t.Fatal(err)
	}
	until := func(what string, ok func(*enginev1.VolumeStatus) bool) *enginev1.VolumeStatus {
		t.Helper()
		var last uint64
		for {
			st, err := w.Recv()
			if err != nil {
				t.Fatalf("waiting for %s: %v", what, err)
			}
			if st.GetSeq() <= last {
				t.Fatalf("seq %d after %d", st.GetSeq(), last)
			}
			last = st.GetSeq()
			if ok(st) {
				return st
			}
		}
	}
	until("the snapshot", func(st *enginev1.VolumeStatus) bool {
		return slices.ContainsFunc(st.GetSnapshots(), func(s *enginev1.Snapshot) bool { return s.GetName() == "w1" })
	})
	added := startReplica(t)
	if _, err := r.c.ReplicaAdd(c, &enginev1.ReplicaAddRequest{Address: added}); err != nil {
		t.Fatal(err)
	}
	// The replica turns RW as its rebuild ends; the rebuild's record says
	// complete just after.
	until("the added replica RW and its rebuild complete", func(st *enginev1.VolumeStatus) bool {
		rw := slices.ContainsFunc(st.GetReplicas(), func(rep *enginev1.Replica) bool { return rep.GetAddress() == added && rep.GetMode() == "RW" })
		return rw && len(st.GetRebuilds()) == 1 && st.GetRebuilds()[0].GetState() == string(engine.RebuildComplete)
	})
	rbs, err := r.c.RebuildStatus(c, &enginev1.RebuildStatusRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if len(rbs.GetRebuilds()) != 1 || rbs.GetRebuilds()[0].GetReplica() != added || rbs.GetRebuilds()[0].GetBytesDone() != rbs.GetRebuilds()[0].GetBytesTotal() ||
		rbs.GetRebuilds()[0].GetFinishedUnixNano() == 0 {
		t.Fatalf("rebuilds %v", rbs.GetRebuilds())
	}
	m, err := r.c.Metrics(c, &enginev1.MetricsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if m.GetWrite().GetOps() < 1 || m.GetWrite().GetBytes() < 64<<10 || len(m.GetLatencyBoundsNs()) != len(engine.LatencyBuckets) || len(m.GetReplicas()) != 2 {
		t.Fatalf("metrics %v", m)
	}
}

// TestWatchIdleAsksNoReplica: an engine whose status is watched (every
// attached volume's is, by the engine controller) does not look at its
// state on a tick while nothing happens, and asks its replica nothing;
// writes bring the data bytes in without any call (the sampler takes them
// again usageInterval after it last did).
func TestWatchIdleAsksNoReplica(t *testing.T) {
	r := newRig(t, 1)
	c := ctx(t)
	if err := r.e.WriteAt(c, bytes.Repeat([]byte{0x5a}, 64<<10), 0, true); err != nil {
		t.Fatal(err)
	}
	w, first := openWatch(t, r, c)
	// The sample at join and the sampler's first look; then nothing for
	// five watchIntervals (the window is what is observed, not a wait).
	asks, samples := r.srv.watch.asks.Load(), r.srv.watch.samples.Load()
	if asks == 0 {
		t.Fatalf("the first sample asked the replica nothing: status %v", first)
	}
	time.Sleep(5 * watchInterval)
	if got, n := r.srv.watch.asks.Load(), r.srv.watch.samples.Load(); got != asks || n > samples+1 {
		t.Fatalf("an idle watched engine took %d samples and asked its replica %d times in %s", n-samples, got-asks, 5*watchInterval)
	}
	// A write to new blocks shows in the data bytes without any call
	// through the server.
	if err := r.e.WriteAt(c, bytes.Repeat([]byte{0xa5}, 1<<20), 4<<20, true); err != nil {
		t.Fatal(err)
	}
	for {
		st, err := w.Recv()
		if err != nil {
			t.Fatalf("waiting for the data bytes to grow past %d: %v", first.GetActualSize(), err)
		}
		if st.GetActualSize() >= first.GetActualSize()+1<<20 {
			break
		}
	}
}

// TestWatchFollowsEngineChanges: what changes in the engine without a call
// through the server (a snapshot, a replica removed, as a rebuild or a
// failure would) reaches the stream by the engine's signal; the sampler's
// timer is set to an hour, so nothing else would bring it. A layer change
// brings the data bytes too, with the writes made just before it.
func TestWatchFollowsEngineChanges(t *testing.T) {
	r := newRig(t, 2)
	r.srv.watch.idle = time.Hour
	c := ctx(t)
	w, first := openWatch(t, r, c)
	until := func(what string, ok func(*enginev1.VolumeStatus) bool) *enginev1.VolumeStatus {
		t.Helper()
		for {
			st, err := w.Recv()
			if err != nil {
				t.Fatalf("waiting for %s: %v", what, err)
			}
			if ok(st) {
				return st
			}
		}
	}
	if err := r.e.WriteAt(c, bytes.Repeat([]byte{0xa5}, 1<<20), 4<<20, true); err != nil {
		t.Fatal(err)
	}
	if err := r.e.Snapshot(c, "direct"); err != nil {
		t.Fatal(err)
	}
	st := until("the snapshot", func(st *enginev1.VolumeStatus) bool {
		return slices.ContainsFunc(st.GetSnapshots(), func(s *enginev1.Snapshot) bool { return s.GetName() == "direct" })
	})
	if st.GetActualSize() < first.GetActualSize()+1<<20 {
		t.Fatalf("the status with the snapshot has %d data bytes, %d before a 1 MiB write to new blocks", st.GetActualSize(), first.GetActualSize())
	}
	gone := first.GetReplicas()[1].GetAddress()
	if err := r.e.RemoveReplica(c, gone); err != nil {
		t.Fatal(err)
	}
	until("the replica removed", func(st *enginev1.VolumeStatus) bool {
		return len(st.GetReplicas()) == 1 && st.GetReplicas()[0].GetAddress() != gone && st.GetRobustness() != first.GetRobustness()
	})
}
