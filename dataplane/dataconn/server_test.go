package dataconn

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"runtime"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// sparseBackend is a volume far larger than memory that stores nothing:
// it records the largest buffer the server handed it, which is what the
// server allocated for the request, and the lengths it was asked to unmap.
type sparseBackend struct {
	size int64

	mu       sync.Mutex
	maxBuf   int
	reads    int
	unmapped []int64
}

func (b *sparseBackend) saw(p []byte) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.maxBuf = max(b.maxBuf, len(p))
}

func (b *sparseBackend) ReadAt(p []byte, off int64) (int, error) {
	b.saw(p)
	b.mu.Lock()
	b.reads++
	b.mu.Unlock()
	if off%7 == 3 {
		return 0, syscall.EIO // some requests fail, to exercise error replies
	}
	return len(p), nil
}

func (b *sparseBackend) WriteAt(p []byte, off int64) (int, error) {
	b.saw(p)
	if off%7 == 3 {
		return 0, syscall.ENOSPC
	}
	return len(p), nil
}

func (b *sparseBackend) Flush() error { return nil }

func (b *sparseBackend) Unmap(off, length int64) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.unmapped = append(b.unmapped, length)
	return nil
}

func (b *sparseBackend) Size() int64 { return b.size }

func (b *sparseBackend) ReadSnapshotAt(p []byte, name string, off int64) error {
	b.saw(p)
	if off%7 == 3 || name == "gone" {
		return fmt.Errorf("%w: no snapshot %q", CodeInvalid, name)
	}
	return nil
}

// rawConn serves b with opts on one end of a unix socket pair and returns
// the other end, to send frames by hand.
func rawConn(t *testing.T, b Backend, opts ServerOptions) net.Conn {
	t.Helper()
	srv := NewServer(b, opts)
	s, c := socketPair(t)
	srv.ServeConn(s)
	t.Cleanup(func() { c.Close(); srv.Close() })
	_ = c.SetDeadline(deadline.After(30 * time.Second))
	return c
}

// TestReadLongerThanMaxPayloadRefused: a read's length is the size of the
// reply the server allocates, so a read beyond the payload bound is
// refused as invalid before anything is allocated or read, however large
// the volume; a read of exactly the bound is served.
func TestReadLongerThanMaxPayloadRefused(t *testing.T) {
	const maxPayload = 1 << 20
	b := &sparseBackend{size: 1 << 50}
	c := rawConn(t, b, ServerOptions{MaxPayload: maxPayload, Workers: 2})

	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	for i, n := range []uint32{maxPayload + 1, 64 << 20, 1<<32 - 1} {
		f := roundTrip(t, c, Header{Op: OpRead, Seq: uint64(i + 1), Offset: 1 << 40, Length: n}, nil)
		if f.Op != OpRead.Reply() || f.Code != CodeInvalid || f.Length != 0 {
			t.Fatalf("read of %d bytes with a %d-byte bound: got %s code %q length %d, want an invalid reply",
				n, maxPayload, f.Op, f.Code, f.Length)
		}
	}
	runtime.ReadMemStats(&after)
	if grew := after.TotalAlloc - before.TotalAlloc; grew > 16<<20 {
		t.Fatalf("refusing three oversized reads allocated %d MiB", grew>>20)
	}
	b.mu.Lock()
	reads, maxBuf := b.reads, b.maxBuf
	b.mu.Unlock()
	if reads != 0 || maxBuf != 0 {
		t.Fatalf("the backend was asked to read %d times (largest buffer %d bytes); want none", reads, maxBuf)
	}

	// The connection still works, and a read of exactly the bound is served.
	f := roundTrip(t, c, Header{Op: OpRead, Seq: 10, Offset: 1 << 40, Length: maxPayload}, nil)
	if f.Code != CodeOK || len(f.Payload) != maxPayload {
		t.Fatalf("read of the bound: code %q, %d bytes", f.Code, len(f.Payload))
	}
	// An unmap allocates nothing: any length within the volume is fine.
	f = roundTrip(t, c, Header{Op: OpUnmap, Seq: 11, Offset: 0, Length: 1<<32 - 1}, nil)
	b.mu.Lock()
	unmapped := b.unmapped
	b.mu.Unlock()
	if f.Code != CodeOK || len(unmapped) != 1 || unmapped[0] != 1<<32-1 {
		t.Fatalf("4 GiB unmap: code %q, backend unmapped %v", f.Code, unmapped)
	}
}

// fuzzMaxPayload is the payload bound of the server FuzzServer drives.
const fuzzMaxPayload = 1 << 16

// fuzzFrames turns fuzz input into a stream of frames with valid
// checksums (random bytes would almost never pass the header checksum,
// and the fuzzer would only ever reach the decoder). Each frame is
// described by 19 bytes, followed by its payload:
//
//	0    op (any byte: unknown ops too)
//	1    flags (any byte)
//	2    code (any byte)
//	3    mangle: low 3 bits pick a corruption, the rest its position
//	4-11 offset
//	12-15 length
//	16-17 payload length (up to what the input has left)
//	18   seq
//
// The corruptions: 1 flips a header byte and leaves the checksum wrong, 2
// flips one and fixes the checksum (so field checks see it), 3 breaks the
// payload checksum, 4 ends the stream in the middle of this frame.
func fuzzFrames(in []byte) []byte {
	var out []byte
	for len(in) >= 19 {
		d := in[:19]
		in = in[19:]
		n := min(int(binary.BigEndian.Uint16(d[16:])), len(in))
		payload := in[:n]
		in = in[n:]
		h := Header{
			Op: Op(d[0]), Flags: Flags(d[1]), Code: Code(d[2]), Seq: uint64(d[18]),
			Offset: binary.BigEndian.Uint64(d[4:]), Length: binary.BigEndian.Uint32(d[12:]),
		}
		b := AppendFrame(nil, h, payload)
		at := int(d[3]>>3) % 44
		switch d[3] & 7 {
		case 1:
			b[at] ^= 0x5a
		case 2:
			b[at] ^= 0x5a
			binary.BigEndian.PutUint32(b[44:], Checksum(b[:44]))
		case 3:
			b[40] ^= 1
			binary.BigEndian.PutUint32(b[44:], Checksum(b[:44]))
		case 4:
			return append(out, b[:len(b)/2]...)
		}
		out = append(out, b...)
	}
	return out
}

// FuzzServer drives a server with arbitrary frames on a real socket: it
// must never panic, never hand the backend (that is, allocate) a buffer
// beyond the payload bound, whatever the lengths say, and answer only
// with well-formed replies within the bound.
func FuzzServer(f *testing.F) {
	desc := func(op Op, flags Flags, mangle uint8, off uint64, length uint32, payload []byte) []byte {
		d := make([]byte, 19, 19+len(payload))
		d[0], d[1], d[3] = byte(op), byte(flags), mangle
		binary.BigEndian.PutUint64(d[4:], off)
		binary.BigEndian.PutUint32(d[12:], length)
		binary.BigEndian.PutUint16(d[16:], uint16(len(payload)))
		return append(d, payload...)
	}
	cat := func(bs ...[]byte) []byte {
		var out []byte
		for _, b := range bs {
			out = append(out, b...)
		}
		return out
	}
	data := make([]byte, 4096)
	f.Add(desc(OpRead, 0, 0, 0, fuzzMaxPayload+1, nil))
	f.Add(desc(OpRead, 0, 0, 1<<40, 1<<28, nil))
	f.Add(cat(desc(OpWrite, FlagFUA, 0, 8192, 4096, data), desc(OpRead, 0, 0, 8192, 4096, nil),
		desc(OpFlush, 0, 0, 0, 0, nil), desc(OpUnmap, 0, 0, 0, 1<<30, nil), desc(OpPing, 0, 0, 0, 0, nil)))
	f.Add(cat(desc(OpWrite, FlagShared, 0, 0, 1<<20, make([]byte, 8)), desc(OpAttach, 0, 0, 0, 4096, nil)))
	f.Add(cat(desc(OpRead, 0, 0, 3, 512, nil), desc(OpWrite, 0, 0, 3, 512, data[:512])))
	f.Add(cat(desc(OpRead, 0, 2|5<<3, 0, 512, nil), desc(OpWrite, 0, 3, 0, 16, data[:16])))
	f.Add(cat(desc(OpRead, 0, 0, 0, 512, nil), desc(OpRead, 0, 4, 0, 512, nil)))
	f.Add(cat(desc(OpSnapshotRead, 0, 0, 0, 4096, []byte("s1")), desc(OpSnapshotRead, 0, 0, 1<<40, 1<<28, []byte("s1")),
		desc(OpSnapshotRead, 0, 0, 3, 512, []byte("gone")), desc(OpSnapshotRead, 0, 0, 0, 512, nil),
		desc(OpSnapshotRead, 0, 0, 0, 512, make([]byte, MaxSnapshotNameLen+1))))
	f.Fuzz(func(t *testing.T, in []byte) {
		b := &sparseBackend{size: 1 << 62}
		srv := NewServer(b, ServerOptions{MaxPayload: fuzzMaxPayload, Workers: 2})
		defer srv.Close()
		s, c := socketPair(t)
		defer c.Close()
		srv.ServeConn(s)
		_ = c.SetDeadline(deadline.After(20 * time.Second))
		go func() {
			_, _ = c.Write(fuzzFrames(in)) // fails once the server gives up on the stream
			_ = c.(*net.UnixConn).CloseWrite()
		}()
		for {
			fr, err := Decode(c, fuzzMaxPayload)
			if errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET) {
				break
			}
			if err != nil {
				t.Fatalf("reading the server's replies: %v", err)
			}
			if !fr.Op.IsReply() {
				t.Fatalf("the server sent a request: %s", fr.Op)
			}
			if fr.Code == CodeOK && (fr.Op == OpRead.Reply() || fr.Op == OpSnapshotRead.Reply()) && fr.Length > fuzzMaxPayload {
				t.Fatalf("read reply of %d bytes, bound %d", fr.Length, fuzzMaxPayload)
			}
		}
		b.mu.Lock()
		maxBuf := b.maxBuf
		b.mu.Unlock()
		if maxBuf > fuzzMaxPayload {
			t.Fatalf("the server handed the backend a %d-byte buffer; bound %d", maxBuf, fuzzMaxPayload)
		}
	})
}

// TestServeAfterCloseClosesListener: a Serve that comes after Close (one
// started in the background, late) closes its listener, so that a unix
// socket is not left accepting connections no one serves.
func TestServeAfterCloseClosesListener(t *testing.T) {
	l, _ := listenUnix(t)
	srv := NewServer(newMem(1<<20), ServerOptions{})
	srv.Close()
	if err := srv.Serve(l); !errors.Is(err, ErrServerClosed) {
		t.Fatalf("Serve after Close: %v, want ErrServerClosed", err)
	}
	if _, err := l.Accept(); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("the listener is still open after Serve returned: Accept gave %v", err)
	}
}
