package engine_test

import (
	"context"
	"errors"
	"net"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/cairn-io/cairn/dataplane/engine"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// closedPort returns a loopback address nothing listens on.
func closedPort(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	return addr
}

// TestOpenErrorKeepsCauses: when no replica can be opened, Open waits
// for them until its context ends, and the error then carries each
// replica's own cause, reachable through errors.Is and status.Code: a
// refused data connection is ECONNREFUSED, a control API that cannot be
// reached is the gRPC status Unavailable, and the whole is ErrNoReplica
// and ErrReplicasMissing.
func TestOpenErrorKeepsCauses(t *testing.T) {
	open := func(addr string) error {
		// Open waits for the missing replica until this deadline: long
		// enough for the live data port's dial to complete on a loaded
		// machine (2 s was not, at a load of 50), so that the cause left is
		// the control API's.
		ctx, cancel := context.WithTimeout(context.Background(), deadline.Scale(10*time.Second))
		defer cancel()
		_, err := engine.Open(ctx, engine.Options{Replicas: []string{addr}, Dial: dialer(), WaitInterval: 100 * time.Millisecond})
		return err
	}
	t.Run("data connection refused", func(t *testing.T) {
		err := open(closedPort(t) + "," + closedPort(t))
		if !errors.Is(err, engine.ErrNoReplica) || !errors.Is(err, engine.ErrReplicasMissing) || !errors.Is(err, syscall.ECONNREFUSED) {
			t.Fatalf("open: %v: want ErrNoReplica, ErrReplicasMissing and ECONNREFUSED reachable through errors.Is", err)
		}
	})
	t.Run("control API unreachable", func(t *testing.T) {
		tr := startReplica(t, filepath.Join(t.TempDir(), "r"), 1<<20, "")
		addr := tr.data + "," + closedPort(t) // a replica started without its control listener
		err := open(addr)
		if !errors.Is(err, engine.ErrNoReplica) || status.Code(err) != codes.Unavailable {
			t.Fatalf("open: %v: want ErrNoReplica and the gRPC status Unavailable (got code %v)", err, status.Code(err))
		}
		if !strings.Contains(err.Error(), addr) {
			t.Fatalf("open: %v: the message does not name the replica", err)
		}
	})
}

// counted wraps a real replica client: it counts its Close calls and,
// with failInfo, fails its Info calls.
type counted struct {
	engine.Replica
	failInfo bool
	closes   atomic.Int32
}

func (c *counted) Info(ctx context.Context) (engine.ReplicaInfo, error) {
	if c.failInfo {
		return engine.ReplicaInfo{}, errors.New("injected info failure")
	}
	return c.Replica.Info(ctx)
}

func (c *counted) Close() error {
	c.closes.Add(1)
	return c.Replica.Close()
}

// TestOpenClosesUnusableReplicas: a replica that fails at open (here its
// Info fails) or is left out (another size) is ERR with its reason, and
// its connection is closed then, not left open for the engine's life;
// Close closes every connection exactly once. The volume was served from
// the good replica alone before, so the one whose Info fails cannot hold
// newer data and Open does not wait for it.
func TestOpenClosesUnusableReplicas(t *testing.T) {
	good := startReplica(t, filepath.Join(t.TempDir(), "good"), 1<<20, "")
	noInfo := startReplica(t, filepath.Join(t.TempDir(), "noinfo"), 1<<20, "")
	small := startReplica(t, filepath.Join(t.TempDir(), "small"), 512<<10, "")
	first, err := engine.Open(context.Background(), engine.Options{Name: "test", Replicas: []string{good.addr}, Dial: dialer()})
	if err != nil {
		t.Fatal(err)
	}
	first.Close()
	var mu sync.Mutex
	clients := map[string]*counted{}
	dial := dialer()
	var e *engine.Engine
	e, err = engine.Open(context.Background(), engine.Options{Name: "test", Size: 1 << 20,
		Replicas: []string{good.addr, noInfo.addr, small.addr},
		Dial: func(ctx context.Context, addr string) (engine.Replica, error) {
			r, err := dial(ctx, addr)
			if err != nil {
				return nil, err
			}
			mu.Lock()
			defer mu.Unlock()
			c := &counted{Replica: r, failInfo: addr == noInfo.addr}
			clients[addr] = c
			return c, nil
		}})
	if err != nil {
		t.Fatal(err)
	}
	closed := false
	t.Cleanup(func() {
		if !closed {
			e.Close()
		}
	})
	st := map[string]engine.ReplicaStatus{}
	for _, r := range e.Replicas() {
		st[r.Address] = r
	}
	if st[good.addr].Mode != engine.ModeRW || st[noInfo.addr].Mode != engine.ModeERR || st[small.addr].Mode != engine.ModeERR {
		t.Fatalf("modes after open: %+v", st)
	}
	if !strings.Contains(st[noInfo.addr].Error, "injected info failure") || !strings.Contains(st[small.addr].Error, "size") {
		t.Fatalf("reasons after open: %+v", st)
	}
	for _, a := range []string{noInfo.addr, small.addr} {
		waitFor(t, "the connection to "+a+", unusable at open, closed", func() bool { return clients[a].closes.Load() == 1 })
	}
	if n := clients[good.addr].closes.Load(); n != 0 {
		t.Fatalf("the usable replica's connection was closed %d times at open", n)
	}
	e.Close()
	closed = true
	for a, c := range clients {
		if n := c.closes.Load(); n != 1 {
			t.Errorf("%s: connection closed %d times after Close, want 1", a, n)
		}
	}
}
