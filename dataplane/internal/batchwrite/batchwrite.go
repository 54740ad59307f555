// Package batchwrite sends frames on one connection the way the data path
// wants them: a frame goes out at once, from the goroutine that has it,
// when nobody is writing (at queue depth 1 that spares a hand-off to
// another goroutine, which the scheduler pays for with a thread wake-up);
// otherwise it is queued, and the goroutine that is writing sends
// everything queued meanwhile in one vectored write before it leaves, so a
// burst costs one system call and no goroutine waits for another (flat
// combining). The dataconn client (requests), the dataconn server
// (replies) and the NBD frontend (replies) send this way.
package batchwrite

import (
	"io"
	"net"
	"sync"

	"github.com/cairn-io/cairn/dataplane/internal/rawio"
)

// Options configure a Writer. Buffers is required; zero values of the
// others take the defaults.
type Options[T any] struct {
	// Buffers appends the buffers of item, in the order they go out (a
	// header, then a payload, say), to bufs and returns it.
	Buffers func(bufs net.Buffers, item T) net.Buffers
	// Done, if set, is called with every batch once it is written, or
	// dropped because a write failed (err is that write's error: a Writer
	// whose write failed writes nothing more). The items are not used by
	// the Writer afterwards: Done is where their buffers are released.
	// Done must not keep the slice, which the Writer reuses.
	Done func(items []T, err error)
	// Failed, if set, is called once, with the error of the first write
	// that fails, by the goroutine that wrote, holding no lock: the owner
	// closes the connection or fails whatever uses it.
	Failed func(err error)
	// Queue bounds the items waiting while another goroutine writes: Send
	// waits beyond it, so a peer that stops reading slows its senders down
	// instead of growing the queue. Default 256; negative means no bound,
	// for senders that must never wait for the connection (each of them
	// sends one item and then waits for its answer, which bounds the
	// queue).
	Queue int
	// MaxBatch bounds the items in one vectored write. Default 64.
	MaxBatch int
}

// Writer sends items on one connection (see the package comment). It is
// safe for concurrent use.
type Writer[T any] struct {
	w    io.Writer
	opts Options[T]

	mu      sync.Mutex
	room    sync.Cond // signalled when the writer takes items off the queue
	queue   []T       // waiting for the writer
	spare   []T       // the previous batch's array, for the next queue
	writing bool      // a goroutine is in Send's write loop
	err     error     // the first write's error

	bufs net.Buffers // the writer's, reused
}

// New returns a Writer on w, written to with rawio.WriteBuffers (writev).
func New[T any](w io.Writer, opts Options[T]) *Writer[T] {
	if opts.Queue == 0 {
		opts.Queue = 256
	}
	if opts.MaxBatch <= 0 {
		opts.MaxBatch = 64
	}
	wr := &Writer[T]{w: w, opts: opts}
	wr.room.L = &wr.mu
	return wr
}

// Idle reports whether nothing is queued and nobody is writing, that is
// whether an item sent now would go out at once from the sender.
func (w *Writer[T]) Idle() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return !w.writing && len(w.queue) == 0
}

// Send sends item. When another goroutine is writing, it queues item
// (waiting while the queue is full) and returns: that goroutine writes it
// before it returns from its own Send. Otherwise it writes item, and then
// whatever others queue meanwhile, in batches, until the queue is empty.
// So once every Send has returned, every item has been written, or
// dropped after a failed write and handed to Done.
func (w *Writer[T]) Send(item T) {
	w.mu.Lock()
	for w.writing && w.opts.Queue > 0 && len(w.queue) >= w.opts.Queue {
		w.room.Wait()
	}
	w.queue = append(w.queue, item)
	if w.writing {
		w.mu.Unlock()
		return
	}
	w.writing = true
	var failed error
	for len(w.queue) > 0 {
		// Take up to MaxBatch items; the rest, if any, move to the spare
		// array, which becomes the queue others append to meanwhile.
		n := min(len(w.queue), w.opts.MaxBatch)
		batch, rest := w.queue[:n], w.queue[n:]
		w.queue = append(w.spare[:0], rest...)
		clear(rest)
		w.spare = nil
		err := w.err
		w.room.Broadcast()
		w.mu.Unlock()

		if err == nil {
			if err = w.write(batch); err != nil {
				failed = err
			}
		}
		if w.opts.Done != nil {
			w.opts.Done(batch, err)
		}
		clear(batch) // drop the references to released buffers

		w.mu.Lock()
		if failed != nil && w.err == nil {
			w.err = failed
		}
		w.spare = batch[:0]
	}
	w.writing = false
	w.room.Broadcast()
	w.mu.Unlock()
	if failed != nil && w.opts.Failed != nil {
		w.opts.Failed(failed)
	}
}

// write sends batch in one vectored write (only the goroutine writing
// calls it).
func (w *Writer[T]) write(batch []T) error {
	bufs := w.bufs[:0]
	for _, item := range batch {
		bufs = w.opts.Buffers(bufs, item)
	}
	w.bufs = bufs
	_, err := rawio.WriteBuffers(w.w, &bufs) // consumes its copy of the slice header
	clear(w.bufs)
	return err
}
