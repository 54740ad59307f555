package engine

import (
	"context"
	"fmt"
	"hash/crc32"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// CloneSource is the replica of another volume a clone reads from: its
// info (size, snapshots), the view at a snapshot, and checksums of that
// view. engine/replicaclient implements it over the replica's control API.
type CloneSource interface {
	Info(ctx context.Context) (ReplicaInfo, error)
	// ReadSnapshot returns the data extents of [off, off+length) of the
	// view at snapshot name (holes left out).
	ReadSnapshot(ctx context.Context, name string, off, length int64) ([]Extent, error)
	// Checksum is the CRC-32C of [off, off+length) of the view at name,
	// holes read as zeros.
	Checksum(ctx context.Context, name string, off, length int64) (uint32, error)
	Close() error
}

// CloneStatus reports the engine's clone copy (CloneFrom).
type CloneStatus struct {
	Source, Snapshot string
	// State: in-progress, complete (copied and verified) or failed (also
	// when the engine was closed during the copy).
	State RebuildState
	// BytesDone and BytesTotal measure progress through the range copied,
	// then through the verification.
	BytesDone, BytesTotal int64
	// BytesCopied is the data actually written (holes are skipped).
	BytesCopied int64
	Started     time.Time
	Finished    time.Time
	Error       string
}

// clone is the engine's one clone copy; Engine.clone is replaced only by
// a new CloneFrom once the previous one has ended.
type clone struct {
	mu     sync.Mutex
	st     CloneStatus
	done   atomic.Int64
	copied atomic.Int64
	fin    chan struct{}
}

func (c *clone) status() CloneStatus {
	c.mu.Lock()
	defer c.mu.Unlock()
	s := c.st
	s.BytesDone, s.BytesCopied = c.done.Load(), c.copied.Load()
	return s
}

// Clone returns the status of the last CloneFrom, false if none was asked.
func (e *Engine) Clone() (CloneStatus, bool) {
	e.mu.Lock()
	c := e.clone
	e.mu.Unlock()
	if c == nil {
		return CloneStatus{}, false
	}
	return c.status(), true
}

// CloneFrom starts filling the volume with the view at snapshot of the
// source replica (another volume's), named source in reports, and returns.
// The copy goes through the engine's own write path to every writable
// replica, only where the source holds data: the volume is new, so it
// reads zeros everywhere else already. The source's bytes are written as
// they are, never encrypted: an encrypted source's ciphertext is copied,
// and the clone reads it with the same key. Then every RW replica's data is
// read back and its CRC-32C compared with the source's for each chunk.
// Only a volume nobody uses may be cloned into: the copy overwrites it.
//
// A copy in progress or completed from the same source and snapshot is
// left as it is (a caller retrying gets the same copy); a failed one is
// started again, from the beginning. Starting again is safe for the same
// reason the copy is sparse: a partial earlier copy wrote the source's own
// data at the same places, and nothing else wrote the volume meanwhile.
// The engine owns src from here and closes it when the copy ends.
func (e *Engine) CloneFrom(src CloneSource, source, snapshot string) error {
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		src.Close()
		return ErrClosed
	}
	if c := e.clone; c != nil {
		st := c.status()
		if st.Source == source && st.Snapshot == snapshot && st.State != RebuildFailed {
			e.mu.Unlock()
			src.Close()
			return nil
		}
		if st.State == RebuildInProgress {
			e.mu.Unlock()
			src.Close()
			return fmt.Errorf("%w: a clone from %s snapshot %s is in progress", ErrInvalid, st.Source, st.Snapshot)
		}
	}
	c := &clone{st: CloneStatus{Source: source, Snapshot: snapshot, State: RebuildInProgress, Started: time.Now()}, fin: make(chan struct{})}
	e.clone = c
	e.changed()
	e.bg.Add(1)
	e.mu.Unlock()
	go func() {
		defer e.bg.Done()
		defer close(c.fin)
		defer src.Close()
		err := e.copyClone(e.stop, c, src, snapshot)
		c.mu.Lock()
		c.st.Finished = time.Now()
		if err != nil {
			c.st.State, c.st.Error = RebuildFailed, err.Error()
		} else {
			c.st.State = RebuildComplete
		}
		c.mu.Unlock()
		e.layersChanged() // the clone's data is in the replicas
		if err != nil {
			e.log.Info("clone failed", "source", source, "snapshot", snapshot, "error", err.Error())
		} else {
			e.log.Info("clone complete", "source", source, "snapshot", snapshot, "copied", c.copied.Load())
		}
	}()
	return nil
}

// WaitClone blocks until the current clone ends or ctx does.
func (e *Engine) WaitClone(ctx context.Context) (CloneStatus, error) {
	e.mu.Lock()
	c := e.clone
	e.mu.Unlock()
	if c == nil {
		return CloneStatus{}, fmt.Errorf("%w: no clone", ErrInvalid)
	}
	select {
	case <-c.fin:
		return c.status(), nil
	case <-ctx.Done():
		return c.status(), ctx.Err()
	}
}

// copyClone copies then verifies. The range is the source's size, or the
// volume's if smaller: the source must hold no data past the volume's end
// (the control plane makes a clone at least as big as the snapshot).
func (e *Engine) copyClone(ctx context.Context, c *clone, src CloneSource, snapshot string) error {
	info, err := src.Info(ctx)
	if err != nil {
		return fmt.Errorf("source info: %w", err)
	}
	if !slices.ContainsFunc(info.Snapshots, func(s SnapshotInfo) bool { return s.Name == snapshot }) {
		return fmt.Errorf("%w: the source replica has no snapshot %s", ErrSnapshotNotFound, snapshot)
	}
	size := min(info.Size, e.Size())
	c.mu.Lock()
	c.st.BytesTotal = 2 * size // the copy, then the verification
	c.mu.Unlock()
	if info.Size > size {
		err := eachChunk([]span{{size, info.Size - size}}, func(off, n int64) error {
			ext, err := src.ReadSnapshot(ctx, snapshot, off, n)
			if err != nil {
				return fmt.Errorf("read snapshot %s from the source: %w", snapshot, err)
			}
			if len(ext) > 0 {
				return fmt.Errorf("%w: the source holds data at byte %d, past this volume's size %d: the clone must be at least as big as the snapshot", ErrInvalid, ext[0].Offset, size)
			}
			return nil
		})
		if err != nil {
			return err
		}
	}
	regions := []span{{0, size}}
	err = eachChunk(regions, func(off, n int64) error {
		if err := ctx.Err(); err != nil {
			return err
		}
		ext, err := src.ReadSnapshot(ctx, snapshot, off, n)
		if err != nil {
			return fmt.Errorf("read snapshot %s from the source at %d: %w", snapshot, off, err)
		}
		for _, x := range ext {
			if err := e.write(ctx, x.Data, x.Offset, false, nil); err != nil { // the source's bytes as they are: ciphertext stays ciphertext
				return fmt.Errorf("write at %d: %w", x.Offset, err)
			}
			c.copied.Add(int64(len(x.Data)))
		}
		c.done.Add(n)
		return nil
	})
	if err != nil {
		return err
	}
	if err := e.Flush(ctx); err != nil {
		return fmt.Errorf("flush: %w", err)
	}
	return e.verifyClone(ctx, c, src, snapshot, regions)
}

// castagnoli is the CRC-32C table replicas checksum with.
var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// verifyClone reads every chunk back from each RW replica (its own data
// connection, not the engine's read path, which asks one of them) and
// compares the CRC-32C with the source's.
func (e *Engine) verifyClone(ctx context.Context, c *clone, src CloneSource, snapshot string, regions []span) error {
	buf := make([]byte, RebuildChunk)
	return eachChunk(regions, func(off, n int64) error {
		if err := ctx.Err(); err != nil {
			return err
		}
		want, err := src.Checksum(ctx, snapshot, off, n)
		if err != nil {
			return fmt.Errorf("verify: checksum on the source at %d: %w", off, err)
		}
		ms := e.readable()
		if len(ms) == 0 {
			return fmt.Errorf("%w: no RW replica to verify", ErrNoReplica)
		}
		for _, m := range ms {
			if err := m.data.ReadAt(detach(ctx), buf[:n], off); err != nil {
				return fmt.Errorf("verify: read %s at %d: %w", m.addr, off, err)
			}
			if got := crc32.Checksum(buf[:n], castagnoli); got != want {
				return fmt.Errorf("verify: bytes %d..%d on %s differ from the source's snapshot %s (%08x vs %08x)", off, off+n, m.addr, snapshot, got, want)
			}
		}
		c.done.Add(n)
		return nil
	})
}
