// Package ready is the contract between the instance manager and the
// engine and replica processes it starts: when a process has opened
// everything it serves, it writes one Report as a JSON line to the
// descriptor the instance manager gave it with --ready-fd, and closes it.
// The instance manager learns from that line that the process is running
// and where it serves (the addresses it listens on, the engine's block
// device), instead of probing ports or deriving one address from another.
package ready

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
)

// EndpointKind says what an engine's endpoint is.
type EndpointKind string

// Endpoint kinds.
const (
	// EndpointBlockDevice is a kernel block device attached through the
	// kernel's nbd driver (/dev/nbdN).
	EndpointBlockDevice EndpointKind = "block-device"
	// EndpointLoopDevice is a loop device (/dev/loopN) over the volume's
	// file in a FUSE mount (the fuse frontend).
	EndpointLoopDevice EndpointKind = "loop-device"
	// EndpointNBDSocket is the NBD server's unix socket: there is no block
	// device, only userspace NBD clients can use the volume.
	EndpointNBDSocket EndpointKind = "nbd-socket"
)

// Report is what a process says when it is ready. Fields that do not apply
// to the process's kind are empty.
type Report struct {
	// Data is a replica's dataconn address (HOST:PORT or unix:PATH).
	Data string `json:"data,omitempty"`
	// LocalData is a replica's second dataconn address, unix:PATH, for
	// an engine on its node (shared memory); empty when it serves only
	// Data.
	LocalData string `json:"localData,omitempty"`
	// Control is the gRPC control address (replica and engine); empty when
	// the process serves none.
	Control string `json:"control,omitempty"`
	// Size is the volume size in bytes.
	Size int64 `json:"size"`
	// Endpoint is where an engine's frontend serves the volume: the block
	// device path, or the NBD socket when there is no device.
	Endpoint string `json:"endpoint,omitempty"`
	// EndpointKind says what Endpoint is.
	EndpointKind EndpointKind `json:"endpointKind,omitempty"`
	// Socket is the NBD socket of an nbd frontend (also when Endpoint is
	// the kernel device attached to it).
	Socket string `json:"socket,omitempty"`
	// Fallback says why an engine asked for a kernel block device serves
	// only its NBD socket (e.g. the host has no nbd driver); empty when it
	// got what it asked for.
	Fallback string `json:"fallback,omitempty"`
	// Resumed: the engine serves the block device a dead engine of the
	// volume served, taken over with the I/O it held (the fuse frontend
	// through the device keeper, the nbd frontend by reattaching
	// /dev/nbdN); false for a fresh device.
	Resumed bool `json:"resumed,omitempty"`
}

// MaxLine bounds a report line: a longer one is refused, not buffered.
const MaxLine = 64 << 10

// MaxWaiting bounds a waiting line's message; a longer one is cut.
const MaxWaiting = 4 << 10

// line is one line on the descriptor: a waiting line has Waiting set,
// the ready report has not.
type line struct {
	Report
	// Waiting says what a process that is not ready yet waits for (an
	// engine waiting for a replica); any number of such lines may come
	// before the report.
	Waiting string `json:"waiting,omitempty"`
}

// Writer writes to a process's ready descriptor: any number of waiting
// lines while it starts, then the ready report, which closes it.
type Writer struct {
	fd int
	mu sync.Mutex
	f  *os.File // nil: no descriptor, or closed
}

// NewWriter returns the Writer of descriptor fd; with a negative fd (no
// --ready-fd given) it writes nothing.
func NewWriter(fd int) (*Writer, error) {
	w := &Writer{fd: fd}
	if fd < 0 {
		return w, nil
	}
	if w.f = os.NewFile(uintptr(fd), "ready-fd"); w.f == nil {
		return nil, fmt.Errorf("--ready-fd %d: not an open descriptor", fd)
	}
	return w, nil
}

// Waiting writes a line saying what the process waits for (cut to
// MaxWaiting bytes); an empty msg writes nothing.
func (w *Writer) Waiting(msg string) error {
	if msg == "" {
		return nil
	}
	if len(msg) > MaxWaiting {
		msg = msg[:MaxWaiting]
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.writeLocked(line{Waiting: msg})
}

// Ready writes r and closes the descriptor.
func (w *Writer) Ready(r Report) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	err := w.writeLocked(line{Report: r})
	if w.f != nil {
		w.f.Close()
		w.f = nil
	}
	return err
}

func (w *Writer) writeLocked(l line) error {
	if w.f == nil {
		return nil
	}
	b, err := json.Marshal(l)
	if err != nil {
		return err
	}
	if _, err := w.f.Write(append(b, '\n')); err != nil {
		return fmt.Errorf("--ready-fd %d: %w", w.fd, err)
	}
	return nil
}

// Write writes r as one JSON line to the descriptor fd and closes it. A
// negative fd (no --ready-fd given) writes nothing.
func Write(fd int, r Report) error {
	w, err := NewWriter(fd)
	if err != nil {
		return err
	}
	return w.Ready(r)
}

// ErrNoReport: the writer closed the stream without a report (the process
// exited or failed before it was ready).
var ErrNoReport = errors.New("the process closed its ready descriptor without reporting ready")

// Read reads the ready report from rd, skipping waiting lines.
func Read(rd io.Reader) (Report, error) { return ReadProgress(rd, nil) }

// ReadProgress reads lines from rd until the ready report, giving the
// message of each waiting line before it to waiting (nil: skipped).
func ReadProgress(rd io.Reader, waiting func(msg string)) (Report, error) {
	br := bufio.NewReaderSize(rd, 4096)
	for {
		l, err := readLine(br)
		if err != nil {
			return Report{}, err
		}
		if l.Waiting == "" {
			return l.Report, nil
		}
		if waiting != nil {
			waiting(l.Waiting)
		}
	}
}

// readLine reads and decodes one line of at most MaxLine bytes.
func readLine(br *bufio.Reader) (line, error) {
	b, err := br.ReadSlice('\n')
	if errors.Is(err, bufio.ErrBufferFull) {
		// ReadSlice's buffer is smaller than MaxLine; gather the rest.
		buf := append([]byte(nil), b...)
		for errors.Is(err, bufio.ErrBufferFull) && len(buf) <= MaxLine {
			b, err = br.ReadSlice('\n')
			buf = append(buf, b...)
		}
		b = buf
	}
	if len(b) > MaxLine {
		return line{}, fmt.Errorf("ready report longer than %d bytes", MaxLine)
	}
	if err != nil {
		if errors.Is(err, io.EOF) {
			return line{}, ErrNoReport
		}
		return line{}, err
	}
	var l line
	if err := json.Unmarshal(b, &l); err != nil {
		return line{}, fmt.Errorf("ready report %q: %w", b, err)
	}
	return l, nil
}
