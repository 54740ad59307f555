package dataconn

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"syscall"
)

// HeaderSize is the size of every frame header in bytes.
const HeaderSize = 48

// SharedRefSize is the payload of a write with FlagShared: the offset of
// its data in the attached shared memory.
const SharedRefSize = 8

// Magic starts every frame.
const Magic uint32 = 0x43524e44 // "CRND"

// Version is the protocol version this package speaks. A peer that receives
// any other version rejects the frame (ErrBadVersion) and closes the stream.
const Version uint8 = 1

// DefaultMaxPayload bounds the payload of a frame unless configured
// otherwise: 4 MiB, well above any single block-device request.
const DefaultMaxPayload = 4 << 20

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// Checksum returns the CRC32C of b, as carried in payloadCRC.
func Checksum(b []byte) uint32 { return crc32.Checksum(b, castagnoli) }

// Op is a frame's operation. Replies carry the request's op with ReplyBit set.
type Op uint8

// Request ops.
const (
	OpRead  Op = 1 // read length bytes at offset; the reply carries them
	OpWrite Op = 2 // write the payload (length bytes) at offset
	OpFlush Op = 3 // make every completed write durable
	OpUnmap Op = 4 // discard length bytes at offset; they read as zeros after
	OpPing  Op = 5 // liveness check; no payload, not epoch-checked
	// OpAttach offers the server shared memory of length bytes: the frame
	// carries a sealed memfd (SCM_RIGHTS) and must be a unix connection's
	// first. Afterwards writes may carry FlagShared. Not epoch-checked.
	OpAttach Op = 6
	// OpSnapshotRead reads length bytes at offset of the view at a
	// snapshot: the payload is the snapshot's name (1 to
	// MaxSnapshotNameLen bytes), the reply carries the bytes, holes as
	// zeros. It reads only what a snapshot froze, so it is not
	// epoch-checked: a backup reads beside the engine owning the volume.
	OpSnapshotRead Op = 7
)

// MaxSnapshotNameLen bounds the name a snapshot read carries.
const MaxSnapshotNameLen = 255

// ReplyBit marks a reply: its op is the request's op | ReplyBit.
const ReplyBit Op = 0x80

// IsReply reports whether op is a reply op.
func (o Op) IsReply() bool { return o&ReplyBit != 0 }

// Request returns the request op of a reply (or o itself for a request).
func (o Op) Request() Op { return o &^ ReplyBit }

// Reply returns the reply op for request op o.
func (o Op) Reply() Op { return o | ReplyBit }

// Valid reports whether o is a known request or reply op.
func (o Op) Valid() bool {
	switch o.Request() {
	case OpRead, OpWrite, OpFlush, OpUnmap, OpPing, OpAttach, OpSnapshotRead:
		return true
	}
	return false
}

func (o Op) String() string {
	var s string
	switch o.Request() {
	case OpRead:
		s = "read"
	case OpWrite:
		s = "write"
	case OpFlush:
		s = "flush"
	case OpUnmap:
		s = "unmap"
	case OpPing:
		s = "ping"
	case OpAttach:
		s = "attach"
	case OpSnapshotRead:
		s = "snapshot-read"
	default:
		return fmt.Sprintf("op(0x%02x)", uint8(o))
	}
	if o.IsReply() {
		return s + "-reply"
	}
	return s
}

// FlushOffsetClean, as a flush request's Offset (a plain flush's is 0),
// makes it a clean flush: the engine sending it has no write in flight
// and every write it completed is on every replica of a set that is not
// degraded (it is stopping), so the server may clear the write-intent
// record of every region without a write in flight, not only of those
// gone quiet. A server without such a record, or one older than clean
// flushes (they ignore a flush's Offset), flushes plainly: the record
// stays, which is always safe.
const FlushOffsetClean uint64 = 1

// Flags modify a request.
type Flags uint8

const (
	// FlagFUA on a write asks that the data be durable before the reply
	// (force unit access), as if a flush followed it.
	FlagFUA Flags = 1 << 0
	// FlagShared on a write says the data is not in the frame: the
	// payload is an 8-byte big-endian offset into the shared memory the
	// connection attached, where the length bytes to write lie.
	FlagShared Flags = 1 << 1

	knownFlags = FlagFUA | FlagShared
)

// Code is the typed error code of a reply. It is also an error, so callers
// test remote failures with errors.Is(err, dataconn.CodeStaleEpoch); a
// full disk also matches syscall.ENOSPC (see Code.Is).
type Code uint8

// Error codes. CodeOK (0) means success.
const (
	CodeOK          Code = 0
	CodeIO          Code = 1 // the backend failed the I/O (EIO)
	CodeNoSpace     Code = 2 // the backend's disk is full (ENOSPC)
	CodeOutOfRange  Code = 3 // offset+length beyond the volume size
	CodeStaleEpoch  Code = 4 // the request's epoch is not the replica's
	CodeInvalid     Code = 5 // a request the server cannot act on (bad alignment, flags)
	CodeUnsupported Code = 6 // the op is known but this server does not do it
	CodeShutdown    Code = 7 // the server is shutting down
	maxCode              = CodeShutdown
)

func (c Code) Error() string {
	switch c {
	case CodeOK:
		return "ok"
	case CodeIO:
		return "I/O error"
	case CodeNoSpace:
		return "no space left on device"
	case CodeOutOfRange:
		return "out of range"
	case CodeStaleEpoch:
		return "stale epoch"
	case CodeInvalid:
		return "invalid request"
	case CodeUnsupported:
		return "unsupported operation"
	case CodeShutdown:
		return "server shutting down"
	}
	return fmt.Sprintf("error code %d", uint8(c))
}

// String is the same as Error.
func (c Code) String() string { return c.Error() }

// Is makes a code match the errno a local disk would have given for it,
// so that callers above the engine (the NBD and FUSE frontends) test a
// replica's full disk as they would a local one:
// errors.Is(err, syscall.ENOSPC) holds for CodeNoSpace.
func (c Code) Is(target error) bool {
	return c == CodeNoSpace && target == syscall.ENOSPC
}

// RemoteError is an error reply: the server's code and its message.
type RemoteError struct {
	Code    Code
	Message string
}

func (e *RemoteError) Error() string {
	if e.Message == "" {
		return "replica: " + e.Code.Error()
	}
	return "replica: " + e.Code.Error() + ": " + e.Message
}

// Unwrap makes errors.Is(err, CodeX) work.
func (e *RemoteError) Unwrap() error { return e.Code }

// Decoding errors. A stream that yields one of them cannot be trusted any
// further: the reader closes it.
var (
	ErrBadMagic        = errors.New("dataconn: bad magic (not a dataconn stream)")
	ErrBadVersion      = errors.New("dataconn: unsupported protocol version")
	ErrUnknownOp       = errors.New("dataconn: unknown op")
	ErrUnknownCode     = errors.New("dataconn: unknown error code")
	ErrUnknownFlags    = errors.New("dataconn: unknown flags")
	ErrHeaderChecksum  = errors.New("dataconn: header checksum mismatch")
	ErrPayloadChecksum = errors.New("dataconn: payload checksum mismatch")
	ErrPayloadTooLarge = errors.New("dataconn: payload larger than the configured maximum")
	ErrMalformed       = errors.New("dataconn: malformed frame")
)

// Header is a frame header. PayloadLen and PayloadCRC are filled in by
// Encode from the payload it is given.
type Header struct {
	Op         Op
	Flags      Flags
	Code       Code
	Seq        uint64
	Offset     uint64
	Epoch      uint64
	Length     uint32
	PayloadLen uint32
	PayloadCRC uint32
}

// Frame is a decoded header and its payload.
type Frame struct {
	Header
	Payload []byte
}

// PutHeader writes h into b[:HeaderSize], computing the header checksum. It
// writes h.PayloadLen and h.PayloadCRC as given.
func PutHeader(b []byte, h *Header) {
	_ = b[HeaderSize-1]
	binary.BigEndian.PutUint32(b[0:], Magic)
	b[4] = Version
	b[5] = byte(h.Op)
	b[6] = byte(h.Flags)
	b[7] = byte(h.Code)
	binary.BigEndian.PutUint64(b[8:], h.Seq)
	binary.BigEndian.PutUint64(b[16:], h.Offset)
	binary.BigEndian.PutUint64(b[24:], h.Epoch)
	binary.BigEndian.PutUint32(b[32:], h.Length)
	binary.BigEndian.PutUint32(b[36:], h.PayloadLen)
	binary.BigEndian.PutUint32(b[40:], h.PayloadCRC)
	binary.BigEndian.PutUint32(b[44:], Checksum(b[:44]))
}

// AppendFrame appends the encoding of h with payload to dst and returns the
// extended slice. It sets PayloadLen and PayloadCRC from payload.
func AppendFrame(dst []byte, h Header, payload []byte) []byte {
	h.PayloadLen = uint32(len(payload))
	h.PayloadCRC = Checksum(payload)
	var hb [HeaderSize]byte
	PutHeader(hb[:], &h)
	dst = append(dst, hb[:]...)
	return append(dst, payload...)
}

// ParseHeader decodes and checks a header: magic, version, header checksum,
// op, flags, error code, the payload bound and the consistency of length
// and payload length for the op. It never allocates.
func ParseHeader(b []byte, maxPayload uint32) (Header, error) {
	if len(b) < HeaderSize {
		return Header{}, fmt.Errorf("%w: header is %d bytes, want %d", ErrMalformed, len(b), HeaderSize)
	}
	if m := binary.BigEndian.Uint32(b[0:]); m != Magic {
		return Header{}, fmt.Errorf("%w: got 0x%08x", ErrBadMagic, m)
	}
	if b[4] != Version {
		return Header{}, fmt.Errorf("%w: got %d, this side speaks %d", ErrBadVersion, b[4], Version)
	}
	if got, want := binary.BigEndian.Uint32(b[44:]), Checksum(b[:44]); got != want {
		return Header{}, fmt.Errorf("%w: got 0x%08x, computed 0x%08x", ErrHeaderChecksum, got, want)
	}
	h := Header{
		Op:         Op(b[5]),
		Flags:      Flags(b[6]),
		Code:       Code(b[7]),
		Seq:        binary.BigEndian.Uint64(b[8:]),
		Offset:     binary.BigEndian.Uint64(b[16:]),
		Epoch:      binary.BigEndian.Uint64(b[24:]),
		Length:     binary.BigEndian.Uint32(b[32:]),
		PayloadLen: binary.BigEndian.Uint32(b[36:]),
		PayloadCRC: binary.BigEndian.Uint32(b[40:]),
	}
	if !h.Op.Valid() {
		return Header{}, fmt.Errorf("%w: 0x%02x", ErrUnknownOp, uint8(h.Op))
	}
	if h.Flags&^knownFlags != 0 {
		return Header{}, fmt.Errorf("%w: 0x%02x", ErrUnknownFlags, uint8(h.Flags))
	}
	if h.Code > maxCode {
		return Header{}, fmt.Errorf("%w: %d", ErrUnknownCode, uint8(h.Code))
	}
	if h.PayloadLen > maxPayload {
		return Header{}, fmt.Errorf("%w: %d bytes, maximum %d", ErrPayloadTooLarge, h.PayloadLen, maxPayload)
	}
	if err := h.checkShape(); err != nil {
		return Header{}, err
	}
	return h, nil
}

// checkShape checks that length, payload length and code fit the op.
func (h *Header) checkShape() error {
	bad := func(why string) error { return fmt.Errorf("%w: %s %s", ErrMalformed, h.Op, why) }
	if !h.Op.IsReply() {
		if h.Code != CodeOK {
			return bad("request carries an error code")
		}
		if h.Flags&FlagFUA != 0 && h.Op != OpWrite {
			return bad("has FUA, which only writes may carry")
		}
		if h.Flags&FlagShared != 0 && h.Op != OpWrite {
			return bad("has the shared flag, which only writes may carry")
		}
		switch h.Op {
		case OpWrite:
			if h.Flags&FlagShared != 0 {
				if h.PayloadLen != SharedRefSize || h.Length == 0 {
					return bad("with the shared flag needs a length and an 8-byte offset as payload")
				}
			} else if h.PayloadLen != h.Length {
				return bad("payload length differs from length")
			}
		case OpAttach:
			if h.PayloadLen != 0 || h.Length == 0 {
				return bad("needs a length and no payload")
			}
		case OpRead, OpUnmap:
			if h.PayloadLen != 0 {
				return bad("request carries a payload")
			}
		case OpSnapshotRead:
			if h.PayloadLen == 0 || h.PayloadLen > MaxSnapshotNameLen || h.Length == 0 {
				return bad(fmt.Sprintf("needs a length and a snapshot name of 1 to %d bytes as payload", MaxSnapshotNameLen))
			}
		case OpFlush, OpPing:
			if h.PayloadLen != 0 || h.Length != 0 {
				return bad("request carries a length or payload")
			}
		}
		return nil
	}
	if h.Flags != 0 {
		return bad("reply carries flags")
	}
	if h.Code != CodeOK {
		return nil // error replies carry a message of any length up to the bound
	}
	if r := h.Op.Request(); r == OpRead || r == OpSnapshotRead {
		if h.PayloadLen != h.Length {
			return bad("reply payload length differs from length")
		}
	} else if h.PayloadLen != 0 {
		return bad("reply carries a payload")
	}
	return nil
}

// Encode writes one frame to w.
func Encode(w io.Writer, h Header, payload []byte) error {
	_, err := w.Write(AppendFrame(make([]byte, 0, HeaderSize+len(payload)), h, payload))
	return err
}

// Decode reads one frame from r. The payload is allocated only after the
// header has been checked, and never beyond maxPayload bytes.
func Decode(r io.Reader, maxPayload uint32) (Frame, error) {
	return ReadFrame(r, maxPayload, nil)
}

// ReadFrame is Decode reading the payload into buf when it is large enough
// (the returned Payload then aliases buf).
func ReadFrame(r io.Reader, maxPayload uint32, buf []byte) (Frame, error) {
	var hb [HeaderSize]byte
	if _, err := io.ReadFull(r, hb[:]); err != nil {
		return Frame{}, err
	}
	h, err := ParseHeader(hb[:], maxPayload)
	if err != nil {
		return Frame{}, err
	}
	f := Frame{Header: h}
	if h.PayloadLen > 0 {
		if uint32(cap(buf)) >= h.PayloadLen {
			f.Payload = buf[:h.PayloadLen]
		} else {
			f.Payload = make([]byte, h.PayloadLen)
		}
		if _, err := io.ReadFull(r, f.Payload); err != nil {
			return Frame{}, unexpectedEOF(err)
		}
	}
	if got := Checksum(f.Payload); got != h.PayloadCRC {
		return Frame{}, fmt.Errorf("%w: %s seq %d: header says 0x%08x, payload has 0x%08x",
			ErrPayloadChecksum, h.Op, h.Seq, h.PayloadCRC, got)
	}
	return f, nil
}

func unexpectedEOF(err error) error {
	if errors.Is(err, io.EOF) {
		return io.ErrUnexpectedEOF
	}
	return err
}
