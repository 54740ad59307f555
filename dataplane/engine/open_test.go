package engine_test

import (
	"context"
	"errors"
	"net"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/cairn-io/cairn/dataplane/engine"
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

// TestOpenErrorKeepsCauses: when no replica can be opened, the error
// carries each replica's own cause, reachable through errors.Is and
// status.Code (it used to be flattened into text): a refused data
// connection is ECONNREFUSED, a control API that cannot be reached is the
// gRPC status Unavailable, and the whole is ErrNoReplica.
func TestOpenErrorKeepsCauses(t *testing.T) {
	ctx := context.Background()
	t.Run("data connection refused", func(t *testing.T) {
		_, err := engine.Open(ctx, engine.Options{Replicas: []string{closedPort(t) + "," + closedPort(t)}, Dial: dialer()})
		if !errors.Is(err, engine.ErrNoReplica) || !errors.Is(err, syscall.ECONNREFUSED) {
			t.Fatalf("open: %v: want ErrNoReplica and ECONNREFUSED reachable through errors.Is", err)
		}
	})
	t.Run("control API unreachable", func(t *testing.T) {
		tr := startReplica(t, filepath.Join(t.TempDir(), "r"), 1<<20, "")
		addr := tr.data + "," + closedPort(t) // a replica started without its control listener
		_, err := engine.Open(ctx, engine.Options{Replicas: []string{addr}, Dial: dialer()})
		if !errors.Is(err, engine.ErrNoReplica) || status.Code(err) != codes.Unavailable {
			t.Fatalf("open: %v: want ErrNoReplica and the gRPC status Unavailable (got code %v)", err, status.Code(err))
		}
		if !strings.Contains(err.Error(), addr) {
			t.Fatalf("open: %v: the message does not name the replica", err)
		}
	})
}
