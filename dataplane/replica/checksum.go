// Checksums a rebuild verifies its copy with: of a snapshot's view and of
// one layer's own data, answered from the checksum cache (sumcache.go) when
// the range was just read.

package replica

import (
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"sync"
)

// castagnoli is the CRC-32C table every checksum here uses.
var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// sumChunk is how much a checksum reads at a time.
const sumChunk = 1 << 20

// sumBufs recycles the buffers checksums read through (aligned for
// direct I/O): a rebuild asks for one checksum per chunk on both sides,
// and a fresh buffer each time is a megabyte allocated and cleared.
var sumBufs = sync.Pool{New: func() any { b := alignedBuf(sumChunk); return &b }}

// Checksum returns the CRC-32C of [off, off+length) of the volume as it was
// at snapshot name (holes count as zeros), to verify a rebuild.
func (r *Replica) Checksum(name string, off, length int64) (uint32, error) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	top, err := r.snapshotSpan(name, off, length, "")
	if err != nil {
		return 0, err
	}
	if crc, ok := r.sums.take(sumKey{name, off, length, false}); ok {
		return crc, nil
	}
	h := crc32.New(castagnoli)
	pb := sumBufs.Get().(*[]byte)
	defer sumBufs.Put(pb)
	buf := (*pb)[:min(length, sumChunk)]
	for done := int64(0); done < length; {
		n := min(int64(len(buf)), length-done)
		if err := r.readChain(buf[:n], off+done, top); err != nil {
			return 0, err
		}
		h.Write(buf[:n])
		done += n
	}
	return h.Sum32(), nil
}

// LayerChecksum returns a CRC-32C of what snapshot name's own layer holds
// in [off, off+length) (block-aligned): its data and where that data lies,
// so a hole and a block of written zeros differ (in a layer they do: the
// hole shows the older layers through). Two layers with the same data at
// the same blocks have the same sum.
func (r *Replica) LayerChecksum(name string, off, length int64) (uint32, error) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	top, err := r.snapshotSpan(name, off, length, "layer checksums")
	if err != nil {
		return 0, err
	}
	if crc, ok := r.sums.take(sumKey{name, off, length, true}); ok {
		return crc, nil
	}
	l := r.layers[top-1]
	h := crc32.New(castagnoli)
	var runs []int64 // first and end block of each maximal data run
	pb := sumBufs.Get().(*[]byte)
	defer sumBufs.Put(pb)
	buf := (*pb)[:min(length, sumChunk)]
	err = eachRun(l.idx, off/BlockSize, length/BlockSize, true, func(b, n int64) error {
		if k := len(runs); k > 0 && runs[k-1] == b {
			runs[k-1] = b + n
		} else {
			runs = append(runs, b, b+n)
		}
		for c := b; c < b+n; {
			k := min(b+n-c, int64(len(buf))/BlockSize)
			if _, err := l.f.ReadAt(buf[:k*BlockSize], c*BlockSize); err != nil {
				return fmt.Errorf("read %s: %w", l.file, err)
			}
			h.Write(buf[:k*BlockSize])
			c += k
		}
		return nil
	})
	if err != nil {
		return 0, err
	}
	var x [8]byte
	for _, v := range runs {
		binary.LittleEndian.PutUint64(x[:], uint64(v))
		h.Write(x[:])
	}
	return h.Sum32(), nil
}
