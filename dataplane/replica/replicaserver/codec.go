package replicaserver

import (
	"sync"
	"unicode/utf8"
	"unsafe"

	"google.golang.org/grpc/encoding"
	protocodec "google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	replicav1 "github.com/cairn-io/cairn/dataplane/api/replica/v1"
	"github.com/cairn-io/cairn/dataplane/replica"
)

// codec is the control API's proto codec with two fast paths for the
// bulk messages of a rebuild: a SnapshotReadResponse's data is sent as
// it is, not copied into the marshalled message first, and a
// LayerWriteRequest is decoded in place, its data pointing into the
// received message, instead of being copied out of it once more. The
// wire format is protobuf's, as the proto codec writes and reads it;
// every other message goes through the proto codec, and so does a
// LayerWriteRequest that holds anything the fast path does not expect.
type codec struct{ proto encoding.CodecV2 }

func newCodec() codec { return codec{proto: encoding.GetCodecV2(protocodec.Name)} }

// Name is the proto codec's.
func (c codec) Name() string { return protocodec.Name }

func (c codec) Marshal(v any) (mem.BufferSlice, error) {
	if m, ok := v.(*replicav1.SnapshotReadResponse); ok {
		return marshalSnapshotRead(m), nil
	}
	return c.proto.Marshal(v)
}

func (c codec) Unmarshal(data mem.BufferSlice, v any) error {
	if m, ok := v.(*replicav1.LayerWriteRequest); ok {
		// A copy of its own, not the transport's buffers: the request's
		// data keeps pointing into it after this returns, until the
		// handler gives it back (releaseLayerWrite).
		b, raw := materializeAligned(data)
		if decodeLayerWrite(b, m) {
			lend(m.Data, raw)
			return nil
		}
		defer giveBack(raw)
		proto.Reset(m)
		return proto.Unmarshal(b, m) // copies what it keeps
	}
	return c.proto.Unmarshal(data, v)
}

// Field numbers in replica.proto.
const (
	readExtents      = 1
	extentOffset     = 1
	extentData       = 2
	layerWriteName   = 1
	layerWriteOffset = 2
	layerWriteData   = 3
	layerWriteEpoch  = 4
	// copyBelow: data shorter than this is copied, not referenced.
	copyBelow = 4 << 10
)

// marshalSnapshotRead encodes m as the proto codec would (fields in
// order, zero values left out); the data of each extent is referenced,
// not copied, unless it is short.
func marshalSnapshotRead(m *replicav1.SnapshotReadResponse) mem.BufferSlice {
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
		out = append(out, mem.SliceBuffer(b), mem.SliceBuffer(x.Data))
		b = nil
	}
	if len(b) > 0 {
		out = append(out, mem.SliceBuffer(b))
	}
	return out
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

// dataAlignment is the alignment a replica with direct I/O needs of the
// memory it writes from (replica.BlockSize); without it, the replica
// copies the data into an aligned buffer first.
const dataAlignment = replica.BlockSize

// materializeAligned copies a LayerWriteRequest into one buffer, placed so
// that the data field's bytes start on a dataAlignment boundary when the
// fields before them come first (as the engine sends them) and are
// short. The buffer is raw, from layerBufs (nil if it is not from there).
func materializeAligned(data mem.BufferSlice) (b []byte, raw *[]byte) {
	var head [256]byte
	at := dataStart(head[:data.CopyTo(head[:])])
	n := data.Len()
	if at < 0 || n+dataAlignment > layerBufSize {
		return data.Materialize(), nil
	}
	raw = layerBufs.Get().(*[]byte)
	skip := (dataAlignment - int((uintptr(unsafe.Pointer(unsafe.SliceData(*raw)))+uintptr(at))%dataAlignment)) % dataAlignment
	b = (*raw)[skip : skip+n : skip+n]
	data.CopyTo(b)
	return b, raw
}

// layerBufSize fits a rebuild's largest layer write (4 MiB, engine.
// RebuildChunk) with its fields and room to align it.
const layerBufSize = 4<<20 + 2*dataAlignment

// layerBufs recycles the buffers LayerWriteRequests are decoded into, so
// that a rebuild's target does not allocate (and clear) 4 MiB per chunk;
// lent maps the data of each request being handled to its buffer, until
// the handler gives it back (the server has no interceptor: a decoded
// request always reaches its handler).
var (
	layerBufs = sync.Pool{New: func() any { b := make([]byte, layerBufSize); return &b }}
	lent      sync.Map // *byte (a request's data) -> *[]byte
)

func lend(data []byte, raw *[]byte) {
	if raw == nil {
		return
	}
	if len(data) == 0 {
		giveBack(raw)
		return
	}
	lent.Store(unsafe.SliceData(data), raw)
}

func giveBack(raw *[]byte) {
	if raw != nil {
		layerBufs.Put(raw)
	}
}

// releaseLayerWrite gives back the buffer a LayerWriteRequest's data was
// decoded into, once nothing uses the data any more.
func releaseLayerWrite(req *replicav1.LayerWriteRequest) {
	if len(req.Data) == 0 {
		return
	}
	if raw, ok := lent.LoadAndDelete(unsafe.SliceData(req.Data)); ok {
		req.Data = nil
		layerBufs.Put(raw)
	}
}

// dataStart is where the data field's bytes start in a LayerWriteRequest
// whose start is head, or -1 if head does not reach them.
func dataStart(head []byte) int {
	at := 0
	for at < len(head) {
		num, typ, n := protowire.ConsumeTag(head[at:])
		if n < 0 {
			return -1
		}
		at += n
		if num == layerWriteData && typ == protowire.BytesType {
			_, n := protowire.ConsumeVarint(head[at:])
			if n < 0 {
				return -1
			}
			return at + n
		}
		n = protowire.ConsumeFieldValue(num, typ, head[at:])
		if n < 0 {
			return -1
		}
		at += n
	}
	return -1
}
