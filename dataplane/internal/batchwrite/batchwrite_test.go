package batchwrite

import (
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// pair returns both ends of a unix stream socket pair.
func pair(t *testing.T) (net.Conn, net.Conn) {
	t.Helper()
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	var cs [2]net.Conn
	for i, fd := range fds {
		f := os.NewFile(uintptr(fd), "pair")
		c, err := net.FileConn(f)
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		cs[i] = c
		t.Cleanup(func() { c.Close() })
	}
	return cs[0], cs[1]
}

// gatedConn is a connection whose writes wait until open is closed. It
// embeds the net.Conn interface, so that no method of the concrete
// connection (its writev) bypasses Write.
type gatedConn struct {
	net.Conn
	open chan struct{}
}

func (g *gatedConn) Write(p []byte) (int, error) {
	<-g.open
	return g.Conn.Write(p)
}

// frame is an 8-byte sequence number and a payload of seq%100 bytes.
type frame struct {
	hdr     [8]byte
	payload []byte
}

func newFrame(seq uint64) frame {
	f := frame{payload: make([]byte, seq%100)}
	binary.BigEndian.PutUint64(f.hdr[:], seq)
	return f
}

func bufsOf(bufs net.Buffers, f frame) net.Buffers {
	bufs = append(bufs, f.hdr[:])
	if len(f.payload) > 0 {
		bufs = append(bufs, f.payload)
	}
	return bufs
}

// readFrames reads n frames from c and checks they come in order.
func readFrames(c net.Conn, n uint64) error {
	hdr := make([]byte, 8)
	payload := make([]byte, 100)
	for i := range n {
		if _, err := io.ReadFull(c, hdr); err != nil {
			return err
		}
		if got := binary.BigEndian.Uint64(hdr); got != i {
			return fmt.Errorf("frame %d arrived where %d belongs", got, i)
		}
		if _, err := io.ReadFull(c, payload[:i%100]); err != nil {
			return err
		}
	}
	return nil
}

// writerStats counts what Done saw.
type writerStats struct {
	frames, writes atomic.Int64
}

func (s *writerStats) done(t *testing.T) func([]frame, error) {
	return func(fs []frame, err error) {
		if err != nil {
			t.Errorf("write: %v", err)
		}
		s.frames.Add(int64(len(fs)))
		s.writes.Add(1)
	}
}

// queued returns how many items wait in w's queue.
func queued[T any](w *Writer[T]) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.queue)
}

// waitQueued polls until w's queue holds n items.
func waitQueued[T any](t *testing.T, w *Writer[T], n int) {
	t.Helper()
	for until := deadline.After(10 * time.Second); queued(w) != n; time.Sleep(time.Millisecond) {
		if time.Now().After(until) {
			t.Fatalf("%d items queued, want %d", queued(w), n)
		}
	}
}

// TestQueuedBehindAWriterInOneBatch: while one goroutine's write is in
// progress, frames sent by another are queued, not written, and Send
// returns at once (with no bound, however many); the writing goroutine
// then sends them all, in order, in batches of at most MaxBatch, before
// its own Send returns.
func TestQueuedBehindAWriterInOneBatch(t *testing.T) {
	a, b := pair(t)
	gate := &gatedConn{Conn: a, open: make(chan struct{})}
	var st writerStats
	w := New(gate, Options[frame]{Buffers: bufsOf, Done: st.done(t), Queue: -1, MaxBatch: 64})
	if !w.Idle() {
		t.Fatal("a new Writer is not idle")
	}
	first := make(chan struct{})
	go func() { w.Send(newFrame(0)); close(first) }()
	for until := deadline.After(10 * time.Second); w.Idle(); time.Sleep(time.Millisecond) {
		if time.Now().After(until) {
			t.Fatal("the first Send did not start writing")
		}
	}
	const n = 1000 // beyond the default bound
	sent := make(chan struct{})
	go func() {
		for i := uint64(1); i < n; i++ {
			w.Send(newFrame(i)) // returns at once: the first sender writes it
		}
		close(sent)
	}()
	waitQueued(t, w, n-1)
	select {
	case <-sent:
	case <-time.After(deadline.Scale(10 * time.Second)):
		t.Fatal("Send waited with no bound on the queue")
	}
	read := make(chan error, 1)
	go func() { read <- readFrames(b, n) }()
	close(gate.open)
	select {
	case <-first:
	case <-time.After(deadline.Scale(10 * time.Second)):
		t.Fatal("the writing Send did not return")
	}
	// Its Send has returned: everything queued behind it is written.
	if st.frames.Load() != n || !w.Idle() {
		t.Fatalf("after the writer's Send: %d frames done, idle %v; want %d and idle", st.frames.Load(), w.Idle(), n)
	}
	if err := <-read; err != nil {
		t.Fatal(err)
	}
	if writes, want := st.writes.Load(), int64(1+(n-1+63)/64); writes != want {
		t.Fatalf("%d frames in %d writes, want %d (one, then the queued in batches of 64)", n, writes, want)
	}
}

// TestQueueBound: senders wait while the queue is full, so a peer that
// stops reading holds its senders back instead of growing the queue.
func TestQueueBound(t *testing.T) {
	a, b := pair(t)
	gate := &gatedConn{Conn: a, open: make(chan struct{})}
	var st writerStats
	w := New(gate, Options[frame]{Buffers: bufsOf, Done: st.done(t), Queue: 8})
	go w.Send(newFrame(0))
	for until := deadline.After(10 * time.Second); w.Idle(); time.Sleep(time.Millisecond) {
		if time.Now().After(until) {
			t.Fatal("the first Send did not start writing")
		}
	}
	const n = 20
	sent := make(chan struct{})
	go func() {
		for i := uint64(1); i < n; i++ {
			w.Send(newFrame(i))
		}
		close(sent)
	}()
	waitQueued(t, w, 8)
	select {
	case <-sent:
		t.Fatalf("%d frames sent past a full queue of 8", n-1)
	default:
	}
	read := make(chan error, 1)
	go func() { read <- readFrames(b, n) }()
	close(gate.open)
	if err := <-read; err != nil {
		t.Fatal(err)
	}
	<-sent
}

// TestConcurrentSenders: many goroutines send at once; each one's frames
// arrive in its own order, and every frame reaches Done once.
func TestConcurrentSenders(t *testing.T) {
	a, b := pair(t)
	var st writerStats
	w := New(a, Options[frame]{Buffers: bufsOf, Done: st.done(t), Queue: 16})
	const senders, per = 8, 500
	read := make(chan error, 1)
	go func() {
		next := make([]uint64, senders)
		hdr := make([]byte, 8)
		for range senders * per {
			if _, err := io.ReadFull(b, hdr); err != nil {
				read <- err
				return
			}
			v := binary.BigEndian.Uint64(hdr)
			s, seq := v>>32, v&(1<<32-1)
			if s >= senders || seq != next[s] {
				read <- fmt.Errorf("sender %d's frame %d arrived where its %d belongs", s, seq, next[s])
				return
			}
			next[s]++
		}
		read <- nil
	}()
	var wg sync.WaitGroup
	for s := range uint64(senders) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range uint64(per) {
				var f frame
				binary.BigEndian.PutUint64(f.hdr[:], s<<32|i)
				w.Send(f)
			}
		}()
	}
	wg.Wait()
	if st.frames.Load() != senders*per {
		t.Fatalf("Done saw %d frames once every Send returned, want %d", st.frames.Load(), senders*per)
	}
	if err := <-read; err != nil {
		t.Fatal(err)
	}
	t.Logf("%d frames in %d writes", senders*per, st.writes.Load())
}

// TestFailedWrite: once a write fails, Failed is called once, nothing is
// written any more, and every frame still reaches Done, with the error
// (its buffers must be released), so senders never block.
func TestFailedWrite(t *testing.T) {
	a, b := pair(t)
	b.Close()
	var failed atomic.Int32
	var mu sync.Mutex
	var errs []error
	w := New(a, Options[frame]{
		Buffers: bufsOf,
		Done: func(fs []frame, err error) {
			mu.Lock()
			defer mu.Unlock()
			for range fs {
				errs = append(errs, err)
			}
		},
		Failed: func(error) { failed.Add(1) },
		Queue:  4,
	})
	const senders, per = 4, 50
	var wg sync.WaitGroup
	for range senders {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range uint64(per) {
				w.Send(newFrame(i))
			}
		}()
	}
	wg.Wait()
	if failed.Load() != 1 {
		t.Fatalf("Failed called %d times, want once", failed.Load())
	}
	mu.Lock()
	defer mu.Unlock()
	if len(errs) != senders*per {
		t.Fatalf("Done saw %d frames, want %d", len(errs), senders*per)
	}
	for i, err := range errs {
		if err == nil {
			t.Fatalf("frame %d: Done got no error from a write to a closed peer", i)
		}
	}
}
