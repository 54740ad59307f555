package backupstore

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// Range is a byte range of a volume.
type Range struct {
	Offset, Length int64
}

// BackupOptions describe one backup.
type BackupOptions struct {
	// Volume and Name identify the backup (Kubernetes object names).
	Volume, Name string
	// Source is the snapshot's data, read with ReadAt (concurrently) for
	// every block Changed covers. An encrypted volume gives its ciphertext.
	Source io.ReaderAt
	// Size is the volume's size in bytes.
	Size int64
	// BlockSize defaults to DefaultBlockSize; an incremental backup uses its
	// parent's.
	BlockSize int64
	// Parent names the earlier backup of the volume this one builds on:
	// blocks Changed does not cover are taken from it unread. Empty is a
	// full backup.
	Parent string
	// Changed lists the byte ranges whose content may differ from the
	// parent's (from all zeros when there is no parent). Nil means the
	// whole volume. The store reads every block a range touches; a range
	// the caller leaves out is trusted to be unchanged, so the list must be
	// complete (the replica's change map between the two snapshots).
	Changed []Range
	// Labels are kept with the backup (snapshot name, encryption, ...).
	Labels map[string]string
	// Progress, if set, is called after each block with the bytes done and
	// the total to read, from one goroutine at a time.
	Progress func(done, total int64)
}

// BackupResult says what a backup stored.
type BackupResult struct {
	Info BackupInfo
	// ReadBytes is how much of the source was read.
	ReadBytes int64
	// ZeroBlocks is how many blocks read were all zeros (not stored).
	ZeroBlocks int64
}

// Backup uploads a backup: every non-zero block in the changed ranges
// whose hash the parent does not reference already, then the manifest,
// then the volume's index. It holds a lease on the target from before it
// reads the parent until the manifest is written. If it fails or is killed
// before the manifest, the backup does not exist; the blocks it uploaded
// are unreferenced and CollectGarbage removes them once its lease expires.
func (s *Store) Backup(ctx context.Context, opts BackupOptions) (*BackupResult, error) {
	if err := s.validateBackup(&opts); err != nil {
		return nil, err
	}
	if _, err := s.readManifest(ctx, opts.Volume, opts.Name); err == nil {
		s.healIndex(ctx, opts.Volume)
		return nil, fmt.Errorf("%w: %s/%s", ErrBackupExists, opts.Volume, opts.Name)
	} else if !errors.Is(err, ErrBackupNotFound) {
		return nil, err
	}
	if idx, _, err := s.readIndex(ctx, opts.Volume); err == nil && len(idx.Backups) >= MaxBackupsPerVolume {
		return nil, fmt.Errorf("%w: volume %s has %d backups, the most one volume may have; delete some", ErrInvalid, opts.Volume, len(idx.Backups))
	}
	l, err := s.takeWorkLease(ctx, opts.Volume, leaseBackup, opts.Name)
	if err != nil {
		return nil, err
	}
	defer l.release()
	b := &backupRun{s: s, opts: opts, created: time.Now().UTC(), uploaded: map[Hash]bool{}}
	if err := b.loadParent(ctx); err != nil {
		return nil, err
	}
	if err := b.run(ctx); err != nil {
		return nil, err
	}
	m := b.manifest()
	data, err := EncodeManifest(m)
	if err != nil {
		return nil, err
	}
	// The commit point. The lease check, before every attempt, guards the
	// blocks this backup relies on but does not yet reference (its own
	// uploads and its parent's blocks): had the lease looked expired, a
	// collection may have removed them.
	key := manifestKey(opts.Volume, opts.Name)
	err = s.call(ctx, "put", key, func(ctx context.Context) error {
		if err := l.check(); err != nil {
			return err
		}
		return s.target.Put(ctx, key, data)
	})
	if err != nil {
		return nil, err
	}
	info := infoOf(m)
	if err := s.updateIndex(ctx, opts.Volume, func(idx *Index) { idx.add(info) }); err != nil {
		// The backup exists (its manifest is written); the next write of
		// the index, or RebuildIndex, lists it.
		s.log.Error(err, "backup written, but the volume's index was not updated", "volume", opts.Volume, "backup", opts.Name)
	}
	return &BackupResult{Info: info, ReadBytes: b.readBytes.Load(), ZeroBlocks: b.zeroBlocks.Load()}, nil
}

func (s *Store) validateBackup(o *BackupOptions) error {
	if err := validName("volume", o.Volume); err != nil {
		return err
	}
	if err := validName("backup", o.Name); err != nil {
		return err
	}
	if o.BlockSize == 0 {
		o.BlockSize = DefaultBlockSize
	}
	m := Manifest{ManifestMeta: ManifestMeta{Volume: o.Volume, Name: o.Name, Parent: o.Parent, Labels: o.Labels}, Size: o.Size, BlockSize: o.BlockSize}
	if err := m.validate(s.opts.MaxVolumeSize); err != nil {
		return err
	}
	if o.Source == nil {
		return fmt.Errorf("%w: no source", ErrInvalid)
	}
	for _, r := range o.Changed {
		if r.Offset < 0 || r.Length < 0 || r.Offset > o.Size-r.Length {
			return fmt.Errorf("%w: changed range %d+%d outside the volume's %d bytes", ErrInvalid, r.Offset, r.Length, o.Size)
		}
	}
	return nil
}

// backupRun is one backup in progress.
type backupRun struct {
	s       *Store
	opts    BackupOptions
	created time.Time

	parent *Manifest
	// known holds every hash the parent references: such blocks are on
	// the target and are not uploaded again.
	known map[Hash]bool
	// affected lists the block intervals [start, end) to read.
	affected [][2]uint64

	mu       sync.Mutex
	uploaded map[Hash]bool // hashes this run has uploaded or is uploading
	fresh    []BlockRef    // the blocks read that are not zero

	newBlocks, newBytes, readBytes, zeroBlocks atomic.Int64
}

func (b *backupRun) loadParent(ctx context.Context) error {
	o := b.opts
	n := blockCount(o.Size, o.BlockSize)
	if o.Parent == "" {
		b.affected = blockIntervals(o.Changed, o.Size, o.BlockSize)
		return nil
	}
	p, err := b.s.readManifest(ctx, o.Volume, o.Parent)
	if err != nil {
		return fmt.Errorf("parent backup: %w", err)
	}
	if p.BlockSize != o.BlockSize || p.Size > o.Size {
		return fmt.Errorf("%w: parent %s has block size %d and size %d; this backup %d and %d (a volume only grows)",
			ErrInvalid, o.Parent, p.BlockSize, p.Size, o.BlockSize, o.Size)
	}
	b.parent = p
	b.known = make(map[Hash]bool, len(p.Blocks))
	for _, r := range p.Blocks {
		b.known[r.Hash] = true
	}
	b.affected = blockIntervals(o.Changed, o.Size, o.BlockSize)
	// Blocks the parent did not cover in full (the volume grew) are read
	// whatever the change list says.
	if grown := uint64(p.Size / o.BlockSize); grown < n {
		b.affected = mergeIntervals(append(b.affected, [2]uint64{grown, n}))
	}
	return nil
}

// blockIntervals turns byte ranges into merged, sorted block intervals;
// nil ranges mean the whole volume.
func blockIntervals(changed []Range, size, bs int64) [][2]uint64 {
	if changed == nil {
		return [][2]uint64{{0, blockCount(size, bs)}}
	}
	var iv [][2]uint64
	for _, r := range changed {
		if r.Length > 0 {
			iv = append(iv, [2]uint64{uint64(r.Offset / bs), uint64((r.Offset + r.Length + bs - 1) / bs)})
		}
	}
	return mergeIntervals(iv)
}

func mergeIntervals(iv [][2]uint64) [][2]uint64 {
	slices.SortFunc(iv, func(a, b [2]uint64) int { return int64Cmp(a[0], b[0]) })
	var out [][2]uint64
	for _, x := range iv {
		if len(out) > 0 && x[0] <= out[len(out)-1][1] {
			out[len(out)-1][1] = max(out[len(out)-1][1], x[1])
			continue
		}
		out = append(out, x)
	}
	return out
}

func int64Cmp(a, b uint64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

func inIntervals(iv [][2]uint64, i uint64) bool {
	k, _ := slices.BinarySearchFunc(iv, i, func(x [2]uint64, t uint64) int {
		if x[1] <= t {
			return -1
		}
		if x[0] > t {
			return 1
		}
		return 0
	})
	return k < len(iv) && iv[k][0] <= i && i < iv[k][1]
}

// run reads, hashes and uploads the affected blocks with
// Options.Concurrency workers.
func (b *backupRun) run(ctx context.Context) error {
	var total int64
	for _, iv := range b.affected {
		for i := iv[0]; i < iv[1]; i++ {
			total += blockLen(i, b.opts.Size, b.opts.BlockSize)
		}
	}
	g := newGroup(ctx)
	ctx = g.ctx
	jobs := make(chan uint64)
	done := make(chan int64)
	g.Go(func() error {
		defer close(jobs)
		for _, iv := range b.affected {
			for i := iv[0]; i < iv[1]; i++ {
				select {
				case jobs <- i:
				case <-ctx.Done():
					return ctx.Err()
				}
			}
		}
		return nil
	})
	var workers sync.WaitGroup
	for range b.s.opts.Concurrency {
		workers.Add(1)
		g.Go(func() error {
			defer workers.Done()
			return b.worker(ctx, jobs, done)
		})
	}
	go func() { workers.Wait(); close(done) }()
	var progress int64
	for n := range done {
		progress += n
		if b.opts.Progress != nil {
			b.opts.Progress(progress, total)
		}
	}
	return g.Wait()
}

func (b *backupRun) worker(ctx context.Context, jobs <-chan uint64, done chan<- int64) error {
	bs := b.opts.BlockSize
	buf := make([]byte, bs)
	scratch := make([]byte, 0, maxBlockObject(bs))
	for i := range jobs {
		n := blockLen(i, b.opts.Size, bs)
		if err := b.block(ctx, i, buf[:n], scratch); err != nil {
			return err
		}
		select {
		case done <- n:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

// block backs up block i: read, skip if zero, hash, upload unless known.
func (b *backupRun) block(ctx context.Context, i uint64, buf, scratch []byte) error {
	off := int64(i) * b.opts.BlockSize
	// ReadAt may report io.EOF with a full buffer at the source's end.
	if n, err := b.opts.Source.ReadAt(buf, off); n < len(buf) {
		return fmt.Errorf("reading the source at %d: %d of %d bytes: %w", off, n, len(buf), err)
	}
	b.readBytes.Add(int64(len(buf)))
	if isZero(buf) {
		b.zeroBlocks.Add(1)
		return nil
	}
	h := Hash(sha256.Sum256(buf))
	b.mu.Lock()
	b.fresh = append(b.fresh, BlockRef{Index: i, Hash: h})
	skip := b.known[h] || b.uploaded[h]
	b.uploaded[h] = true
	b.mu.Unlock()
	if skip {
		return nil
	}
	obj := encodeBlock(buf, scratch)
	if err := b.s.put(ctx, blockKey(b.opts.Volume, h), obj); err != nil {
		return err
	}
	b.newBlocks.Add(1)
	b.newBytes.Add(int64(len(obj)))
	return nil
}

// manifest merges the blocks read with the parent's blocks outside the
// affected intervals.
func (b *backupRun) manifest() *Manifest {
	refs := b.fresh
	if b.parent != nil {
		for _, r := range b.parent.Blocks {
			if !inIntervals(b.affected, r.Index) {
				refs = append(refs, r)
			}
		}
	}
	slices.SortFunc(refs, func(x, y BlockRef) int { return int64Cmp(x.Index, y.Index) })
	o := b.opts
	return &Manifest{
		ManifestMeta: ManifestMeta{
			Volume: o.Volume, Name: o.Name, Parent: o.Parent, Created: b.created, Labels: o.Labels,
			NewBlocks: b.newBlocks.Load(), NewBytes: b.newBytes.Load(), ReadBytes: b.readBytes.Load(),
		},
		Size: o.Size, BlockSize: o.BlockSize, Blocks: refs,
	}
}
