package rawio

import (
	"bytes"
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// pair returns both ends of a real connection of the given network, the
// first wrapped.
func pair(t *testing.T, network string) (*Conn, net.Conn) {
	t.Helper()
	addr := "127.0.0.1:0"
	if network == "unix" {
		addr = filepath.Join(t.TempDir(), "s")
	}
	l, err := net.Listen(network, addr)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := l.Accept()
		if err != nil {
			close(accepted)
			return
		}
		accepted <- c
	}()
	nc, err := net.Dial(network, l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	peer, ok := <-accepted
	if !ok {
		t.Fatal("accept failed")
	}
	c, ok := Wrap(nc).(*Conn)
	if !ok {
		t.Fatalf("Wrap(%T) did not return a *Conn", nc)
	}
	t.Cleanup(func() { c.Close(); peer.Close() })
	return c, peer
}

func TestWrapWithoutDescriptorReturnsTheConn(t *testing.T) {
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	if got := Wrap(a); got != a {
		t.Fatalf("Wrap(net.Pipe end) = %T, want the conn itself", got)
	}
}

// Every byte written in buffers of every shape, with the socket filling
// up on the way (EAGAIN, partial writevs), arrives in order, in both
// directions and on both networks.
func TestConnCarriesStreamsBothWays(t *testing.T) {
	for _, network := range []string{"tcp", "unix"} {
		t.Run(network, func(t *testing.T) {
			c, peer := pair(t, network)
			rng := rand.New(rand.NewPCG(1, 2))
			var want bytes.Buffer
			var batches []net.Buffers
			for range 40 {
				var bufs net.Buffers
				for range rng.IntN(20) {
					b := make([]byte, rng.IntN(70000))
					for i := range b {
						b[i] = byte(rng.Uint32())
					}
					bufs = append(bufs, b)
					want.Write(b)
				}
				batches = append(batches, bufs)
			}
			many := make(net.Buffers, 3000) // more than one writev takes
			for i := range many {
				many[i] = []byte{byte(i), byte(i >> 8)}
				want.Write(many[i])
			}
			big := bytes.Repeat([]byte("cairn"), 4<<20/5) // far more than the socket buffer
			want.Write(big)
			batches = append(batches, many, net.Buffers{nil, big, {}})

			// The peer reads slowly, in small pieces, so the writer waits.
			got := make(chan []byte, 1)
			go func() {
				b, _ := io.ReadAll(io.LimitReader(peer, int64(want.Len())))
				got <- b
			}()
			for i, bufs := range batches {
				n := int64(0)
				for _, b := range bufs {
					n += int64(len(b))
				}
				w, err := c.WriteBuffers(&bufs)
				if err != nil || w != n {
					t.Fatalf("batch %d: WriteBuffers = %d, %v; want %d", i, w, err, n)
				}
				if len(bufs) != 0 {
					t.Fatalf("batch %d: %d buffers left unconsumed", i, len(bufs))
				}
			}
			if b := <-got; !bytes.Equal(b, want.Bytes()) {
				t.Fatalf("peer got %d bytes, want %d (or they differ)", len(b), want.Len())
			}

			// And back: Read in random sizes sees the peer's stream.
			back := bytes.Repeat([]byte{1, 2, 3, 4, 5, 6, 7}, 300000)
			go func() {
				if _, err := peer.Write(back); err != nil {
					t.Errorf("peer Write: %v", err)
				}
				peer.Close()
			}()
			var read bytes.Buffer
			buf := make([]byte, 1<<16)
			for {
				n, err := c.Read(buf[:1+rng.IntN(len(buf)-1)])
				read.Write(buf[:n])
				if errors.Is(err, io.EOF) {
					break
				}
				if err != nil {
					t.Fatalf("Read: %v", err)
				}
			}
			if !bytes.Equal(read.Bytes(), back) {
				t.Fatalf("read %d bytes, want %d (or they differ)", read.Len(), len(back))
			}
			if n, err := c.Read(buf); n != 0 || !errors.Is(err, io.EOF) {
				t.Fatalf("Read after EOF = %d, %v; want 0, EOF", n, err)
			}
		})
	}
}

func TestConnReadWaitsForData(t *testing.T) {
	c, peer := pair(t, "tcp")
	got := make(chan string, 1)
	go func() {
		b := make([]byte, 16)
		n, err := c.Read(b)
		if err != nil {
			got <- err.Error()
			return
		}
		got <- string(b[:n])
	}()
	select {
	case s := <-got:
		t.Fatalf("Read returned %q before anything was sent", s)
	default:
	}
	if _, err := peer.Write([]byte("late")); err != nil {
		t.Fatal(err)
	}
	if s := <-got; s != "late" {
		t.Fatalf("Read = %q, want %q", s, "late")
	}
}

func TestConnHonoursDeadlinesAndClose(t *testing.T) {
	c, peer := pair(t, "unix")
	if err := c.SetReadDeadline(time.Now().Add(20 * time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	_, err := c.Read(make([]byte, 8))
	var ne net.Error
	if !errors.Is(err, os.ErrDeadlineExceeded) || !errors.As(err, &ne) || !ne.Timeout() {
		t.Fatalf("Read past the deadline = %v, want a timeout", err)
	}
	if err := c.SetReadDeadline(time.Time{}); err != nil {
		t.Fatal(err)
	}

	// Close unblocks a waiting Read with net.ErrClosed.
	done := make(chan error, 1)
	go func() {
		_, err := c.Read(make([]byte, 8))
		done <- err
	}()
	c.Close()
	if err := <-done; !errors.Is(err, net.ErrClosed) {
		t.Fatalf("Read on a closed conn = %v, want net.ErrClosed", err)
	}
	if _, err := c.Write([]byte("x")); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("Write on a closed conn = %v, want net.ErrClosed", err)
	}
	_ = peer
}

func TestConnWriteToAGonePeerFails(t *testing.T) {
	c, peer := pair(t, "tcp")
	peer.Close()
	b := make([]byte, 64<<10)
	until := deadline.After(10 * time.Second)
	for {
		_, err := c.Write(b)
		if err != nil {
			var oe *net.OpError
			if !errors.As(err, &oe) || oe.Op != "write" {
				t.Fatalf("Write to a closed peer = %v (%T), want a *net.OpError for write", err, err)
			}
			return
		}
		if time.Now().After(until) {
			t.Fatal("writes to a closed peer kept succeeding")
		}
	}
}

func TestWriteBuffersFallsBackForOtherWriters(t *testing.T) {
	var w bytes.Buffer
	bufs := net.Buffers{[]byte("ab"), nil, []byte("cd")}
	n, err := WriteBuffers(&w, &bufs)
	if err != nil || n != 4 || w.String() != "abcd" || len(bufs) != 0 {
		t.Fatalf("WriteBuffers(bytes.Buffer) = %d, %v, %q, %d left", n, err, w.String(), len(bufs))
	}
}
