package backupstore

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
)

// readManifest reads and decodes one backup's manifest.
func (s *Store) readManifest(ctx context.Context, vol, name string) (*Manifest, error) {
	var m *Manifest
	err := s.read(ctx, manifestKey(vol, name), func(r io.Reader) error {
		var err error
		m, err = DecodeManifest(r, s.opts.MaxVolumeSize)
		return err
	})
	switch {
	case errors.Is(err, ErrNotFound):
		return nil, fmt.Errorf("%w: %s/%s", ErrBackupNotFound, vol, name)
	case err != nil:
		return nil, err
	case m.Volume != vol || m.Name != name:
		return nil, fmt.Errorf("%w: manifest %s describes %s/%s", ErrCorrupt, manifestKey(vol, name), m.Volume, m.Name)
	}
	return m, nil
}

// Manifest returns a backup's manifest: its size, block size and blocks.
func (s *Store) Manifest(ctx context.Context, vol, name string) (*Manifest, error) {
	if err := validName("volume", vol); err != nil {
		return nil, err
	}
	if err := validName("backup", name); err != nil {
		return nil, err
	}
	return s.readManifest(ctx, vol, name)
}

// readIndex reads the volume's index; a missing one is an empty index.
func (s *Store) readIndex(ctx context.Context, vol string) (*Index, bool, error) {
	data, err := s.readAll(ctx, indexKey(vol), maxIndexLen)
	if errors.Is(err, ErrNotFound) {
		return &Index{Format: indexFormat, Volume: vol}, false, nil
	}
	if err != nil {
		return nil, false, err
	}
	idx, err := DecodeIndex(data, s.opts.MaxVolumeSize)
	if err != nil {
		return nil, false, fmt.Errorf("%s: %w", indexKey(vol), err)
	}
	if idx.Volume != vol {
		return nil, false, fmt.Errorf("%w: %s lists volume %s", ErrCorrupt, indexKey(vol), idx.Volume)
	}
	return idx, true, nil
}

// List returns the volume's backups, oldest first, from its index (one
// object read). A volume without an index (none written yet, or its first
// backup's writer stopped right after the manifest) has it rebuilt from
// the manifests.
func (s *Store) List(ctx context.Context, vol string) ([]BackupInfo, error) {
	if err := validName("volume", vol); err != nil {
		return nil, err
	}
	idx, found, err := s.readIndex(ctx, vol)
	if err != nil {
		return nil, err
	}
	if !found {
		if idx, err = s.rebuild(ctx, vol, nil); err != nil {
			return nil, err
		}
	}
	return idx.Backups, nil
}

// RebuildIndex writes the volume's index afresh from its manifests: the
// repair for an index that is lost or corrupt.
func (s *Store) RebuildIndex(ctx context.Context, vol string) error {
	if err := validName("volume", vol); err != nil {
		return err
	}
	idx, err := s.rebuild(ctx, vol, nil)
	if err != nil {
		return err
	}
	return s.writeIndex(ctx, idx)
}

// updateIndex reads the index, reconciles it with the manifests on the
// target, applies change and writes it. A corrupt index is rebuilt.
func (s *Store) updateIndex(ctx context.Context, vol string, change func(*Index)) error {
	idx, _, err := s.readIndex(ctx, vol)
	if errors.Is(err, ErrCorrupt) {
		s.log.Error(err, "the volume's index is corrupt; rebuilding it from the manifests", "volume", vol)
		idx, err = nil, nil
	}
	if err != nil {
		return err
	}
	if idx, err = s.rebuild(ctx, vol, idx); err != nil {
		return err
	}
	change(idx)
	return s.writeIndex(ctx, idx)
}

// healIndex reconciles the index with the manifests, logging a failure.
func (s *Store) healIndex(ctx context.Context, vol string) {
	if err := s.updateIndex(ctx, vol, func(*Index) {}); err != nil {
		s.log.Error(err, "could not update the volume's index", "volume", vol)
	}
}

func (s *Store) writeIndex(ctx context.Context, idx *Index) error {
	sortBackups(idx.Backups)
	data, err := EncodeIndex(idx)
	if err != nil {
		return err
	}
	return s.put(ctx, indexKey(idx.Volume), data)
}

// rebuild returns the index of the backups whose manifests exist: the
// entries of old (nil: none) that still have a manifest, plus the
// manifests old lacks, read from the target. It lists one object per
// backup, not the blocks.
func (s *Store) rebuild(ctx context.Context, vol string, old *Index) (*Index, error) {
	names, err := s.manifestNames(ctx, vol)
	if err != nil {
		return nil, err
	}
	idx := &Index{Format: indexFormat, Volume: vol}
	have := map[string]bool{}
	if old != nil {
		for _, b := range old.Backups {
			if names[b.Name] {
				idx.Backups = append(idx.Backups, b)
				have[b.Name] = true
			}
		}
	}
	for name := range names {
		if have[name] {
			continue
		}
		m, err := s.readManifest(ctx, vol, name)
		if errors.Is(err, ErrBackupNotFound) {
			continue // deleted since the listing
		}
		if err != nil {
			return nil, err
		}
		idx.Backups = append(idx.Backups, infoOf(m))
	}
	sortBackups(idx.Backups)
	return idx, nil
}

// manifestNames lists the names of the volume's backups with a manifest.
func (s *Store) manifestNames(ctx context.Context, vol string) (map[string]bool, error) {
	objs, err := s.list(ctx, manifestPrefix(vol))
	if err != nil {
		return nil, err
	}
	names := make(map[string]bool, len(objs))
	for _, o := range objs {
		name, ok := strings.CutSuffix(strings.TrimPrefix(o.Key, manifestPrefix(vol)), manifestSuffix)
		if ok && validName("backup", name) == nil {
			names[name] = true
		}
	}
	return names, nil
}

// add puts info in the index, replacing an entry of the same name.
func (idx *Index) add(info BackupInfo) {
	idx.remove(info.Name)
	idx.Backups = append(idx.Backups, info)
}

func (idx *Index) remove(name string) {
	idx.Backups = slices.DeleteFunc(idx.Backups, func(b BackupInfo) bool { return b.Name == name })
}

// Delete deletes a backup: its manifest, then its index entry. The blocks
// it alone referenced stay until CollectGarbage. Deleting a backup that
// does not exist is ErrBackupNotFound.
func (s *Store) Delete(ctx context.Context, vol, name string) error {
	if _, err := s.Manifest(ctx, vol, name); err != nil && !errors.Is(err, ErrCorrupt) {
		return err
	}
	if err := s.delete(ctx, manifestKey(vol, name)); err != nil {
		return err
	}
	return s.updateIndex(ctx, vol, func(idx *Index) { idx.remove(name) })
}
