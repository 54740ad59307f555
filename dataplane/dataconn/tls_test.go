package dataconn

import (
	"bytes"
	"context"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/cairn-io/cairn/dataplane/internal/shm"
	"github.com/cairn-io/cairn/dataplane/testutil/testpki"
)

// TestTLS: a server with TLS and a key serves a client with both, and the
// bytes on the wire are not the data; a client without TLS, one without a
// certificate, one with another CA's, and one with TLS but not the key are
// refused, and the backend is unchanged.
func TestTLS(t *testing.T) {
	ca := testpki.New(t)
	serverTLS, clientTLS := ca.Pair(t, "engine")
	key := testKey(t)
	addr, b := authServer(t, key, ServerOptions{HandshakeTimeout: 2 * time.Second, TLS: serverTLS})
	seed := bytes.Repeat([]byte{0xa5}, 1<<20)
	copy(b.data, seed)
	ctx := context.Background()

	// Through a recording proxy: what crosses the network is ciphertext.
	proxy, wire := recordingProxy(t, addr)
	c, err := Dial(ctx, "tcp", proxy, ClientOptions{Key: key, TLS: clientTLS, Conns: 2})
	if err != nil {
		t.Fatalf("TLS and the key refused: %v", err)
	}
	data := bytes.Repeat([]byte("plaintext on the data port "), 4096/27+1)[:4096]
	if err := c.WriteAt(ctx, data, 8192, false); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 4096)
	if err := c.ReadAt(ctx, got, 8192); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("read back over TLS: %v", err)
	}
	c.Close()
	if bytes.Contains(wire(), []byte("plaintext on the data port")) {
		t.Fatal("the data crossed the network in the clear")
	}
	copy(seed[8192:], data)

	other := testpki.New(t)
	_, otherTLS := other.Pair(t, "engine")
	otherTLS.RootCAs = ca.Pool // trusts the server; its own certificate is another CA's
	noCert := clientTLS.Clone()
	noCert.Certificates = nil
	for name, opts := range map[string]ClientOptions{
		"no TLS":                      {Key: key},
		"TLS without a certificate":   {Key: key, TLS: noCert},
		"a certificate of another CA": {Key: key, TLS: otherTLS},
		"TLS without the key":         {TLS: clientTLS},
		"TLS with another key":        {Key: testKey(t), TLS: clientTLS},
	} {
		t.Run(name, func(t *testing.T) {
			opts.Conns, opts.HandshakeTimeout = 1, 2*time.Second
			assertRefused(t, func() (*Client, error) { return Dial(ctx, "tcp", addr, opts) })
		})
	}
	if !bytes.Equal(b.contents(), seed) {
		t.Fatal("a refused client changed the backend")
	}
}

// assertRefused fails the test unless the client dial returns is refused,
// either at the dial or at its first write. A TLS 1.3 client finishes its
// handshake before the server checks its certificate, so a refusal can
// show only on the first request.
func assertRefused(t *testing.T, dial func() (*Client, error)) {
	t.Helper()
	c, err := dial()
	if err == nil {
		err = c.WriteAt(context.Background(), make([]byte, 4096), 0, false)
		c.Close()
	}
	if err == nil {
		t.Fatal("served")
	}
}

// TestTLSPerListener: a server with TLS and a key serving a TCP and a
// unix listener serves TLS on TCP only. A TLS client with the key is
// served on TCP and a plain client with the key on the unix socket (with
// shared memory), and they see each other's writes; a plain client on TCP
// and a client without the key on the unix socket are refused.
func TestTLSPerListener(t *testing.T) {
	ca := testpki.New(t)
	serverTLS, clientTLS := ca.Pair(t, "engine")
	key := testKey(t)
	b := newMem(1 << 20)
	srv := NewServer(b, ServerOptions{Key: key, TLS: serverTLS, HandshakeTimeout: 2 * time.Second})
	tl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ul, path := listenUnix(t)
	for _, l := range []net.Listener{tl, ul} {
		go func() { _ = srv.Serve(l) }() // ErrServerClosed at Close
	}
	t.Cleanup(func() { srv.Close() })
	ctx := context.Background()

	overTCP, err := Dial(ctx, "tcp", tl.Addr().String(), ClientOptions{Key: key, TLS: clientTLS, Conns: 1})
	if err != nil {
		t.Fatalf("TLS client with the key on TCP refused: %v", err)
	}
	defer overTCP.Close()
	region := newRegion(t, 1<<20)
	arena := shm.NewArena(region)
	// A client's TLS config leaves unix connections plain, as an engine's does.
	overUnix, err := Dial(ctx, "unix", path, ClientOptions{Key: key, TLS: clientTLS, Shared: region, Conns: 1})
	if err != nil {
		t.Fatalf("plain client with the key on the unix socket refused: %v", err)
	}
	defer overUnix.Close()

	p := arena.Get(4096)
	copy(p, bytes.Repeat([]byte("through the unix socket "), 4096/24+1))
	if err := overUnix.WriteAt(ctx, p, 4096, true); err != nil {
		t.Fatalf("write on the unix socket: %v", err)
	}
	if overUnix.SharedWrites() != 1 {
		t.Fatal("the write on the unix socket did not go through shared memory")
	}
	got := make([]byte, 4096)
	if err := overTCP.ReadAt(ctx, got, 4096); err != nil || !bytes.Equal(got, p) {
		t.Fatalf("read back over TLS: %v (equal %v)", err, bytes.Equal(got, p))
	}
	arena.Put(p)
	data := bytes.Repeat([]byte{0x5a}, 4096)
	if err := overTCP.WriteAt(ctx, data, 8192, false); err != nil {
		t.Fatalf("write over TLS: %v", err)
	}
	if err := overUnix.ReadAt(ctx, got, 8192); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("read back on the unix socket: %v", err)
	}

	seed := b.contents()
	for name, dial := range map[string]func() (*Client, error){
		"plain client on TCP": func() (*Client, error) {
			return Dial(ctx, "tcp", tl.Addr().String(), ClientOptions{Key: key, Conns: 1, HandshakeTimeout: 2 * time.Second})
		},
		"no key on the unix socket": func() (*Client, error) {
			return Dial(ctx, "unix", path, ClientOptions{Conns: 1, HandshakeTimeout: 2 * time.Second})
		},
	} {
		t.Run(name, func(t *testing.T) { assertRefused(t, dial) })
	}
	if !bytes.Equal(b.contents(), seed) {
		t.Fatal("a refused client changed the backend")
	}
}

// recordingProxy forwards TCP connections to addr and records what the
// client sends.
func recordingProxy(t *testing.T, addr string) (string, func() []byte) {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	rec := &lockedBuffer{}
	go func() {
		for {
			in, err := l.Accept()
			if err != nil {
				return
			}
			out, err := net.Dial("tcp", addr)
			if err != nil {
				in.Close()
				continue
			}
			go func() { copyRecording(out, in, rec); out.Close() }()
			go func() { copyRecording(in, out, nil); in.Close() }()
		}
	}()
	return l.Addr().String(), rec.bytes
}

type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) bytes() []byte {
	l.mu.Lock()
	defer l.mu.Unlock()
	return bytes.Clone(l.b.Bytes())
}

// copyRecording copies src to dst, and into rec when it is not nil.
func copyRecording(dst, src net.Conn, rec *lockedBuffer) {
	buf := make([]byte, 64<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if rec != nil {
				rec.mu.Lock()
				rec.b.Write(buf[:n])
				rec.mu.Unlock()
			}
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}
