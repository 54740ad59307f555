package replica

import (
	"math/bits"
	"sort"
	"sync"
)

// BlockSize is the unit of allocation tracking: every layer records, per
// 4 KiB block, whether it holds data.
const BlockSize = 4096

// chunkBlocks is how many blocks one index chunk covers (128 MiB). A chunk
// is in one of four forms: all holes or all data (its 16-byte header only),
// sparse (a sorted list of the blocks with data, at most arrayMax of them,
// 2 bytes each) or mixed (a 4 KiB bitmap).
const (
	chunkBlocks = 1 << 15
	chunkWords  = chunkBlocks / 64
	arrayMax    = 256 // past this a chunk becomes a bitmap (4 KiB: 2,048 entries' worth)
)

type chunk struct {
	bits  *[chunkWords]uint64 // the mixed form; nil otherwise
	count uint32              // blocks with data
}

// blockIndex records which blocks of one layer hold data. Per TiB:
// contiguous data and holes cost 128 KiB (16 bytes per 128 MiB); scattered
// small writes a few bytes each (sparse chunks); the worst case (every
// chunk mixed) one bit per block, 32 MiB. It is safe for concurrent use.
type blockIndex struct {
	mu     sync.RWMutex
	chunks []chunk
	// sparse holds the sorted block offsets of chunks in the sparse form
	// (0 < count < chunkBlocks and no bitmap).
	sparse map[int64][]uint16
	blocks int64
}

func newBlockIndex(blocks int64) *blockIndex {
	return &blockIndex{chunks: make([]chunk, (blocks+chunkBlocks-1)/chunkBlocks), sparse: map[int64][]uint16{}, blocks: blocks}
}

// grow extends the index to cover blocks (expansion); new blocks are holes.
func (x *blockIndex) grow(blocks int64) {
	x.mu.Lock()
	defer x.mu.Unlock()
	if blocks <= x.blocks {
		return
	}
	n := (blocks + chunkBlocks - 1) / chunkBlocks
	for int64(len(x.chunks)) < n {
		x.chunks = append(x.chunks, chunk{})
	}
	x.blocks = blocks
}

// has reports whether block b holds data.
func (x *blockIndex) has(b int64) bool {
	x.mu.RLock()
	defer x.mu.RUnlock()
	return x.hasLocked(b)
}

func (x *blockIndex) hasLocked(b int64) bool {
	if b < 0 || b >= x.blocks {
		return false
	}
	ci := b / chunkBlocks
	c := &x.chunks[ci]
	i := b % chunkBlocks
	switch {
	case c.count == 0:
		return false
	case c.bits != nil:
		return c.bits[i/64]&(1<<(i%64)) != 0
	case c.count == chunkBlocks:
		return true
	}
	arr := x.sparse[ci]
	k := sort.Search(len(arr), func(j int) bool { return int64(arr[j]) >= i })
	return k < len(arr) && int64(arr[k]) == i
}

// set marks blocks [b, b+n) as holding data.
func (x *blockIndex) set(b, n int64) { x.update(b, n, true) }

// clear marks blocks [b, b+n) as holes.
func (x *blockIndex) clear(b, n int64) { x.update(b, n, false) }

func (x *blockIndex) update(b, n int64, v bool) {
	x.mu.Lock()
	defer x.mu.Unlock()
	if b < 0 {
		n += b
		b = 0
	}
	if b+n > x.blocks {
		n = x.blocks - b
	}
	for n > 0 {
		ci := b / chunkBlocks
		start := b % chunkBlocks
		m := min(n, chunkBlocks-start)
		x.updateChunk(ci, start, m, v)
		b += m
		n -= m
	}
}

// updateChunk sets or clears [start, start+n) within chunk ci, choosing the
// chunk's form.
func (x *blockIndex) updateChunk(ci, start, n int64, v bool) {
	c := &x.chunks[ci]
	if n == chunkBlocks { // whole chunk: uniform either way
		c.bits = nil
		delete(x.sparse, ci)
		c.count = 0
		if v {
			c.count = chunkBlocks
		}
		return
	}
	if c.bits == nil {
		if (v && c.count == chunkBlocks) || (!v && c.count == 0) {
			return // already so
		}
		if c.count < chunkBlocks { // empty or sparse: try to stay sparse
			if arr, ok := sparseUpdate(x.sparse[ci], start, n, v); ok {
				c.count = uint32(len(arr))
				if len(arr) == 0 {
					delete(x.sparse, ci)
				} else {
					x.sparse[ci] = arr
				}
				return
			}
		}
		// Becomes mixed: a bitmap, seeded from the current form.
		c.bits = new([chunkWords]uint64)
		if c.count == chunkBlocks {
			for i := range c.bits {
				c.bits[i] = ^uint64(0)
			}
		}
		for _, i := range x.sparse[ci] {
			c.bits[i/64] |= 1 << (i % 64)
		}
		delete(x.sparse, ci)
	}
	c.updateBits(start, n, v)
}

// sparseUpdate applies the change to a sorted block list, or reports that
// the result would exceed arrayMax entries.
func sparseUpdate(arr []uint16, start, n int64, v bool) ([]uint16, bool) {
	lo := sort.Search(len(arr), func(j int) bool { return int64(arr[j]) >= start })
	hi := sort.Search(len(arr), func(j int) bool { return int64(arr[j]) >= start+n })
	if !v {
		return append(arr[:lo:lo], arr[hi:]...), true
	}
	if len(arr)-(hi-lo)+int(n) > arrayMax {
		return nil, false
	}
	out := make([]uint16, 0, len(arr)-(hi-lo)+int(n))
	out = append(out, arr[:lo]...)
	for i := start; i < start+n; i++ {
		out = append(out, uint16(i))
	}
	return append(out, arr[hi:]...), true
}

// updateBits sets or clears [start, start+n) in a mixed chunk, and returns
// it to a uniform form when it becomes all holes or all data.
func (c *chunk) updateBits(start, n int64, v bool) {
	for i := start; i < start+n; {
		w, off := i/64, i%64
		span := min(64-off, start+n-i)
		mask := ^uint64(0)
		if span < 64 {
			mask = ((uint64(1) << span) - 1) << off
		}
		old := c.bits[w]
		if v {
			c.bits[w] |= mask
		} else {
			c.bits[w] &^= mask
		}
		c.count += uint32(bits.OnesCount64(c.bits[w])) - uint32(bits.OnesCount64(old))
		i += span
	}
	if c.count == 0 || c.count == chunkBlocks {
		c.bits = nil
	}
}

// run returns how many blocks starting at b share b's state (data or hole),
// up to limit, and that state.
func (x *blockIndex) run(b, limit int64) (n int64, data bool) {
	x.mu.RLock()
	defer x.mu.RUnlock()
	if b >= x.blocks { // past this layer's end (an older, smaller layer): all hole
		return limit, false
	}
	data = x.hasLocked(b)
	end := min(b+limit, x.blocks)
	for n = 1; b+n < end; n++ {
		next := b + n
		c := &x.chunks[next/chunkBlocks]
		if next%chunkBlocks == 0 && c.bits == nil && (c.count == 0 || c.count == chunkBlocks) && (c.count != 0) == data {
			n += chunkBlocks - 1 // a whole uniform chunk: skip it
			continue
		}
		if x.hasLocked(next) != data {
			break
		}
	}
	return min(n, end-b), data
}

// count returns how many blocks hold data.
func (x *blockIndex) count() int64 {
	x.mu.RLock()
	defer x.mu.RUnlock()
	var t int64
	for i := range x.chunks {
		t += int64(x.chunks[i].count)
	}
	return t
}

// memBytes is the index's memory footprint: chunk headers plus bitmaps.
func (x *blockIndex) memBytes() int64 {
	x.mu.RLock()
	defer x.mu.RUnlock()
	m := int64(len(x.chunks)) * 16
	for i := range x.chunks {
		if x.chunks[i].bits != nil {
			m += chunkWords * 8
		}
	}
	for _, arr := range x.sparse {
		m += 48 + 2*int64(cap(arr)) // map entry, slice header, entries
	}
	return m
}
