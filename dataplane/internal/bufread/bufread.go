// Package bufread reads frame streams: small headers through a buffer,
// large payloads past it.
//
// The data-path readers (dataconn client and server, the NBD server) read
// through a large buffer so that many small frames cost one read syscall.
// A large payload read the same way is copied twice: from the socket into
// the buffer, then from the buffer into its destination. Reader.Payload
// copies what the buffer already holds and reads the rest straight into
// the destination; Reader.Header keeps the buffer from taking in the next
// large payload in the first place.
package bufread

import (
	"bufio"
	"io"
)

// DirectMin is the payload size from which Payload bypasses the buffer.
// Smaller payloads go through it, so that the frames after them arrive in
// the same read syscall.
const DirectMin = 32 << 10

// Reader reads a stream of frames, each a small header and a payload:
// headers through a buffer, so that many small frames cost one read
// syscall, and large payloads past it (Payload). After a large payload
// the next header is read on its own, straight from the stream, when the
// buffer is empty: the frame after a large one is usually large too, and a
// buffer fill would take in most of its payload only to copy it again.
type Reader struct {
	br         *bufio.Reader
	r          io.Reader
	afterLarge bool
}

// NewReader returns a Reader over r with a buffer of size bytes.
func NewReader(r io.Reader, size int) *Reader {
	return &Reader{br: bufio.NewReaderSize(r, size), r: r}
}

// Header fills p (a header: small) with io.ReadFull semantics.
func (x *Reader) Header(p []byte) error {
	direct := x.afterLarge && x.br.Buffered() == 0
	x.afterLarge = false
	if direct {
		_, err := io.ReadFull(x.r, p)
		return err
	}
	_, err := io.ReadFull(x.br, p)
	return err
}

// Payload fills p. It returns what io.ReadFull would: nil, io.EOF if
// nothing was read, or io.ErrUnexpectedEOF if p was filled in part. From
// DirectMin bytes up it copies what the buffer holds and reads the rest
// straight into p.
func (x *Reader) Payload(p []byte) error {
	x.afterLarge = len(p) >= DirectMin
	if !x.afterLarge {
		_, err := io.ReadFull(x.br, p)
		return err
	}
	n := 0
	if b := x.br.Buffered(); b > 0 {
		// Read returns only buffered bytes when the buffer is not empty.
		n, _ = x.br.Read(p[:min(b, len(p))])
	}
	m, err := io.ReadFull(x.r, p[n:])
	if err == io.EOF && n > 0 {
		err = io.ErrUnexpectedEOF
	}
	if err == nil && n+m != len(p) {
		err = io.ErrUnexpectedEOF
	}
	return err
}

// Discard skips n bytes.
func (x *Reader) Discard(n int64) error {
	_, err := io.CopyN(io.Discard, x.br, n)
	return err
}

// Idle reports whether nothing more is known to have arrived: the buffer
// is empty and the last payload was small. After a large payload, read
// past the buffer, it reports false: whether the next frame is waiting is
// unknown, and the callers' fast path for a lone request (run it on the
// reading goroutine) would stall a pipeline of large writes.
func (x *Reader) Idle() bool { return !x.afterLarge && x.br.Buffered() == 0 }
