package engine_test

import (
	"bytes"
	"context"
	"math/rand/v2"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cairn-io/cairn/dataplane/engine"
)

// shuffledTarget is the replica being rebuilt, its layer writes each held
// a random few milliseconds, so that the chunks a rebuild has in flight
// finish out of order and their checksums race the other chunks' writes.
// It records the most layer writes it saw in progress at once.
type shuffledTarget struct {
	engine.Replica
	inFlight, most atomic.Int64
}

func (s *shuffledTarget) WriteLayer(ctx context.Context, name string, p []byte, off int64) error {
	n := s.inFlight.Add(1)
	defer s.inFlight.Add(-1)
	for m := s.most.Load(); n > m && !s.most.CompareAndSwap(m, n); m = s.most.Load() {
	}
	time.Sleep(rand.N(3 * time.Millisecond))
	return s.Replica.WriteLayer(ctx, name, p, off)
}

// TestRebuildChunksInFlightWithRacingWrites: a full rebuild of a volume of
// many chunks, two layers deep (a user snapshot and the rebuild's), with
// holes, copies and verifies several chunks at once, out of order, while
// verified writes go on: afterwards the rebuilt replica alone holds every
// byte of the model (the data written before, then every write made
// during the rebuild), and the user snapshot's view, checksummed, is the
// source's.
func TestRebuildChunksInFlightWithRacingWrites(t *testing.T) {
	ctx := context.Background()
	const chunk = engine.RebuildChunk
	const size = 12 * chunk
	var reps []*testReplica
	var addrs []string
	for i := range 2 {
		tr := startReplica(t, filepath.Join(t.TempDir(), string(rune('a'+i))), size, "")
		reps, addrs = append(reps, tr), append(addrs, tr.addr)
	}
	fresh := startReplica(t, filepath.Join(t.TempDir(), "fresh"), size, "")
	var target *shuffledTarget
	var mu sync.Mutex
	dial := dialer()
	e, err := engine.Open(ctx, engine.Options{Name: "test", Replicas: addrs, Dial: func(ctx context.Context, addr string) (engine.Replica, error) {
		r, err := dial(ctx, addr)
		if err != nil || addr != fresh.addr {
			return r, err
		}
		mu.Lock()
		defer mu.Unlock()
		target = &shuffledTarget{Replica: r}
		return target, nil
	}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })

	// The model: half of most chunks written before the snapshot (a hole
	// around each half, every third chunk left empty), then a quarter of
	// every other chunk written over after it.
	model := make([]byte, size)
	write := func(p []byte, off int64) {
		t.Helper()
		if err := e.WriteAt(ctx, p, off, false); err != nil {
			t.Fatal(err)
		}
		copy(model[off:], p)
	}
	for c := int64(0); c < size/chunk; c++ {
		if c%3 != 2 {
			write(pattern(int(c), chunk/2), c*chunk+chunk/4)
		}
	}
	if err := e.Snapshot(ctx, "s1"); err != nil {
		t.Fatal(err)
	}
	for c := int64(0); c < size/chunk; c += 2 {
		write(pattern(int(100+c), chunk/4), c*chunk+chunk/8)
	}

	wctx, stop := context.WithCancel(ctx)
	v := &verifier{}
	wg := v.run(wctx, t, e, 4, size/4096)
	waitFor(t, "writes to start", func() bool { return v.ops.Load() > 50 })
	if err := e.AddReplica(ctx, fresh.addr); err != nil {
		t.Fatal(err)
	}
	st, err := e.WaitRebuild(ctx, fresh.addr)
	stop()
	wg.Wait()
	if err != nil || st.State != engine.RebuildComplete || st.DirtyOnly {
		t.Fatalf("rebuild: %+v %v", st, err)
	}
	if len(st.Layers) != 2 || st.BytesDone != st.BytesTotal || st.BytesCopied != st.BytesTotal {
		t.Fatalf("rebuild status: %+v", st)
	}
	// The wrapper hides the client's LayerPuller: the engine relays.
	if !strings.Contains(st.RelayReason, "cannot pull") {
		t.Fatalf("rebuild status: %+v: want the reason the data went through the engine", st)
	}
	if m := target.most.Load(); m < 2 {
		t.Fatalf("at most %d layer write in flight at once: the chunks were copied one at a time", m)
	}
	if v.errs.Load() != 0 {
		t.Fatalf("%d I/O errors", v.errs.Load())
	}
	for b, p := range v.content {
		copy(model[b*4096:], p)
	}

	want, err := reps[0].run.Replica.Checksum("s1", 0, size)
	if err != nil {
		t.Fatal(err)
	}
	got, err := fresh.run.Replica.Checksum("s1", 0, size)
	if err != nil || got != want {
		t.Fatalf("snapshot s1 on the rebuilt replica: checksum %08x (%v), the source's %08x", got, err, want)
	}

	// Lose the originals: the rebuilt replica alone must hold everything.
	reps[0].kill()
	reps[1].kill()
	waitFor(t, "originals to be dropped", func() bool {
		m := modes(e)
		return m[reps[0].addr] == "ERR" && m[reps[1].addr] == "ERR"
	})
	all := make([]byte, size)
	if err := e.ReadAt(ctx, all, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(all, model) {
		for off := 0; off < size; off += 4096 {
			if !bytes.Equal(all[off:off+4096], model[off:off+4096]) {
				t.Fatalf("the rebuilt replica's block at %d differs from the model", off)
			}
		}
	}
}
