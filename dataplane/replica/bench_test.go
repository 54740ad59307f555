package replica

import (
	"math/rand/v2"
	"path/filepath"
	"testing"
)

// BenchmarkIndexMemory reports the block index's memory for a 1 TiB
// volume (Longhorn v1 keeps one byte per 4 KiB block: 256 MiB per TiB):
//
//   - empty and full: 128 KiB (16 bytes per 128 MiB chunk);
//   - scattered: a real 1 TiB sparse replica after 20,000 random 4 KiB
//     writes (sparse chunks: a short sorted list each);
//   - worst: more than 256 separate runs of data in every chunk, so every
//     chunk needs its bitmap: 32 MiB + 128 KiB.
func BenchmarkIndexMemory(b *testing.B) {
	const tib = int64(1) << 40
	report := func(b *testing.B, bytes int64) {
		b.ReportMetric(float64(bytes), "bytes/TiB")
		b.ReportMetric(float64(256<<20)/float64(bytes), "x-smaller-than-1-byte-per-block")
	}
	b.Run("empty", func(b *testing.B) {
		for range b.N {
			report(b, newBlockIndex(tib/BlockSize).memBytes())
		}
	})
	b.Run("full", func(b *testing.B) {
		for range b.N {
			x := newBlockIndex(tib / BlockSize)
			x.set(0, tib/BlockSize)
			report(b, x.memBytes())
		}
	})
	b.Run("worst", func(b *testing.B) {
		for range b.N {
			x := newBlockIndex(tib / BlockSize)
			for c := int64(0); c < tib/BlockSize; c += chunkBlocks {
				for k := int64(0); k <= arrayMax; k++ {
					x.set(c+2*k, 1) // arrayMax+1 separate blocks: too many for the sparse form
				}
			}
			report(b, x.memBytes())
		}
	})
	b.Run("scattered-real-replica", func(b *testing.B) {
		for range b.N {
			dir := filepath.Join(b.TempDir(), "r")
			r, err := Open(dir, Options{Size: tib})
			if err != nil {
				b.Fatal(err)
			}
			rng := rand.New(rand.NewPCG(1, 1))
			p := make([]byte, BlockSize)
			for range 20000 {
				if _, err := r.WriteAt(p, rng.Int64N(tib/BlockSize)*BlockSize); err != nil {
					b.Fatal(err)
				}
			}
			r.Close()
			r, err = Open(dir, Options{}) // rebuilt from SEEK_DATA/SEEK_HOLE
			if err != nil {
				b.Fatal(err)
			}
			in, _ := r.Info()
			r.Close()
			report(b, in.IndexBytes)
		}
	})
}
