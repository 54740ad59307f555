package bufread

import (
	"bytes"
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"testing"
)

// TestReaderMatchesStream reads a stream of frames of random sizes, each
// a small header followed by its payload, through a Reader over a real
// socket pair and checks every byte arrives in order; large payloads must
// not go through the buffer.
func TestReaderMatchesStream(t *testing.T) {
	a, b := net.Pipe()
	defer a.Close()
	rng := rand.New(rand.NewPCG(1, 2))
	var sizes []int
	for range 200 {
		sizes = append(sizes, rng.IntN(200<<10))
	}
	var want bytes.Buffer
	go func() {
		defer b.Close()
		for i, n := range sizes {
			p := make([]byte, 8+n)
			for j := range p {
				p[j] = byte(i + j)
			}
			want.Write(p) // before the write: the reader reads want after EOF
			// Write in uneven pieces so buffered and direct parts vary.
			for len(p) > 0 {
				k := min(len(p), 1+rng.IntN(100<<10))
				if _, err := b.Write(p[:k]); err != nil {
					return
				}
				p = p[k:]
			}
		}
	}()
	counter := &countingReader{r: a}
	x := NewReader(counter, 64<<10)
	var got bytes.Buffer
	for _, n := range sizes {
		hdr := make([]byte, 8)
		if err := x.Header(hdr); err != nil {
			t.Fatal(err)
		}
		p := make([]byte, n)
		if err := x.Payload(p); err != nil {
			t.Fatal(err)
		}
		got.Write(hdr)
		got.Write(p)
	}
	if err := x.Header(make([]byte, 1)); !errors.Is(err, io.EOF) {
		t.Fatalf("after the stream: %v, want EOF", err)
	}
	if !bytes.Equal(got.Bytes(), want.Bytes()) {
		t.Fatal("the bytes read differ from the bytes sent")
	}
	if counter.direct == 0 {
		t.Fatal("no large payload was read straight into its destination")
	}
}

type countingReader struct {
	r      io.Reader
	direct int // reads larger than the buffer: straight into a payload
}

func (c *countingReader) Read(p []byte) (int, error) {
	if len(p) > 64<<10 {
		c.direct++
	}
	return c.r.Read(p)
}

func TestPayloadShortStream(t *testing.T) {
	for _, tc := range []struct {
		name   string
		stream int
		want   error
	}{
		{"empty", 0, io.EOF},
		{"partial, all buffered", 1000, io.ErrUnexpectedEOF},
		{"partial, past the buffer", DirectMin + 5000, io.ErrUnexpectedEOF},
	} {
		t.Run(tc.name, func(t *testing.T) {
			x := NewReader(bytes.NewReader(make([]byte, tc.stream)), 4096)
			if tc.stream > 0 {
				if _, err := x.br.Peek(1); err != nil { // fill the buffer
					t.Fatal(err)
				}
			}
			err := x.Payload(make([]byte, 2*DirectMin))
			if !errors.Is(err, tc.want) {
				t.Fatalf("got %v, want %v", err, tc.want)
			}
		})
	}
}

// recorder records the size of every Read its caller asked for.
type recorder struct {
	r     io.Reader
	asked []int
}

func (c *recorder) Read(p []byte) (int, error) {
	c.asked = append(c.asked, len(p))
	return c.r.Read(p)
}

// TestReaderHeaderAfterLargePayload: after a payload read past the buffer,
// the next header is read on its own (a 28-byte read), not by a buffer fill
// that would take in the next payload only to copy it again, and Idle says
// the stream's state is unknown.
func TestReaderHeaderAfterLargePayload(t *testing.T) {
	const bufSize = 256 << 10
	var stream bytes.Buffer
	frame := func(n int, b byte) {
		stream.Write(bytes.Repeat([]byte{'H'}, 28))
		stream.Write(bytes.Repeat([]byte{b}, n))
	}
	frame(300<<10, 1) // larger than the buffer: ends with a direct read
	frame(128<<10, 2)
	frame(100, 3)
	frame(100, 4)
	rec := &recorder{r: &stream}
	x := NewReader(rec, bufSize)
	hdr := make([]byte, 28)
	read := func(n int, b byte) {
		t.Helper()
		if err := x.Header(hdr); err != nil || hdr[0] != 'H' {
			t.Fatalf("header: %v %q", err, hdr[:1])
		}
		p := make([]byte, n)
		if err := x.Payload(p); err != nil || !bytes.Equal(p, bytes.Repeat([]byte{b}, n)) {
			t.Fatalf("payload %d: %v", b, err)
		}
	}
	read(300<<10, 1)
	if x.Idle() {
		t.Fatal("Idle after a large payload")
	}
	n := len(rec.asked)
	read(128<<10, 2)
	if got := rec.asked[n:]; len(got) != 2 || got[0] != 28 || got[1] != 128<<10 {
		t.Fatalf("reads for a large frame after a large frame: %v, want [28 %d] (header alone, payload direct)", got, 128<<10)
	}
	n = len(rec.asked)
	read(100, 3)
	if got := rec.asked[n:]; len(got) != 2 || got[0] != 28 || got[1] != bufSize {
		t.Fatalf("reads for a small frame after a large one: %v, want [28 %d] (header alone, then a buffer fill)", got, bufSize)
	}
	if x.Idle() {
		t.Fatal("Idle with the next frame in the buffer")
	}
	n = len(rec.asked)
	read(100, 4)
	if len(rec.asked) != n {
		t.Fatalf("a buffered small frame cost reads: %v", rec.asked[n:])
	}
	if !x.Idle() {
		t.Fatal("not Idle with an empty buffer after a small payload")
	}
	if err := x.Header(hdr); !errors.Is(err, io.EOF) {
		t.Fatalf("at the end: %v, want EOF", err)
	}
}
