package engine_test

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"path/filepath"
	"testing"
	"time"

	"github.com/cairn-io/cairn/dataplane/engine"
	"github.com/cairn-io/cairn/dataplane/engine/replicaclient"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
	"github.com/cairn-io/cairn/dataplane/volcrypt"
)

// testCipher is the cipher of a test key (seed picks the key).
func testCipher(t *testing.T, seed int) *volcrypt.Cipher {
	t.Helper()
	c, err := volcrypt.New(pattern(seed, volcrypt.KeySize))
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// encryptedCluster is cluster with the volume encrypted by c.
func encryptedCluster(t *testing.T, n int, size int64, c *volcrypt.Cipher) (*engine.Engine, []*testReplica) {
	t.Helper()
	var reps []*testReplica
	var addrs []string
	for i := range n {
		tr := startReplica(t, filepath.Join(t.TempDir(), fmt.Sprint("r", i)), size, "")
		reps = append(reps, tr)
		addrs = append(addrs, tr.addr)
	}
	e, err := engine.Open(context.Background(), engine.Options{Name: "test", Replicas: addrs, Dial: dialer(), Cipher: c})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	if !e.Encrypted() {
		t.Fatal("an engine opened with a cipher says it is not encrypted")
	}
	return e, reps
}

// rawVolume reads a replica's whole volume as it stores it.
func rawVolume(t *testing.T, tr *testReplica, epoch uint64, size int64) []byte {
	t.Helper()
	b := make([]byte, size)
	for off := int64(0); off < size; off += 1 << 20 {
		readReplica(t, tr, epoch, b[off:min(off+1<<20, size)], off)
	}
	return b
}

// TestEncryptedReplicasHoldCiphertext: through an encrypted engine a write
// reads back as written, while every replica holds exactly its
// AES-XTS ciphertext under the volume's sector numbers (and never the
// plaintext); the caller's buffer is left as it was. A range never written
// and a discarded range read as zeros, and the discard reaches the
// replicas as zeros, not as encrypted data.
func TestEncryptedReplicasHoldCiphertext(t *testing.T) {
	ctx := context.Background()
	const size = 4 << 20
	c := testCipher(t, 1)
	e, reps := encryptedCluster(t, 3, size, c)
	data := pattern(2, 1<<20)
	caller := bytes.Clone(data)
	const at = 64 << 10
	if err := e.WriteAt(ctx, caller, at, false); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(caller, data) {
		t.Fatal("the write changed the caller's buffer")
	}
	got := make([]byte, len(data))
	if err := e.ReadAt(ctx, got, at); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("read back through the engine: %v (equal %v)", err, bytes.Equal(got, data))
	}
	want := make([]byte, len(data))
	if err := c.Encrypt(want, data, at); err != nil {
		t.Fatal(err)
	}
	for _, tr := range reps {
		raw := rawVolume(t, tr, e.Epoch(), size)
		if !bytes.Equal(raw[at:at+len(data)], want) {
			t.Fatalf("replica %s does not hold the ciphertext of the write", tr.addr)
		}
		if bytes.Contains(raw, data[:64]) {
			t.Fatalf("replica %s holds plaintext", tr.addr)
		}
	}

	zeros := make([]byte, 1<<20)
	if err := e.ReadAt(ctx, got, 2<<20); err != nil || !bytes.Equal(got, zeros) {
		t.Fatalf("a range never written: %v, zeros %v", err, bytes.Equal(got, zeros))
	}
	// Discard 64 KiB in the middle of the write.
	const hole, holeLen = at + 256<<10, 64 << 10
	if err := e.Unmap(ctx, hole, holeLen); err != nil {
		t.Fatal(err)
	}
	if err := e.ReadAt(ctx, got, at); err != nil {
		t.Fatal(err)
	}
	copy(data[hole-at:], zeros[:holeLen])
	if !bytes.Equal(got, data) {
		t.Fatal("after a discard: the discarded range does not read as zeros, or the rest changed")
	}
	for _, tr := range reps {
		raw := rawVolume(t, tr, e.Epoch(), size)
		if !bytes.Equal(raw[hole:hole+holeLen], zeros[:holeLen]) {
			t.Fatalf("replica %s: the discarded range is not zeros on the replica", tr.addr)
		}
	}
}

// TestEncryptedUnalignedIO: reads, writes and discards at any byte offset
// and length (a FUSE file written directly, an NBD client that ignores the
// minimum block size) on an encrypted volume behave as on a plain one: a
// model of the volume's bytes predicts every read, and each replica's
// ciphertext decrypts to the model.
func TestEncryptedUnalignedIO(t *testing.T) {
	ctx := context.Background()
	const size = 1 << 20
	c := testCipher(t, 3)
	e, reps := encryptedCluster(t, 2, size, c)
	model := make([]byte, size)
	r := rand.New(rand.NewPCG(4, 5))
	span := func() (int64, int) {
		n := 1 + r.IntN(20000)
		return r.Int64N(size - int64(n)), n
	}
	for i := range 400 {
		off, n := span()
		switch op := r.IntN(4); op {
		case 0, 1:
			p := pattern(100+i, n)
			if err := e.WriteAt(ctx, p, off, false); err != nil {
				t.Fatalf("op %d: write %d bytes at %d: %v", i, n, off, err)
			}
			copy(model[off:], p)
		case 2:
			got := make([]byte, n)
			if err := e.ReadAt(ctx, got, off); err != nil {
				t.Fatalf("op %d: read %d bytes at %d: %v", i, n, off, err)
			}
			if !bytes.Equal(got, model[off:off+int64(n)]) {
				t.Fatalf("op %d: read %d bytes at %d: not what was written", i, n, off)
			}
		case 3:
			if err := e.Unmap(ctx, off, int64(n)); err != nil {
				t.Fatalf("op %d: discard %d bytes at %d: %v", i, n, off, err)
			}
			clear(model[off : off+int64(n)])
		}
	}
	got := make([]byte, size)
	if err := e.ReadAt(ctx, got, 0); err != nil || !bytes.Equal(got, model) {
		t.Fatalf("the whole volume: %v (equal %v)", err, bytes.Equal(got, model))
	}
	for _, tr := range reps {
		raw := rawVolume(t, tr, e.Epoch(), size)
		if err := c.Decrypt(raw, 0); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(raw, model) {
			t.Fatalf("replica %s does not decrypt to what was written", tr.addr)
		}
	}
}

// TestEncryptedRebuildUnderWrites: a replica of an encrypted volume is
// killed during continuous verified writes and a fresh one rebuilt while
// they go on. The rebuild copies ciphertext as it is: the new replica's
// bytes equal a survivor's, hold no plaintext, and alone (the originals
// killed) it serves every byte written.
func TestEncryptedRebuildUnderWrites(t *testing.T) {
	ctx := context.Background()
	const size = 16 << 20
	c := testCipher(t, 6)
	e, reps := encryptedCluster(t, 3, size, c)
	base := pattern(7, size)
	if err := e.WriteAt(ctx, base, 0, false); err != nil {
		t.Fatal(err)
	}
	wctx, stop := context.WithCancel(ctx)
	v := &verifier{}
	wg := v.run(wctx, t, e, 4, size/4096)
	waitFor(t, "writes to start", func() bool { return v.ops.Load() > 100 })
	reps[1].kill()
	waitFor(t, "the killed replica to be ERR", func() bool { return modes(e)[reps[1].addr] == "ERR" })
	fresh := startReplica(t, filepath.Join(t.TempDir(), "fresh"), size, "")
	if err := e.AddReplica(ctx, fresh.addr); err != nil {
		t.Fatal(err)
	}
	st, err := e.WaitRebuild(ctx, fresh.addr)
	if err != nil || st.State != engine.RebuildComplete {
		t.Fatalf("rebuild: %+v %v", st, err)
	}
	stop()
	wg.Wait()
	if v.errs.Load() != 0 {
		t.Fatalf("%d I/O errors", v.errs.Load())
	}
	want := bytes.Clone(base)
	for b, p := range v.content {
		copy(want[b*4096:], p)
	}
	rebuilt := rawVolume(t, fresh, e.Epoch(), size)
	if !bytes.Equal(rebuilt, rawVolume(t, reps[0], e.Epoch(), size)) {
		t.Fatal("the rebuilt replica's bytes differ from a survivor's")
	}
	if bytes.Contains(rebuilt, base[:64]) {
		t.Fatal("the rebuilt replica holds plaintext")
	}
	reps[0].kill()
	reps[2].kill()
	waitFor(t, "originals to be dropped", func() bool {
		m := modes(e)
		return m[reps[0].addr] == "ERR" && m[reps[2].addr] == "ERR"
	})
	got := make([]byte, size)
	if err := e.ReadAt(ctx, got, 0); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("from the rebuilt replica alone: %v (equal %v)", err, bytes.Equal(got, want))
	}
}

// TestEncryptedCloneCopiesCiphertext: an encrypted volume cloned from an
// encrypted source's snapshot (same key: the key depends on the passphrase
// alone) gets the source's ciphertext byte for byte, not encrypted a
// second time: the copy's verification, which compares the replicas'
// bytes, passes, and the clone reads the snapshot's plaintext. Snapshot
// and revert on the source read back the plaintext of the time.
func TestEncryptedCloneCopiesCiphertext(t *testing.T) {
	ctx := context.Background()
	const size = 8 << 20
	c := testCipher(t, 8)
	src, srcReps := encryptedCluster(t, 2, size, c)
	a := pattern(9, 2<<20)
	if err := src.WriteAt(ctx, a, 1<<20, false); err != nil {
		t.Fatal(err)
	}
	if err := src.Snapshot(ctx, "s1"); err != nil {
		t.Fatal(err)
	}
	if err := src.WriteAt(ctx, pattern(10, 1<<20), 1<<20, false); err != nil {
		t.Fatal(err)
	}

	dst, dstReps := encryptedCluster(t, 2, size, c)
	source, err := replicaclient.DialSource(srcReps[1].ctl, deadline.Scale(5*time.Second), nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := dst.CloneFrom(source, srcReps[1].ctl, "s1"); err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, deadline.Scale(60*time.Second))
	defer cancel()
	if st, err := dst.WaitClone(wctx); err != nil || st.State != engine.RebuildComplete {
		t.Fatalf("clone: %+v, %v", st, err)
	}
	got := make([]byte, len(a))
	if err := dst.ReadAt(ctx, got, 1<<20); err != nil || !bytes.Equal(got, a) {
		t.Fatalf("the clone reads: %v (the snapshot's data: %v)", err, bytes.Equal(got, a))
	}
	want := make([]byte, len(a))
	if err := c.Encrypt(want, a, 1<<20); err != nil {
		t.Fatal(err)
	}
	for _, tr := range dstReps {
		if raw := rawVolume(t, tr, dst.Epoch(), size); !bytes.Equal(raw[1<<20:1<<20+len(a)], want) {
			t.Fatalf("clone replica %s does not hold the source's ciphertext", tr.addr)
		}
	}

	if err := src.Revert(ctx, "s1"); err != nil {
		t.Fatal(err)
	}
	if err := src.ReadAt(ctx, got, 1<<20); err != nil || !bytes.Equal(got, a) {
		t.Fatalf("the source after revert: %v (the snapshot's data: %v)", err, bytes.Equal(got, a))
	}
}

// TestEncryptedExpand: after an online expansion of an encrypted volume
// the new range reads as zeros, then as what is written there.
func TestEncryptedExpand(t *testing.T) {
	ctx := context.Background()
	c := testCipher(t, 11)
	e, _ := encryptedCluster(t, 2, 2<<20, c)
	a := pattern(12, 1<<20)
	if err := e.WriteAt(ctx, a, 1<<20, false); err != nil {
		t.Fatal(err)
	}
	if err := e.Expand(ctx, 4<<20); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 2<<20)
	if err := e.ReadAt(ctx, got, 2<<20); err != nil || !bytes.Equal(got, make([]byte, 2<<20)) {
		t.Fatalf("the new range: %v (zeros: %v)", err, bytes.Equal(got, make([]byte, 2<<20)))
	}
	b := pattern(13, 2<<20)
	if err := e.WriteAt(ctx, b, 2<<20, false); err != nil {
		t.Fatal(err)
	}
	all := make([]byte, 4<<20)
	if err := e.ReadAt(ctx, all, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(all[1<<20:2<<20], a) || !bytes.Equal(all[2<<20:], b) || !bytes.Equal(all[:1<<20], make([]byte, 1<<20)) {
		t.Fatal("after the expansion the volume does not read as written")
	}
}
