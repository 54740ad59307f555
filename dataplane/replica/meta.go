package replica

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"time"
)

// On-disk layout of one replica directory (docs/replica-format.md):
//
//	volume.meta          JSON metadata, replaced atomically
//	layer-NNNNNN.img     one sparse file per layer: every snapshot, and the head
//	dirty.bitmap         the write-intent bitmap
//
// Any other layer file, and any *.tmp file, is debris from a crash and is
// removed on open.
const (
	metaFileName  = "volume.meta"
	formatVersion = 1
)

type metadata struct {
	FormatVersion int `json:"formatVersion"`
	// ID is random, set when the replica is created: it tells a replica
	// that comes back from a new one at the same address.
	ID    string `json:"id"`
	Size  int64  `json:"size"`
	Epoch uint64 `json:"epoch"`
	// EpochOwner identifies the engine that set Epoch (empty: none given).
	EpochOwner string `json:"epochOwner,omitempty"`
	// EpochMembers are the IDs of the replicas that were RW in the set
	// when Epoch was set (empty: set without them, e.g. by an older
	// binary). An engine opening the volume without some replica needs
	// them to show that the missing one cannot hold newer data.
	EpochMembers []string `json:"epochMembers,omitempty"`
	// DirtyKeptSince is the epoch from which this replica has cleared no
	// write-intent bit, continuously: every write it took at that epoch
	// or later, and every region the engine asked it to mark
	// (FenceOptions.Mark), is marked in dirty.bitmap. 0: unknown (bits
	// may be cleared, or metadata written before the marker existed). A
	// replica last a member at epoch E may copy only the dirty regions
	// from a source whose marker is non-zero and at most E+1.
	DirtyKeptSince uint64 `json:"dirtyKeptSince,omitempty"`
	// Rebuilding is true while the replica is being rebuilt: its data is
	// incomplete and no engine may open it as a healthy member.
	Rebuilding bool   `json:"rebuilding,omitempty"`
	RegionSize int64  `json:"regionSize"`
	NextLayer  uint64 `json:"nextLayer"`
	// Head is the file name of the writable layer.
	Head string `json:"head"`
	// Snapshots are the immutable layers, oldest first; each is the parent
	// of the next, and the newest is the parent of Head.
	Snapshots []snapshotMeta `json:"snapshots"`
}

type snapshotMeta struct {
	Name        string    `json:"name"`
	File        string    `json:"file"`
	Created     time.Time `json:"created"`
	UserCreated bool      `json:"userCreated"`
	// Deleting is set before a deletion that rewrites this layer starts;
	// open finishes such a deletion, and the snapshot is never served.
	Deleting bool `json:"deleting,omitempty"`
}

var snapshotName = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$`)

func layerFile(id uint64) string { return fmt.Sprintf("layer-%06d.img", id) }

var layerFilePattern = regexp.MustCompile(`^layer-[0-9]{6}\.img$`)

// readMeta reads and checks dir's metadata. Only metadata that was read
// but does not decode or check out is ErrCorrupt (with the decoder's error
// wrapped too); an error reading it (ENOENT, EACCES, EIO) is returned as
// it is, for the caller to tell apart with errors.Is.
func readMeta(dir string) (metadata, error) {
	var m metadata
	b, err := os.ReadFile(filepath.Join(dir, metaFileName))
	if err != nil {
		return m, err
	}
	if err := json.Unmarshal(b, &m); err != nil {
		return m, fmt.Errorf("%w: %s: %w", ErrCorrupt, metaFileName, err)
	}
	if m.FormatVersion != formatVersion {
		return m, fmt.Errorf("%w: %s has format version %d, this binary reads %d", ErrCorrupt, metaFileName, m.FormatVersion, formatVersion)
	}
	if m.Size <= 0 || m.Size%BlockSize != 0 || m.Head == "" || m.RegionSize <= 0 {
		return m, fmt.Errorf("%w: %s: size %d, head %q, region size %d", ErrCorrupt, metaFileName, m.Size, m.Head, m.RegionSize)
	}
	return m, nil
}

// writeMeta replaces the metadata atomically: write a temporary file, sync
// it, rename it over the old one, sync the directory. A crash at any point
// leaves either the old or the new metadata, never a mix.
func writeMeta(dir string, m metadata) error {
	b, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return err
	}
	return writeFileAtomic(dir, metaFileName, b)
}

func writeFileAtomic(dir, name string, data []byte) error {
	tmp := filepath.Join(dir, name+".tmp")
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	if err := os.Rename(tmp, filepath.Join(dir, name)); err != nil {
		return err
	}
	return syncDir(dir)
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// removeDebris deletes layer files the metadata does not name and leftover
// temporary files: what a crash between creating a file and committing the
// metadata (or between committing and deleting) leaves behind.
func removeDebris(dir string, m metadata) error {
	keep := map[string]bool{m.Head: true}
	for _, s := range m.Snapshots {
		keep[s.File] = true
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	removed := false
	for _, e := range entries {
		n := e.Name()
		if (layerFilePattern.MatchString(n) && !keep[n]) || filepath.Ext(n) == ".tmp" {
			if err := os.Remove(filepath.Join(dir, n)); err != nil && !errors.Is(err, os.ErrNotExist) {
				return err
			}
			removed = true
		}
	}
	if removed {
		return syncDir(dir)
	}
	return nil
}
