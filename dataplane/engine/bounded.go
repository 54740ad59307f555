package engine

import (
	"context"
	"fmt"
	"time"
)

// DefaultControlTimeout is Options.ControlTimeout's default.
const DefaultControlTimeout = 30 * time.Second

// deleteRate is the slowest merge a snapshot deletion is given time for:
// a replica merges a snapshot's data into its child, so deleting a large
// snapshot takes long, and a fixed deadline would fail every replica
// deleting one. 16 MiB/s is far below any disk's.
const deleteRate = 16 << 20

// bounded is a member's control and rebuild calls, each under a deadline
// (Options.ControlTimeout): a replica that hangs fails the call, and the
// caller fails or skips the replica, instead of the call holding a
// control operation, and the locks it holds, for ever.
type bounded struct {
	c       controller
	timeout time.Duration
}

func (b bounded) ctx(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, b.timeout)
}

func (b bounded) Info(ctx context.Context) (ReplicaInfo, error) {
	ctx, cancel := b.ctx(ctx)
	defer cancel()
	return b.c.Info(ctx)
}

func (b bounded) SetEpoch(ctx context.Context, st EpochState) error {
	ctx, cancel := b.ctx(ctx)
	defer cancel()
	return b.c.SetEpoch(ctx, st)
}

func (b bounded) Snapshot(ctx context.Context, s SnapshotInfo) error {
	ctx, cancel := b.ctx(ctx)
	defer cancel()
	return b.c.Snapshot(ctx, s)
}

// DeleteSnapshot deletes snapshot name, which holds dataBytes of data:
// the deadline is the timeout plus the time to merge that much at
// deleteRate.
func (b bounded) DeleteSnapshot(ctx context.Context, name string, dataBytes int64) error {
	ctx, cancel := context.WithTimeout(ctx, b.timeout+time.Duration(dataBytes/deleteRate)*time.Second)
	defer cancel()
	return b.c.DeleteSnapshot(ctx, name)
}

func (b bounded) Revert(ctx context.Context, name string) error {
	ctx, cancel := b.ctx(ctx)
	defer cancel()
	return b.c.Revert(ctx, name)
}

func (b bounded) Expand(ctx context.Context, size int64) error {
	ctx, cancel := b.ctx(ctx)
	defer cancel()
	return b.c.Expand(ctx, size)
}

func (b bounded) ReadSnapshot(ctx context.Context, name string, off, length int64) ([]Extent, error) {
	ctx, cancel := b.ctx(ctx)
	defer cancel()
	return b.c.ReadSnapshot(ctx, name, off, length)
}

func (b bounded) ReadLayer(ctx context.Context, name string, off, length int64) ([]Extent, error) {
	ctx, cancel := b.ctx(ctx)
	defer cancel()
	return b.c.ReadLayer(ctx, name, off, length)
}

func (b bounded) Checksum(ctx context.Context, name string, off, length int64) (uint32, error) {
	ctx, cancel := b.ctx(ctx)
	defer cancel()
	return b.c.Checksum(ctx, name, off, length)
}

func (b bounded) LayerChecksum(ctx context.Context, name string, off, length int64) (uint32, error) {
	ctx, cancel := b.ctx(ctx)
	defer cancel()
	return b.c.LayerChecksum(ctx, name, off, length)
}

func (b bounded) ReplaceChain(ctx context.Context, snaps []SnapshotInfo) error {
	ctx, cancel := b.ctx(ctx)
	defer cancel()
	return b.c.ReplaceChain(ctx, snaps)
}

func (b bounded) WriteLayer(ctx context.Context, name string, p []byte, off int64) error {
	ctx, cancel := b.ctx(ctx)
	defer cancel()
	return b.c.WriteLayer(ctx, name, p, off)
}

// PullLayer is the target's LayerPuller (ErrNoPull if it is none), src
// the source's connection.
func (b bounded) PullLayer(ctx context.Context, src Replica, srcID, name string, off, length int64, layerOnly bool) (int64, error) {
	p, ok := b.c.(LayerPuller)
	if !ok || src == nil {
		return 0, fmt.Errorf("%w: the replica's connection cannot pull", ErrNoPull)
	}
	ctx, cancel := b.ctx(ctx)
	defer cancel()
	return p.PullLayer(ctx, src, srcID, name, off, length, layerOnly)
}

func (b bounded) SyncLayers(ctx context.Context) error {
	ctx, cancel := b.ctx(ctx)
	defer cancel()
	return b.c.SyncLayers(ctx)
}

// snapshotBytes is the data snapshot name holds in chain (0 if there is
// no such snapshot).
func snapshotBytes(chain []SnapshotInfo, name string) int64 {
	for _, s := range chain {
		if s.Name == name {
			return s.DataBytes
		}
	}
	return 0
}
