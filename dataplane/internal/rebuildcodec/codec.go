// Package rebuildcodec is the gRPC codec of the replica control API, used
// at every end: the engine's client (engine/replicaclient), the replica's
// server (replica/replicaserver), and a target replica's client of its
// rebuild source. It is the proto codec with fast paths for the two bulk
// messages of a rebuild, which carry up to 4 MiB each:
//
//   - SnapshotReadResponse (source replica → the target that pulls a
//     chunk, or → the engine when it relays one): marshalled with each
//     large extent's data referenced, not copied into the message, and
//     decoded in place, the extents' data pointing into the received
//     message instead of being copied out of it once more.
//   - LayerWriteRequest (engine → target replica, for a relayed chunk):
//     marshalled with its data referenced, and decoded into a recycled
//     buffer placed so that the data is aligned for direct I/O, lent to
//     the handler until it calls ReleaseLayerWrite.
//
// The wire format is protobuf's, as the proto codec writes and reads it.
// Every other message goes through the proto codec, and so does a bulk
// message that holds anything the fast path does not expect (a field of
// a newer peer, a name that is not UTF-8), errors included.
package rebuildcodec

import (
	"sync"
	"sync/atomic"
	"unsafe"

	"google.golang.org/grpc/encoding"
	protocodec "google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"

	replicav1 "github.com/cairn-io/cairn/dataplane/api/replica/v1"
)

// Options configure a Codec. Zero values take the defaults.
type Options struct {
	// DataAlignment is the alignment of a decoded LayerWriteRequest's
	// data: the block size of a replica with direct I/O, which otherwise
	// copies the data into an aligned buffer before writing. Default 4096.
	DataAlignment int
	// MaxLayerWrite is the largest LayerWriteRequest data decoded into a
	// recycled buffer; larger ones are decoded into memory of their own.
	// Default 4 MiB (engine.RebuildChunk).
	MaxLayerWrite int
	// RecycleSnapshotReads decodes a SnapshotReadResponse into a recycled
	// buffer too, its first extent's data aligned as a LayerWriteRequest's
	// is, for a client that gives every response back
	// (ReleaseSnapshotRead) once it no longer uses its data: a replica
	// pulling a rebuild's chunks, which writes them and is done. Without
	// it a response's extents point into memory of their own, which the
	// caller may keep.
	RecycleSnapshotReads bool
}

// Codec is the control API's codec. It is safe for concurrent use; one
// Codec serves any number of connections.
type Codec struct {
	proto   encoding.CodecV2
	align   int
	bufSize int
	// bufs recycles the buffers LayerWriteRequests are decoded into, so
	// that a rebuild's target does not allocate (and clear) 4 MiB per
	// chunk; lent maps the data of each request being handled to its
	// buffer, until the handler gives it back.
	bufs sync.Pool
	lent sync.Map // *byte (a request's data) -> *[]byte
	// recycleReads: Options.RecycleSnapshotReads; lentReads maps each
	// response lent a buffer to it.
	recycleReads bool
	lentReads    sync.Map // *replicav1.SnapshotReadResponse -> *[]byte
	// sending maps each SnapshotReadResponse a server read into a
	// recycled buffer (SendSnapshotRead) to it, until Marshal hands the
	// data to the transport.
	sending sync.Map // *replicav1.SnapshotReadResponse -> *[]byte
	// sentBack counts the buffers of sent responses given back.
	sentBack atomic.Int64
	// readsOut counts the buffers from ReadBuffer not back yet.
	readsOut atomic.Int64
}

// New returns a Codec.
func New(opts Options) *Codec {
	if opts.DataAlignment <= 0 {
		opts.DataAlignment = 4096
	}
	if opts.MaxLayerWrite <= 0 {
		opts.MaxLayerWrite = 4 << 20
	}
	c := &Codec{proto: encoding.GetCodecV2(protocodec.Name), align: opts.DataAlignment,
		bufSize: opts.MaxLayerWrite + 2*opts.DataAlignment, recycleReads: opts.RecycleSnapshotReads}
	c.bufs.New = func() any { b := make([]byte, c.bufSize); return &b }
	return c
}

// Name is the proto codec's, so the content-subtype on the wire is too.
func (c *Codec) Name() string { return protocodec.Name }

// Marshal encodes v, referencing the data of a LayerWriteRequest and the
// large extents of a SnapshotReadResponse. The caller must not change
// that data afterwards, not even after a call that failed: the transport
// may still be sending a cancelled call's frames.
func (c *Codec) Marshal(v any) (mem.BufferSlice, error) {
	switch m := v.(type) {
	case *replicav1.LayerWriteRequest:
		if len(m.GetData()) > 0 {
			return marshalLayerWrite(m)
		}
	case *replicav1.SnapshotReadResponse:
		if raw, ok := c.sending.LoadAndDelete(m); ok {
			return c.marshalLent(m, raw.(*[]byte)), nil
		}
		return marshalSnapshotRead(m, func(d []byte) mem.Buffer { return mem.SliceBuffer(d) }), nil
	}
	return c.proto.Marshal(v)
}

// ReadBuffer lends a recycled buffer of n bytes, aligned as a decoded
// LayerWriteRequest's data is, for a server to read a
// SnapshotReadResponse's data into; raw is what SendSnapshotRead or
// GiveBack takes. It returns nil, nil when n is larger than the
// buffers (Options.MaxLayerWrite). A source replica reads each rebuild
// chunk this way instead of into 4 MiB allocated (and cleared) per
// chunk.
func (c *Codec) ReadBuffer(n int) (b []byte, raw *[]byte) {
	if n <= 0 || n > c.bufSize-2*c.align { // Options.MaxLayerWrite
		return nil, nil
	}
	raw = c.bufs.Get().(*[]byte)
	c.readsOut.Add(1)
	skip := (c.align - int(uintptr(unsafe.Pointer(unsafe.SliceData(*raw)))%uintptr(c.align))) % c.align
	return (*raw)[skip : skip+n : skip+n], raw
}

// SentBack is how many buffers of responses marked by SendSnapshotRead
// have come back since the codec was made.
func (c *Codec) SentBack() int64 { return c.sentBack.Load() }

// Lent is how many buffers from ReadBuffer are not back yet: given back
// unsent, or sent and freed by the transport.
func (c *Codec) Lent() int64 { return c.readsOut.Load() }

// GiveBack returns a buffer from ReadBuffer that is not sent.
func (c *Codec) GiveBack(raw *[]byte) {
	if raw != nil {
		c.readsOut.Add(-1)
		c.giveBack(raw)
	}
}

// SendSnapshotRead marks m, a response whose extents' data lies in raw
// (ReadBuffer), as the reply a server handler returns: Marshal hands the
// data to the transport by reference, and the buffer comes back once
// the transport has freed the last of it (sent, or dropped with its
// call). The handler must not use m or the buffer after it returns m. A
// response that is never marshalled (a handler called without gRPC), or
// one whose connection dies while its frames are queued (the transport
// then frees only part of them), keeps its buffer from being recycled:
// the garbage collector takes it, nothing worse, and Lent stays that
// much higher.
func (c *Codec) SendSnapshotRead(m *replicav1.SnapshotReadResponse, raw *[]byte) {
	if raw != nil {
		c.sending.Store(m, raw)
	}
}

// marshalLent is marshalSnapshotRead for a response read into raw: every
// piece of raw the message references holds one reference on it, and so
// does the marshalling until it is done, so raw returns to bufs when
// both the transport and marshalLent are done with it.
func (c *Codec) marshalLent(m *replicav1.SnapshotReadResponse, raw *[]byte) mem.BufferSlice {
	l := &lease{c: c, raw: raw}
	l.refs.Store(1)
	out := marshalSnapshotRead(m, func(d []byte) mem.Buffer {
		b := mem.NewBuffer(&d, l)
		if _, plain := b.(mem.SliceBuffer); plain {
			// Not counted (gRPC pools nothing this small): a copy, so
			// that nothing points into raw once it is recycled.
			return mem.SliceBuffer(append([]byte(nil), d...))
		}
		l.refs.Add(1) // a counted buffer: its last Free calls l.Put
		return b
	})
	l.Put(nil)
	return out
}

// lease counts the references to one lent buffer. It is the
// mem.BufferPool of the pieces of that buffer the transport holds: each
// piece's Put drops one reference.
type lease struct {
	c    *Codec
	raw  *[]byte
	refs atomic.Int32
}

// Get is never called: the transport only frees these buffers.
func (l *lease) Get(n int) *[]byte { b := make([]byte, n); return &b }

func (l *lease) Put(*[]byte) {
	if l.refs.Add(-1) == 0 {
		l.c.sentBack.Add(1)
		l.c.readsOut.Add(-1)
		l.c.bufs.Put(l.raw)
	}
}

// Unmarshal decodes data into v. A SnapshotReadResponse's extents point
// into a copy of the message of their own; a LayerWriteRequest's data
// points into a recycled buffer, which ReleaseLayerWrite gives back.
func (c *Codec) Unmarshal(data mem.BufferSlice, v any) error {
	switch m := v.(type) {
	case *replicav1.SnapshotReadResponse:
		if c.recycleReads {
			b, raw := c.materializeAligned(data, readDataStart)
			if decodeSnapshotRead(b, m) {
				if raw != nil {
					c.lentReads.Store(m, raw)
				}
				return nil
			}
			defer c.giveBack(raw)
			proto.Reset(m)
			return proto.Unmarshal(b, m) // copies what it keeps
		}
		// A copy of its own, not a pooled buffer: the extents keep
		// pointing into it after the call.
		b := data.Materialize()
		if decodeSnapshotRead(b, m) {
			return nil
		}
		proto.Reset(m)
		return proto.Unmarshal(b, m)
	case *replicav1.LayerWriteRequest:
		b, raw := c.materializeAligned(data, dataStart)
		if decodeLayerWrite(b, m) {
			c.lend(m.Data, raw)
			return nil
		}
		defer c.giveBack(raw)
		proto.Reset(m)
		return proto.Unmarshal(b, m) // copies what it keeps
	}
	return c.proto.Unmarshal(data, v)
}

// ReleaseLayerWrite gives back the buffer a LayerWriteRequest's data was
// decoded into, once nothing uses the data any more, and clears the
// request's data. A request not decoded into a recycled buffer, or
// released already, is left as it is. A gRPC server without interceptors
// hands every decoded request to its handler, so a handler that releases
// its request returns every buffer.
func (c *Codec) ReleaseLayerWrite(req *replicav1.LayerWriteRequest) {
	if len(req.Data) == 0 {
		return
	}
	if raw, ok := c.lent.LoadAndDelete(unsafe.SliceData(req.Data)); ok {
		req.Data = nil
		c.bufs.Put(raw)
	}
}

// ReleaseSnapshotRead gives back the buffer a SnapshotReadResponse was
// decoded into (Options.RecycleSnapshotReads), once nothing uses its
// extents' data any more, and clears its extents. A response not decoded
// into a recycled buffer, or released already, is left as it is.
func (c *Codec) ReleaseSnapshotRead(m *replicav1.SnapshotReadResponse) {
	if raw, ok := c.lentReads.LoadAndDelete(m); ok {
		m.Extents = nil
		c.bufs.Put(raw)
	}
}

func (c *Codec) lend(data []byte, raw *[]byte) {
	if raw == nil {
		return
	}
	if len(data) == 0 {
		c.giveBack(raw)
		return
	}
	c.lent.Store(unsafe.SliceData(data), raw)
}

func (c *Codec) giveBack(raw *[]byte) {
	if raw != nil {
		c.bufs.Put(raw)
	}
}

// materializeAligned copies a message into one buffer, placed so that the
// bytes at start(its first bytes) (a LayerWriteRequest's data, or a
// SnapshotReadResponse's first extent's) begin on an alignment boundary
// when the fields before them are short. The buffer is raw, from bufs
// (nil if it is not from there).
func (c *Codec) materializeAligned(data mem.BufferSlice, start func(head []byte) int) (b []byte, raw *[]byte) {
	var head [256]byte
	at := start(head[:data.CopyTo(head[:])])
	n := data.Len()
	if at < 0 || n+c.align > c.bufSize {
		return data.Materialize(), nil
	}
	raw = c.bufs.Get().(*[]byte)
	skip := (c.align - int((uintptr(unsafe.Pointer(unsafe.SliceData(*raw)))+uintptr(at))%uintptr(c.align))) % c.align
	b = (*raw)[skip : skip+n : skip+n]
	data.CopyTo(b)
	return b, raw
}
