package replica

import (
	"math/rand/v2"
	"testing"
)

// TestIndexMatchesModel drives the index and a plain bool slice with the
// same random updates and compares every query.
func TestIndexMatchesModel(t *testing.T) {
	const blocks = 3*chunkBlocks + 1234
	x := newBlockIndex(blocks)
	model := make([]bool, blocks)
	r := rand.New(rand.NewPCG(1, 2))
	for it := range 3000 {
		var b, n int64
		switch r.IntN(4) {
		case 0: // small
			b, n = r.Int64N(blocks), 1+r.Int64N(70)
		case 1: // chunk-sized and aligned
			b, n = r.Int64N(4)*chunkBlocks, chunkBlocks
		case 2: // large, unaligned
			b, n = r.Int64N(blocks), r.Int64N(2*chunkBlocks)
		default: // single block
			b, n = r.Int64N(blocks), 1
		}
		v := r.IntN(2) == 0
		if v {
			x.set(b, n)
		} else {
			x.clear(b, n)
		}
		for i := b; i < min(b+n, blocks); i++ {
			model[i] = v
		}
		if it%100 == 0 {
			var want int64
			for i := range model {
				if model[i] {
					want++
				}
				if x.has(int64(i)) != model[i] {
					t.Fatalf("iteration %d: block %d: index %v, model %v", it, i, x.has(int64(i)), model[i])
				}
			}
			if x.count() != want {
				t.Fatalf("count %d, want %d", x.count(), want)
			}
			// run() agrees with the model from random points.
			for range 50 {
				s := r.Int64N(blocks)
				n, data := x.run(s, 1<<40)
				if data != model[s] {
					t.Fatalf("run(%d) state %v, model %v", s, data, model[s])
				}
				for i := s; i < s+n; i++ {
					if model[i] != data {
						t.Fatalf("run(%d) = %d blocks of %v, but block %d is %v", s, n, data, i, model[i])
					}
				}
				if s+n < blocks && model[s+n] == data {
					t.Fatalf("run(%d) stopped early at %d", s, s+n)
				}
			}
		}
	}
}

func TestIndexMemory(t *testing.T) {
	const tib = int64(1) << 40
	blocks := tib / BlockSize
	x := newBlockIndex(blocks)
	if got := x.memBytes(); got != 128<<10 {
		t.Fatalf("empty 1 TiB index: %d bytes, want 128 KiB", got)
	}
	x.set(0, blocks)
	if got := x.memBytes(); got != 128<<10 {
		t.Fatalf("full 1 TiB index: %d bytes, want 128 KiB", got)
	}
	for b := int64(0); b < blocks; b += 2 * chunkBlocks / 64 { // a hole in every 64th... of each chunk
		x.clear(b, 1)
	}
	if got, max := x.memBytes(), int64(32<<20)+128<<10; got > max {
		t.Fatalf("worst case: %d bytes, want at most %d", got, max)
	}
	// Scattered single blocks (a few per chunk) stay in the sparse form.
	y := newBlockIndex(blocks)
	for b := int64(0); b < blocks; b += chunkBlocks / 4 {
		y.set(b+7, 1)
	}
	if got := y.memBytes(); got > 1<<20 {
		t.Fatalf("4 scattered blocks per chunk over 1 TiB: %d bytes, want under 1 MiB", got)
	}
	if !y.has(7) || y.has(8) || y.count() != blocks/(chunkBlocks/4) {
		t.Fatal("sparse chunks answer wrongly")
	}
}
