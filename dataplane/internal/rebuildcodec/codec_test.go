package rebuildcodec

import (
	"bytes"
	"testing"
	"unsafe"

	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	replicav1 "github.com/cairn-io/cairn/dataplane/api/replica/v1"
)

// split cuts b into pieces of n bytes, as the transport hands a message
// to the codec in frames.
func split(b []byte, n int) mem.BufferSlice {
	var s mem.BufferSlice
	for len(b) > 0 {
		k := min(n, len(b))
		s = append(s, mem.SliceBuffer(b[:k]))
		b = b[k:]
	}
	return s
}

// frames are the frame sizes a message of n bytes is tried in: 16 KiB
// (gRPC's), all in one, and an odd size that cuts fields anywhere: 7
// bytes for a short message, 4093 for a long one (7-byte frames of 4 MiB
// would make the test slow for nothing).
func frames(n int) []int {
	if n < 64<<10 {
		return []int{16 << 10, n + 1, 7}
	}
	return []int{16 << 10, n + 1, 4093}
}

func data(n int) []byte {
	p := make([]byte, n)
	for i := range p {
		p[i] = byte(i*7 + i>>9)
	}
	return p
}

// referenced reports whether one of out's buffers starts at p's first
// byte.
func referenced(out mem.BufferSlice, p []byte) bool {
	for _, b := range out {
		if d := b.ReadOnlyData(); len(d) > 0 && &d[0] == &p[0] {
			return true
		}
	}
	return false
}

// aliases reports whether p lies in msg.
func aliases(msg, p []byte) bool {
	start, end := uintptr(unsafe.Pointer(unsafe.SliceData(msg))), uintptr(unsafe.Pointer(unsafe.SliceData(msg)))+uintptr(len(msg))
	at := uintptr(unsafe.Pointer(unsafe.SliceData(p)))
	return at >= start && at < end
}

// TestMarshalLayerWrite: a LayerWriteRequest marshalled by the fast path
// reads back the same through the proto codec, and sends its data without
// copying it.
func TestMarshalLayerWrite(t *testing.T) {
	c := New(Options{})
	for _, m := range []*replicav1.LayerWriteRequest{
		{Snapshot: "rebuild-7-1", Offset: 12 << 20, Data: data(4 << 20), Epoch: 9},
		{Snapshot: "s", Data: data(4096)},
		{Offset: -1, Data: data(1), Epoch: 1 << 63},
		{Snapshot: "empty", Offset: 4096, Epoch: 3},
	} {
		out, err := c.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		got := &replicav1.LayerWriteRequest{}
		if err := proto.Unmarshal(out.Materialize(), got); err != nil || !proto.Equal(got, m) {
			t.Fatalf("%v: read back %v (%v)", m, got, err)
		}
		if len(m.Data) > 0 && !referenced(out, m.Data) {
			t.Fatalf("%q: the data was copied", m.Snapshot)
		}
	}
}

// TestMarshalSnapshotRead: the fast path writes a SnapshotReadResponse
// byte for byte as the proto codec does, referencing large extents' data
// instead of copying it.
func TestMarshalSnapshotRead(t *testing.T) {
	c := New(Options{})
	for _, m := range []*replicav1.SnapshotReadResponse{
		{},
		{Extents: []*replicav1.Extent{{Offset: 0, Data: data(4096)}}},
		{Extents: []*replicav1.Extent{{Offset: 8192, Data: data(1 << 20)}, {Offset: 4 << 20, Data: data(3 << 20)}, {Offset: 5}, {Offset: 6, Data: data(10)}}},
		{Extents: []*replicav1.Extent{{Offset: -4096, Data: data(100)}, {}}},
	} {
		out, err := c.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		want, err := proto.MarshalOptions{Deterministic: true}.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		if got := out.Materialize(); !bytes.Equal(got, want) {
			t.Fatalf("%d extents: the fast path wrote %d bytes, unlike the proto codec's %d", len(m.Extents), len(got), len(want))
		}
		for _, x := range m.Extents {
			if len(x.Data) >= copyBelow && !referenced(out, x.Data) {
				t.Fatalf("an extent of %d bytes was copied", len(x.Data))
			}
		}
	}
}

// TestUnmarshalSnapshotRead: a SnapshotReadResponse as the replica writes
// it decodes the same on the fast path, whatever the frames it arrives in,
// its extents' data pointing into the received message; one holding a
// field the fast path does not know goes through proto, and a truncated
// one is an error.
func TestUnmarshalSnapshotRead(t *testing.T) {
	c := New(Options{})
	for _, m := range []*replicav1.SnapshotReadResponse{
		{},
		{Extents: []*replicav1.Extent{{Offset: 0, Data: data(4096)}}},
		{Extents: []*replicav1.Extent{{Offset: 8192, Data: data(1 << 20)}, {Offset: 4 << 20, Data: data(3 << 20)}, {Offset: 5}}},
	} {
		out, err := c.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		b := out.Materialize()
		for _, frame := range frames(len(b)) {
			got := &replicav1.SnapshotReadResponse{}
			if err := c.Unmarshal(split(b, frame), got); err != nil || !proto.Equal(got, m) {
				t.Fatalf("%d extents in frames of %d: %v", len(m.Extents), frame, err)
			}
		}
		got := &replicav1.SnapshotReadResponse{}
		if !decodeSnapshotRead(b, got) {
			t.Fatal("the fast path refused a message the proto codec wrote")
		}
		for _, x := range got.Extents {
			if len(x.Data) > 0 && !aliases(b, x.Data) {
				t.Fatal("an extent's data was copied out of the message")
			}
		}
	}
	// An unknown field (as a newer replica might send): the proto codec
	// decodes it, and the extents are not lost.
	m := &replicav1.SnapshotReadResponse{Extents: []*replicav1.Extent{{Offset: 4096, Data: data(8192)}}}
	b, _ := proto.Marshal(m)
	b = protowire.AppendVarint(protowire.AppendTag(b, 9, protowire.VarintType), 1)
	if decodeSnapshotRead(b, &replicav1.SnapshotReadResponse{}) {
		t.Fatal("the fast path took a field it does not know")
	}
	got := &replicav1.SnapshotReadResponse{}
	if err := c.Unmarshal(split(b, 100), got); err != nil || len(got.Extents) != 1 || !bytes.Equal(got.Extents[0].Data, m.Extents[0].Data) {
		t.Fatalf("with an unknown field: %v %v", got, err)
	}
	if err := c.Unmarshal(split(b[:len(b)-20], 100), &replicav1.SnapshotReadResponse{}); err == nil {
		t.Fatal("a truncated message decoded")
	}
}

// TestUnmarshalLayerWrite: a LayerWriteRequest as the codec or the proto
// codec writes it decodes the same on the fast path, whatever the frames
// it arrives in, with its data aligned for direct I/O (also at an
// alignment other than the default); one the fast path does not expect
// goes through the proto codec, errors included.
func TestUnmarshalLayerWrite(t *testing.T) {
	for _, align := range []int{4096, 512} {
		c := New(Options{DataAlignment: align})
		for _, m := range []*replicav1.LayerWriteRequest{
			{Snapshot: "rebuild-7-1", Offset: 12 << 20, Data: data(4 << 20), Epoch: 9},
			{Snapshot: "s", Data: data(4096)},
			{Offset: -1, Data: data(1), Epoch: 1 << 63},
			{Snapshot: "empty", Offset: 4096, Epoch: 3},
		} {
			protoOrder, _ := proto.Marshal(m)
			out, err := c.Marshal(m) // the data last
			if err != nil {
				t.Fatal(err)
			}
			for _, msg := range [][]byte{protoOrder, out.Materialize()} {
				for _, frame := range frames(len(msg)) {
					got := &replicav1.LayerWriteRequest{}
					if err := c.Unmarshal(split(msg, frame), got); err != nil || !proto.Equal(got, m) {
						t.Fatalf("%q in frames of %d: %v", m.Snapshot, frame, err)
					}
					if len(got.Data) > 0 && uintptr(unsafe.Pointer(&got.Data[0]))%uintptr(align) != 0 {
						t.Fatalf("%q in frames of %d: data not aligned on %d", m.Snapshot, frame, align)
					}
					c.ReleaseLayerWrite(got)
				}
			}
		}
	}
	c := New(Options{})
	m := &replicav1.LayerWriteRequest{Snapshot: "s", Data: data(8192), Epoch: 2}
	b, _ := proto.Marshal(m)
	unknown := protowire.AppendVarint(protowire.AppendTag(bytes.Clone(b), 9, protowire.VarintType), 1)
	if decodeLayerWrite(unknown, &replicav1.LayerWriteRequest{}) {
		t.Fatal("the fast path took a field it does not know")
	}
	got := &replicav1.LayerWriteRequest{}
	if err := c.Unmarshal(split(unknown, 100), got); err != nil || got.Snapshot != m.Snapshot || got.Epoch != m.Epoch || !bytes.Equal(got.Data, m.Data) {
		t.Fatalf("with an unknown field: %v", err)
	}
	badName := protowire.AppendString(protowire.AppendTag(nil, layerWriteName, protowire.BytesType), "\xff")
	if err := c.Unmarshal(split(badName, 100), &replicav1.LayerWriteRequest{}); err == nil {
		t.Fatal("a name that is not UTF-8 decoded")
	}
	if err := c.Unmarshal(split(b[:len(b)-20], 100), &replicav1.LayerWriteRequest{}); err == nil {
		t.Fatal("a truncated message decoded")
	}
}

func (c *Codec) lentCount() int {
	n := 0
	c.lent.Range(func(any, any) bool { n++; return true })
	return n
}

func (c *Codec) lentReadCount() int {
	n := 0
	c.lentReads.Range(func(any, any) bool { n++; return true })
	return n
}

// TestLayerWriteBufferGivenBack: the buffer a request is decoded into is
// lent until the handler releases the request, and not kept when the
// request is empty of data, goes through the proto codec, or is too large
// for a recycled buffer.
func TestLayerWriteBufferGivenBack(t *testing.T) {
	c := New(Options{MaxLayerWrite: 4 << 20})
	m := &replicav1.LayerWriteRequest{Snapshot: "s", Offset: 8192, Data: data(4 << 20), Epoch: 2}
	b, _ := proto.Marshal(m)
	got := &replicav1.LayerWriteRequest{}
	if err := c.Unmarshal(split(b, 16<<10), got); err != nil || !proto.Equal(got, m) {
		t.Fatal(err)
	}
	if c.lentCount() != 1 {
		t.Fatalf("%d buffers lent, want 1", c.lentCount())
	}
	c.ReleaseLayerWrite(got)
	if c.lentCount() != 0 || got.Data != nil {
		t.Fatalf("%d buffers lent after the release", c.lentCount())
	}
	c.ReleaseLayerWrite(got) // twice: nothing
	empty, _ := proto.Marshal(&replicav1.LayerWriteRequest{Snapshot: "s"})
	unknown := protowire.AppendVarint(protowire.AppendTag(bytes.Clone(b), 9, protowire.VarintType), 1)
	large, _ := proto.Marshal(&replicav1.LayerWriteRequest{Snapshot: "s", Data: data(5 << 20)})
	for _, msg := range [][]byte{empty, unknown, large} {
		got := &replicav1.LayerWriteRequest{}
		if err := c.Unmarshal(split(msg, 100<<10), got); err != nil {
			t.Fatal(err)
		}
		c.ReleaseLayerWrite(got) // not lent: the data stays
		if len(msg) > len(empty) && len(got.Data) == 0 {
			t.Fatal("a request's data not from a recycled buffer was cleared by its release")
		}
	}
	if c.lentCount() != 0 {
		t.Fatalf("%d buffers lent for requests that do not use them", c.lentCount())
	}
	if n := c.Lent(); n != 0 {
		t.Fatalf("Lent counts %d buffers after decoding requests (it counts ReadBuffer's only)", n)
	}
}

// TestSnapshotReadRecycled: with RecycleSnapshotReads a response decodes
// as without, into a recycled buffer with its first extent's data
// aligned, whatever the frames; ReleaseSnapshotRead gives the buffer
// back once (and clears the extents); a response the fast path does not
// take, or too large for a buffer, keeps memory of its own.
func TestSnapshotReadRecycled(t *testing.T) {
	c := New(Options{MaxLayerWrite: 4 << 20, RecycleSnapshotReads: true})
	for _, m := range []*replicav1.SnapshotReadResponse{
		{Extents: []*replicav1.Extent{{Offset: 8192, Data: data(4 << 20)}}},
		{Extents: []*replicav1.Extent{{Offset: 0, Data: data(1 << 20)}, {Offset: 2 << 20, Data: data(64 << 10)}}},
	} {
		out, err := c.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		b := out.Materialize()
		for _, frame := range frames(len(b)) {
			got := &replicav1.SnapshotReadResponse{}
			if err := c.Unmarshal(split(b, frame), got); err != nil || !proto.Equal(got, m) {
				t.Fatalf("%d extents in frames of %d: %v", len(m.Extents), frame, err)
			}
			if p := uintptr(unsafe.Pointer(unsafe.SliceData(got.Extents[0].Data))); p%4096 != 0 {
				t.Fatalf("the first extent's data is at %#x, not aligned", p)
			}
			if n := c.lentReadCount(); n != 1 {
				t.Fatalf("%d buffers lent, want 1", n)
			}
			c.ReleaseSnapshotRead(got)
			c.ReleaseSnapshotRead(got) // twice: nothing
			if n := c.lentReadCount(); n != 0 || got.Extents != nil {
				t.Fatalf("%d buffers lent after the release (extents %d)", n, len(got.Extents))
			}
		}
	}
	m := &replicav1.SnapshotReadResponse{Extents: []*replicav1.Extent{{Offset: 4096, Data: data(8192)}}}
	unknown, _ := proto.Marshal(m)
	unknown = protowire.AppendVarint(protowire.AppendTag(unknown, 9, protowire.VarintType), 1)
	large, _ := proto.Marshal(&replicav1.SnapshotReadResponse{Extents: []*replicav1.Extent{{Data: data(5 << 20)}}})
	for _, msg := range [][]byte{unknown, large} {
		got := &replicav1.SnapshotReadResponse{}
		if err := c.Unmarshal(split(msg, 100<<10), got); err != nil || len(got.Extents) != 1 {
			t.Fatalf("%v %v", got, err)
		}
		c.ReleaseSnapshotRead(got)
		if len(got.Extents) != 1 {
			t.Fatal("a response not from a recycled buffer was cleared by its release")
		}
	}
	if n := c.lentReadCount(); n != 0 {
		t.Fatalf("%d buffers lent for responses that do not use them", n)
	}
}

// TestSnapshotReadSentFromLentBuffer: a response read into a buffer from
// ReadBuffer is marshalled as the proto codec would, its large extents
// referenced in the buffer, and the buffer comes back only when the
// transport has freed every piece of it, however many references it took;
// the same response marshalled again, no longer marked, gives nothing
// back.
func TestSnapshotReadSentFromLentBuffer(t *testing.T) {
	c := New(Options{MaxLayerWrite: 4 << 20})
	buf, raw := c.ReadBuffer(4 << 20)
	if raw == nil || len(buf) != 4<<20 || uintptr(unsafe.Pointer(unsafe.SliceData(buf)))%4096 != 0 {
		t.Fatalf("ReadBuffer: %d bytes, lent %v, aligned %v", len(buf), raw != nil, uintptr(unsafe.Pointer(unsafe.SliceData(buf)))%4096 == 0)
	}
	copy(buf, data(len(buf)))
	m := &replicav1.SnapshotReadResponse{Extents: []*replicav1.Extent{
		{Offset: 0, Data: buf[: 1<<20 : 1<<20]},
		{Offset: 2 << 20, Data: buf[2<<20 : 2<<20+64<<10 : 2<<20+64<<10]},
		{Offset: 3 << 20, Data: buf[3<<20 : 3<<20+512 : 3<<20+512]}, // short: copied
	}}
	want, _ := proto.Marshal(m)
	c.SendSnapshotRead(m, raw)
	out, err := c.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(out.Materialize(), want) {
		t.Fatal("the lent response is not encoded as the proto codec encodes it")
	}
	if !referenced(out, m.Extents[0].Data) || !referenced(out, m.Extents[1].Data) {
		t.Fatal("the large extents are copied, not referenced")
	}
	c.sending.Range(func(any, any) bool { t.Fatal("the response is still marked after it was marshalled"); return false })
	if n := c.sentBack.Load(); n != 0 {
		t.Fatalf("%d buffers given back before the transport freed the message", n)
	}
	out.Ref() // the transport's reader holds the message while it writes
	out.Free()
	if n := c.sentBack.Load(); n != 0 {
		t.Fatalf("%d buffers given back while the transport still holds the message", n)
	}
	out.Free()
	if n := c.sentBack.Load(); n != 1 {
		t.Fatalf("%d buffers given back once the message is freed, want 1", n)
	}
	again, _ := c.Marshal(m)
	again.Free()
	if n := c.sentBack.Load(); n != 1 {
		t.Fatalf("%d buffers given back after a response no longer lent was marshalled, want 1", n)
	}
	if b, raw := c.ReadBuffer(4<<20 + 1); b != nil || raw != nil {
		t.Fatal("ReadBuffer lent a buffer larger than MaxLayerWrite")
	}
}

// TestOtherMessages: messages without a fast path go through the proto
// codec both ways.
func TestOtherMessages(t *testing.T) {
	c := New(Options{})
	m := &replicav1.SnapshotReadRequest{Snapshot: "s", Offset: 4096, Length: 8192}
	out, err := c.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	got := &replicav1.SnapshotReadRequest{}
	if err := c.Unmarshal(out, got); err != nil || !proto.Equal(got, m) {
		t.Fatalf("read back %v (%v)", got, err)
	}
	if c.Name() != "proto" {
		t.Fatalf("name %q: the content-subtype on the wire must stay proto's", c.Name())
	}
}
