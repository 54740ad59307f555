package replicaserver

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

func data(n int) []byte {
	p := make([]byte, n)
	for i := range p {
		p[i] = byte(i*7 + i>>9)
	}
	return p
}

// TestCodecSnapshotRead: the fast path writes a SnapshotReadResponse
// byte for byte as the proto codec does, referencing large extents'
// data instead of copying it.
func TestCodecSnapshotRead(t *testing.T) {
	c := newCodec()
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
			if len(x.Data) < copyBelow {
				continue
			}
			referenced := false
			for _, b := range out {
				if d := b.ReadOnlyData(); len(d) > 0 && &d[0] == &x.Data[0] {
					referenced = true
				}
			}
			if !referenced {
				t.Fatalf("an extent of %d bytes was copied", len(x.Data))
			}
		}
	}
}

// TestCodecLayerWrite: a LayerWriteRequest as the engine's codec or the
// proto codec writes it decodes the same on the fast path, whatever the
// frames it arrives in, with its data aligned for direct I/O; one the fast
// path does not expect goes through the proto codec, errors included.
func TestCodecLayerWrite(t *testing.T) {
	c := newCodec()
	for _, m := range []*replicav1.LayerWriteRequest{
		{Snapshot: "rebuild-7-1", Offset: 12 << 20, Data: data(4 << 20), Epoch: 9},
		{Snapshot: "s", Data: data(4096)},
		{Offset: -1, Data: data(1), Epoch: 1 << 63},
		{Snapshot: "empty", Offset: 4096, Epoch: 3},
	} {
		b, err := proto.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		// The engine's order: the data last.
		head, _ := proto.Marshal(&replicav1.LayerWriteRequest{Snapshot: m.Snapshot, Offset: m.Offset, Epoch: m.Epoch})
		head = protowire.AppendTag(head, layerWriteData, protowire.BytesType)
		engineOrder := append(protowire.AppendVarint(head, uint64(len(m.Data))), m.Data...)
		for _, msg := range [][]byte{b, engineOrder} {
			for _, frame := range []int{16 << 10, 7, len(msg) + 1} {
				got := &replicav1.LayerWriteRequest{}
				if err := c.Unmarshal(split(msg, frame), got); err != nil || !proto.Equal(got, m) {
					t.Fatalf("%q in frames of %d: %v", m.Snapshot, frame, err)
				}
				if len(got.Data) > 0 && uintptr(unsafe.Pointer(&got.Data[0]))%dataAlignment != 0 {
					t.Fatalf("%q in frames of %d: data not aligned", m.Snapshot, frame)
				}
				releaseLayerWrite(got)
			}
		}
	}
	m := &replicav1.LayerWriteRequest{Snapshot: "s", Data: data(8192), Epoch: 2}
	b, _ := proto.Marshal(m)
	unknown := protowire.AppendVarint(protowire.AppendTag(bytes.Clone(b), 9, protowire.VarintType), 1)
	if decodeLayerWrite(unknown, &replicav1.LayerWriteRequest{}) {
		t.Fatal("the fast path took a message with an unknown field")
	}
	got := &replicav1.LayerWriteRequest{}
	if err := c.Unmarshal(split(unknown, 100), got); err != nil || got.Snapshot != m.Snapshot || got.Epoch != m.Epoch || !bytes.Equal(got.Data, m.Data) {
		t.Fatalf("fallback: %v", err)
	}
	badName := protowire.AppendString(protowire.AppendTag(nil, layerWriteName, protowire.BytesType), "\xff")
	if err := c.Unmarshal(split(badName, 100), &replicav1.LayerWriteRequest{}); err == nil {
		t.Fatal("a name that is not UTF-8 decoded")
	}
	if err := c.Unmarshal(split(b[:len(b)-20], 100), &replicav1.LayerWriteRequest{}); err == nil {
		t.Fatal("a truncated message decoded")
	}
}

func lentCount() int {
	n := 0
	lent.Range(func(any, any) bool { n++; return true })
	return n
}

// TestLayerWriteBufferGivenBack: the buffer a request is decoded into is
// lent until the handler releases the request, and not kept when the
// request is empty of data or goes through the proto codec.
func TestLayerWriteBufferGivenBack(t *testing.T) {
	c := newCodec()
	m := &replicav1.LayerWriteRequest{Snapshot: "s", Offset: 8192, Data: data(4 << 20), Epoch: 2}
	b, _ := proto.Marshal(m)
	got := &replicav1.LayerWriteRequest{}
	if err := c.Unmarshal(split(b, 16<<10), got); err != nil || !proto.Equal(got, m) {
		t.Fatal(err)
	}
	if lentCount() != 1 {
		t.Fatalf("%d buffers lent, want 1", lentCount())
	}
	releaseLayerWrite(got)
	if lentCount() != 0 || got.Data != nil {
		t.Fatalf("%d buffers lent after the release", lentCount())
	}
	releaseLayerWrite(got) // twice: nothing
	empty, _ := proto.Marshal(&replicav1.LayerWriteRequest{Snapshot: "s"})
	unknown := protowire.AppendVarint(protowire.AppendTag(bytes.Clone(b), 9, protowire.VarintType), 1)
	for _, msg := range [][]byte{empty, unknown} {
		if err := c.Unmarshal(split(msg, 100), &replicav1.LayerWriteRequest{}); err != nil {
			t.Fatal(err)
		}
	}
	if lentCount() != 0 {
		t.Fatalf("%d buffers lent for requests that do not use them", lentCount())
	}
}
