package snapshotsource

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"io"
	mrand "math/rand/v2"
	"net"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/cairn-io/cairn/dataplane/dataconn"
	"github.com/cairn-io/cairn/dataplane/replica"
	"github.com/cairn-io/cairn/dataplane/replica/replicaserver"
	"github.com/cairn-io/cairn/dataplane/testutil/testpki"
)

const testSize = 8 << 20

// served is a real replica served on loopback (data port with a key,
// control API) and the view its snapshot "s1" holds.
type served struct {
	r        *replica.Replica
	key      []byte
	control  string
	snapshot []byte
}

// serveReplica writes random data with holes into a replica, snapshots it
// as s1, writes over part of it after (the head: not in the view), and
// serves it with a data-port key.
func serveReplica(t *testing.T) *served { return serveReplicaTLS(t, nil) }

// serveReplicaTLS is serveReplica with the data port served with TLS
// (nil: without).
func serveReplicaTLS(t *testing.T, dataTLS *tls.Config) *served {
	t.Helper()
	r, err := replica.Open(t.TempDir(), replica.Options{Size: testSize, ClearDelay: -1})
	if err != nil {
		t.Fatal(err)
	}
	rng := mrand.New(mrand.NewPCG(7, 8))
	view := make([]byte, testSize)
	for _, w := range []struct{ off, n int64 }{{0, 3 << 20}, {4 << 20, 64 << 10}, {5<<20 + 8192, 4096}, {testSize - 1<<20, 1 << 20}} {
		p := make([]byte, w.n)
		for i := range p {
			p[i] = byte(rng.Uint32())
		}
		if _, err := r.WriteAt(p, w.off); err != nil {
			t.Fatal(err)
		}
		copy(view[w.off:], p)
	}
	if err := r.Snapshot(replica.SnapshotOptions{Name: "s1", UserCreated: true}); err != nil {
		t.Fatal(err)
	}
	if _, err := r.WriteAt(bytes.Repeat([]byte{0xaa}, 1<<20), 1<<20); err != nil {
		t.Fatal(err)
	}
	data, ctl := listen(t), listen(t)
	key := bytes.Repeat([]byte{0x42}, dataconn.KeySize)
	run := replicaserver.Start(r, replicaserver.Options{Data: data, Control: ctl, Key: key, DataTLS: dataTLS, Logger: logr.Discard()})
	t.Cleanup(func() { run.Kill() })
	return &served{r: r, key: key, control: ctl.Addr().String(), snapshot: view}
}

func listen(t *testing.T) net.Listener {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func dial(t *testing.T, s *served, dp *DataPort) *Client {
	t.Helper()
	c, err := Dial(s.control, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	c.DataPort = dp
	t.Cleanup(c.Close)
	return c
}

// readAll reads the view at s1 through c's Reader as the backup store
// does (whole 2 MiB blocks, several at once), then once more at unaligned
// edges, and compares both with what the snapshot holds.
func readAll(t *testing.T, s *served, c *Client) {
	t.Helper()
	rd := c.Reader(context.Background(), "s1", testSize)
	got := bytes.Repeat([]byte{0xee}, testSize) // holes must come back as zeros
	errs := make(chan error, testSize/(2<<20))
	for off := int64(0); off < testSize; off += 2 << 20 {
		go func() {
			_, err := rd.ReadAt(got[off:off+2<<20], off)
			errs <- err
		}()
	}
	for range testSize / (2 << 20) {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	if !bytes.Equal(got, s.snapshot) {
		t.Fatal("the blocks read differ from the view at the snapshot")
	}
	for _, tc := range []struct{ off, n int64 }{{5000, 5<<20 + 123}, {4095, 2}, {testSize - 100, 100}} {
		p := make([]byte, tc.n)
		if n, err := rd.ReadAt(p, tc.off); err != nil || int64(n) != tc.n || !bytes.Equal(p, s.snapshot[tc.off:tc.off+tc.n]) {
			t.Fatalf("read of %d bytes at %d: %d, %v; equal %v", tc.n, tc.off, n, err, bytes.Equal(p, s.snapshot[tc.off:tc.off+tc.n]))
		}
	}
	p := make([]byte, 8192)
	if n, err := rd.ReadAt(p, testSize-4096); n != 4096 || !errors.Is(err, io.EOF) || !bytes.Equal(p[:n], s.snapshot[testSize-4096:]) {
		t.Fatalf("read across the end: %d, %v", n, err)
	}
}

// TestReaderOverDataPort: with the volume's key, the snapshot's bytes come
// over the data port (the address the replica reports), exactly the view
// at the snapshot.
func TestReaderOverDataPort(t *testing.T) {
	s := serveReplica(t)
	c := dial(t, s, &DataPort{Key: s.key})
	readAll(t, s, c)
	if used, err := c.DataPortInUse(); !used || err != nil {
		t.Fatalf("data port in use: %v (%v), want true", used, err)
	}
}

// TestReaderOverDataPortWithTLS: a data port served with mutual TLS and
// the key is read with the client's certificate and the key, as the
// engine connects; a client without TLS is refused by the port and reads
// through the control API.
func TestReaderOverDataPortWithTLS(t *testing.T) {
	server, client := testpki.New(t).Pair(t, "backup")
	s := serveReplicaTLS(t, server)
	c := dial(t, s, &DataPort{Key: s.key, TLS: client})
	readAll(t, s, c)
	if used, err := c.DataPortInUse(); !used || err != nil {
		t.Fatalf("data port in use: %v (%v), want true", used, err)
	}
	c = dial(t, s, &DataPort{Key: s.key})
	readAll(t, s, c)
	if used, err := c.DataPortInUse(); used || err == nil {
		t.Fatalf("data port in use without TLS: %v (%v), want false with the reason", used, err)
	}
}

// TestReaderFallsBackToControlAPI: a data port that does not serve
// snapshot reads leaves the reads to SnapshotRead, which return the same
// bytes, and DataPortInUse says why.
func TestReaderFallsBackToControlAPI(t *testing.T) {
	s := serveReplica(t)
	t.Run("no data port", func(t *testing.T) {
		c := dial(t, s, nil)
		readAll(t, s, c)
		if used, err := c.DataPortInUse(); used || err != nil {
			t.Fatalf("data port in use: %v (%v), want false and no reason", used, err)
		}
	})
	t.Run("wrong key", func(t *testing.T) {
		c := dial(t, s, &DataPort{Key: bytes.Repeat([]byte{1}, dataconn.KeySize)})
		readAll(t, s, c)
		if used, err := c.DataPortInUse(); used || !errors.Is(err, dataconn.ErrAuthRefused) {
			t.Fatalf("data port in use: %v (%v), want false because the key was refused", used, err)
		}
	})
	t.Run("replica without snapshot reads", func(t *testing.T) {
		l := listen(t)
		srv := dataconn.NewServer(withoutSnapshotReads{replicaserver.Backend{Replica: s.r}}, dataconn.ServerOptions{})
		go func() { _ = srv.Serve(l) }() // ErrServerClosed at Close
		t.Cleanup(func() { srv.Close() })
		c := dial(t, s, &DataPort{Address: l.Addr().String()})
		readAll(t, s, c)
		if used, err := c.DataPortInUse(); used || !errors.Is(err, dataconn.CodeUnsupported) {
			t.Fatalf("data port in use: %v (%v), want false because the replica does not serve snapshot reads", used, err)
		}
	})
	t.Run("replica from before snapshot reads", func(t *testing.T) {
		// What a server from before the op does with it: the decoder
		// rejects the unknown op and the server closes the connection.
		addr := serveConns(t, func(nc net.Conn) {
			var hb [dataconn.HeaderSize]byte
			_, _ = io.ReadFull(nc, hb[:]) // the snapshot read's header, or the peer went
		})
		c := dial(t, s, &DataPort{Address: addr})
		readAll(t, s, c)
		if used, err := c.DataPortInUse(); used || !errors.Is(err, dataconn.ErrConnectionLost) {
			t.Fatalf("data port in use: %v (%v), want false because the connection was closed", used, err)
		}
	})
	t.Run("data port that never answers", func(t *testing.T) {
		// Accepts and reads, never writes: as a port whose replies a
		// network drops. The check gives up after CheckTimeout, not
		// after the calls' own timeout (2 minutes).
		addr := serveConns(t, func(nc net.Conn) { _, _ = io.Copy(io.Discard, nc) })
		c := dial(t, s, &DataPort{Address: addr, CheckTimeout: 300 * time.Millisecond})
		readAll(t, s, c)
		if used, err := c.DataPortInUse(); used || !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("data port in use: %v (%v), want false after the check's timeout", used, err)
		}
	})
}

// serveConns accepts connections on loopback until the test ends,
// handing each to handle and closing it after: a stand-in for a data
// port that misbehaves. It returns the address.
func serveConns(t *testing.T, handle func(net.Conn)) string {
	l := listen(t)
	go func() {
		for {
			nc, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer nc.Close()
				handle(nc)
			}()
		}
	}()
	t.Cleanup(func() { l.Close() })
	return l.Addr().String()
}

// withoutSnapshotReads hides a backend's snapshot reads.
type withoutSnapshotReads struct{ dataconn.EpochBackend }
