package replicaserver

import (
	"bytes"
	"context"
	"encoding/binary"
	"net"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/cairn-io/cairn/dataplane/dataconn"
	"github.com/cairn-io/cairn/dataplane/replica"
)

// TestEpochChangeIsAtomicWithWrites: once SetEpoch returns, no write sent
// with the old epoch may land, even one that was being checked at that
// very moment (a stale engine's writes must not reach a replica that a
// new engine has taken over).
func TestEpochChangeIsAtomicWithWrites(t *testing.T) {
	r, err := replica.Open(filepath.Join(t.TempDir(), "r"), replica.Options{Size: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	srv := dataconn.NewServer(Backend{Replica: r}, dataconn.ServerOptions{Workers: 8})
	defer srv.Close()
	var conns []net.Conn
	for range 4 {
		c, s := net.Pipe()
		srv.ServeConn(s)
		conns = append(conns, c)
	}
	cl := dataconn.NewClient(conns, dataconn.ClientOptions{PingInterval: -1})
	defer cl.Close()
	ctx := context.Background()
	for round := uint64(1); round < 300; round++ {
		epoch := 2*round - 1 // this round's engine; 2*round is the next one's
		if err := r.Fence(replica.FenceOptions{Epoch: epoch}); err != nil {
			t.Fatal(err)
		}
		cl.SetEpoch(epoch)
		var stop atomic.Bool
		var seq atomic.Uint64
		var wg sync.WaitGroup
		for range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				p := make([]byte, 4096)
				for !stop.Load() {
					binary.LittleEndian.PutUint64(p, seq.Add(1))
					if cl.WriteAt(ctx, p, 0, false) != nil {
						return // refused: stale epoch
					}
				}
			}()
		}
		for seq.Load() < 4 {
			// let the writers get going
		}
		if err := r.Fence(replica.FenceOptions{Epoch: epoch + 1}); err != nil { // the new engine takes over
			t.Fatal(err)
		}
		after := make([]byte, 4096)
		if _, err := r.ReadAt(after, 0); err != nil {
			t.Fatal(err)
		}
		stop.Store(true)
		wg.Wait()
		final := make([]byte, 4096)
		if _, err := r.ReadAt(final, 0); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(after, final) {
			t.Fatalf("round %d: a write with the old epoch landed after Fence returned", round)
		}
	}
}
