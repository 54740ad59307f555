package replicaclient

import (
	"google.golang.org/grpc/encoding"
	protocodec "google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	replicav1 "github.com/cairn-io/cairn/dataplane/api/replica/v1"
)

// codec is the control connection's proto codec with two fast paths for
// the bulk messages of a rebuild, which pass through the engine: a
// LayerWriteRequest's data is sent as it is, not copied into the
// marshalled message first, and a SnapshotReadResponse is decoded in
// place, its extents' data pointing into the received message, instead
// of being copied out of it once more. The wire format is protobuf's, as
// the proto codec writes and reads it; every other message goes through
// the proto codec, and so does a SnapshotReadResponse that holds anything
// the fast path does not expect.
type codec struct{ proto encoding.CodecV2 }

func newCodec() codec { return codec{proto: encoding.GetCodecV2(protocodec.Name)} }

// Name is the proto codec's, so the content-subtype on the wire is too.
func (c codec) Name() string { return protocodec.Name }

func (c codec) Marshal(v any) (mem.BufferSlice, error) {
	if m, ok := v.(*replicav1.LayerWriteRequest); ok && len(m.GetData()) > 0 {
		return marshalLayerWrite(m)
	}
	return c.proto.Marshal(v)
}

func (c codec) Unmarshal(data mem.BufferSlice, v any) error {
	if m, ok := v.(*replicav1.SnapshotReadResponse); ok {
		// A copy of its own, not a pooled buffer: the extents keep
		// pointing into it after the call.
		b := data.Materialize()
		if decodeSnapshotRead(b, m) {
			return nil
		}
		proto.Reset(m)
		return proto.Unmarshal(b, m)
	}
	return c.proto.Unmarshal(data, v)
}

// Field numbers in replica.proto.
const (
	layerWriteData = 3
	readExtents    = 1
	extentOffset   = 1
	extentData     = 2
)

// marshalLayerWrite encodes m as the proto codec would, less the order of
// its fields: the others first, then the data (a field may come in any
// order), which the returned slice references without copying it. The
// caller must not change m.Data afterwards, not even after a call that
// failed: the transport may still be sending a cancelled call's frames (a
// rebuild writes every chunk from a buffer of its own).
func marshalLayerWrite(m *replicav1.LayerWriteRequest) (mem.BufferSlice, error) {
	head, err := proto.Marshal(&replicav1.LayerWriteRequest{Snapshot: m.GetSnapshot(), Offset: m.GetOffset(), Epoch: m.GetEpoch()})
	if err != nil {
		return nil, err
	}
	head = protowire.AppendTag(head, layerWriteData, protowire.BytesType)
	head = protowire.AppendVarint(head, uint64(len(m.Data)))
	return mem.BufferSlice{mem.SliceBuffer(head), mem.SliceBuffer(m.Data)}, nil
}

// decodeSnapshotRead decodes a SnapshotReadResponse from b into m, the
// extents' data aliasing b. It reports false, having maybe filled m
// partly, if b holds anything else than extents of an offset and data.
func decodeSnapshotRead(b []byte, m *replicav1.SnapshotReadResponse) bool {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 || num != readExtents || typ != protowire.BytesType {
			return false
		}
		b = b[n:]
		v, n := protowire.ConsumeBytes(b)
		if n < 0 {
			return false
		}
		b = b[n:]
		x := &replicav1.Extent{}
		if !decodeExtent(v, x) {
			return false
		}
		m.Extents = append(m.Extents, x)
	}
	return true
}

func decodeExtent(b []byte, x *replicav1.Extent) bool {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return false
		}
		b = b[n:]
		switch {
		case num == extentOffset && typ == protowire.VarintType:
			v, n := protowire.ConsumeVarint(b)
			if n < 0 {
				return false
			}
			x.Offset, b = int64(v), b[n:]
		case num == extentData && typ == protowire.BytesType:
			v, n := protowire.ConsumeBytes(b)
			if n < 0 {
				return false
			}
			x.Data, b = v[:len(v):len(v)], b[n:]
		default:
			return false
		}
	}
	return true
}
