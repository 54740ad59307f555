package replica

import (
	"math/bits"
	"sync"
)

// BlockSize is the unit of allocation tracking: every layer records, per
// 4 KiB block, whether it holds data.
const BlockSize = 4096

// chunkBlocks is how many blocks one index chunk covers (128 MiB). A chunk
// that is all holes or all data costs only its 16-byte header; a mixed
// chunk adds a 4 KiB bitmap.
const (
	chunkBlocks = 1 << 15
	chunkWords  = chunkBlocks / 64
)

type chunk struct {
	bits  *[chunkWords]uint64 // nil when count is 0 (all holes) or chunkBlocks (all data)
	count uint32              // blocks with data
}

// blockIndex records which blocks of one layer hold data. The worst case
// (alternating data and holes everywhere) is one bit per block, 32 MiB per
// TiB; contiguous data and holes cost 16 bytes per 128 MiB, 128 KiB per TiB.
// It is safe for concurrent use.
type blockIndex struct {
	mu     sync.RWMutex
	chunks []chunk
	blocks int64
}

func newBlockIndex(blocks int64) *blockIndex {
	return &blockIndex{chunks: make([]chunk, (blocks+chunkBlocks-1)/chunkBlocks), blocks: blocks}
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
	c := &x.chunks[b/chunkBlocks]
	switch {
	case c.count == 0:
		return false
	case c.bits == nil:
		return true
	}
	i := b % chunkBlocks
	return c.bits[i/64]&(1<<(i%64)) != 0
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
		x.chunks[ci].update(start, m, v)
		b += m
		n -= m
	}
}

// update sets or clears [start, start+n) within one chunk.
func (c *chunk) update(start, n int64, v bool) {
	if n == chunkBlocks { // whole chunk: no bitmap either way
		c.bits = nil
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
		c.bits = new([chunkWords]uint64)
		if c.count == chunkBlocks {
			for i := range c.bits {
				c.bits[i] = ^uint64(0)
			}
		}
	}
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
		if next%chunkBlocks == 0 && c.bits == nil && (c.count != 0) == data {
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
	return m
}
