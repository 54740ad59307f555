package engine_test

import (
	"bytes"
	"context"
	"testing"

	"github.com/cairn-io/cairn/dataplane/dataconn"
	"github.com/cairn-io/cairn/dataplane/engine"
)

// TestOpenReconcilesDivergentReplicas: an engine died with writes applied
// on some replicas only (written here straight to two of the three, in
// many regions, as a killed engine leaves them); the next engine makes
// every replica identical in every region before it serves, and what it
// reads is what each replica holds.
func TestOpenReconcilesDivergentReplicas(t *testing.T) {
	ctx := context.Background()
	const size = 32 << 20
	e, reps := cluster(t, 3, size)
	if err := e.WriteAt(ctx, pattern(1, size), 0, false); err != nil {
		t.Fatal(err)
	}
	if err := e.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	epoch := e.Epoch()
	// Close without the final clean flush, as a killed engine: the
	// replicas keep their write-intent bits.
	e.Close()
	for i, tr := range reps[1:] {
		c, err := dataconn.Dial(ctx, "tcp", tr.data, dataconn.ClientOptions{Conns: 1})
		if err != nil {
			t.Fatal(err)
		}
		c.SetEpoch(epoch)
		for off := int64(i) << 20; off < size; off += 3 << 20 {
			if err := c.WriteAt(ctx, pattern(10+i, 64<<10), off+4096, false); err != nil {
				t.Fatal(err)
			}
		}
		if err := c.Flush(ctx); err != nil {
			t.Fatal(err)
		}
		c.Close()
	}
	e2, err := engine.Open(ctx, engine.Options{Name: "test", Replicas: []string{reps[0].addr, reps[1].addr, reps[2].addr}, Dial: dialer()})
	if err != nil {
		t.Fatal(err)
	}
	defer e2.Close()
	if m := modes(e2); m[reps[0].addr] != "RW" || m[reps[1].addr] != "RW" || m[reps[2].addr] != "RW" {
		t.Fatalf("modes after open: %v", m)
	}
	want := make([]byte, size)
	if err := e2.ReadAt(ctx, want, 0); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, size)
	for _, tr := range reps {
		for off := int64(0); off < size; off += 4 << 20 {
			readReplica(t, tr, e2.Epoch(), got[off:off+4<<20], off)
		}
		if !bytes.Equal(got, want) {
			t.Fatalf("replica %s differs from what the engine reads after the open", tr.addr)
		}
	}
}

// BenchmarkOpenReconcile times an engine's open over three replicas whose
// every region of a 128 MiB volume is marked dirty (a killed engine's
// leftovers after writing the whole volume): the application's pause
// after an engine dies is mostly this.
func BenchmarkOpenReconcile(b *testing.B) {
	ctx := context.Background()
	const size = 128 << 20
	for b.Loop() {
		b.StopTimer()
		e, reps := cluster(b, 3, size)
		for off := int64(0); off < size; off += 4 << 20 {
			if err := e.WriteAt(ctx, pattern(int(off>>20), 4<<20), off, false); err != nil {
				b.Fatal(err)
			}
		}
		e.Close()
		b.StartTimer()
		e2, err := engine.Open(ctx, engine.Options{Name: "bench", Replicas: []string{reps[0].addr, reps[1].addr, reps[2].addr}, Dial: dialer()})
		if err != nil {
			b.Fatal(err)
		}
		b.StopTimer()
		e2.Close()
		for _, r := range reps {
			r.kill()
		}
		b.StartTimer()
	}
	b.SetBytes(size)
}
