package dataconn

import (
	"bytes"
	"context"
	"encoding/binary"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cairn-io/cairn/dataplane/internal/shm"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// listenUnix listens on a unix socket in a temporary directory.
func listenUnix(t *testing.T) (net.Listener, string) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "data.sock")
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	return l, path
}

// unixServer serves b on a unix socket in a temporary directory.
func unixServer(t *testing.T, b Backend) string {
	t.Helper()
	l, path := listenUnix(t)
	srv := NewServer(b, ServerOptions{})
	go func() { _ = srv.Serve(l) }() // ErrServerClosed at Close
	t.Cleanup(func() { srv.Close() })
	return path
}

func newRegion(t *testing.T, size int) *shm.Region {
	t.Helper()
	r, err := shm.Create(t.Name(), size)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	return r
}

// sharedMappings counts this process's mappings of memfds named for the test.
func sharedMappings(t *testing.T) int {
	t.Helper()
	b, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		t.Fatal(err)
	}
	return strings.Count(string(b), "memfd:cairn-"+t.Name())
}

func TestSharedWritesOverUnix(t *testing.T) {
	ctx := context.Background()
	m := newMem(4 << 20)
	path := unixServer(t, m)
	region := newRegion(t, 8<<20)
	arena := shm.NewArena(region)
	cl, err := Dial(ctx, "unix", path, ClientOptions{Conns: 3, Shared: region})
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	if n := sharedMappings(t); n != 1+3 {
		t.Fatalf("%d mappings of the region, want the client's and one per server connection (4)", n)
	}

	// Writes of several sizes from the arena travel as references.
	want := make([]byte, 4<<20)
	off := int64(0)
	for i, n := range []int{4096, 512, 128 << 10, 1 << 20, 12288} {
		p := arena.Get(n)
		for j := range p {
			p[j] = byte(rand.Uint32())
		}
		if err := cl.WriteAt(ctx, p, off, i%2 == 0); err != nil {
			t.Fatalf("shared write %d: %v", i, err)
		}
		copy(want[off:], p)
		arena.Put(p)
		off += int64(n)
	}
	if got := cl.SharedWrites(); got != 5 {
		t.Fatalf("SharedWrites = %d, want 5", got)
	}
	// A write from the heap travels in the frame, as before.
	heap := bytes.Repeat([]byte("heap"), 1024)
	if err := cl.WriteAt(ctx, heap, off, false); err != nil {
		t.Fatal(err)
	}
	copy(want[off:], heap)
	if got := cl.SharedWrites(); got != 5 {
		t.Fatalf("a heap write went by reference (SharedWrites = %d)", got)
	}
	// Part of an arena buffer (the engine splits large writes) works too.
	p := arena.Get(256 << 10)
	for j := range p {
		p[j] = byte(j * 7)
	}
	if err := cl.WriteAt(ctx, p[64<<10:192<<10], 3<<20, false); err != nil {
		t.Fatal(err)
	}
	copy(want[3<<20:], p[64<<10:192<<10])
	arena.Put(p)

	got := make([]byte, len(want))
	if err := cl.ReadAt(ctx, got, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("data read back differs from what was written")
	}
	if !bytes.Equal(m.contents(), want) {
		t.Fatal("backend holds different data")
	}

	// Closing the client lets the server unmap the region.
	cl.Close()
	until := deadline.After(10 * time.Second)
	for sharedMappings(t) != 1 {
		if time.Now().After(until) {
			t.Fatalf("server still maps the region after the client closed (%d mappings)", sharedMappings(t))
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestSharedIsNotOfferedOverTCP(t *testing.T) {
	ctx := context.Background()
	region := newRegion(t, 1<<20)
	cl, _, _ := tcpPair(t, newMem(1<<20), ClientOptions{Conns: 2, Shared: region})
	p := shm.NewArena(region).Get(4096)
	copy(p, "over tcp")
	if err := cl.WriteAt(ctx, p, 0, false); err != nil {
		t.Fatal(err)
	}
	if cl.SharedWrites() != 0 {
		t.Fatal("a TCP client sent a shared-memory reference")
	}
	got := make([]byte, 8)
	if err := cl.ReadAt(ctx, got, 0); err != nil || string(got) != "over tcp" {
		t.Fatalf("read back %q, %v", got, err)
	}
}

// rawUnix dials the server without a Client, to send frames by hand.
func rawUnix(t *testing.T, path string) *net.UnixConn {
	t.Helper()
	c, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	_ = c.SetDeadline(deadline.After(30 * time.Second))
	return c.(*net.UnixConn)
}

func roundTrip(t *testing.T, c net.Conn, h Header, payload []byte, fds ...int) Frame {
	t.Helper()
	b := AppendFrame(nil, h, payload)
	var err error
	if len(fds) > 0 {
		_, _, err = c.(*net.UnixConn).WriteMsgUnix(b, syscall.UnixRights(fds...), nil)
	} else {
		_, err = c.Write(b)
	}
	if err != nil {
		t.Fatal(err)
	}
	f, err := Decode(c, DefaultMaxPayload)
	if err != nil {
		t.Fatalf("reply to %s: %v", h.Op, err)
	}
	return f
}

func ref(off uint64) []byte { return binary.BigEndian.AppendUint64(nil, off) }

func TestSharedBadInputIsRefused(t *testing.T) {
	m := newMem(1 << 20)
	path := unixServer(t, m)
	region := newRegion(t, 1<<20)
	copy(region.Bytes(), bytes.Repeat([]byte{0xee}, 1<<20))
	wantCode := func(t *testing.T, f Frame, code Code, msg string) {
		t.Helper()
		if f.Code != code || !strings.Contains(string(f.Payload), msg) {
			t.Fatalf("reply %s code %v %q, want %v containing %q", f.Op, f.Code, f.Payload, code, msg)
		}
	}
	untouched := func(t *testing.T) {
		t.Helper()
		if d := m.contents(); !bytes.Equal(d, make([]byte, len(d))) {
			t.Fatal("a refused request changed the backend")
		}
	}

	t.Run("shared write without attach", func(t *testing.T) {
		c := rawUnix(t, path)
		f := roundTrip(t, c, Header{Op: OpWrite, Flags: FlagShared, Seq: 1, Length: 4096}, ref(0))
		wantCode(t, f, CodeInvalid, "attached none")
		untouched(t)
		if f := roundTrip(t, c, Header{Op: OpPing, Seq: 2}, nil); f.Code != CodeOK {
			t.Fatalf("connection unusable after a refused request: %v", f.Code)
		}
	})
	t.Run("reference outside the region", func(t *testing.T) {
		c := rawUnix(t, path)
		if f := roundTrip(t, c, Header{Op: OpAttach, Length: 1 << 20}, nil, region.FD()); f.Code != CodeOK {
			t.Fatalf("attach: %v %q", f.Code, f.Payload)
		}
		for _, r := range []struct {
			at  uint64
			len uint32
		}{{1 << 20, 4096}, {1<<20 - 4095, 4096}, {1<<64 - 4096, 8192}} {
			f := roundTrip(t, c, Header{Op: OpWrite, Flags: FlagShared, Seq: 3, Length: r.len}, ref(r.at))
			wantCode(t, f, CodeInvalid, "outside the region")
		}
		untouched(t)
		// The same connection still writes a reference that is inside.
		if f := roundTrip(t, c, Header{Op: OpWrite, Flags: FlagShared, Seq: 4, Offset: 8192, Length: 4096}, ref(0)); f.Code != CodeOK {
			t.Fatalf("valid shared write: %v %q", f.Code, f.Payload)
		}
		if d := m.contents(); d[8192] != 0xee || d[8192+4095] != 0xee || d[8191] != 0 || d[8192+4096] != 0 {
			t.Fatal("the valid shared write did not land exactly at its range")
		}
		if err := m.Unmap(0, m.Size()); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("attach that is not the first frame", func(t *testing.T) {
		c := rawUnix(t, path)
		roundTrip(t, c, Header{Op: OpPing, Seq: 1}, nil)
		f := roundTrip(t, c, Header{Op: OpAttach, Seq: 2, Length: 1 << 20}, nil, region.FD())
		wantCode(t, f, CodeInvalid, "first frame")
	})
	t.Run("attach without a descriptor", func(t *testing.T) {
		c := rawUnix(t, path)
		f := roundTrip(t, c, Header{Op: OpAttach, Length: 1 << 20}, nil)
		wantCode(t, f, CodeInvalid, "got 0 descriptors")
	})
	t.Run("attach of an unsealed memfd", func(t *testing.T) {
		fd, err := unix.MemfdCreate("unsealed", unix.MFD_CLOEXEC)
		if err != nil {
			t.Fatal(err)
		}
		defer unix.Close(fd)
		if err := unix.Ftruncate(fd, 1<<20); err != nil {
			t.Fatal(err)
		}
		c := rawUnix(t, path)
		f := roundTrip(t, c, Header{Op: OpAttach, Length: 1 << 20}, nil, fd)
		wantCode(t, f, CodeInvalid, "can still shrink")
	})
	t.Run("attach larger than the memfd", func(t *testing.T) {
		c := rawUnix(t, path)
		f := roundTrip(t, c, Header{Op: OpAttach, Length: 2 << 20}, nil, region.FD())
		wantCode(t, f, CodeInvalid, "announced")
	})
	t.Run("attach over TCP", func(t *testing.T) {
		_, _, addr := tcpPair(t, newMem(4096), ClientOptions{Conns: 1})
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		f := roundTrip(t, c, Header{Op: OpAttach, Length: 1 << 20}, nil)
		wantCode(t, f, CodeUnsupported, "unix socket")
	})
}

func TestSharedRefusedFallsBackToPlainWrites(t *testing.T) {
	// A server that refuses the attach (an older or differently built
	// replica) answers it with an error; the client then writes in frames.
	ctx := context.Background()
	m := newMem(1 << 20)
	srv := NewServer(m, ServerOptions{})
	defer srv.Close()
	l, path := listenUnix(t)
	defer l.Close()
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			f, err := Decode(c, DefaultMaxPayload)
			if err != nil || f.Op != OpAttach {
				c.Close()
				continue
			}
			if _, err := c.Write(AppendFrame(nil, Header{Op: OpAttach.Reply(), Code: CodeUnsupported}, []byte("not here"))); err != nil {
				c.Close()
				continue
			}
			srv.ServeConn(c)
		}
	}()
	region := newRegion(t, 1<<20)
	cl, err := Dial(ctx, "unix", path, ClientOptions{Conns: 2, Shared: region})
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	p := shm.NewArena(region).Get(4096)
	copy(p, "in a frame")
	if err := cl.WriteAt(ctx, p, 0, false); err != nil {
		t.Fatal(err)
	}
	if cl.SharedWrites() != 0 {
		t.Fatal("the client sent a reference to a server that refused the region")
	}
	if d := m.contents(); string(d[:10]) != "in a frame" {
		t.Fatalf("backend has %q", d[:10])
	}
}
