package dataconn

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"runtime"
	"testing"
)

// snapMem is memBackend with frozen snapshots: the view at each is a copy
// of the data taken when it was made.
type snapMem struct {
	*memBackend
	snaps map[string][]byte
	reads int // snapshot reads the backend ran
}

func (m *snapMem) snapshot(name string) { m.snaps[name] = m.contents() }

func (m *snapMem) ReadSnapshotAt(p []byte, name string, off int64) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.reads++
	v, ok := m.snaps[name]
	if !ok {
		return fmt.Errorf("%w: no snapshot %q", CodeInvalid, name)
	}
	copy(p, v[off:])
	return nil
}

// noSnapshots hides a backend's snapshot reads: a replica that does not
// serve them.
type noSnapshots struct{ Backend }

// TestSnapshotRead reads a snapshot's view over the wire: the bytes frozen
// at the snapshot, not the data written since, whatever epoch the client
// carries; a missing snapshot is the backend's typed error and leaves the
// client working.
func TestSnapshotRead(t *testing.T) {
	ctx := context.Background()
	m := &snapMem{memBackend: newMem(1 << 20), snaps: map[string][]byte{}}
	m.epoch = 3
	cl := pipePair(t, m, 2, ClientOptions{})
	cl.SetEpoch(3)
	old := bytes.Repeat([]byte("frozen"), 2000)
	if err := cl.WriteAt(ctx, old, 8192, false); err != nil {
		t.Fatal(err)
	}
	m.snapshot("s1")
	if err := cl.WriteAt(ctx, bytes.Repeat([]byte("later!"), 2000), 8192, false); err != nil {
		t.Fatal(err)
	}
	cl.SetEpoch(99) // stale for reads and writes, irrelevant to a snapshot
	got := make([]byte, len(old))
	if err := cl.ReadSnapshotAt(ctx, got, "s1", 8192); err != nil || !bytes.Equal(got, old) {
		t.Fatalf("snapshot read: %v, equal to the frozen bytes %v", err, bytes.Equal(got, old))
	}
	if err := cl.ReadAt(ctx, got[:4096], 0); !errors.Is(err, CodeStaleEpoch) {
		t.Fatalf("a read at a stale epoch: %v, want stale epoch", err)
	}
	if err := cl.ReadSnapshotAt(ctx, got, "nope", 8192); !errors.Is(err, CodeInvalid) {
		t.Fatalf("missing snapshot: %v, want invalid", err)
	}
	if err := cl.Ping(ctx); err != nil {
		t.Fatalf("the client failed after an error reply: %v", err)
	}
}

// TestSnapshotReadUnsupported: a backend without snapshot reads answers
// CodeUnsupported, and the connection goes on.
func TestSnapshotReadUnsupported(t *testing.T) {
	ctx := context.Background()
	cl := pipePair(t, noSnapshots{newMem(1 << 20)}, 1, ClientOptions{})
	if err := cl.ReadSnapshotAt(ctx, make([]byte, 4096), "s1", 0); !errors.Is(err, CodeUnsupported) {
		t.Fatalf("got %v, want unsupported", err)
	}
	if err := cl.Ping(ctx); err != nil {
		t.Fatalf("the client failed after an unsupported reply: %v", err)
	}
}

// TestSnapshotReadBounds: the client refuses a read it could not take the
// reply of and a name the server would refuse, before sending; the server
// refuses a read longer than its payload bound (nothing allocated, the
// backend not called) or past the volume's end, and a frame whose name is
// too long ends the stream.
func TestSnapshotReadBounds(t *testing.T) {
	ctx := context.Background()
	m := &snapMem{memBackend: newMem(1 << 20), snaps: map[string][]byte{"s1": make([]byte, 1<<20)}}
	cl := pipePair(t, m, 1, ClientOptions{MaxPayload: 64 << 10})
	for _, tc := range []struct {
		what string
		n    int
		name string
	}{
		{"reply over the bound", 64<<10 + 1, "s1"},
		{"no bytes", 0, "s1"},
		{"no name", 4096, ""},
		{"name too long", 4096, string(make([]byte, MaxSnapshotNameLen+1))},
	} {
		if err := cl.ReadSnapshotAt(ctx, make([]byte, tc.n), tc.name, 0); err == nil {
			t.Errorf("%s: sent", tc.what)
		}
	}
	if err := cl.ReadSnapshotAt(ctx, make([]byte, 64<<10), "s1", 0); err != nil {
		t.Fatalf("a read of the bound: %v", err)
	}

	const maxPayload = 1 << 20
	b := &sparseBackend{size: 1 << 50}
	c := rawConn(t, b, ServerOptions{MaxPayload: maxPayload, Workers: 2})
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	for i, n := range []uint32{maxPayload + 1, 1<<32 - 1} {
		f := roundTrip(t, c, Header{Op: OpSnapshotRead, Seq: uint64(i + 1), Length: n}, []byte("s1"))
		if f.Code != CodeInvalid || f.Length != 0 {
			t.Fatalf("snapshot read of %d bytes: code %q, length %d; want invalid", n, f.Code, f.Length)
		}
	}
	f := roundTrip(t, c, Header{Op: OpSnapshotRead, Seq: 3, Offset: 1<<50 - 4096, Length: 8192}, []byte("s1"))
	if f.Code != CodeOutOfRange {
		t.Fatalf("snapshot read past the end: code %q, want out of range", f.Code)
	}
	runtime.ReadMemStats(&after)
	if grew := after.TotalAlloc - before.TotalAlloc; grew > 16<<20 {
		t.Fatalf("refusing oversized snapshot reads allocated %d MiB", grew>>20)
	}
	b.mu.Lock()
	maxBuf := b.maxBuf
	b.mu.Unlock()
	if maxBuf != 0 {
		t.Fatalf("the backend was handed a %d-byte buffer; want none", maxBuf)
	}
	f = roundTrip(t, c, Header{Op: OpSnapshotRead, Seq: 4, Length: maxPayload}, []byte("s1"))
	if f.Code != CodeOK || len(f.Payload) != maxPayload {
		t.Fatalf("snapshot read of the bound: code %q, %d bytes", f.Code, len(f.Payload))
	}
	if _, err := c.Write(AppendFrame(nil, Header{Op: OpSnapshotRead, Seq: 5, Length: 4096}, make([]byte, MaxSnapshotNameLen+1))); err != nil {
		t.Fatal(err)
	}
	if fr, err := Decode(c, DefaultMaxPayload); err == nil {
		t.Fatalf("a snapshot read with a %d-byte name was answered (%s code %q); want the stream closed", MaxSnapshotNameLen+1, fr.Op, fr.Code)
	}
}
