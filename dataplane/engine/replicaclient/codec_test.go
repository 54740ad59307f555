package replicaclient

import (
	"bytes"
	"testing"

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

// TestCodecLayerWrite: a LayerWriteRequest marshalled by the fast path
// reads back the same through the proto codec, and sends its data without
// copying it.
func TestCodecLayerWrite(t *testing.T) {
	c := newCodec()
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
		b := out.Materialize()
		got := &replicav1.LayerWriteRequest{}
		if err := proto.Unmarshal(b, got); err != nil || !proto.Equal(got, m) {
			t.Fatalf("%v: read back %v (%v)", m, got, err)
		}
		if len(m.Data) > 0 && &out[len(out)-1].ReadOnlyData()[0] != &m.Data[0] {
			t.Fatalf("%v: the data was copied", m)
		}
	}
}

// TestCodecSnapshotRead: a SnapshotReadResponse as the replica's proto
// codec writes it decodes the same on the fast path, whatever the frames
// it arrives in, its extents' data pointing into the received message;
// one holding a field the fast path does not know goes through proto.
func TestCodecSnapshotRead(t *testing.T) {
	c := newCodec()
	for _, m := range []*replicav1.SnapshotReadResponse{
		{},
		{Extents: []*replicav1.Extent{{Offset: 0, Data: data(4096)}}},
		{Extents: []*replicav1.Extent{{Offset: 8192, Data: data(1 << 20)}, {Offset: 4 << 20, Data: data(3 << 20)}, {Offset: 5}}},
	} {
		b, err := proto.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		for _, frame := range []int{16 << 10, 7, len(b) + 1} {
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
	b = protowire.AppendTag(b, 9, protowire.VarintType)
	b = protowire.AppendVarint(b, 1)
	if decodeSnapshotRead(b, &replicav1.SnapshotReadResponse{}) {
		t.Fatal("the fast path took a message with an unknown field")
	}
	got := &replicav1.SnapshotReadResponse{}
	if err := c.Unmarshal(split(b, 100), got); err != nil || len(got.Extents) != 1 || !bytes.Equal(got.Extents[0].Data, m.Extents[0].Data) {
		t.Fatalf("fallback: %v", err)
	}
	// Truncated: an error, as from the proto codec.
	if err := c.Unmarshal(split(b[:len(b)-20], 100), &replicav1.SnapshotReadResponse{}); err == nil {
		t.Fatal("a truncated message decoded")
	}
}

// aliases reports whether p lies in msg.
func aliases(msg, p []byte) bool {
	for i := range msg {
		if &msg[i] == &p[0] {
			return true
		}
	}
	return false
}
