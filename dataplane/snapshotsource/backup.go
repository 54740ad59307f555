package snapshotsource

import (
	"context"
	"fmt"
	"maps"

	"github.com/cairn-io/cairn/dataplane/backupstore"
)

// BackupOptions describe one backup of a replica's snapshot.
type BackupOptions struct {
	// Volume and Name identify the backup on the target.
	Volume, Name string
	// Snapshot is the replica snapshot to back up.
	Snapshot string
	// BaseSnapshot and BaseBackup (both or neither) make the backup
	// incremental: BaseBackup must have been taken from BaseSnapshot, an
	// older snapshot of the same replica's chain.
	BaseSnapshot, BaseBackup string
	// BlockSize is a full backup's block size (0: the store's default);
	// an incremental one uses its base's.
	BlockSize int64
	// Labels are kept with the backup besides SnapshotLabel.
	Labels map[string]string
	// Progress, if set, gets the bytes read and the bytes to read.
	Progress func(done, total int64)
}

// Backup backs snapshot Snapshot of the replica c serves up to store: the
// replica's size, the change map since the base snapshot, then the store's
// upload (manifest last). A base backup taken from another snapshot than
// BaseSnapshot is refused with backupstore.ErrInvalid before anything is
// written.
func Backup(ctx context.Context, store *backupstore.Store, c *Client, o BackupOptions) (*backupstore.BackupResult, error) {
	if (o.BaseSnapshot == "") != (o.BaseBackup == "") {
		return nil, fmt.Errorf("%w: a base snapshot and a base backup go together", backupstore.ErrInvalid)
	}
	size, err := c.Size(ctx)
	if err != nil {
		return nil, err
	}
	labels := maps.Clone(o.Labels)
	if labels == nil {
		labels = map[string]string{}
	}
	labels[SnapshotLabel] = o.Snapshot
	opts := backupstore.BackupOptions{
		Volume: o.Volume, Name: o.Name, Size: size, Parent: o.BaseBackup, BlockSize: o.BlockSize,
		Source: c.Reader(ctx, o.Snapshot, size), Labels: labels, Progress: o.Progress,
	}
	if o.BaseBackup != "" {
		if opts.BlockSize, err = baseBlockSize(ctx, store, o); err != nil {
			return nil, err
		}
	}
	bs := opts.BlockSize
	if bs == 0 {
		bs = backupstore.DefaultBlockSize
	}
	if opts.Changed, err = c.Changes(ctx, o.Snapshot, o.BaseSnapshot, size, bs); err != nil {
		return nil, err
	}
	return store.Backup(ctx, opts)
}

// baseBlockSize checks that the base backup was taken from the base
// snapshot and returns its block size.
func baseBlockSize(ctx context.Context, store *backupstore.Store, o BackupOptions) (int64, error) {
	m, err := store.Manifest(ctx, o.Volume, o.BaseBackup)
	if err != nil {
		return 0, fmt.Errorf("base backup: %w", err)
	}
	if got := m.Labels[SnapshotLabel]; got != o.BaseSnapshot {
		return 0, fmt.Errorf("%w: base backup %s was taken from snapshot %q, not the base snapshot %q", backupstore.ErrInvalid, o.BaseBackup, got, o.BaseSnapshot)
	}
	return m.BlockSize, nil
}
