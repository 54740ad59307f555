package nbd

import (
	"encoding/binary"
	"io"
	"net"
	"os"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// BenchmarkPipelinedReplies measures the transmission path alone: 4 KiB
// reads and writes against an in-memory device, 32 in flight on one
// connection (a socket pair, as the kernel's driver gets), so the cost is
// the server's reading, dispatching and reply batching. It reports
// operations per second and the process's CPU time per operation (client
// included), which a busy machine disturbs less than the rate.
func BenchmarkPipelinedReplies(b *testing.B) {
	const (
		qd    = 32
		block = 4096
		ops   = 200000
	)
	dev := &memDevice{data: make([]byte, 64<<20)}
	s := NewServer(dev, Options{})
	defer s.Close()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		b.Fatal(err)
	}
	conn := func(fd int) net.Conn {
		f := os.NewFile(uintptr(fd), "pair")
		defer f.Close()
		c, err := net.FileConn(f)
		if err != nil {
			b.Fatal(err)
		}
		return c
	}
	srv, c := conn(fds[1]), conn(fds[0])
	defer c.Close()
	go s.ServeTransmission(srv)
	for _, write := range []bool{false, true} {
		name := "read"
		if write {
			name = "write"
		}
		b.Run(name, func(b *testing.B) {
			n := max(b.N, ops)
			sent := make(chan struct{}, qd) // one token per request in flight
			payload := make([]byte, block)
			go func() {
				req := make([]byte, 28, 28+block)
				for i := range n {
					sent <- struct{}{}
					typ := uint16(cmdRead)
					if write {
						typ = cmdWrite
					}
					binary.BigEndian.PutUint32(req[0:], magicRequest)
					binary.BigEndian.PutUint16(req[4:], 0)
					binary.BigEndian.PutUint16(req[6:], typ)
					binary.BigEndian.PutUint64(req[8:], uint64(i))
					binary.BigEndian.PutUint64(req[16:], uint64(i%(64<<20/block))*block)
					binary.BigEndian.PutUint32(req[24:], block)
					buf := req
					if write {
						buf = append(req, payload...)
					}
					if _, err := c.Write(buf); err != nil {
						return
					}
				}
			}()
			var ru0, ru1 unix.Rusage
			if err := unix.Getrusage(unix.RUSAGE_SELF, &ru0); err != nil {
				b.Fatal(err)
			}
			start := time.Now()
			rep := make([]byte, 16+block)
			for range n {
				r := rep[:16]
				if !write {
					r = rep
				}
				if _, err := io.ReadFull(c, r); err != nil {
					b.Fatal(err)
				}
				if binary.BigEndian.Uint32(r[4:]) != 0 {
					b.Fatalf("reply error %d", binary.BigEndian.Uint32(r[4:]))
				}
				<-sent
			}
			elapsed := time.Since(start)
			if err := unix.Getrusage(unix.RUSAGE_SELF, &ru1); err != nil {
				b.Fatal(err)
			}
			cpu := time.Duration(ru1.Utime.Nano() + ru1.Stime.Nano() - ru0.Utime.Nano() - ru0.Stime.Nano())
			b.ReportMetric(float64(n)/elapsed.Seconds(), "ops/s")
			b.ReportMetric(float64(cpu.Nanoseconds())/1e3/float64(n), "cpu-µs/op")
		})
	}
}
