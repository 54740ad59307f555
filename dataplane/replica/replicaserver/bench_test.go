package replicaserver

import (
	"context"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/cairn-io/cairn/dataplane/dataconn"
	"github.com/cairn-io/cairn/dataplane/replica"
)

const (
	benchSize = 512 << 20 // volume and raw file size
	benchQD   = 32        // requests in flight
)

// ioFunc does one 4 KiB operation at off with buffer p.
type ioFunc func(p []byte, off int64) error

// drive runs n random 4 KiB operations with benchQD in flight and returns
// the achieved operations per second.
func drive(b *testing.B, n int, op ioFunc) float64 {
	var wg sync.WaitGroup
	per := max(n/benchQD, 1)
	start := time.Now()
	for w := range benchQD {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(w), 7))
			p := make([]byte, 4096)
			for i := range p {
				p[i] = byte(i * w)
			}
			for range per {
				if err := op(p, r.Int64N(benchSize/4096)*4096); err != nil {
					b.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	return float64(per*benchQD) / time.Since(start).Seconds()
}

// fill writes the whole file so reads hit data, not holes.
func fill(b *testing.B, write func(p []byte, off int64) error) {
	p := make([]byte, 1<<20)
	for i := range p {
		p[i] = byte(i)
	}
	for off := int64(0); off < benchSize; off += int64(len(p)) {
		if err := write(p, off); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkRandom4K measures 4 KiB random writes and reads at queue depth
// 32 against the raw file and through dataconn over loopback TCP to one
// replica on the same disk, in the same run, and reports both and their
// ratio (replica ÷ raw). Both go to the page cache; neither syncs.
func BenchmarkRandom4K(b *testing.B) {
	dir := b.TempDir()
	raw, err := os.OpenFile(filepath.Join(dir, "raw.img"), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		b.Fatal(err)
	}
	defer raw.Close()
	if err := raw.Truncate(benchSize); err != nil {
		b.Fatal(err)
	}
	fill(b, func(p []byte, off int64) error { _, err := raw.WriteAt(p, off); return err })

	r, err := replica.Open(filepath.Join(dir, "replica"), replica.Options{Size: benchSize})
	if err != nil {
		b.Fatal(err)
	}
	defer r.Close()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	srv := dataconn.NewServer(Backend{Replica: r}, dataconn.ServerOptions{})
	go func() { _ = srv.Serve(l) }() // ErrServerClosed at Close
	defer srv.Close()
	ctx := context.Background()
	c, err := dataconn.Dial(ctx, "tcp", l.Addr().String(), dataconn.ClientOptions{})
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	fill(b, func(p []byte, off int64) error { return c.WriteAt(ctx, p, off, false) })

	for _, tc := range []struct {
		name      string
		raw, repl ioFunc
	}{
		{"write",
			func(p []byte, off int64) error { _, err := raw.WriteAt(p, off); return err },
			func(p []byte, off int64) error { return c.WriteAt(ctx, p, off, false) }},
		{"read",
			func(p []byte, off int64) error { _, err := raw.ReadAt(p, off); return err },
			func(p []byte, off int64) error { return c.ReadAt(ctx, p, off) }},
	} {
		b.Run(tc.name, func(b *testing.B) {
			n := max(b.N, 20000)
			rawOps := drive(b, n, tc.raw)
			replOps := drive(b, n, tc.repl)
			b.ReportMetric(rawOps, "raw-ops/s")
			b.ReportMetric(replOps, "replica-ops/s")
			b.ReportMetric(replOps/rawOps, "ratio")
		})
	}
}
