package backupstore

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"reflect"
	"runtime"
	"testing"
	"time"

	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

func sampleManifest() *Manifest {
	return &Manifest{
		ManifestMeta: ManifestMeta{Volume: "vol-1", Name: "b2", Parent: "b1", Created: time.Date(2026, 11, 27, 7, 0, 0, 0, time.UTC),
			Labels: map[string]string{"snapshot": "snap-2"}, NewBlocks: 1, NewBytes: 100},
		Size: 10<<20 + 4096, BlockSize: DefaultBlockSize,
		Blocks: []BlockRef{{Index: 0, Hash: sha256.Sum256([]byte("a"))}, {Index: 5, Hash: sha256.Sum256([]byte("b"))}},
	}
}

func TestManifestRoundTrip(t *testing.T) {
	m := sampleManifest()
	data, err := EncodeManifest(m)
	if err != nil {
		t.Fatal(err)
	}
	got, err := DecodeManifest(bytes.NewReader(data), MaxVolumeSize)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, m) {
		t.Errorf("decoded %+v, want %+v", got, m)
	}
	// Every single-byte change and every truncation is detected.
	for i := range data {
		bad := bytes.Clone(data)
		bad[i] ^= 0x20
		if _, err := DecodeManifest(bytes.NewReader(bad), MaxVolumeSize); !errors.Is(err, ErrCorrupt) {
			t.Fatalf("byte %d flipped: %v, want ErrCorrupt", i, err)
		}
		if _, err := DecodeManifest(bytes.NewReader(data[:i]), MaxVolumeSize); !errors.Is(err, ErrCorrupt) {
			t.Fatalf("truncated to %d bytes: %v, want ErrCorrupt", i, err)
		}
	}
	if _, err := DecodeManifest(bytes.NewReader(append(bytes.Clone(data), 0)), MaxVolumeSize); !errors.Is(err, ErrCorrupt) {
		t.Errorf("a byte after the trailer: %v, want ErrCorrupt", err)
	}
	if _, err := DecodeManifest(bytes.NewReader(data), 8<<20); !errors.Is(err, ErrCorrupt) {
		t.Errorf("a volume above the reader's bound: %v, want ErrCorrupt", err)
	}
}

// TestManifestBounds: a header that claims more entries than the volume
// has blocks is refused before anything is allocated for them, and a
// header that claims many entries the object does not hold allocates only
// for the bytes present.
func TestManifestBounds(t *testing.T) {
	data, _ := EncodeManifest(sampleManifest())
	hdr := bytes.Clone(data[:manifestHeaderLen])
	hdr[32], hdr[33] = 0xff, 0xff // entry count 2^63-ish
	if _, err := DecodeManifest(bytes.NewReader(hdr), MaxVolumeSize); !errors.Is(err, ErrCorrupt) {
		t.Errorf("entry count above the block count: %v", err)
	}
	// 64 TiB of 64 KiB blocks: 2^30 entries claimed, none present.
	m := &Manifest{ManifestMeta: ManifestMeta{Volume: "v", Name: "b"}, Size: MaxVolumeSize, BlockSize: MinBlockSize}
	data, _ = EncodeManifest(m)
	claim := bytes.Clone(data[:manifestHeaderLen])
	for i := 32; i < 40; i++ {
		claim[i] = 0
	}
	claim[34] = 0x40 // 1<<30 entries
	claim = append(claim, data[manifestHeaderLen:len(data)-manifestTrailer]...)
	var ms1, ms2 runtimeMem
	ms1.read()
	_, err := DecodeManifest(bytes.NewReader(claim), MaxVolumeSize)
	ms2.read()
	if !errors.Is(err, ErrCorrupt) {
		t.Errorf("a claim of 2^30 absent entries: %v", err)
	}
	if grew := ms2.total - ms1.total; grew > 16<<20 {
		t.Errorf("decoding a short manifest that claims 2^30 entries allocated %d bytes", grew)
	}
}

func TestIndexRoundTrip(t *testing.T) {
	idx := &Index{Format: indexFormat, Volume: "vol-1", Backups: []BackupInfo{infoOf(sampleManifest())}}
	data, err := EncodeIndex(idx)
	if err != nil {
		t.Fatal(err)
	}
	got, err := DecodeIndex(data, MaxVolumeSize)
	if err != nil || !reflect.DeepEqual(got, idx) {
		t.Fatalf("decoded %+v, %v; want %+v", got, err, idx)
	}
	for _, bad := range []string{
		`{"format":2,"volume":"vol-1","backups":[]}`,
		`{"format":1,"volume":"../x","backups":[]}`,
		`{"format":1,"volume":"v","backups":[{"name":"a","size":1048576,"blockSize":2097152},{"name":"a","size":1048576,"blockSize":2097152}]}`,
		`{"format":1,"volume":"v","backups":[{"name":"a","size":1048576,"blockSize":1000}]}`,
		`{"format":1,"volume":"v","backups":[{"name":"a","size":1048576,"blockSize":2097152,"blocks":2}]}`,
		`{"format":1,"volume":"v","backups":[]} {}`,
	} {
		if _, err := DecodeIndex([]byte(bad), MaxVolumeSize); !errors.Is(err, ErrCorrupt) {
			t.Errorf("DecodeIndex(%s) = %v, want ErrCorrupt", bad, err)
		}
	}
}

// FuzzDecodeManifest: no input makes the decoder panic or accept a
// manifest that breaks its invariants; what it accepts re-encodes to a
// manifest that decodes the same. The seeds run in every go test.
func FuzzDecodeManifest(f *testing.F) {
	data, _ := EncodeManifest(sampleManifest())
	f.Add(data)
	f.Add(data[:manifestHeaderLen])
	empty, _ := EncodeManifest(&Manifest{ManifestMeta: ManifestMeta{Volume: "v", Name: "b"}, Size: 1, BlockSize: MinBlockSize})
	f.Add(empty)
	f.Add([]byte("CAIRNBKM"))
	f.Fuzz(func(t *testing.T, data []byte) {
		m, err := DecodeManifest(bytes.NewReader(data), MaxVolumeSize)
		if err != nil {
			if !errors.Is(err, ErrCorrupt) {
				t.Fatalf("error not ErrCorrupt: %v", err)
			}
			return
		}
		if err := m.validate(MaxVolumeSize); err != nil {
			t.Fatalf("accepted an invalid manifest: %v", err)
		}
		again, err := EncodeManifest(m)
		if err != nil {
			t.Fatal(err)
		}
		m2, err := DecodeManifest(bytes.NewReader(again), MaxVolumeSize)
		if err != nil || !reflect.DeepEqual(m.Blocks, m2.Blocks) || m.Size != m2.Size {
			t.Fatalf("re-encoded manifest decodes differently: %v", err)
		}
	})
}

// FuzzDecodeIndex: the same for the index.
func FuzzDecodeIndex(f *testing.F) {
	data, _ := EncodeIndex(&Index{Format: indexFormat, Volume: "vol-1", Backups: []BackupInfo{infoOf(sampleManifest())}})
	f.Add(data)
	f.Add([]byte(`{"format":1,"volume":"v","backups":[]}`))
	f.Add([]byte(`{"format":1,"volume":"v","backups":[{"name":"a","size":1,"blockSize":65536,"blocks":1}]}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		idx, err := DecodeIndex(data, MaxVolumeSize)
		if err != nil {
			if !errors.Is(err, ErrCorrupt) {
				t.Fatalf("error not ErrCorrupt: %v", err)
			}
			return
		}
		if _, err := EncodeIndex(idx); err != nil {
			t.Fatalf("accepted an index that does not re-encode: %v", err)
		}
	})
}

// TestBlockCodec: blocks round-trip stored and compressed; a block whose
// bytes or header were altered fails with ErrCorrupt.
func TestBlockCodec(t *testing.T) {
	for _, data := range [][]byte{bytes.Repeat([]byte("abc"), 1000), randomBytes(3000)} {
		h := Hash(sha256.Sum256(data))
		obj := encodeBlock(data, make([]byte, 0, maxBlockObject(MinBlockSize)))
		dst := make([]byte, len(data))
		if err := decodeBlock(obj, h, dst); err != nil || !bytes.Equal(dst, data) {
			t.Fatalf("round trip: %v", err)
		}
		for i := range obj {
			bad := bytes.Clone(obj)
			bad[i] ^= 1
			if err := decodeBlock(bad, h, dst); !errors.Is(err, ErrCorrupt) {
				t.Fatalf("byte %d of %d flipped (codec %d): %v", i, len(obj), obj[5], err)
			}
		}
		if err := decodeBlock(obj, h, make([]byte, len(data)+1)); !errors.Is(err, ErrCorrupt) {
			t.Errorf("wrong expected length: %v", err)
		}
	}
}

func randomBytes(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i*7919 ^ i>>3*131)
	}
	return b
}

// TestCallTimeoutNamesObject: a transfer that hangs fails, after the
// retries, with an ObjectError naming the object and wrapping ErrTimeout;
// transient failures are retried and then succeed.
func TestCallTimeoutNamesObject(t *testing.T) {
	dir, err := NewDirTarget(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	ft := &faultTarget{Target: dir, hang: func(key string) bool { return key == "stuck" }}
	opts := testOptions(t)
	opts.CallTimeout, opts.Retries = 50*time.Millisecond, 2
	s := newStore(t, ft, opts)
	err = s.put(context.Background(), "stuck", []byte("x"))
	var oe *ObjectError
	if !errors.As(err, &oe) || oe.Key != "stuck" || oe.Attempts != 3 || !errors.Is(err, ErrTimeout) {
		t.Fatalf("stuck put: %v, want an ObjectError for key stuck after 3 attempts wrapping ErrTimeout", err)
	}
	// The retries of transient failures, with a timeout no loaded
	// machine's directory write runs into (50 ms did under CI load).
	opts.CallTimeout = deadline.Scale(30 * time.Second)
	s = newStore(t, ft, opts)
	ft.failures = 2
	if err := s.put(context.Background(), "ok", []byte("x")); err != nil {
		t.Fatalf("put after 2 transient failures: %v", err)
	}
	ft.failures = 3
	if err := s.put(context.Background(), "ok", []byte("x")); !errors.Is(err, ErrTransient) {
		t.Fatalf("put after 3 transient failures (2 retries): %v, want the transient error", err)
	}
	if _, err := s.readAll(context.Background(), "missing", 10); !errors.Is(err, ErrNotFound) {
		t.Fatalf("get of a missing key: %v, want ErrNotFound", err)
	}
}

type runtimeMem struct{ total uint64 }

func (m *runtimeMem) read() {
	var st runtime.MemStats
	runtime.ReadMemStats(&st)
	m.total = st.TotalAlloc
}

// readFullTo (a restore's block reads into a reused buffer) takes an
// object up to one byte less than the buffer, refuses a larger one with
// ErrTooLarge, and passes a read error on.
func TestReadFullTo(t *testing.T) {
	buf := make([]byte, 9)
	if n, err := readFullTo(bytes.NewReader([]byte("12345678")), buf); err != nil || string(buf[:n]) != "12345678" {
		t.Fatalf("8 bytes into 9: %q, %v", buf[:n], err)
	}
	if n, err := readFullTo(bytes.NewReader(nil), buf); err != nil || n != 0 {
		t.Fatalf("empty object: %d, %v", n, err)
	}
	if _, err := readFullTo(bytes.NewReader([]byte("123456789")), buf); !errors.Is(err, ErrTooLarge) {
		t.Fatalf("9 bytes into 9: %v, want ErrTooLarge", err)
	}
	boom := errors.New("boom")
	if _, err := readFullTo(errReader{boom}, buf); !errors.Is(err, boom) {
		t.Fatalf("failing reader: %v, want its error", err)
	}
}

type errReader struct{ err error }

func (r errReader) Read([]byte) (int, error) { return 0, r.err }
