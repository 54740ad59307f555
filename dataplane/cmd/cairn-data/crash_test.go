package main

import (
	"context"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	replicav1 "github.com/cairn-io/cairn/dataplane/api/replica/v1"
	"github.com/cairn-io/cairn/dataplane/replica"
)

// blockContent is the 4 KiB a write of version v to block b carries: its
// block number and version, then a pattern derived from both, so a read
// tells exactly which write (if any) a block holds.
func blockContent(b int, v uint32) []byte {
	p := make([]byte, replica.BlockSize)
	if v == 0 {
		return p // never written, or unmapped
	}
	binary.LittleEndian.PutUint64(p, uint64(b))
	binary.LittleEndian.PutUint32(p[8:], v)
	x := uint32(b)*2654435761 ^ v
	for i := 12; i < len(p); i += 4 {
		x = x*1664525 + 1013904223
		binary.LittleEndian.PutUint32(p[i:], x)
	}
	return p
}

// crashModel is what the test knows: for each block, the last acknowledged
// version and the version of an operation whose outcome is unknown (in
// flight when the process died); the same for snapshots.
type crashModel struct {
	mu        sync.Mutex
	committed []uint32
	pending   []int64 // -1: none; otherwise the version in flight (0 = unmap)
	snaps     map[string]bool
	pendSnap  map[string]bool // create or delete in flight
	epoch     uint64
	next      uint32
}

// TestReplicaCrashSafety kills a replica process with SIGKILL at random
// moments, mid-write, mid-snapshot and mid-delete, and checks after each
// restart that it opens with consistent metadata, that every acknowledged
// write, snapshot operation and epoch survived, and that blocks with an
// operation in flight hold either the old or the new data, never a mix.
//
// SIGKILL keeps the kernel's page cache, so here every acknowledged write
// must survive, flushed or not; surviving power loss is what Flush is for,
// and this test does not simulate it.
// Every other run uses --direct-io (O_DIRECT), alternating with buffered
// runs on the same replica directory.
func TestReplicaCrashSafety(t *testing.T) {
	iterations := 25
	if s := os.Getenv("CAIRN_CRASH_ITERATIONS"); s != "" {
		iterations, _ = strconv.Atoi(s)
	}
	seed := uint64(time.Now().UnixNano())
	if s := os.Getenv("CAIRN_CRASH_SEED"); s != "" {
		seed, _ = strconv.ParseUint(s, 10, 64)
	}
	t.Logf("seed %d (replay with CAIRN_CRASH_SEED=%d)", seed, seed)
	rng := rand.New(rand.NewPCG(seed, 0))
	const size, workers = 8 << 20, 8
	blocks := size / replica.BlockSize
	m := &crashModel{committed: make([]uint32, blocks), pending: make([]int64, blocks), snaps: map[string]bool{}, pendSnap: map[string]bool{}}
	for i := range m.pending {
		m.pending[i] = -1
	}
	dir := t.TempDir()
	snapSeq := 0
	for it := range iterations {
		args := []string{"replica", "--dir", dir, "--size", strconv.Itoa(size), "--listen", "127.0.0.1:0", "--control-listen", "127.0.0.1:0"}
		if it%2 == 1 {
			args = append(args, "--direct-io") // every other run bypasses the page cache
		}
		p := start(t, args...)
		ctl := dialControl(t, p.control)
		m.verify(t, it, p, ctl)

		m.epoch++
		if _, err := ctl.SetEpoch(context.Background(), &replicav1.SetEpochRequest{Epoch: m.epoch}); err != nil {
			t.Fatal(err)
		}
		d := dialData(t, p.data, m.epoch)
		ctx, cancel := context.WithCancel(context.Background())
		var wg sync.WaitGroup
		for w := range workers {
			wg.Add(1)
			wr := rand.New(rand.NewPCG(seed+uint64(it), uint64(w)))
			go func() {
				defer wg.Done()
				for ctx.Err() == nil {
					b := w + workers*wr.IntN(blocks/workers) // each worker owns its blocks
					var err error
					switch k := wr.IntN(10); {
					case k < 7, k == 9 && wr.IntN(2) == 0:
						v := m.begin(b, true)
						if err = d.WriteAt(ctx, blockContent(b, v), int64(b)*replica.BlockSize, false); err == nil {
							m.ack(b, v)
						}
					case k < 9:
						m.begin(b, false)
						if err = d.Unmap(ctx, int64(b)*replica.BlockSize, replica.BlockSize); err == nil {
							m.ack(b, 0)
						}
					default:
						err = d.Flush(ctx)
					}
					if err != nil {
						return // the process died: the op's outcome stays unknown
					}
				}
			}()
		}
		wg.Add(1)
		go func() { // snapshots, concurrently with I/O
			defer wg.Done()
			sr := rand.New(rand.NewPCG(seed+uint64(it), 99))
			for ctx.Err() == nil {
				m.mu.Lock()
				var victim string
				for s := range m.snaps {
					victim = s
					break
				}
				m.mu.Unlock()
				var err error
				if victim != "" && sr.IntN(3) == 0 {
					m.snapBegin(victim)
					_, err = ctl.SnapshotDelete(ctx, &replicav1.SnapshotDeleteRequest{Name: victim, Epoch: m.epoch})
					m.snapAck(victim, false, err)
				} else {
					snapSeq++
					name := fmt.Sprintf("s%d", snapSeq)
					m.snapBegin(name)
					_, err = ctl.SnapshotCreate(ctx, &replicav1.SnapshotCreateRequest{Name: name, Epoch: m.epoch})
					m.snapAck(name, true, err)
				}
				if err != nil {
					return
				}
				time.Sleep(time.Duration(sr.IntN(5)) * time.Millisecond) // pacing, not synchronisation
			}
		}()
		time.Sleep(time.Duration(5+rng.IntN(75)) * time.Millisecond) // when to strike: the point of the test
		if err := p.cmd.Process.Kill(); err != nil {
			t.Fatal(err)
		}
		p.waitExit(t)
		cancel()
		wg.Wait()
		d.Close()
	}
	p := start(t, "replica", "--dir", dir, "--listen", "127.0.0.1:0", "--control-listen", "127.0.0.1:0")
	m.verify(t, iterations, p, dialControl(t, p.control))
	t.Logf("%d kills; %d writes issued; %d snapshots created; %d remain", iterations, m.next, snapSeq, len(m.snaps))
}

func (m *crashModel) begin(b int, write bool) uint32 {
	m.mu.Lock()
	defer m.mu.Unlock()
	var v uint32
	if write {
		m.next++
		v = m.next
	}
	m.pending[b] = int64(v)
	return v
}

func (m *crashModel) ack(b int, v uint32) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.committed[b] = v
	m.pending[b] = -1
}

func (m *crashModel) snapBegin(name string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.pendSnap[name] = true
}

func (m *crashModel) snapAck(name string, created bool, err error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if err != nil {
		return // outcome unknown: stays pending
	}
	delete(m.pendSnap, name)
	if created {
		m.snaps[name] = true
	} else {
		delete(m.snaps, name)
	}
}

// verify reads everything back from a restarted replica and checks it
// against the model, then adopts what it saw for operations in flight.
func (m *crashModel) verify(t *testing.T, it int, p *proc, ctl replicav1.ReplicaServiceClient) {
	t.Helper()
	ctx := context.Background()
	in, err := ctl.Info(ctx, &replicav1.InfoRequest{})
	if err != nil {
		t.Fatalf("iteration %d: info after restart: %v\n%s", it, err, p.stderr.String())
	}
	if in.Epoch != m.epoch {
		t.Fatalf("iteration %d: epoch %d after restart, %d was acknowledged", it, in.Epoch, m.epoch)
	}
	seen := map[string]bool{}
	for _, s := range in.Snapshots {
		seen[s.Name] = true
		if !m.snaps[s.Name] && !m.pendSnap[s.Name] {
			t.Fatalf("iteration %d: snapshot %s exists but was never created (or its delete was acknowledged)", it, s.Name)
		}
	}
	for s := range m.snaps {
		if !seen[s] && !m.pendSnap[s] {
			t.Fatalf("iteration %d: acknowledged snapshot %s is gone", it, s)
		}
	}
	m.snaps, m.pendSnap = seen, map[string]bool{}

	d := dialData(t, p.data, m.epoch)
	buf := make([]byte, 1<<20)
	per := len(buf) / replica.BlockSize
	for first := 0; first < len(m.committed); first += per {
		if err := d.ReadAt(ctx, buf, int64(first)*replica.BlockSize); err != nil {
			t.Fatal(err)
		}
		for i := range per {
			b := first + i
			got := buf[i*replica.BlockSize : (i+1)*replica.BlockSize]
			switch {
			case string(got) == string(blockContent(b, m.committed[b])):
			case m.pending[b] >= 0 && string(got) == string(blockContent(b, uint32(m.pending[b]))):
				m.committed[b] = uint32(m.pending[b])
			default:
				v := binary.LittleEndian.Uint32(got[8:])
				t.Fatalf("iteration %d: block %d holds version %d (or garbage); acknowledged %d, in flight %d",
					it, b, v, m.committed[b], m.pending[b])
			}
			m.pending[b] = -1
		}
	}
	d.Close()
}
