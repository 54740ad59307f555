package replicaclient_test

import (
	"bytes"
	"context"
	"errors"
	"net"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	replicav1 "github.com/cairn-io/cairn/dataplane/api/replica/v1"
	"github.com/cairn-io/cairn/dataplane/engine"
	"github.com/cairn-io/cairn/dataplane/engine/replicaclient"
	"github.com/cairn-io/cairn/dataplane/replica"
	"github.com/cairn-io/cairn/dataplane/replica/replicaserver"
)

// pullPair is a source replica with data in snapshot s1 (two extents
// with a hole between them, then more in the head) and an empty target
// with an empty s1, both served and dialed.
type pullPair struct {
	src, dst      *replica.Replica
	srcC, dstC    engine.Replica
	srcID, srcCtl string
	dstCtl        string
}

func newPullPair(t *testing.T) *pullPair {
	t.Helper()
	p := &pullPair{src: openReplica(t), dst: openReplica(t)}
	for _, w := range []struct {
		off int64
		b   byte
	}{{0, 1}, {64 << 10, 2}} {
		if _, err := p.src.WriteAt(bytes.Repeat([]byte{w.b}, 16<<10), w.off); err != nil {
			t.Fatal(err)
		}
	}
	for _, r := range []*replica.Replica{p.src, p.dst} {
		if err := r.Snapshot(replica.SnapshotOptions{Name: "s1"}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := p.src.WriteAt(bytes.Repeat([]byte{9}, 4096), 8192); err != nil { // after s1: not copied
		t.Fatal(err)
	}
	d := replicaclient.Dialer(replicaclient.Options{})
	srcAddr, dstAddr := serve(t, p.src, listen(t)), serve(t, p.dst, listen(t))
	_, p.srcCtl, _ = strings.Cut(srcAddr, ",")
	_, p.dstCtl, _ = strings.Cut(dstAddr, ",")
	p.srcC, p.dstC = dial(t, d, srcAddr), dial(t, d, dstAddr)
	in, err := p.srcC.Info(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	p.srcID = in.ID
	return p
}

// TestPullLayer: a target pulls a snapshot's layer (its extents, holes
// left out) and the view at it (written whole, over stale data) from the
// source itself, and ends with the source's checksums; the engine's
// client returns the bytes written.
func TestPullLayer(t *testing.T) {
	ctx := context.Background()
	p := newPullPair(t)
	puller := p.dstC.(engine.LayerPuller)

	n, err := puller.PullLayer(ctx, p.srcC, p.srcID, "s1", 0, size, true)
	if err != nil || n != 32<<10 {
		t.Fatalf("layer pull: %d bytes written, %v; want %d", n, err, 32<<10)
	}
	want, _ := p.src.LayerChecksum("s1", 0, size)
	if got, err := p.dst.LayerChecksum("s1", 0, size); err != nil || got != want {
		t.Fatalf("target layer s1: checksum %08x (%v), the source's %08x", got, err, want)
	}

	// The view, written whole: stale data in the target where the source
	// has a hole is overwritten with zeros.
	if err := p.dst.WriteLayer("s1", bytes.Repeat([]byte{7}, 4096), 32<<10); err != nil {
		t.Fatal(err)
	}
	n, err = puller.PullLayer(ctx, p.srcC, p.srcID, "s1", 0, 128<<10, false)
	if err != nil || n != 128<<10 {
		t.Fatalf("view pull: %d bytes written, %v; want %d", n, err, 128<<10)
	}
	want, _ = p.src.Checksum("s1", 0, 128<<10)
	if got, err := p.dst.Checksum("s1", 0, 128<<10); err != nil || got != want {
		t.Fatalf("target view at s1: checksum %08x (%v), the source's %08x", got, err, want)
	}
}

// TestPullLayerFallsBack: what a target cannot pull is ErrNoPull, saying
// why, so the engine copies the chunk itself: a source at the address
// that is another replica than the engine means, and a replica server
// without pulling (as one that predates it answers). Nothing is written.
func TestPullLayerFallsBack(t *testing.T) {
	ctx := context.Background()
	p := newPullPair(t)
	before, _ := p.dst.LayerChecksum("s1", 0, size)

	_, err := p.dstC.(engine.LayerPuller).PullLayer(ctx, p.srcC, "another-replica", "s1", 0, size, true)
	if !errors.Is(err, engine.ErrNoPull) || !strings.Contains(err.Error(), "another-replica") {
		t.Fatalf("pull from a source of another ID: %v, want ErrNoPull naming the ID", err)
	}

	// A replica server that does not pull (Control without Sources).
	old := openReplica(t)
	if err := old.Snapshot(replica.SnapshotOptions{Name: "s1"}); err != nil {
		t.Fatal(err)
	}
	ctl := listen(t)
	gs := grpc.NewServer()
	replicav1.RegisterReplicaServiceServer(gs, &replicaserver.Control{Replica: old})
	go func() { _ = gs.Serve(ctl) }() // nil after Stop at cleanup; a failure shows as the call failing
	t.Cleanup(gs.Stop)
	data := listen(t)
	run := replicaserver.Start(old, replicaserver.Options{Data: data})
	t.Cleanup(run.Kill)
	oldC := dial(t, replicaclient.Dialer(replicaclient.Options{}), data.Addr().String()+","+ctl.Addr().String())
	_, err = oldC.(engine.LayerPuller).PullLayer(ctx, p.srcC, p.srcID, "s1", 0, size, true)
	if !errors.Is(err, engine.ErrNoPull) || !strings.Contains(err.Error(), "pulls no rebuild data") {
		t.Fatalf("pull into a replica server that does not pull: %v, want ErrNoPull saying so", err)
	}
	if ext, _ := old.ReadLayer("s1", 0, size); len(ext) != 0 {
		t.Fatal("a refused pull wrote into the target's layer")
	}
	if after, _ := p.dst.LayerChecksum("s1", 0, size); after != before {
		t.Fatal("a refused pull changed the target's layer")
	}
}

// TestLayerPullBoundsTheRequest: the call checks what it is given before
// it dials or reads anything: an oversized range, a source that is not
// HOST:PORT, a missing or oversized source ID are INVALID_ARGUMENT; a
// write this replica would refuse (stale epoch, unaligned, no such
// snapshot, past the end) is refused with its own code without the
// source being dialed; a source nobody serves is UNAVAILABLE naming it.
// The target's layer is unchanged.
func TestLayerPullBoundsTheRequest(t *testing.T) {
	ctx := context.Background()
	p := newPullPair(t)
	before, _ := p.dst.LayerChecksum("s1", 0, size)
	cc, err := grpc.NewClient(p.dstCtl, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	api := replicav1.NewReplicaServiceClient(cc)
	gone := listen(t)
	gone.Close()
	for _, tc := range []struct {
		name string
		req  *replicav1.LayerPullRequest
		code codes.Code
		says string
	}{
		{"too long", &replicav1.LayerPullRequest{Snapshot: "s1", Length: replicaserver.MaxSnapshotRead + 4096, Source: p.srcCtl, SourceId: p.srcID}, codes.InvalidArgument, "limited"},
		{"negative", &replicav1.LayerPullRequest{Snapshot: "s1", Length: -4096, Source: p.srcCtl, SourceId: p.srcID}, codes.InvalidArgument, "limited"},
		{"unix source", &replicav1.LayerPullRequest{Snapshot: "s1", Length: 4096, Source: "unix:/tmp/x.sock", SourceId: p.srcID}, codes.InvalidArgument, "HOST:PORT"},
		{"port out of range", &replicav1.LayerPullRequest{Snapshot: "s1", Length: 4096, Source: "127.0.0.1:70000", SourceId: p.srcID}, codes.InvalidArgument, "1..65535"},
		{"no source ID", &replicav1.LayerPullRequest{Snapshot: "s1", Length: 4096, Source: p.srcCtl}, codes.InvalidArgument, "ID"},
		{"nobody there", &replicav1.LayerPullRequest{Snapshot: "s1", Length: 4096, Source: gone.Addr().String(), SourceId: p.srcID}, codes.Unavailable, gone.Addr().String()},
		{"ID too long", &replicav1.LayerPullRequest{Snapshot: "s1", Length: 4096, Source: p.srcCtl, SourceId: strings.Repeat("x", 129)}, codes.InvalidArgument, "ID"},
		{"address too long", &replicav1.LayerPullRequest{Snapshot: "s1", Length: 4096, Source: strings.Repeat("a", 300) + ":1", SourceId: p.srcID}, codes.InvalidArgument, "at most"},
		// Checked on this replica before anything is dialed: the source
		// here is nobody, and the answer is not UNAVAILABLE.
		{"stale epoch", &replicav1.LayerPullRequest{Snapshot: "s1", Length: 4096, Source: gone.Addr().String(), SourceId: p.srcID, Epoch: 7}, codes.FailedPrecondition, "epoch"},
		{"unaligned", &replicav1.LayerPullRequest{Snapshot: "s1", Offset: 100, Length: 4096, Source: gone.Addr().String(), SourceId: p.srcID}, codes.InvalidArgument, "aligned"},
		{"no such snapshot here", &replicav1.LayerPullRequest{Snapshot: "nope", Length: 4096, Source: gone.Addr().String(), SourceId: p.srcID}, codes.NotFound, "nope"},
		{"past the end", &replicav1.LayerPullRequest{Snapshot: "s1", Offset: size, Length: 4096, Source: gone.Addr().String(), SourceId: p.srcID}, codes.OutOfRange, "offset"},
	} {
		_, err := api.LayerPull(ctx, tc.req)
		if status.Code(err) != tc.code || !strings.Contains(status.Convert(err).Message(), tc.says) {
			t.Errorf("%s: %v, want %v saying %q", tc.name, err, tc.code, tc.says)
		}
	}
	if after, _ := p.dst.LayerChecksum("s1", 0, size); after != before {
		t.Fatal("a refused pull changed the target's layer")
	}
}

// TestPullLayerSourceReplacedAtItsAddress: the source replica stops and
// another replica (another ID, other data) starts at the same ports; a
// pull that names the first one's ID does not read the second, though
// the target's connection to the address reconnects by itself: ErrNoPull,
// naming the ID found, and the target's layer unchanged.
func TestPullLayerSourceReplacedAtItsAddress(t *testing.T) {
	ctx := context.Background()
	p := newPullPair(t)
	src := openReplica(t)
	if _, err := src.WriteAt(bytes.Repeat([]byte{5}, 8192), 0); err != nil {
		t.Fatal(err)
	}
	if err := src.Snapshot(replica.SnapshotOptions{Name: "s1"}); err != nil {
		t.Fatal(err)
	}
	dl, cl := listen(t), listen(t)
	run := replicaserver.Start(src, replicaserver.Options{Data: dl, Control: cl})
	srcC := dial(t, replicaclient.Dialer(replicaclient.Options{}), dl.Addr().String()+","+cl.Addr().String())
	in, err := srcC.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	puller := p.dstC.(engine.LayerPuller)
	if _, err := puller.PullLayer(ctx, srcC, in.ID, "s1", 0, size, true); err != nil {
		t.Fatalf("pull from the first source: %v", err)
	}
	before, _ := p.dst.LayerChecksum("s1", 0, size)
	run.Kill()

	other := openReplica(t)
	if _, err := other.WriteAt(bytes.Repeat([]byte{6}, 8192), 0); err != nil {
		t.Fatal(err)
	}
	if err := other.Snapshot(replica.SnapshotOptions{Name: "s1"}); err != nil {
		t.Fatal(err)
	}
	dl2, cl2 := relisten(t, dl.Addr().String()), relisten(t, cl.Addr().String())
	run2 := replicaserver.Start(other, replicaserver.Options{Data: dl2, Control: cl2})
	t.Cleanup(run2.Kill)
	_, err = puller.PullLayer(ctx, srcC, in.ID, "s1", 0, size, true)
	if !errors.Is(err, engine.ErrNoPull) || !strings.Contains(err.Error(), other.ID()) {
		t.Fatalf("pull naming the first source's ID from the replica now at its address: %v, want ErrNoPull naming %s", err, other.ID())
	}
	if after, _ := p.dst.LayerChecksum("s1", 0, size); after != before {
		t.Fatal("the target's layer changed: it read the other replica")
	}
}

// relisten listens on addr again once its old socket has closed.
func relisten(t *testing.T, addr string) net.Listener {
	t.Helper()
	for range 200 {
		if l, err := net.Listen("tcp", addr); err == nil {
			return l
		}
		time.Sleep(10 * time.Millisecond) // the killed server's socket is closing
	}
	t.Fatalf("cannot listen on %s again", addr)
	return nil
}
