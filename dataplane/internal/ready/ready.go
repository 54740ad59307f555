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
}

// MaxLine bounds a report line: a longer one is refused, not buffered.
const MaxLine = 64 << 10

// Write writes r as one JSON line to the descriptor fd and closes it. A
// negative fd (no --ready-fd given) writes nothing.
func Write(fd int, r Report) error {
	if fd < 0 {
		return nil
	}
	f := os.NewFile(uintptr(fd), "ready-fd")
	if f == nil {
		return fmt.Errorf("--ready-fd %d: not an open descriptor", fd)
	}
	defer f.Close()
	b, err := json.Marshal(r)
	if err != nil {
		return err
	}
	if _, err := f.Write(append(b, '\n')); err != nil {
		return fmt.Errorf("--ready-fd %d: %w", fd, err)
	}
	return nil
}

// ErrNoReport: the writer closed the stream without a report (the process
// exited or failed before it was ready).
var ErrNoReport = errors.New("the process closed its ready descriptor without reporting ready")

// Read reads one report line from rd.
func Read(rd io.Reader) (Report, error) {
	br := bufio.NewReaderSize(io.LimitReader(rd, MaxLine+1), 4096)
	line, err := br.ReadSlice('\n')
	if errors.Is(err, bufio.ErrBufferFull) {
		// ReadSlice's buffer is smaller than MaxLine; gather the rest.
		buf := append([]byte(nil), line...)
		for errors.Is(err, bufio.ErrBufferFull) && len(buf) <= MaxLine {
			line, err = br.ReadSlice('\n')
			buf = append(buf, line...)
		}
		line = buf
	}
	if len(line) > MaxLine {
		return Report{}, fmt.Errorf("ready report longer than %d bytes", MaxLine)
	}
	if err != nil {
		if errors.Is(err, io.EOF) {
			return Report{}, ErrNoReport
		}
		return Report{}, err
	}
	var r Report
	if err := json.Unmarshal(line, &r); err != nil {
		return Report{}, fmt.Errorf("ready report %q: %w", line, err)
	}
	return r, nil
}
