package backupstore

import (
	"bytes"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"time"
)

// BackupInfo describes one backup as the volume's index lists it.
type BackupInfo struct {
	Name      string            `json:"name"`
	Parent    string            `json:"parent,omitempty"`
	Created   time.Time         `json:"created"`
	Size      int64             `json:"size"`
	BlockSize int64             `json:"blockSize"`
	Labels    map[string]string `json:"labels,omitempty"`
	// Blocks is how many non-zero blocks the backup holds.
	Blocks int64 `json:"blocks"`
	// NewBlocks and NewBytes are what this backup uploaded (stored bytes,
	// after compression); the rest it shares with earlier backups.
	NewBlocks int64 `json:"newBlocks"`
	NewBytes  int64 `json:"newBytes"`
}

func infoOf(m *Manifest) BackupInfo {
	return BackupInfo{
		Name: m.Name, Parent: m.Parent, Created: m.Created, Size: m.Size, BlockSize: m.BlockSize,
		Labels: m.Labels, Blocks: int64(len(m.Blocks)), NewBlocks: m.NewBlocks, NewBytes: m.NewBytes,
	}
}

// Index is a volume's list of backups, kept in one object so that listing
// the backups reads one object. It is a cache: the manifests are the truth,
// and every write of the index first drops entries whose manifest is gone
// and adds manifests it lacks.
type Index struct {
	Format  int          `json:"format"`
	Volume  string       `json:"volume"`
	Backups []BackupInfo `json:"backups"`
}

const (
	indexFormat = 1
	// MaxBackupsPerVolume bounds a volume's index; Backup refuses more.
	MaxBackupsPerVolume = 10000
	// maxIndexLen bounds the index object: MaxBackupsPerVolume entries
	// of at most maxLabelBytes of labels and their other fields.
	maxIndexLen = MaxBackupsPerVolume * (maxLabelBytes + 2048)
)

// EncodeIndex writes idx as indented JSON (operators read it).
func EncodeIndex(idx *Index) ([]byte, error) {
	if err := idx.validate(MaxVolumeSize); err != nil {
		return nil, err
	}
	return json.MarshalIndent(idx, "", "  ")
}

// DecodeIndex reads an index of at most maxIndexLen bytes (the caller has
// read it with that limit) and validates every entry.
func DecodeIndex(data []byte, maxVolumeSize int64) (*Index, error) {
	if len(data) > maxIndexLen {
		return nil, fmt.Errorf("%w: index of %d bytes", ErrCorrupt, len(data))
	}
	var idx Index
	dec := json.NewDecoder(bytes.NewReader(data))
	if err := dec.Decode(&idx); err != nil {
		return nil, fmt.Errorf("%w: index: %w", ErrCorrupt, err)
	}
	if dec.More() {
		return nil, fmt.Errorf("%w: index: data after the JSON object", ErrCorrupt)
	}
	if err := idx.validate(maxVolumeSize); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrCorrupt, err)
	}
	return &idx, nil
}

func (idx *Index) validate(maxVolumeSize int64) error {
	if idx.Format != indexFormat {
		return fmt.Errorf("%w: index format %d, this reader knows %d", ErrInvalid, idx.Format, indexFormat)
	}
	if err := validName("volume", idx.Volume); err != nil {
		return err
	}
	if len(idx.Backups) > MaxBackupsPerVolume {
		return fmt.Errorf("%w: %d backups, at most %d", ErrInvalid, len(idx.Backups), MaxBackupsPerVolume)
	}
	seen := make(map[string]bool, len(idx.Backups))
	for _, b := range idx.Backups {
		if seen[b.Name] {
			return fmt.Errorf("%w: backup %q listed twice", ErrInvalid, b.Name)
		}
		seen[b.Name] = true
		m := Manifest{ManifestMeta: ManifestMeta{Volume: idx.Volume, Name: b.Name, Parent: b.Parent, Labels: b.Labels}, Size: b.Size, BlockSize: b.BlockSize}
		if err := m.validate(maxVolumeSize); err != nil {
			return fmt.Errorf("backup %q: %w", b.Name, err)
		}
		if b.Blocks < 0 || uint64(b.Blocks) > blockCount(b.Size, b.BlockSize) || b.NewBlocks < 0 || b.NewBlocks > b.Blocks || b.NewBytes < 0 {
			return fmt.Errorf("%w: backup %q: block counts %d/%d, %d bytes", ErrInvalid, b.Name, b.NewBlocks, b.Blocks, b.NewBytes)
		}
	}
	return nil
}

// sortBackups orders backups oldest first (by name when created together).
func sortBackups(b []BackupInfo) {
	slices.SortFunc(b, func(x, y BackupInfo) int {
		if c := x.Created.Compare(y.Created); c != 0 {
			return c
		}
		return strings.Compare(x.Name, y.Name)
	})
}
