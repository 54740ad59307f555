package dataconn

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"io"
	"net"
	"testing"
	"time"

	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

func testKey(t testing.TB) []byte {
	t.Helper()
	k := make([]byte, KeySize)
	if _, err := rand.Read(k); err != nil {
		t.Fatal(err)
	}
	return k
}

// TestAuthGoldenBytes pins the handshake's layout.
func TestAuthGoldenBytes(t *testing.T) {
	var h Hello
	for i := range h.Nonce {
		h.Nonce[i] = byte(i)
	}
	want := "43524e4101000000" + "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f"
	if got := hex.EncodeToString(EncodeHello(h)); got != want {
		t.Fatalf("hello = %s, want %s", got, want)
	}
	if got := hex.EncodeToString(EncodeResult(true)); got != "43524e4101000000" {
		t.Fatalf("accepted = %s", got)
	}
	if got := hex.EncodeToString(EncodeResult(false)); got != "43524e4101010000" {
		t.Fatalf("refused = %s", got)
	}
	c := Challenge{Nonce: h.Nonce, Proof: h.Nonce}
	d, err := DecodeChallenge(EncodeChallenge(c))
	if err != nil || d != c {
		t.Fatalf("challenge round trip: %+v %v", d, err)
	}
	for _, bad := range [][]byte{
		EncodeHello(h)[:39],
		append([]byte("CRND"), EncodeHello(h)[4:]...), // a data frame's magic
		{}, // nothing
	} {
		if _, err := DecodeHello(bad); !errors.Is(err, ErrAuthMalformed) {
			t.Fatalf("hello %x: %v", bad, err)
		}
	}
	v2 := EncodeHello(h)
	v2[4] = 2
	if _, err := DecodeHello(v2); !errors.Is(err, ErrAuthMalformed) {
		t.Fatalf("version 2 hello: %v", err)
	}
	res := EncodeResult(true)
	res[5] = 7
	if _, err := DecodeResult(res); !errors.Is(err, ErrAuthMalformed) {
		t.Fatalf("result 7: %v", err)
	}
}

// authServer serves a memory backend on loopback TCP with key.
func authServer(t *testing.T, key []byte, opts ServerOptions) (string, *memBackend) {
	t.Helper()
	b := newMem(1 << 20)
	opts.Key = key
	srv := NewServer(b, opts)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = srv.Serve(l) }() // ErrServerClosed at Close
	t.Cleanup(func() { srv.Close() })
	return l.Addr().String(), b
}

// mustWrite writes b to nc, failing the test if it cannot.
func mustWrite(t *testing.T, nc net.Conn, b []byte) {
	t.Helper()
	if _, err := nc.Write(b); err != nil {
		t.Fatal(err)
	}
}

// mustReadN reads n bytes from nc, failing the test if it cannot.
func mustReadN(t *testing.T, nc net.Conn, n int) {
	t.Helper()
	if _, err := readN(nc, n); err != nil {
		t.Fatal(err)
	}
}

// refused says whether the server closed nc (reads EOF or a reset) rather
// than serving it, within a deadline.
func closedByServer(t *testing.T, nc net.Conn) bool {
	t.Helper()
	if err := nc.SetReadDeadline(deadline.After(10 * time.Second)); err != nil {
		t.Fatal(err)
	}
	var b [256]byte
	for {
		_, err := nc.Read(b[:])
		if err == nil {
			continue
		}
		var ne net.Error
		return !errors.As(err, &ne) || !ne.Timeout()
	}
}

// TestAuthRogueClients: a server with a key serves only clients holding
// it. Without a credential, with a wrong key or another volume's, with a
// replayed handshake or a truncated one, a client is disconnected before a
// frame is read, and the backend is never touched; the right key works.
func TestAuthRogueClients(t *testing.T) {
	key, other := testKey(t), testKey(t)
	addr, b := authServer(t, key, ServerOptions{HandshakeTimeout: time.Second})
	seed := bytes.Repeat([]byte{0xa5}, 1<<20)
	copy(b.data, seed)
	ctx := context.Background()

	// The right key: reads and writes work.
	c, err := Dial(ctx, "tcp", addr, ClientOptions{Key: key, Conns: 2})
	if err != nil {
		t.Fatalf("the volume's key refused: %v", err)
	}
	got := make([]byte, 4096)
	if err := c.ReadAt(ctx, got, 0); err != nil || !bytes.Equal(got, seed[:4096]) {
		t.Fatalf("read with the key: %v", err)
	}
	c.Close()

	write := make([]byte, HeaderSize+4096)
	PutHeader(write, &Header{Op: OpWrite, Seq: 1, Offset: 0, Length: 4096, PayloadLen: 4096, PayloadCRC: Checksum(write[HeaderSize:])})

	cases := map[string]func(t *testing.T){
		"no credential: a write frame first": func(t *testing.T) {
			nc, err := net.Dial("tcp", addr)
			if err != nil {
				t.Fatal(err)
			}
			defer nc.Close()
			mustWrite(t, nc, write)
			if !closedByServer(t, nc) {
				t.Fatal("not disconnected")
			}
		},
		"no credential: a client without a key": func(t *testing.T) {
			c, err := Dial(ctx, "tcp", addr, ClientOptions{Conns: 1, RequestTimeout: 2 * time.Second})
			if err != nil {
				return // refused at once
			}
			defer c.Close()
			if err := c.WriteAt(ctx, make([]byte, 4096), 0, false); err == nil {
				t.Fatal("a write without a key succeeded")
			}
		},
		"wrong key": func(t *testing.T) {
			_, err := Dial(ctx, "tcp", addr, ClientOptions{Key: other, Conns: 1})
			if !errors.Is(err, ErrAuthRefused) {
				t.Fatalf("err = %v, want ErrAuthRefused", err)
			}
		},
		"replayed handshake": func(t *testing.T) {
			// A recorded good exchange: the hello and the proof a holder
			// of the key sent.
			nc, err := net.Dial("tcp", addr)
			if err != nil {
				t.Fatal(err)
			}
			var hello Hello
			rand.Read(hello.Nonce[:])
			mustWrite(t, nc, EncodeHello(hello))
			buf, _ := readN(nc, challengeSize)
			ch, _ := DecodeChallenge(buf)
			proof := mac(key, clientLabel, ch.Nonce[:], hello.Nonce[:])
			mustWrite(t, nc, proof)
			if res, _ := readN(nc, resultSize); !bytes.Equal(res, EncodeResult(true)) {
				t.Fatalf("the genuine exchange was refused: %x", res)
			}
			nc.Close()
			// Replayed on a new connection: the server's nonce is new,
			// so the old proof fails.
			nc, err = net.Dial("tcp", addr)
			if err != nil {
				t.Fatal(err)
			}
			defer nc.Close()
			mustWrite(t, nc, EncodeHello(hello))
			mustReadN(t, nc, challengeSize)
			mustWrite(t, nc, proof)
			res, _ := readN(nc, resultSize)
			if ok, err := DecodeResult(res); ok || err != nil {
				t.Fatalf("replay: accepted=%v %v", ok, err)
			}
			_, _ = nc.Write(write) // may fail: the server is expected to have closed the connection
			if !closedByServer(t, nc) {
				t.Fatal("not disconnected after a refused proof")
			}
		},
		"truncated hello": func(t *testing.T) {
			nc, err := net.Dial("tcp", addr)
			if err != nil {
				t.Fatal(err)
			}
			defer nc.Close()
			mustWrite(t, nc, EncodeHello(Hello{})[:20])
			start := time.Now()
			if !closedByServer(t, nc) {
				t.Fatal("not disconnected")
			}
			if time.Since(start) > deadline.Scale(8*time.Second) {
				t.Fatal("a stalled handshake outlived the handshake timeout")
			}
		},
		"truncated proof": func(t *testing.T) {
			nc, err := net.Dial("tcp", addr)
			if err != nil {
				t.Fatal(err)
			}
			defer nc.Close()
			mustWrite(t, nc, EncodeHello(Hello{}))
			mustReadN(t, nc, challengeSize)
			mustWrite(t, nc, make([]byte, 10))
			if !closedByServer(t, nc) {
				t.Fatal("not disconnected")
			}
		},
	}
	for name, fn := range cases {
		t.Run(name, fn)
	}
	if !bytes.Equal(b.contents(), seed) {
		t.Fatal("the backend changed under rogue clients")
	}
}

// TestAuthClientRefusesAnImpostor: a client with the volume's key does not
// talk to a server that cannot prove it has the key (a rogue replica
// collecting writes).
func TestAuthClientRefusesAnImpostor(t *testing.T) {
	addr, _ := authServer(t, testKey(t), ServerOptions{})
	if _, err := Dial(context.Background(), "tcp", addr, ClientOptions{Key: testKey(t), Conns: 1}); !errors.Is(err, ErrAuthRefused) {
		t.Fatalf("err = %v, want ErrAuthRefused", err)
	}
	// A server without a key answers a hello with nothing useful: the
	// client fails its handshake instead of sending frames.
	b := newMem(1 << 20)
	srv := NewServer(b, ServerOptions{})
	l, _ := net.Listen("tcp", "127.0.0.1:0")
	go func() { _ = srv.Serve(l) }() // ErrServerClosed at Close
	defer srv.Close()
	if _, err := Dial(context.Background(), "tcp", l.Addr().String(), ClientOptions{Key: testKey(t), Conns: 1, HandshakeTimeout: time.Second}); err == nil {
		t.Fatal("a client with a key accepted a server without one")
	}
}

// TestAuthHandshakeFlood: idle connections beyond MaxHandshakes are closed
// at once, and once the stalled ones time out a genuine client gets in.
func TestAuthHandshakeFlood(t *testing.T) {
	key := testKey(t)
	addr, _ := authServer(t, key, ServerOptions{MaxHandshakes: 2, HandshakeTimeout: 500 * time.Millisecond})
	var idle []net.Conn
	for range 2 {
		nc, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer nc.Close()
		idle = append(idle, nc)
	}
	var err error
	var c *Client
	until := deadline.After(10 * time.Second)
	for time.Now().Before(until) {
		if c, err = Dial(context.Background(), "tcp", addr, ClientOptions{Key: key, Conns: 1}); err == nil {
			break
		}
		time.Sleep(20 * time.Millisecond) // poll interval
	}
	if err != nil {
		t.Fatalf("a genuine client never got in: %v", err)
	}
	c.Close()
	for _, nc := range idle {
		if !closedByServer(t, nc) {
			t.Fatal("an idle handshake was not closed")
		}
	}
}

// FuzzServerHandshake: whatever a client without the key sends, the
// server's handshake fails, within its timeout, without panicking.
func FuzzServerHandshake(f *testing.F) {
	f.Add([]byte{})
	f.Add(EncodeHello(Hello{}))
	f.Add(append(EncodeHello(Hello{}), make([]byte, proofSize)...))
	f.Add([]byte("CRND\x01"))
	key := make([]byte, KeySize)
	key[0] = 1
	f.Fuzz(func(t *testing.T, in []byte) {
		s, c := socketPair(t)
		defer c.Close()
		go func() {
			// The server may close first: its handshake's result is what is checked.
			_, _ = c.Write(in)
			_ = c.(*net.UnixConn).CloseWrite()
			_, _ = io.Copy(io.Discard, c)
		}()
		err := ServerHandshake(s, key, 2*time.Second)
		s.Close()
		if err == nil {
			t.Fatalf("accepted %x", in)
		}
	})
}

// FuzzAuthDecode: the decoders take any bytes without panicking, and what
// they accept encodes back to the same bytes.
func FuzzAuthDecode(f *testing.F) {
	f.Add(EncodeHello(Hello{}))
	f.Add(EncodeChallenge(Challenge{}))
	f.Add(EncodeResult(false))
	f.Fuzz(func(t *testing.T, in []byte) {
		if h, err := DecodeHello(in); err == nil && !bytes.Equal(EncodeHello(h), in) {
			t.Fatalf("hello %x re-encodes differently", in)
		}
		if c, err := DecodeChallenge(in); err == nil && !bytes.Equal(EncodeChallenge(c), in) {
			t.Fatalf("challenge %x re-encodes differently", in)
		}
		if ok, err := DecodeResult(in); err == nil && !bytes.Equal(EncodeResult(ok), in) {
			t.Fatalf("result %x re-encodes differently", in)
		}
	})
}
