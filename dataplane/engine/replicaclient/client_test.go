package replicaclient_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	replicav1 "github.com/cairn-io/cairn/dataplane/api/replica/v1"
	"github.com/cairn-io/cairn/dataplane/engine"
	"github.com/cairn-io/cairn/dataplane/engine/replicaclient"
	"github.com/cairn-io/cairn/dataplane/replica"
	"github.com/cairn-io/cairn/dataplane/replica/replicaserver"
)

const size = 1 << 20

// listen listens on a free loopback port.
func listen(t *testing.T) net.Listener {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func openReplica(t *testing.T) *replica.Replica {
	t.Helper()
	r, err := replica.Open(filepath.Join(t.TempDir(), "r"), replica.Options{Size: size})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// serve runs r as cairn-data replica does: data on one listener, and the
// control API on another unless ctl is nil. It returns "DATA,CONTROL" (or
// the data address alone).
func serve(t *testing.T, r *replica.Replica, ctl net.Listener) string {
	t.Helper()
	data := listen(t)
	run := replicaserver.Start(r, replicaserver.Options{Data: data, Control: ctl})
	t.Cleanup(run.Kill)
	if ctl == nil {
		return data.Addr().String()
	}
	return data.Addr().String() + "," + ctl.Addr().String()
}

func dial(t *testing.T, d engine.Dialer, addr string) engine.Replica {
	t.Helper()
	c, err := d(context.Background(), addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// TestStaleEngineCannotChangeReplica: an engine that a newer one fenced
// out (its epoch 1, the replica's now 2) can change nothing on the
// replica: every change it sends carries its epoch and is refused, and it
// cannot take the replica back, neither with its old epoch nor with the
// new engine's (two engines reaching the same number).
func TestStaleEngineCannotChangeReplica(t *testing.T) {
	ctx := context.Background()
	r := openReplica(t)
	addr := serve(t, r, listen(t))
	old := dial(t, replicaclient.Dialer(replicaclient.Options{}), addr)
	if err := old.SetEpoch(ctx, engine.EpochState{Epoch: 1}); err != nil {
		t.Fatal(err)
	}
	if err := old.Snapshot(ctx, engine.SnapshotInfo{Name: "s1", UserCreated: true}); err != nil {
		t.Fatal(err)
	}
	newer := dial(t, replicaclient.Dialer(replicaclient.Options{}), addr)
	if err := newer.SetEpoch(ctx, engine.EpochState{Epoch: 2}); err != nil {
		t.Fatal(err)
	}
	before, err := newer.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		what string
		call func() error
	}{
		{"snapshot", func() error { return old.Snapshot(ctx, engine.SnapshotInfo{Name: "s2"}) }},
		{"delete snapshot", func() error { return old.DeleteSnapshot(ctx, "s1") }},
		{"revert", func() error { return old.Revert(ctx, "s1") }},
		{"expand", func() error { return old.Expand(ctx, 2*size) }},
		{"replace chain", func() error { return old.ReplaceChain(ctx, []engine.SnapshotInfo{{Name: "x"}}) }},
		{"layer write", func() error { return old.WriteLayer(ctx, "s1", make([]byte, 4096), 0) }},
		{"set its old epoch", func() error { return old.SetEpoch(ctx, engine.EpochState{Epoch: 1}) }},
		{"set the new engine's epoch", func() error { return old.SetEpoch(ctx, engine.EpochState{Epoch: 2}) }},
	} {
		err := tc.call()
		var se *replicaclient.StaleEpochError
		if !errors.Is(err, replicaclient.ErrStaleEpoch) || !errors.As(err, &se) || status.Code(err) != codes.FailedPrecondition {
			t.Errorf("%s by the fenced-out engine: %v, want a stale epoch refusal", tc.what, err)
			continue
		}
		if se.Replica != 2 || !strings.Contains(err.Error(), "epoch 2") {
			t.Errorf("%s: %v does not name the replica's epoch", tc.what, err)
		}
	}
	after, err := newer.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(after.Snapshots) != fmt.Sprint(before.Snapshots) || after.Size != before.Size || after.Epoch != 2 || after.Rebuilding {
		t.Fatalf("the fenced-out engine changed the replica:\nbefore %+v\nafter  %+v", before, after)
	}
	// The new engine's own changes go through, and so does setting its
	// epoch again (with other flags).
	if err := newer.SetEpoch(ctx, engine.EpochState{Epoch: 2, Degraded: true}); err != nil {
		t.Fatalf("the new engine sets its epoch again: %v", err)
	}
	if err := newer.Snapshot(ctx, engine.SnapshotInfo{Name: "s2"}); err != nil {
		t.Fatal(err)
	}
	if err := newer.Expand(ctx, 2*size); err != nil {
		t.Fatal(err)
	}
}

// TestChangeRefusedDuringOwnSetEpochIsSentAgain: a rebuild's layer write
// that reaches the replica just after the engine's own SetEpoch moved it
// to a newer epoch, but before the answer came back, is refused for the
// old epoch; the client sends it again with the new one instead of
// failing the rebuild.
func TestChangeRefusedDuringOwnSetEpochIsSentAgain(t *testing.T) {
	ctx := context.Background()
	r := openReplica(t)
	if err := r.Snapshot(replica.SnapshotOptions{Name: "s1"}); err != nil {
		t.Fatal(err)
	}
	applied, release, refused := make(chan struct{}), make(chan struct{}), make(chan struct{}, 1)
	hold := func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		resp, err := h(ctx, req)
		switch info.FullMethod {
		case replicav1.ReplicaService_SetEpoch_FullMethodName:
			if req.(*replicav1.SetEpochRequest).GetEpoch() == 2 {
				close(applied) // the replica is at epoch 2; the answer waits
				<-release
			}
		case replicav1.ReplicaService_LayerWrite_FullMethodName:
			if status.Code(err) == codes.FailedPrecondition {
				refused <- struct{}{}
			}
		}
		return resp, err
	}
	ctl := listen(t)
	gs := grpc.NewServer(grpc.UnaryInterceptor(hold))
	replicav1.RegisterReplicaServiceServer(gs, &replicaserver.Control{Replica: r})
	go func() { _ = gs.Serve(ctl) }() // nil after Stop at cleanup; a failure shows as the calls failing
	t.Cleanup(gs.Stop)
	data := listen(t)
	run := replicaserver.Start(r, replicaserver.Options{Data: data})
	t.Cleanup(run.Kill)

	unblock := sync.OnceFunc(func() { close(release) })
	t.Cleanup(unblock) // before gs.Stop, which waits for the held handler

	c := dial(t, replicaclient.Dialer(replicaclient.Options{}), data.Addr().String()+","+ctl.Addr().String())
	if err := c.SetEpoch(ctx, engine.EpochState{Epoch: 1, Degraded: true, Rebuilding: true}); err != nil {
		t.Fatal(err)
	}
	setDone := make(chan error, 1)
	go func() { setDone <- c.SetEpoch(ctx, engine.EpochState{Epoch: 2, Degraded: true, Rebuilding: true}) }()
	<-applied
	writeDone := make(chan error, 1)
	go func() { writeDone <- c.WriteLayer(ctx, "s1", make([]byte, 4096), 0) }()
	select {
	case <-refused: // sent with epoch 1 and refused; the client waits for its SetEpoch
	case err := <-writeDone:
		t.Fatalf("a layer write at epoch 1 to a replica at epoch 2 was not refused: %v", err)
	}
	unblock()
	if err := <-setDone; err != nil {
		t.Fatal(err)
	}
	if err := <-writeDone; err != nil {
		t.Fatalf("a layer write that raced the client's own SetEpoch: %v", err)
	}
	if ext, err := r.ReadLayer("s1", 0, 4096); err != nil || len(ext) != 1 {
		t.Fatalf("the layer write did not land: %v %v", ext, err)
	}
}

// freePortPair returns a listener on a port whose next port is free.
func freePortPair(t *testing.T) net.Listener {
	t.Helper()
	for range 50 {
		l := listen(t)
		port := l.Addr().(*net.TCPAddr).Port
		if next, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(port+1)); err == nil {
			next.Close()
			return l
		}
		l.Close()
	}
	t.Fatal("no port with a free next port")
	return nil
}

// TestDialWithoutControlAPINamesTheFlag: a replica started without
// --control-listen (no control listener, as cairn-data replica runs then)
// fails the dial with an error that names the control address it tried
// and the fix, for both address forms; DATA,CONTROL still reaches a
// control API on any port.
func TestDialWithoutControlAPINamesTheFlag(t *testing.T) {
	ctx := context.Background()
	d := replicaclient.Dialer(replicaclient.Options{QuickTimeout: 5 * time.Second})

	data := freePortPair(t)
	run := replicaserver.Start(openReplica(t), replicaserver.Options{Data: data})
	t.Cleanup(run.Kill)
	addr := data.Addr().String()
	port := data.Addr().(*net.TCPAddr).Port
	ctlAddr := "127.0.0.1:" + strconv.Itoa(port+1)
	c, err := d(ctx, addr)
	if err == nil {
		c.Close()
		t.Fatalf("dialing %s, which has no control API, succeeded", addr)
	}
	if !errors.Is(err, replicaclient.ErrNoControlAPI) {
		t.Errorf("dial %s: %v, want ErrNoControlAPI", addr, err)
	}
	for _, want := range []string{addr, ctlAddr, "--control-listen", "DATA,CONTROL"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("dial %s: %q does not mention %q", addr, err, want)
		}
	}

	other := listen(t) // a control address given explicitly, where nothing serves
	other.Close()
	explicit := addr + "," + other.Addr().String()
	if _, err := d(ctx, explicit); !errors.Is(err, replicaclient.ErrNoControlAPI) ||
		!strings.Contains(err.Error(), "--control-listen "+other.Addr().String()) {
		t.Errorf("dial %s: %v, want ErrNoControlAPI naming --control-listen %s", explicit, err, other.Addr())
	}

	good := serve(t, openReplica(t), listen(t))
	c = dial(t, d, good)
	if _, err := c.Info(ctx); err != nil {
		t.Fatalf("DATA,CONTROL: %v", err)
	}
}
