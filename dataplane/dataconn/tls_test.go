package dataconn

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"math/big"
	"net"
	"sync"
	"testing"
	"time"
)

// testCA is a CA that issues certificates for the TLS tests.
type testCA struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	pool *x509.CertPool
}

func newTestCA(t testing.TB) *testCA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test ca"}, NotBefore: time.Now().Add(-time.Minute),
		NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, _ := x509.ParseCertificate(der)
	pool := x509.NewCertPool()
	pool.AddCert(cert)
	return &testCA{cert: cert, key: key, pool: pool}
}

// issue makes a certificate for server and client use, named name.
func (ca *testCA) issue(t testing.TB, name string) tls.Certificate {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(time.Now().UnixNano()), Subject: pkix.Name{CommonName: name}, DNSNames: []string{name},
		NotBefore: time.Now().Add(-time.Minute), NotAfter: time.Now().Add(time.Hour), KeyUsage: x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
}

// tlsPair is a server configuration requiring client certificates of ca,
// and a client configuration with one.
func tlsPair(t testing.TB, ca *testCA) (server, client *tls.Config) {
	server = &tls.Config{Certificates: []tls.Certificate{ca.issue(t, "replica")}, ClientAuth: tls.RequireAndVerifyClientCert, ClientCAs: ca.pool, MinVersion: tls.VersionTLS13}
	client = &tls.Config{Certificates: []tls.Certificate{ca.issue(t, "engine")}, RootCAs: ca.pool, ServerName: "replica", MinVersion: tls.VersionTLS13}
	return server, client
}

// TestTLS: a server with TLS and a key serves a client with both, and the
// bytes on the wire are not the data; a client without TLS, one without a
// certificate, one with another CA's, and one with TLS but not the key are
// refused, and the backend is unchanged.
func TestTLS(t *testing.T) {
	ca := newTestCA(t)
	serverTLS, clientTLS := tlsPair(t, ca)
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

	other := newTestCA(t)
	_, otherTLS := tlsPair(t, other)
	otherTLS.RootCAs = ca.pool // trusts the server; its own certificate is another CA's
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
