package engine

import (
	"context"
	"time"
)

// Replica is the engine's view of one replica: data I/O (dataconn in
// production) and control (gRPC), by role below. The engine never imports
// a transport; engine/replicaclient implements this over the network.
type Replica interface {
	DataPath
	Control
	RebuildSource
	RebuildTarget
	// Close ends the connection; calls in flight fail.
	Close() error
}

// DataPath is what the I/O path calls: reads, writes, flushes and unmaps
// (also a rebuild's writes of new data, which reach a WO replica this
// way), carrying the epoch they were sent in.
type DataPath interface {
	ReadAt(ctx context.Context, p []byte, off int64) error
	WriteAt(ctx context.Context, p []byte, off int64, fua bool) error
	Flush(ctx context.Context) error
	Unmap(ctx context.Context, off, length int64) error
	// SetRequestEpoch sets the epoch carried by later data requests.
	SetRequestEpoch(e uint64)
	// Failed is closed when the data connection fails on its own (broken
	// connection, missed liveness ping).
	Failed() <-chan struct{}
}

// Control is what opening the volume, changing the set and changing the
// snapshot chain call on every member.
type Control interface {
	Info(ctx context.Context) (ReplicaInfo, error)
	// SetEpoch persists the replica's epoch with the state of the set
	// (EpochState).
	SetEpoch(ctx context.Context, st EpochState) error
	// Snapshot takes snapshot s.Name, recording s.UserCreated and s.Created
	// (zero: now).
	Snapshot(ctx context.Context, s SnapshotInfo) error
	DeleteSnapshot(ctx context.Context, name string) error
	Revert(ctx context.Context, name string) error
	Expand(ctx context.Context, size int64) error
}

// RebuildSource is what a rebuild reads from the RW replica it copies.
type RebuildSource interface {
	// ReadSnapshot returns the data extents of [off, off+length) of the
	// view at snapshot name (holes left out).
	ReadSnapshot(ctx context.Context, name string, off, length int64) ([]Extent, error)
	// ReadLayer returns the data extents snapshot name's own layer holds in
	// [off, off+length).
	ReadLayer(ctx context.Context, name string, off, length int64) ([]Extent, error)
	Checksummer
}

// RebuildTarget is what a rebuild calls on the replica it rebuilds.
type RebuildTarget interface {
	// ReplaceChain empties a replica marked rebuilding into empty snapshots
	// named and dated as snaps (oldest first) under an empty head.
	ReplaceChain(ctx context.Context, snaps []SnapshotInfo) error
	// WriteLayer writes into snapshot name's own layer, below the head.
	WriteLayer(ctx context.Context, name string, p []byte, off int64) error
	SyncLayers(ctx context.Context) error
	Checksummer
}

// LayerPuller is a RebuildTarget that copies a rebuild's chunk from the
// source replica itself, so the data goes from replica to replica and
// not through the engine (replicaclient.Client, for a source that is
// one too).
type LayerPuller interface {
	// PullLayer copies [off, off+length) of snapshot name from src, whose
	// replica ID is srcID, into this replica's layer of that snapshot:
	// the source layer's own data (layerOnly), or the view at name
	// written whole, zeros included. It returns the bytes written.
	// ErrNoPull: this replica cannot pull from src (a source of another
	// kind or out of its reach, a replica process that predates pulling);
	// the engine copies the data itself.
	PullLayer(ctx context.Context, src Replica, srcID, name string, off, length int64, layerOnly bool) (int64, error)
}

// Checksummer is how a rebuild verifies its copy, on both sides.
type Checksummer interface {
	// Checksum is the CRC-32C of [off, off+length) of the view at name.
	Checksum(ctx context.Context, name string, off, length int64) (uint32, error)
	// LayerChecksum is a CRC-32C of what snapshot name's own layer holds in
	// [off, off+length): its data and where that data lies.
	LayerChecksum(ctx context.Context, name string, off, length int64) (uint32, error)
}

// EpochState is what SetEpoch persists on a replica.
type EpochState struct {
	Epoch uint64
	// Degraded: the set is missing a member, so write-intent bits are kept
	// for it to resync from.
	Degraded bool
	// Rebuilding: this replica is being rebuilt; its data is incomplete.
	Rebuilding bool
	// Members are the IDs of the replicas RW in the set at Epoch. An
	// engine opening the volume while some replica does not answer reads
	// them to tell whether the missing one can hold newer data (safeToOpen).
	Members []string
	// Mark are byte ranges whose write-intent bits the replica sets,
	// durably, before it answers (only with Degraded): the writes that
	// failed on another replica, which this one may have taken and
	// cleared the bits of before it was told the set is degraded.
	Mark []ByteRange
}

// ByteRange is a byte range of the volume.
type ByteRange struct{ Off, N int64 }

// Extent is a run of data at an offset.
type Extent struct {
	Offset int64
	Data   []byte
}

// ReplicaInfo is what a replica reports of itself.
type ReplicaInfo struct {
	// ID is fixed when the replica is created; a new replica at an old
	// address has another.
	ID string
	// Rebuilding: a rebuild of this replica started and did not finish.
	Rebuilding bool
	Size       int64
	Epoch      uint64
	// EpochMembers are the IDs of the replicas RW when Epoch was set
	// (EpochState.Members); empty if it was set without them.
	EpochMembers []string
	// DirtyKeptSince is the epoch since which the replica has cleared no
	// write-intent bit (0: unknown, or a replica older than the marker).
	DirtyKeptSince uint64
	HeadBytes      int64
	Snapshots      []SnapshotInfo
	// Dirty is the write-intent bitmap: bit r%64 of word r/64 is region r.
	DirtyRegionSize int64
	DirtyCount      int64
	Dirty           []uint64
}

// SnapshotInfo describes one snapshot.
type SnapshotInfo struct {
	Name        string
	Parent      string
	Created     time.Time
	UserCreated bool
	DataBytes   int64
}

// WriteStarter is implemented by replicas that can send a write and wait
// for its answer separately: the engine then sends a write to all of them
// from one goroutine before waiting, instead of one goroutine each.
type WriteStarter interface {
	StartWriteAt(p []byte, off int64, fua bool) Waiter
}

// SharedWriteCounter is implemented by replicas that count the writes they
// got through memory shared with the engine (Metrics reports it).
type SharedWriteCounter interface {
	SharedWrites() uint64
}

// Waiter waits for the answer to a started request. A ctx that ends first
// fails the replica's connection, as for the synchronous calls.
type Waiter interface {
	Wait(ctx context.Context) error
}

// Dialer connects to the replica at address.
type Dialer func(ctx context.Context, address string) (Replica, error)
