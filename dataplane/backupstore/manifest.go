package backupstore

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"io"
	"time"
)

// Hash is the SHA-256 of a block's bytes as they were given to Backup
// (ciphertext for an encrypted volume): the block's name on the target and
// its checksum.
type Hash [sha256.Size]byte

func (h Hash) String() string { return hex.EncodeToString(h[:]) }

// parseHash reads a Hash from its 64 hex digits.
func parseHash(s string) (Hash, bool) {
	var h Hash
	if len(s) != 2*len(h) {
		return h, false
	}
	_, err := hex.Decode(h[:], []byte(s))
	return h, err == nil && h.String() == s // lower case only
}

// BlockRef is one stored block of a backup: the block at byte offset
// Index*BlockSize holds the bytes whose SHA-256 is Hash.
type BlockRef struct {
	Index uint64
	Hash  Hash
}

// Manifest is one backup: every block of the volume that is not all zeros,
// by index, in increasing order. Blocks it does not list are zero.
type Manifest struct {
	ManifestMeta
	// Size is the volume's size in bytes at the backup.
	Size int64
	// BlockSize is the size of every block but possibly the last.
	BlockSize int64
	// Blocks lists the non-zero blocks in increasing Index order.
	Blocks []BlockRef
}

// ManifestMeta is the part of a manifest that describes the backup.
type ManifestMeta struct {
	Volume  string            `json:"volume"`
	Name    string            `json:"name"`
	Parent  string            `json:"parent,omitempty"`
	Created time.Time         `json:"created"`
	Labels  map[string]string `json:"labels,omitempty"`
	// NewBlocks and NewBytes are what this backup uploaded (blocks and
	// stored bytes, after compression); the rest it shares.
	NewBlocks int64 `json:"newBlocks"`
	NewBytes  int64 `json:"newBytes"`
	// ReadBytes is how much of the source the backup read (BackupResult's
	// ReadBytes), kept so that whoever finds the backup already written
	// can report it; zero in manifests written before it was recorded.
	ReadBytes int64 `json:"readBytes,omitempty"`
}

// Bounds on the format.
const (
	// MinBlockSize and MaxBlockSize bound a backup's block size (a power
	// of two); DefaultBlockSize is what Backup uses unless told otherwise.
	MinBlockSize     = 64 << 10
	MaxBlockSize     = 16 << 20
	DefaultBlockSize = 2 << 20
	// maxMetaLen bounds a manifest's description (labels included).
	maxMetaLen = 64 << 10
	// maxLabelBytes bounds a backup's labels, keys and values together.
	maxLabelBytes = 4 << 10
)

var manifestMagic = [8]byte{'C', 'A', 'I', 'R', 'N', 'B', 'K', 'M'}

const (
	manifestVersion   = 1
	manifestHeaderLen = 40
	manifestEntryLen  = 8 + sha256.Size
	manifestTrailer   = sha256.Size
	// decodeChunk bounds how many entries the decoder allocates ahead of
	// the bytes it has actually read.
	decodeChunk = 4096
)

func validBlockSize(bs int64) bool {
	return bs >= MinBlockSize && bs <= MaxBlockSize && bs&(bs-1) == 0
}

// blockCount is how many blocks a volume of size bytes has.
func blockCount(size, bs int64) uint64 { return uint64((size + bs - 1) / bs) }

// blockLen is the length of block i of a volume of size bytes.
func blockLen(i uint64, size, bs int64) int64 { return min(bs, size-int64(i)*bs) }

// EncodeManifest writes m in the manifest format (docs/backup.md):
//
//	header   40 bytes: magic "CAIRNBKM", version u16, 0 u16, meta length u32,
//	         volume size u64, block size u32, 0 u32, entry count u64 (big endian)
//	meta     JSON of ManifestMeta
//	entries  count x (block index u64, SHA-256 32 bytes), indexes increasing
//	trailer  SHA-256 of everything before it
func EncodeManifest(m *Manifest) ([]byte, error) {
	if err := m.validate(MaxVolumeSize); err != nil {
		return nil, err
	}
	meta, err := json.Marshal(m.ManifestMeta)
	if err != nil {
		return nil, err
	}
	if len(meta) > maxMetaLen {
		return nil, fmt.Errorf("%w: manifest description is %d bytes, at most %d", ErrInvalid, len(meta), maxMetaLen)
	}
	buf := make([]byte, manifestHeaderLen, manifestHeaderLen+len(meta)+len(m.Blocks)*manifestEntryLen+manifestTrailer)
	copy(buf, manifestMagic[:])
	binary.BigEndian.PutUint16(buf[8:], manifestVersion)
	binary.BigEndian.PutUint32(buf[12:], uint32(len(meta)))
	binary.BigEndian.PutUint64(buf[16:], uint64(m.Size))
	binary.BigEndian.PutUint32(buf[24:], uint32(m.BlockSize))
	binary.BigEndian.PutUint64(buf[32:], uint64(len(m.Blocks)))
	buf = append(buf, meta...)
	for _, b := range m.Blocks {
		buf = binary.BigEndian.AppendUint64(buf, b.Index)
		buf = append(buf, b.Hash[:]...)
	}
	sum := sha256.Sum256(buf)
	return append(buf, sum[:]...), nil
}

// validate checks what a manifest must satisfy whoever wrote it.
func (m *Manifest) validate(maxVolumeSize int64) error {
	if err := validName("volume", m.Volume); err != nil {
		return err
	}
	if err := validName("backup", m.Name); err != nil {
		return err
	}
	if m.Parent != "" {
		if err := validName("backup", m.Parent); err != nil {
			return err
		}
	}
	if err := validLabels(m.Labels); err != nil {
		return err
	}
	if !validBlockSize(m.BlockSize) {
		return fmt.Errorf("%w: block size %d: a power of two from %d to %d", ErrInvalid, m.BlockSize, MinBlockSize, MaxBlockSize)
	}
	if m.Size <= 0 || m.Size > maxVolumeSize {
		return fmt.Errorf("%w: volume size %d: from 1 byte to %d", ErrInvalid, m.Size, maxVolumeSize)
	}
	n := blockCount(m.Size, m.BlockSize)
	if uint64(len(m.Blocks)) > n {
		return fmt.Errorf("%w: %d blocks in a volume of %d", ErrInvalid, len(m.Blocks), n)
	}
	for i, b := range m.Blocks {
		if b.Index >= n || (i > 0 && b.Index <= m.Blocks[i-1].Index) {
			return fmt.Errorf("%w: block %d at index %d: indexes must increase and be below %d", ErrInvalid, i, b.Index, n)
		}
	}
	return nil
}

func validLabels(labels map[string]string) error {
	total := 0
	for k, v := range labels {
		total += len(k) + len(v)
	}
	if total > maxLabelBytes {
		return fmt.Errorf("%w: labels take %d bytes, at most %d", ErrInvalid, total, maxLabelBytes)
	}
	return nil
}

// DecodeManifest reads a manifest from r, checking every bound before it
// allocates: the volume size against maxVolumeSize, the block size, the
// entry count against the volume's block count, the description's length;
// entries are allocated as they are read, so memory is bounded by the
// bytes r actually holds as well as by what the header claims. Any
// violation, a wrong checksum or trailing bytes is ErrCorrupt; errors of r
// itself are returned as they are.
func DecodeManifest(r io.Reader, maxVolumeSize int64) (*Manifest, error) {
	sum := sha256.New()
	r = io.TeeReader(r, sum)
	var hdr [manifestHeaderLen]byte
	if err := readFull(r, hdr[:], "header"); err != nil {
		return nil, err
	}
	m, count, metaLen, err := decodeManifestHeader(hdr[:], maxVolumeSize)
	if err != nil {
		return nil, err
	}
	meta := make([]byte, metaLen)
	if err := readFull(r, meta, "description"); err != nil {
		return nil, err
	}
	if err := json.Unmarshal(meta, &m.ManifestMeta); err != nil {
		return nil, fmt.Errorf("%w: manifest description: %w", ErrCorrupt, err)
	}
	if m.Blocks, err = decodeEntries(r, count); err != nil {
		return nil, err
	}
	if err := checkTrailer(r, sum); err != nil {
		return nil, err
	}
	if err := m.validate(maxVolumeSize); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrCorrupt, err)
	}
	return m, nil
}

func decodeManifestHeader(hdr []byte, maxVolumeSize int64) (m *Manifest, count uint64, metaLen uint32, err error) {
	if !bytes.Equal(hdr[:8], manifestMagic[:]) {
		return nil, 0, 0, fmt.Errorf("%w: not a manifest (magic %q)", ErrCorrupt, hdr[:8])
	}
	if v := binary.BigEndian.Uint16(hdr[8:]); v != manifestVersion {
		return nil, 0, 0, fmt.Errorf("%w: manifest format version %d, this reader knows %d", ErrCorrupt, v, manifestVersion)
	}
	metaLen = binary.BigEndian.Uint32(hdr[12:])
	size := binary.BigEndian.Uint64(hdr[16:])
	bs := int64(binary.BigEndian.Uint32(hdr[24:]))
	count = binary.BigEndian.Uint64(hdr[32:])
	switch {
	case binary.BigEndian.Uint16(hdr[10:]) != 0 || binary.BigEndian.Uint32(hdr[28:]) != 0:
		return nil, 0, 0, fmt.Errorf("%w: manifest header has reserved bits set", ErrCorrupt)
	case metaLen > maxMetaLen:
		return nil, 0, 0, fmt.Errorf("%w: manifest description of %d bytes", ErrCorrupt, metaLen)
	case size == 0 || size > uint64(maxVolumeSize):
		return nil, 0, 0, fmt.Errorf("%w: manifest volume size %d (at most %d)", ErrCorrupt, size, maxVolumeSize)
	case !validBlockSize(bs):
		return nil, 0, 0, fmt.Errorf("%w: manifest block size %d", ErrCorrupt, bs)
	case count > blockCount(int64(size), bs):
		return nil, 0, 0, fmt.Errorf("%w: manifest lists %d blocks of a %d-block volume", ErrCorrupt, count, blockCount(int64(size), bs))
	}
	return &Manifest{Size: int64(size), BlockSize: bs}, count, metaLen, nil
}

func decodeEntries(r io.Reader, count uint64) ([]BlockRef, error) {
	refs := make([]BlockRef, 0, min(count, decodeChunk))
	var e [manifestEntryLen]byte
	for i := uint64(0); i < count; i++ {
		if err := readFull(r, e[:], "entries"); err != nil {
			return nil, err
		}
		ref := BlockRef{Index: binary.BigEndian.Uint64(e[:8])}
		copy(ref.Hash[:], e[8:])
		refs = append(refs, ref)
	}
	return refs, nil
}

func checkTrailer(r io.Reader, sum hash.Hash) error {
	want := sum.Sum(nil)
	var got [manifestTrailer]byte
	if _, err := io.ReadFull(r, got[:]); err != nil {
		return truncated(err, "trailer")
	}
	if !bytes.Equal(got[:], want) {
		return fmt.Errorf("%w: manifest checksum mismatch", ErrCorrupt)
	}
	var extra [1]byte
	switch n, err := io.ReadFull(r, extra[:]); {
	case n > 0:
		return fmt.Errorf("%w: bytes after the manifest's trailer", ErrCorrupt)
	case err != io.EOF:
		return err
	}
	return nil
}

// readFull is io.ReadFull with a short object reported as ErrCorrupt.
func readFull(r io.Reader, buf []byte, what string) error {
	if _, err := io.ReadFull(r, buf); err != nil {
		return truncated(err, what)
	}
	return nil
}

func truncated(err error, what string) error {
	if errors.Is(err, ErrTransient) {
		return err // the connection broke, not the object
	}
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return fmt.Errorf("%w: manifest ends in its %s", ErrCorrupt, what)
	}
	return err
}
