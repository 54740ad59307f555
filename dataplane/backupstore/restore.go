package backupstore

import (
	"context"
	"errors"
	"fmt"
	"io"
)

// RestoreOptions describe one restore.
type RestoreOptions struct {
	// Volume and Name identify the backup.
	Volume, Name string
	// Dest receives the volume's bytes at their offsets (concurrently).
	// It must hold at least the backup's size; a larger one is fine (a
	// restore into a bigger volume).
	Dest io.WriterAt
	// WriteZeros writes the blocks the backup holds as zeros. Leave it
	// false when Dest reads as zeros already (a new sparse file, a fresh
	// replica): those ranges then stay holes.
	WriteZeros bool
	// Progress, if set, is called after each block with the bytes done and
	// the volume's size, from one goroutine at a time.
	Progress func(done, total int64)
}

// BlockError is a restore's failure on one block: the block is missing
// from the target or its bytes do not match the manifest's checksum
// (errors.Is(err, ErrCorrupt)).
type BlockError struct {
	// Offset is the block's byte offset in the volume.
	Offset int64
	// Hash is the block's expected SHA-256; Key its object on the target.
	Hash Hash
	Key  string
	Err  error
}

func (e *BlockError) Error() string {
	return fmt.Sprintf("block at offset %d (%s): %v", e.Offset, e.Key, e.Err)
}

func (e *BlockError) Unwrap() error { return e.Err }

// Restore writes a backup to opts.Dest, verifying every block against the
// manifest's checksum. It returns the manifest restored. A block that is
// missing or fails its checksum fails the restore with a *BlockError;
// what was written to Dest by then is incomplete and must not be used.
// The restore holds a lease on the target so that garbage collection does
// not run beside it.
func (s *Store) Restore(ctx context.Context, opts RestoreOptions) (*Manifest, error) {
	if err := validName("volume", opts.Volume); err != nil {
		return nil, err
	}
	if err := validName("backup", opts.Name); err != nil {
		return nil, err
	}
	if opts.Dest == nil {
		return nil, fmt.Errorf("%w: no destination", ErrInvalid)
	}
	l, err := s.takeWorkLease(ctx, opts.Volume, leaseRestore, opts.Name+"-"+randomID())
	if err != nil {
		return nil, err
	}
	defer l.release()
	m, err := s.readManifest(ctx, opts.Volume, opts.Name)
	if err != nil {
		return nil, err
	}
	r := &restoreRun{s: s, opts: opts, m: m}
	if err := r.run(ctx); err != nil {
		return nil, err
	}
	return m, nil
}

type restoreRun struct {
	s    *Store
	opts RestoreOptions
	m    *Manifest
}

// job is one block to restore; stored is false for a zero block.
type job struct {
	index  uint64
	hash   Hash
	stored bool
}

func (r *restoreRun) run(ctx context.Context) error {
	g := newGroup(ctx)
	ctx = g.ctx
	jobs := make(chan job)
	done := make(chan int64)
	g.Go(func() error {
		defer close(jobs)
		return r.produce(ctx, jobs, done)
	})
	workers := newGroup(ctx)
	for range r.s.opts.Concurrency {
		workers.Go(func() error { return r.worker(ctx, jobs, done) })
	}
	g.Go(func() error { defer close(done); return workers.Wait() })
	var progress int64
	for n := range done {
		progress += n
		if r.opts.Progress != nil {
			r.opts.Progress(progress, r.m.Size)
		}
	}
	return g.Wait()
}

// produce sends every block to the workers in order: stored blocks, and
// zero blocks too when they are to be written (else it counts them done).
func (r *restoreRun) produce(ctx context.Context, jobs chan<- job, done chan<- int64) error {
	next := 0
	for i := range blockCount(r.m.Size, r.m.BlockSize) {
		j := job{index: i}
		if next < len(r.m.Blocks) && r.m.Blocks[next].Index == i {
			j.hash, j.stored = r.m.Blocks[next].Hash, true
			next++
		}
		if !j.stored && !r.opts.WriteZeros {
			select {
			case done <- blockLen(i, r.m.Size, r.m.BlockSize):
			case <-ctx.Done():
				return ctx.Err()
			}
			continue
		}
		select {
		case jobs <- j:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

func (r *restoreRun) worker(ctx context.Context, jobs <-chan job, done chan<- int64) error {
	bs := r.m.BlockSize
	buf := make([]byte, bs)
	zero := make([]byte, bs)
	obj := make([]byte, maxBlockObject(bs)+1)
	for j := range jobs {
		n := blockLen(j.index, r.m.Size, bs)
		data := zero[:n]
		if j.stored {
			data = buf[:n]
			if err := r.fetch(ctx, j, data, obj); err != nil {
				return err
			}
		}
		if _, err := r.opts.Dest.WriteAt(data, int64(j.index)*bs); err != nil {
			return fmt.Errorf("writing the restore at %d: %w", int64(j.index)*bs, err)
		}
		select {
		case done <- n:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

// fetch reads block j into dst and verifies it; objBuf (one byte more
// than the largest block object) holds the object read.
func (r *restoreRun) fetch(ctx context.Context, j job, dst, objBuf []byte) error {
	key := blockKey(r.opts.Volume, j.hash)
	obj, err := r.s.readInto(ctx, key, objBuf)
	if errors.Is(err, ErrTooLarge) {
		err = fmt.Errorf("%w: %w", ErrCorrupt, err)
	}
	if err == nil {
		err = decodeBlock(obj, j.hash, dst)
	}
	if err != nil {
		if ctx.Err() != nil && !errors.Is(err, ErrCorrupt) {
			return ctx.Err()
		}
		return &BlockError{Offset: int64(j.index) * r.m.BlockSize, Hash: j.hash, Key: key, Err: err}
	}
	return nil
}
