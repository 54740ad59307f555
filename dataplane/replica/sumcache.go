package replica

import (
	"encoding/binary"
	"hash/crc32"
	"sync"
	"sync/atomic"
)

// sumCache keeps the checksums of the latest snapshot reads (ReadLayer,
// ReadSnapshot), computed from the data as it was read: a rebuild reads a
// chunk from its source and asks the source for that chunk's checksum
// right after, to verify the copy, and the source then answers from here
// instead of reading the chunk from its disk a second time (with direct
// I/O, a second gigabyte read per gigabyte copied). The checksum is still
// the source's own, of the bytes it read from its disk, before they
// crossed the network, so the verification stays end to end.
//
// An entry is used once, for exactly the range read, and only while
// nothing that can change a snapshot's data happened since the read:
// every change to the chain (lockChain: snapshot, delete and its merge,
// revert, expand, replace) and every layer write moves gen on, and a read
// made while a change to the chain is in progress (gen odd; a deletion
// copies data without holding mu exclusively) is not kept. Head writes do
// not matter: a snapshot's view never includes the head.
type sumCache struct {
	gen atomic.Uint64
	mu  sync.Mutex
	m   map[sumKey]cachedSum
}

type sumKey struct {
	name        string
	off, length int64
	own         bool // LayerChecksum of the layer, or Checksum of the view
}

type cachedSum struct {
	gen uint64
	crc uint32
}

// maxCachedSums bounds the cache: a rebuild asks for each checksum right
// after its read, with a few chunks in flight.
const maxCachedSums = 64

// changing marks the start of a change to the chain; changed its end.
func (c *sumCache) changing() { c.gen.Add(1) }
func (c *sumCache) changed()  { c.gen.Add(1) }

// layerWritten: a snapshot layer's data changed (the parity of gen stays).
func (c *sumCache) layerWritten() { c.gen.Add(2) }

// put records the checksum of ext, read from [off, off+length) when the
// generation was gen. Callers hold the replica's mu shared.
func (c *sumCache) put(gen uint64, k sumKey, ext []Extent) {
	if gen%2 != 0 {
		return
	}
	crc := extentsChecksum(ext, k.off, k.length, k.own)
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.m == nil {
		c.m = map[sumKey]cachedSum{}
	}
	if len(c.m) >= maxCachedSums {
		for old := range c.m { // any: the oldest are the least likely asked for
			delete(c.m, old)
			break
		}
	}
	c.m[k] = cachedSum{gen: gen, crc: crc}
}

// take returns and forgets the checksum of k if it was read since the
// last change. Callers hold the replica's mu shared.
func (c *sumCache) take(k sumKey) (uint32, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	s, ok := c.m[k]
	if !ok {
		return 0, false
	}
	delete(c.m, k)
	return s.crc, s.gen == c.gen.Load()
}

// zeros feeds holes to a view's checksum.
var zeros [64 << 10]byte

// extentsChecksum is, from what a read of [off, off+length) returned,
// LayerChecksum's sum (own) or Checksum's (the view, holes as zeros).
func extentsChecksum(ext []Extent, off, length int64, own bool) uint32 {
	h := crc32.New(castagnoli)
	if own {
		// The data, then the first and end block of each run: readExtents
		// merges contiguous extents, as LayerChecksum merges runs.
		for _, x := range ext {
			h.Write(x.Data)
		}
		var b [8]byte
		for _, x := range ext {
			binary.LittleEndian.PutUint64(b[:], uint64(x.Offset/BlockSize))
			h.Write(b[:])
			binary.LittleEndian.PutUint64(b[:], uint64((x.Offset+int64(len(x.Data)))/BlockSize))
			h.Write(b[:])
		}
		return h.Sum32()
	}
	at := off
	zero := func(n int64) {
		for n > 0 {
			k := min(n, int64(len(zeros)))
			h.Write(zeros[:k])
			n -= k
		}
	}
	for _, x := range ext {
		zero(x.Offset - at)
		h.Write(x.Data)
		at = x.Offset + int64(len(x.Data))
	}
	zero(off + length - at)
	return h.Sum32()
}
