package engine

import (
	"context"

	"github.com/cairn-io/cairn/dataplane/volcrypt"
)

// Encryption at rest (Options.Cipher) on the I/O path. Writes are
// encrypted in writeChunk, reads decrypted in readAt; this file holds what
// I/O that is not aligned to volcrypt's 512-byte sectors needs. The
// frontends can send such I/O (a FUSE file read or written directly at any
// byte, an NBD client that ignores the minimum block size the server
// announces), and the engine already reads and merges partial blocks for
// writes, so it is served rather than refused.
//
// Nothing else on the engine's paths encrypts or decrypts: the open's
// reconcile, rebuilds and a clone's copy and verification move the
// replicas' bytes as they are, ciphertext included.

const sectorSize = volcrypt.SectorSize

// sectorAligned reports whether [off, off+n) is whole sectors.
func sectorAligned(off int64, n int) bool {
	return off%sectorSize == 0 && n%sectorSize == 0
}

// readSectors reads [off, off+len(p)) of an encrypted volume that starts
// or ends inside a sector: the whole sectors around it are read (and
// decrypted) into a pooled buffer and the bytes asked for copied out.
// The widened range is still inside the volume: its size is whole 4 KiB
// blocks.
func (e *Engine) readSectors(ctx context.Context, p []byte, off int64) error {
	start := off - off%sectorSize
	end := (off + int64(len(p)) + sectorSize - 1) / sectorSize * sectorSize
	buf := e.bufs.Get(int(end - start))
	defer e.bufs.Put(buf)
	if err := e.ReadAt(ctx, buf, start); err != nil {
		return err
	}
	copy(p, buf[off-start:])
	return nil
}

// mergeBlocks puts data, which goes at byte at of the volume, into buf,
// whole blocks read from a replica starting at byte start. With c (an
// encrypted volume) buf holds ciphertext: the sectors data touches are
// decrypted, merged and encrypted again, and the sectors around them are
// left as they are.
func mergeBlocks(c *volcrypt.Cipher, buf []byte, start int64, data []byte, at int64) error {
	if c == nil {
		copy(buf[at-start:], data)
		return nil
	}
	from := (at - start) / sectorSize * sectorSize
	to := (at - start + int64(len(data)) + sectorSize - 1) / sectorSize * sectorSize
	sectors := buf[from:to]
	if err := c.Decrypt(sectors, start+from); err != nil {
		return err
	}
	copy(buf[at-start:], data)
	return c.Encrypt(sectors, sectors, start+from)
}
