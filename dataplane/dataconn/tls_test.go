package dataconn

import (
	"bytes"
	"context"
	"net"
	"sync"
	"testing"
	"time"

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
			c, err := Dial(ctx, "tcp", addr, opts)
			if err == nil {
				// TLS 1.3 clients finish before the server checks their
				// certificate: the refusal shows on the first request.
				err = c.WriteAt(ctx, make([]byte, 4096), 0, false)
				c.Close()
			}
			if err == nil {
				t.Fatal("served")
			}
		})
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
