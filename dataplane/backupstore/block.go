package backupstore

import (
	"crypto/sha256"
	"encoding/binary"
	"fmt"

	"github.com/klauspost/compress/s2"
)

// Block objects: a 12-byte header, then the payload.
//
//	magic "CRNB", version u8 (1), codec u8 (0 stored, 1 S2), 0 u16,
//	length of the block's bytes u32 (big endian)
//
// The block's name is the SHA-256 of its bytes; a reader decodes the
// payload to exactly the stated length (never more than the block size)
// and checks that hash.
const (
	blockHeaderLen = 12
	blockVersion   = 1
)

// codec is how a block's payload is encoded.
type codec uint8

const (
	codecStored codec = 0 // the bytes as they are (incompressible: ciphertext)
	codecS2     codec = 1 // S2 block format (github.com/klauspost/compress/s2)
)

var blockMagic = [4]byte{'C', 'R', 'N', 'B'}

// maxBlockObject bounds a stored block of a backup with block size bs.
func maxBlockObject(bs int64) int64 { return blockHeaderLen + int64(s2.MaxEncodedLen(int(bs))) }

// encodeBlock returns the object for data: S2-compressed, or stored as it
// is when compression does not save at least 1/16 (ciphertext never
// compresses; decoding it as stored bytes is then free).
func encodeBlock(data []byte, scratch []byte) []byte {
	out := make([]byte, blockHeaderLen, blockHeaderLen+s2.MaxEncodedLen(len(data)))
	copy(out, blockMagic[:])
	out[4] = blockVersion
	binary.BigEndian.PutUint32(out[8:], uint32(len(data)))
	enc := s2.Encode(scratch[:cap(scratch)], data)
	if len(enc) < len(data)-len(data)/16 {
		out[5] = byte(codecS2)
		return append(out, enc...)
	}
	out[5] = byte(codecStored)
	return append(out, data...)
}

// decodeBlock decodes obj into dst (len(dst) is the block's expected
// length) and checks it against want. Any mismatch is ErrCorrupt.
func decodeBlock(obj []byte, want Hash, dst []byte) error {
	if len(obj) < blockHeaderLen || [4]byte(obj[:4]) != blockMagic || obj[4] != blockVersion || obj[6] != 0 || obj[7] != 0 {
		return fmt.Errorf("%w: not a block object", ErrCorrupt)
	}
	if n := binary.BigEndian.Uint32(obj[8:]); int(n) != len(dst) {
		return fmt.Errorf("%w: block of %d bytes where %d are expected", ErrCorrupt, n, len(dst))
	}
	payload := obj[blockHeaderLen:]
	switch codec(obj[5]) {
	case codecStored:
		if len(payload) != len(dst) {
			return fmt.Errorf("%w: stored block of %d bytes where %d are expected", ErrCorrupt, len(payload), len(dst))
		}
		copy(dst, payload)
	case codecS2:
		n, err := s2.DecodedLen(payload)
		if err != nil {
			return fmt.Errorf("%w: %w", ErrCorrupt, err)
		}
		if n != len(dst) {
			return fmt.Errorf("%w: compressed block decodes to %d bytes where %d are expected", ErrCorrupt, n, len(dst))
		}
		if _, err := s2.Decode(dst, payload); err != nil {
			return fmt.Errorf("%w: %w", ErrCorrupt, err)
		}
	default:
		return fmt.Errorf("%w: unknown block codec %d", ErrCorrupt, obj[5])
	}
	if sha256.Sum256(dst) != want {
		return fmt.Errorf("%w: block checksum mismatch", ErrCorrupt)
	}
	return nil
}

// isZero reports whether b holds only zero bytes.
func isZero(b []byte) bool {
	for len(b) >= 8 {
		if binary.LittleEndian.Uint64(b) != 0 {
			return false
		}
		b = b[8:]
	}
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}
