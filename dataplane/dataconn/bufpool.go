package dataconn

import (
	"math/bits"
	"sync"
)

// bufPool hands out byte slices in power-of-two size classes from 4 KiB up,
// so that steady-state I/O does not allocate per request.
type bufPool struct {
	classes []sync.Pool // class i holds slices of capacity 4096<<i
}

const minBufClass = 12 // 4 KiB

func newBufPool(max uint32) *bufPool {
	n := 1
	for (uint32(1) << (minBufClass + n - 1)) < max {
		n++
	}
	return &bufPool{classes: make([]sync.Pool, n)}
}

func classOf(n int) int {
	if n <= 1<<minBufClass {
		return 0
	}
	return bits.Len(uint(n-1)) - minBufClass
}

// get returns a slice of length n.
func (p *bufPool) get(n int) []byte {
	c := classOf(n)
	if c >= len(p.classes) {
		return make([]byte, n)
	}
	if b, ok := p.classes[c].Get().(*[]byte); ok {
		return (*b)[:n]
	}
	return make([]byte, n, 1<<(minBufClass+c))
}

// put returns b to the pool; b must not be used afterwards.
func (p *bufPool) put(b []byte) {
	c := classOf(cap(b))
	if c >= len(p.classes) || cap(b) != 1<<(minBufClass+c) {
		return
	}
	b = b[:0]
	p.classes[c].Put(&b)
}
