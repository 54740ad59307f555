package bufread

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"testing"
)

// TestReadFullMatchesStream reads a stream of frames of random sizes, each
// a small header followed by its payload, through ReadFull over a real
// socket pair and checks every byte arrives in order; large payloads must
// not go through the buffer.
func TestReadFullMatchesStream(t *testing.T) {
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
	br := bufio.NewReaderSize(counter, 64<<10)
	var got bytes.Buffer
	for _, n := range sizes {
		hdr := make([]byte, 8)
		if err := ReadFull(br, counter, hdr); err != nil {
			t.Fatal(err)
		}
		p := make([]byte, n)
		if err := ReadFull(br, counter, p); err != nil {
			t.Fatal(err)
		}
		got.Write(hdr)
		got.Write(p)
	}
	if err := ReadFull(br, counter, make([]byte, 1)); err != io.EOF {
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

func TestReadFullShortStream(t *testing.T) {
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
			r := bytes.NewReader(make([]byte, tc.stream))
			br := bufio.NewReaderSize(r, 4096)
			if tc.stream > 0 {
				br.Peek(1) // fill the buffer
			}
			err := ReadFull(br, r, make([]byte, 2*DirectMin))
			if !errors.Is(err, tc.want) {
				t.Fatalf("got %v, want %v", err, tc.want)
			}
		})
	}
}
