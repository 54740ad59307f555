// Package bufread reads large payloads past a bufio.Reader's buffer.
//
// The data-path readers (dataconn client and server, the NBD server) read
// through a large buffer so that many small frames cost one read syscall.
// A large payload read the same way is copied twice: from the socket into
// the buffer, then from the buffer into its destination. ReadFull copies
// what the buffer already holds and reads the rest straight into the
// destination.
package bufread

import (
	"bufio"
	"io"
)

// DirectMin is the payload size from which ReadFull bypasses the buffer.
// Smaller payloads go through it, so that the frames after them arrive in
// the same read syscall.
const DirectMin = 32 << 10

// ReadFull fills p from br, where br reads from r. It returns what
// io.ReadFull(br, p) would: nil, io.EOF if nothing was read, or
// io.ErrUnexpectedEOF if p was filled in part.
func ReadFull(br *bufio.Reader, r io.Reader, p []byte) error {
	if len(p) < DirectMin {
		_, err := io.ReadFull(br, p)
		return err
	}
	n := 0
	if b := br.Buffered(); b > 0 {
		// Read returns only buffered bytes when the buffer is not empty.
		n, _ = br.Read(p[:min(b, len(p))])
	}
	m, err := io.ReadFull(r, p[n:])
	if err == io.EOF && n > 0 {
		err = io.ErrUnexpectedEOF
	}
	if err == nil && n+m != len(p) {
		err = io.ErrUnexpectedEOF
	}
	return err
}
