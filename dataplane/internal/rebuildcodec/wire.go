package rebuildcodec

import (
	"unicode/utf8"

	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	replicav1 "github.com/cairn-io/cairn/dataplane/api/replica/v1"
)

// Field numbers in replica.proto.
const (
	readExtents      = 1
	extentOffset     = 1
	extentData       = 2
	layerWriteName   = 1
	layerWriteOffset = 2
	layerWriteData   = 3
	layerWriteEpoch  = 4
)

// copyBelow: extent data shorter than this is copied into the message,
// not referenced.
const copyBelow = 4 << 10

// marshalLayerWrite encodes m as the proto codec would, less the order of
// its fields: the others first, then the data (a field may come in any
// order), which the returned slice references without copying it.
func marshalLayerWrite(m *replicav1.LayerWriteRequest) (mem.BufferSlice, error) {
	head, err := proto.Marshal(&replicav1.LayerWriteRequest{Snapshot: m.GetSnapshot(), Offset: m.GetOffset(), Epoch: m.GetEpoch()})
	if err != nil {
		return nil, err
	}
	head = protowire.AppendTag(head, layerWriteData, protowire.BytesType)
	head = protowire.AppendVarint(head, uint64(len(m.Data)))
	return mem.BufferSlice{mem.SliceBuffer(head), mem.SliceBuffer(m.Data)}, nil
}

// marshalSnapshotRead encodes m as the proto codec would (fields in
// order, zero values left out); the data of each extent is referenced,
// not copied, unless it is short. Referenced data is wrapped by ref.
func marshalSnapshotRead(m *replicav1.SnapshotReadResponse, ref func([]byte) mem.Buffer) mem.BufferSlice {
	var out mem.BufferSlice
	var b []byte
	for _, x := range m.GetExtents() {
		n := 0
		if x.Offset != 0 {
			n += protowire.SizeTag(extentOffset) + protowire.SizeVarint(uint64(x.Offset))
		}
		if len(x.Data) > 0 {
			n += protowire.SizeTag(extentData) + protowire.SizeBytes(len(x.Data))
		}
		b = protowire.AppendTag(b, readExtents, protowire.BytesType)
		b = protowire.AppendVarint(b, uint64(n))
		if x.Offset != 0 {
			b = protowire.AppendTag(b, extentOffset, protowire.VarintType)
			b = protowire.AppendVarint(b, uint64(x.Offset))
		}
		if len(x.Data) == 0 {
			continue
		}
		b = protowire.AppendTag(b, extentData, protowire.BytesType)
		b = protowire.AppendVarint(b, uint64(len(x.Data)))
		if len(x.Data) < copyBelow {
			b = append(b, x.Data...)
			continue
		}
		out = append(out, mem.SliceBuffer(b), ref(x.Data))
		b = nil
	}
	if len(b) > 0 {
		out = append(out, mem.SliceBuffer(b))
	}
	return out
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

// decodeLayerWrite decodes a LayerWriteRequest from b into m, its data
// aliasing b. It reports false, having maybe filled m partly, if b holds
// anything else than the request's four fields, or a name that is not
// UTF-8 (which the proto codec refuses).
func decodeLayerWrite(b []byte, m *replicav1.LayerWriteRequest) bool {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return false
		}
		b = b[n:]
		switch {
		case num == layerWriteName && typ == protowire.BytesType:
			v, n := protowire.ConsumeBytes(b)
			if n < 0 || !utf8.Valid(v) {
				return false
			}
			m.Snapshot, b = string(v), b[n:]
		case num == layerWriteData && typ == protowire.BytesType:
			v, n := protowire.ConsumeBytes(b)
			if n < 0 {
				return false
			}
			m.Data, b = v[:len(v):len(v)], b[n:]
		case (num == layerWriteOffset || num == layerWriteEpoch) && typ == protowire.VarintType:
			v, n := protowire.ConsumeVarint(b)
			if n < 0 {
				return false
			}
			if num == layerWriteOffset {
				m.Offset = int64(v)
			} else {
				m.Epoch = v
			}
			b = b[n:]
		default:
			return false
		}
	}
	return true
}

// dataStart is where the data field's bytes start in a LayerWriteRequest
// whose start is head, or -1 if head does not reach them.
func dataStart(head []byte) int { return bytesStart(head, layerWriteData) }

// readDataStart is where the first extent's data starts in a
// SnapshotReadResponse whose start is head, or -1 if head does not reach
// it.
func readDataStart(head []byte) int {
	at := bytesStart(head, readExtents)
	if at < 0 {
		return -1
	}
	in := bytesStart(head[at:], extentData)
	if in < 0 {
		return -1
	}
	return at + in
}

// bytesStart is where the bytes of the first field numbered num start in
// a message whose start is head (past its tag and length, when it is of
// the bytes type), or -1 if head does not reach them.
func bytesStart(head []byte, num protowire.Number) int {
	at := 0
	for at < len(head) {
		got, typ, n := protowire.ConsumeTag(head[at:])
		if n < 0 {
			return -1
		}
		at += n
		if got == num && typ == protowire.BytesType {
			_, n := protowire.ConsumeVarint(head[at:])
			if n < 0 {
				return -1
			}
			return at + n
		}
		n = protowire.ConsumeFieldValue(got, typ, head[at:])
		if n < 0 {
			return -1
		}
		at += n
	}
	return -1
}
