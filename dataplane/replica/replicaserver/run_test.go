package replicaserver

import (
	"bytes"
	"context"
	"errors"
	"net"
	"path/filepath"
	"testing"
	"time"

	"github.com/cairn-io/cairn/dataplane/dataconn"
	"github.com/cairn-io/cairn/dataplane/replica"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
	"github.com/cairn-io/cairn/dataplane/testutil/testpki"
)

// TestLocalListener: a replica started with a TCP data listener (with
// DataTLS and a key) and a Local unix one serves both: a plain client
// with the key writes through the socket and a TLS client reads the data
// back through the TCP port. Shutdown and Kill close both listeners.
func TestLocalListener(t *testing.T) {
	for name, stop := range map[string]func(*Running){
		"Shutdown": func(run *Running) { run.Shutdown(context.Background()) },
		"Kill":     (*Running).Kill,
	} {
		t.Run(name, func(t *testing.T) {
			ca := testpki.New(t)
			serverTLS, clientTLS := ca.Pair(t, "engine")
			key := make([]byte, dataconn.KeySize)
			key[0] = 7
			r, err := replica.Open(filepath.Join(t.TempDir(), "r"), replica.Options{Size: 1 << 20})
			if err != nil {
				t.Fatal(err)
			}
			sock := filepath.Join(t.TempDir(), "r.sock")
			local, err := net.Listen("unix", sock)
			if err != nil {
				t.Fatal(err)
			}
			data := listen(t)
			run := Start(r, Options{Data: data, Local: local, Key: key, DataTLS: serverTLS})
			t.Cleanup(run.Kill)
			ctx := context.Background()

			overUnix, err := dataconn.Dial(ctx, "unix", sock, dataconn.ClientOptions{Key: key, Conns: 1})
			if err != nil {
				t.Fatalf("the local socket refused a plain client with the key: %v", err)
			}
			defer overUnix.Close()
			overTCP, err := dataconn.Dial(ctx, "tcp", data.Addr().String(), dataconn.ClientOptions{Key: key, TLS: clientTLS, Conns: 1})
			if err != nil {
				t.Fatalf("the TCP port refused a TLS client with the key: %v", err)
			}
			defer overTCP.Close()
			want := bytes.Repeat([]byte("local"), 4096/5+1)[:4096]
			if err := overUnix.WriteAt(ctx, want, 8192, true); err != nil {
				t.Fatalf("write through the local socket: %v", err)
			}
			got := make([]byte, 4096)
			if err := overTCP.ReadAt(ctx, got, 8192); err != nil || !bytes.Equal(got, want) {
				t.Fatalf("read back through the TCP port: %v (equal %v)", err, bytes.Equal(got, want))
			}

			stop(run)
			if c, err := net.Dial("unix", sock); err == nil {
				c.Close()
				t.Fatal("the local socket still accepts connections after the replica stopped")
			}
			if c, err := net.Dial("tcp", data.Addr().String()); err == nil {
				c.Close()
				t.Fatal("the TCP port still accepts connections after the replica stopped")
			}
		})
	}
}

// brokenListener fails every Accept with an error that does not pass.
type brokenListener struct {
	net.Listener
}

func (brokenListener) Accept() (net.Conn, error) { return nil, errors.New("broken listener") }

// TestLocalListenerFailureStops: a local listener that fails for good
// stops the replica (Done), as a failed data listener does.
func TestLocalListenerFailureStops(t *testing.T) {
	r, err := replica.Open(filepath.Join(t.TempDir(), "r"), replica.Options{Size: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	local := listen(t)
	t.Cleanup(func() { local.Close() })
	run := Start(r, Options{Data: listen(t), Local: brokenListener{local}})
	t.Cleanup(run.Kill)
	select {
	case <-run.Done:
	case <-time.After(deadline.Scale(10 * time.Second)):
		t.Fatal("a failed local listener did not stop the replica")
	}
}
