package backupstore

import (
	"bytes"
	"errors"
	"io"
	"net"
	"net/url"
	"sync"
	"testing"
)

// damagingProxy forwards TCP connections to target and, on the way to it,
// flips one bit of every occurrence of marker: a body damaged between the
// store and the server.
func damagingProxy(t *testing.T, target string, marker []byte) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	t.Cleanup(func() { l.Close(); wg.Wait() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			s, err := net.Dial("tcp", target)
			if err != nil {
				c.Close()
				continue
			}
			wg.Add(2)
			go func() { defer wg.Done(); damage(s, c, marker); s.Close() }()
			go func() { defer wg.Done(); _, _ = io.Copy(c, s); c.Close() }()
		}
	}()
	return l.Addr().String()
}

// damage copies src to dst, flipping a bit in the last byte of every
// occurrence of marker (matched across reads; marker must not overlap
// itself).
func damage(dst io.Writer, src io.Reader, marker []byte) {
	matched := 0
	buf := make([]byte, 64<<10)
	for {
		n, err := src.Read(buf)
		for i, b := range buf[:n] {
			switch b {
			case marker[matched]:
				matched++
			case marker[0]:
				matched = 1
			default:
				matched = 0
			}
			if matched == len(marker) {
				buf[i] ^= 1
				matched = 0
			}
		}
		if _, werr := dst.Write(buf[:n]); werr != nil || err != nil {
			return
		}
	}
}

// TestS3PutDamagedInTransitIsRefused: with either checksum, the server
// refuses a put whose body was damaged on the way and stores nothing; an
// undamaged put goes through the same proxy. A put carrying no checksum
// the server checks would be stored damaged.
func TestS3PutDamagedInTransitIsRefused(t *testing.T) {
	cfg := startVersitygw(t)
	u, err := url.Parse(cfg.Endpoint)
	if err != nil {
		t.Fatal(err)
	}
	marker := []byte("damage me in transit")
	cfg.Endpoint = "http://" + damagingProxy(t, u.Host, marker)
	for _, sum := range []S3Checksum{"", S3ChecksumMD5, S3ChecksumCRC32C} {
		t.Run(string(sum), func(t *testing.T) {
			cfg := cfg
			cfg.Checksum = sum
			cfg.Prefix = "sum-" + string(sum) + "/"
			tg, err := NewS3Target(cfg)
			if err != nil {
				t.Fatal(err)
			}
			ctx := testCtx(t)
			body := append(bytes.Repeat([]byte("block "), 1000), marker...)
			if err := tg.Put(ctx, "damaged", body); err == nil {
				t.Fatal("a put damaged in transit was accepted")
			}
			if _, err := tg.Get(ctx, "damaged"); !errors.Is(err, ErrNotFound) {
				t.Fatalf("after a refused put, get: %v, want not found", err)
			}
			clean := bytes.Repeat([]byte("block "), 1000)
			if err := tg.Put(ctx, "clean", clean); err != nil {
				t.Fatal(err)
			}
			rc, err := tg.Get(ctx, "clean")
			if err != nil {
				t.Fatal(err)
			}
			got, err := io.ReadAll(rc)
			_ = rc.Close()
			if err != nil || !bytes.Equal(got, clean) {
				t.Fatalf("read back: %v, equal %v", err, bytes.Equal(got, clean))
			}
		})
	}
	if _, err := NewS3Target(S3Config{Endpoint: "http://127.0.0.1:1", Bucket: "b", Checksum: "SHA1"}); err == nil {
		t.Fatal("an unknown checksum was accepted")
	}
}
