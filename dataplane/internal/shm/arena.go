package shm

import (
	"sync"
)

// Arena hands out byte slices in power-of-two size classes from 4 KiB up to
// 32 MiB, so that steady-state I/O does not allocate per request. With a
// Region, slices come from it while it has room (each class keeps the slots
// it carved, for reuse); beyond that, and always without a Region, they come
// from the Go heap. A caller never needs to know which: Region.Offset tells.
type Arena struct {
	region *Region
	heap   [arenaClasses]sync.Pool // *[]byte of capacity 4096<<c

	mu   sync.Mutex
	next uint64                 // first region byte not yet carved
	free [arenaClasses][]uint64 // per class: offsets of returned slots
	out  int                    // region slots handed out, not returned
	gets uint64                 // region slots handed out, ever
	seen uint64                 // gets at the last ReleaseIdle
	// touched holds the offset and size of every slot used since its
	// memory was last released.
	touched map[uint64]uint64
}

const arenaClasses = 14 // 4 KiB << 0..13, up to 32 MiB

// NewArena returns an arena over r; r may be nil (heap only).
func NewArena(r *Region) *Arena { return &Arena{region: r} }

func sizeClass(n int) int {
	c := 0
	for 4096<<c < n {
		c++
	}
	return c
}

// Get returns a slice of length n (nil for n == 0). Its contents are
// undefined.
func (a *Arena) Get(n int) []byte {
	if n <= 0 {
		return nil
	}
	c := sizeClass(n)
	if c >= arenaClasses {
		return make([]byte, n)
	}
	if b := a.fromRegion(c); b != nil {
		return b[:n]
	}
	if b, ok := a.heap[c].Get().(*[]byte); ok {
		return (*b)[:n]
	}
	return make([]byte, n, 4096<<c)
}

// fromRegion returns a whole slot of class c, or nil when the region has
// none to give. A class may take at most an eighth of the region, so one
// burst of huge requests cannot starve the common sizes.
func (a *Arena) fromRegion(c int) []byte {
	if a.region == nil {
		return nil
	}
	size := uint64(4096) << c
	mem := a.region.mem
	if size > uint64(len(mem))/8 {
		return nil
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	var off uint64
	if f := a.free[c]; len(f) > 0 {
		off = f[len(f)-1]
		a.free[c] = f[:len(f)-1]
	} else {
		if size > uint64(len(mem))-a.next {
			return nil
		}
		off = a.next
		a.next += size
	}
	a.out++
	a.gets++
	if a.touched == nil {
		a.touched = map[uint64]uint64{}
	}
	a.touched[off] = size
	return mem[off : off+size : off+size]
}

// Put returns b, which must have come from Get and must not be used
// afterwards. Slices of other origin are ignored.
func (a *Arena) Put(b []byte) {
	if cap(b) == 0 {
		return
	}
	c := sizeClass(cap(b))
	if c >= arenaClasses || cap(b) != 4096<<c {
		return
	}
	b = b[:cap(b)]
	if a.region != nil {
		if off, ok := a.region.Offset(b); ok {
			a.mu.Lock()
			a.free[c] = append(a.free[c], off)
			a.out--
			a.mu.Unlock()
			return
		}
	}
	b = b[:0]
	a.heap[c].Put(&b)
}

// ReleaseIdle gives the memory behind the region's free slots back to the
// system (their pages read as zeros until next written) when no slot was
// handed out since the previous call, and returns how many bytes it
// released. Called on an interval, it leaves a busy arena's pages alone
// and empties an idle one's: a node with many mostly idle volumes does not
// keep every engine's peak of buffers resident.
func (a *Arena) ReleaseIdle() (int64, error) {
	if a.region == nil {
		return 0, nil
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.gets != a.seen {
		a.seen = a.gets
		return 0, nil
	}
	var released int64
	for c := range a.free {
		for _, off := range a.free[c] {
			size, ok := a.touched[off]
			if !ok {
				continue
			}
			if err := a.region.punch(off, size); err != nil {
				return released, err
			}
			delete(a.touched, off)
			released += int64(size)
		}
	}
	return released, nil
}

// InUse reports how many region slots are handed out and not yet returned
// (tests use it to find leaks).
func (a *Arena) InUse() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.out
}
