// Package replicaserver puts a replica on the network: its data over
// dataconn and its control API over gRPC. The replica package itself does
// no networking.
package replicaserver

import (
	"context"
	"errors"
	"fmt"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	replicav1 "github.com/cairn-io/cairn/dataplane/api/replica/v1"
	"github.com/cairn-io/cairn/dataplane/dataconn"
	"github.com/cairn-io/cairn/dataplane/replica"
)

// Backend adapts a replica to dataconn.EpochBackend, mapping the
// replica's errors to wire codes (stale epoch, out of range; ENOSPC is
// mapped by dataconn itself). Requests are checked against the epoch
// atomically with the operation.
type Backend struct{ Replica *replica.Replica }

var (
	_ dataconn.EpochBackend    = Backend{}
	_ dataconn.SnapshotBackend = Backend{}
)

func wire(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, replica.ErrStaleEpoch):
		return fmt.Errorf("%w: %w", dataconn.CodeStaleEpoch, err)
	case errors.Is(err, replica.ErrOutOfRange):
		return fmt.Errorf("%w: %w", dataconn.CodeOutOfRange, err)
	case errors.Is(err, replica.ErrClosed), errors.Is(err, replica.ErrNotRebuilding):
		return fmt.Errorf("%w: %w", dataconn.CodeShutdown, err)
	}
	return err
}

func (b Backend) ReadAt(p []byte, off int64) (int, error) {
	n, err := b.Replica.ReadAt(p, off)
	return n, wire(err)
}

func (b Backend) WriteAt(p []byte, off int64) (int, error) {
	n, err := b.Replica.WriteAt(p, off)
	return n, wire(err)
}

func (b Backend) Flush() error                  { return wire(b.Replica.Flush()) }
func (b Backend) Unmap(off, length int64) error { return wire(b.Replica.Unmap(off, length)) }
func (b Backend) Size() int64                   { return b.Replica.Size() }

func (b Backend) ReadAtEpoch(p []byte, off int64, e uint64) (int, error) {
	n, err := b.Replica.ReadAtEpoch(p, off, e)
	return n, wire(err)
}

func (b Backend) WriteAtEpoch(p []byte, off int64, e uint64) (int, error) {
	n, err := b.Replica.WriteAtEpoch(p, off, e)
	return n, wire(err)
}

// ReadSnapshotAt serves a snapshot read (dataconn.OpSnapshotRead): a
// missing snapshot or a misaligned range is CodeInvalid, so a caller
// tells them from a failed disk.
func (b Backend) ReadSnapshotAt(p []byte, name string, off int64) error {
	err := b.Replica.ReadSnapshotAt(p, name, off)
	if errors.Is(err, replica.ErrSnapshotNotFound) || errors.Is(err, replica.ErrInvalidSize) {
		return fmt.Errorf("%w: %w", dataconn.CodeInvalid, err)
	}
	return wire(err)
}

func (b Backend) FlushEpoch(e uint64) error { return wire(b.Replica.FlushEpoch(e)) }

func (b Backend) UnmapEpoch(off, length int64, e uint64) error {
	return wire(b.Replica.UnmapEpoch(off, length, e))
}

// Control implements the gRPC ReplicaService for one replica. The calls
// that change the chain or size go through Replica.At(request epoch), so a
// stale engine's are refused.
type Control struct {
	replicav1.UnimplementedReplicaServiceServer
	Replica *replica.Replica
	// DataAddress is reported in Info.
	DataAddress string
	// OnClose is called (once, in the background) after Close has closed
	// the replica, so the process can stop serving and exit.
	OnClose func()
	// Sources, when set, are the connections LayerPull reads other
	// replicas over; without, LayerPull is UNIMPLEMENTED and the engine
	// copies rebuild data itself.
	Sources *Sources
	// recycleReads: SnapshotRead replies are read into the codec's
	// recycled buffers, which only a server marshalling with that codec
	// gives back (Start's); a Control served otherwise allocates them.
	recycleReads bool
}

// grpcErr maps replica errors to gRPC status codes. A stale epoch is
// FAILED_PRECONDITION with a StaleEpoch detail, so a client tells it from
// the other failed preconditions without reading the message.
func grpcErr(err error) error {
	if err == nil {
		return nil
	}
	if se := (*replica.StaleEpochError)(nil); errors.As(err, &se) {
		st, derr := status.New(codes.FailedPrecondition, err.Error()).WithDetails(
			&replicav1.StaleEpoch{RequestEpoch: se.Request, ReplicaEpoch: se.Current, OtherOwner: se.OtherOwner})
		if derr != nil {
			return status.Error(codes.FailedPrecondition, err.Error())
		}
		return st.Err()
	}
	var code codes.Code
	switch {
	case errors.Is(err, replica.ErrSnapshotNotFound):
		code = codes.NotFound
	case errors.Is(err, replica.ErrSnapshotExists):
		code = codes.AlreadyExists
	case errors.Is(err, replica.ErrInvalidName), errors.Is(err, replica.ErrInvalidSize):
		code = codes.InvalidArgument
	case errors.Is(err, replica.ErrClosed), errors.Is(err, replica.ErrNotRebuilding):
		code = codes.FailedPrecondition
	case errors.Is(err, replica.ErrOutOfRange):
		code = codes.OutOfRange
	default:
		code = codes.Internal
	}
	return status.Error(code, err.Error())
}

func toProto(s replica.SnapshotInfo) *replicav1.Snapshot {
	return &replicav1.Snapshot{Name: s.Name, Parent: s.Parent, CreatedUnixNano: s.Created.UnixNano(), UserCreated: s.UserCreated, DataBytes: s.DataBytes}
}

func (c *Control) Info(context.Context, *replicav1.InfoRequest) (*replicav1.InfoResponse, error) {
	in, err := c.Replica.Info()
	if err != nil {
		return nil, grpcErr(err)
	}
	out := &replicav1.InfoResponse{
		Id: in.ID, Rebuilding: in.Rebuilding, Size: in.Size, Epoch: in.Epoch, EpochMembers: in.EpochMembers, DirtyKeptSince: in.DirtyKeptSince, Head: in.Head, HeadBytes: in.HeadBytes, IndexBytes: in.IndexBytes, DataAddress: c.DataAddress,
		Dirty: &replicav1.DirtyRegions{RegionSize: in.Dirty.RegionSize, Count: in.Dirty.Count, Bits: in.Dirty.Bits, Dirty: in.Dirty.Dirty()},
	}
	for _, s := range in.Snapshots {
		out.Snapshots = append(out.Snapshots, toProto(s))
	}
	return out, nil
}

func (c *Control) SnapshotCreate(_ context.Context, req *replicav1.SnapshotCreateRequest) (*replicav1.SnapshotCreateResponse, error) {
	var created time.Time
	if ns := req.GetCreatedUnixNano(); ns != 0 {
		created = time.Unix(0, ns)
	}
	o := replica.SnapshotOptions{Name: req.GetName(), UserCreated: req.GetUserCreated(), Created: created}
	return &replicav1.SnapshotCreateResponse{}, grpcErr(c.Replica.At(req.GetEpoch()).Snapshot(o))
}

func (c *Control) SnapshotList(context.Context, *replicav1.SnapshotListRequest) (*replicav1.SnapshotListResponse, error) {
	snaps, err := c.Replica.Snapshots()
	if err != nil {
		return nil, grpcErr(err)
	}
	out := &replicav1.SnapshotListResponse{}
	for _, s := range snaps {
		out.Snapshots = append(out.Snapshots, toProto(s))
	}
	return out, nil
}

func (c *Control) SnapshotDelete(_ context.Context, req *replicav1.SnapshotDeleteRequest) (*replicav1.SnapshotDeleteResponse, error) {
	return &replicav1.SnapshotDeleteResponse{}, grpcErr(c.Replica.At(req.GetEpoch()).DeleteSnapshot(req.GetName()))
}

func (c *Control) SnapshotRevert(_ context.Context, req *replicav1.SnapshotRevertRequest) (*replicav1.SnapshotRevertResponse, error) {
	return &replicav1.SnapshotRevertResponse{}, grpcErr(c.Replica.At(req.GetEpoch()).Revert(req.GetName()))
}

func (c *Control) Expand(_ context.Context, req *replicav1.ExpandRequest) (*replicav1.ExpandResponse, error) {
	return &replicav1.ExpandResponse{}, grpcErr(c.Replica.At(req.GetEpoch()).Expand(req.GetSize()))
}

func (c *Control) SetEpoch(_ context.Context, req *replicav1.SetEpochRequest) (*replicav1.SetEpochResponse, error) {
	o := replica.FenceOptions{Epoch: req.GetEpoch(), Owner: req.GetOwner(), Degraded: req.GetDegraded(), Rebuilding: req.GetRebuilding(), Members: req.GetMembers()}
	for _, m := range req.GetMark() {
		o.Mark = append(o.Mark, replica.Range{Offset: m.GetOffset(), Length: m.GetLength()})
	}
	return &replicav1.SetEpochResponse{}, grpcErr(c.Replica.Fence(o))
}

func (c *Control) Close(context.Context, *replicav1.CloseRequest) (*replicav1.CloseResponse, error) {
	err := c.Replica.Flush()
	if err == nil || errors.Is(err, replica.ErrClosed) {
		err = c.Replica.Close()
	}
	if err != nil {
		return nil, grpcErr(err)
	}
	if c.OnClose != nil {
		go c.OnClose()
	}
	return &replicav1.CloseResponse{}, nil
}

// notExpected starts a SnapshotRead's refusal for another expected_id
// than the replica's (a pull takes it as its source being unreadable).
const notExpected = "this is replica"

// MaxSnapshotRead bounds one SnapshotRead call, so replies stay well under
// gRPC's message limits.
const MaxSnapshotRead = 4 << 20

func (c *Control) SnapshotRead(_ context.Context, req *replicav1.SnapshotReadRequest) (*replicav1.SnapshotReadResponse, error) {
	if req.GetLength() > MaxSnapshotRead {
		return nil, status.Errorf(codes.InvalidArgument, "snapshot reads are limited to %d bytes per call, got %d", MaxSnapshotRead, req.GetLength())
	}
	if want := req.GetExpectedId(); want != "" {
		if id := c.Replica.ID(); id != want {
			return nil, status.Errorf(codes.FailedPrecondition, notExpected+" %.64q, not %.64q", id, want)
		}
	}
	// The data is read into a recycled buffer, which the codec gets back
	// once the transport has sent the reply (SendSnapshotRead), or into
	// memory of its own when this server does not marshal with the codec
	// or the read is longer than its buffers.
	var buf []byte
	var raw *[]byte
	if c.recycleReads && req.GetLength() > 0 && req.GetLength() <= MaxControlMessage {
		buf, raw = codec.ReadBuffer(int(req.GetLength()))
	}
	ext, err := c.Replica.ReadExtentsInto(buf, req.GetSnapshot(), req.GetOffset(), req.GetLength(), req.GetLayerOnly())
	if err != nil {
		codec.GiveBack(raw)
		return nil, grpcErr(err)
	}
	if len(ext) == 0 {
		codec.GiveBack(raw)
		return &replicav1.SnapshotReadResponse{}, nil
	}
	out := &replicav1.SnapshotReadResponse{Extents: make([]*replicav1.Extent, 0, len(ext))}
	for _, e := range ext {
		out.Extents = append(out.Extents, &replicav1.Extent{Offset: e.Offset, Data: e.Data})
	}
	codec.SendSnapshotRead(out, raw)
	return out, nil
}

func (c *Control) ReplaceChain(_ context.Context, req *replicav1.ReplaceChainRequest) (*replicav1.ReplaceChainResponse, error) {
	snaps := make([]replica.SnapshotInfo, 0, len(req.GetSnapshots()))
	for _, s := range req.GetSnapshots() {
		snaps = append(snaps, replica.SnapshotInfo{Name: s.GetName(), Created: time.Unix(0, s.GetCreatedUnixNano()), UserCreated: s.GetUserCreated()})
	}
	return &replicav1.ReplaceChainResponse{}, grpcErr(c.Replica.At(req.GetEpoch()).ReplaceChain(snaps))
}

func (c *Control) LayerWrite(_ context.Context, req *replicav1.LayerWriteRequest) (*replicav1.LayerWriteResponse, error) {
	// The replica keeps nothing of the data once written: its buffer can
	// serve the next request.
	defer releaseLayerWrite(req)
	return &replicav1.LayerWriteResponse{}, grpcErr(c.Replica.At(req.GetEpoch()).WriteLayer(req.GetSnapshot(), req.GetData(), req.GetOffset()))
}

func (c *Control) SyncLayers(context.Context, *replicav1.SyncLayersRequest) (*replicav1.SyncLayersResponse, error) {
	return &replicav1.SyncLayersResponse{}, grpcErr(c.Replica.SyncLayers())
}

func (c *Control) Checksum(_ context.Context, req *replicav1.ChecksumRequest) (*replicav1.ChecksumResponse, error) {
	sum := c.Replica.Checksum
	if req.GetLayerOnly() {
		sum = c.Replica.LayerChecksum
	}
	crc, err := sum(req.GetSnapshot(), req.GetOffset(), req.GetLength())
	if err != nil {
		return nil, grpcErr(err)
	}
	return &replicav1.ChecksumResponse{Crc32C: crc}, nil
}

func (c *Control) SnapshotChanges(_ context.Context, req *replicav1.SnapshotChangesRequest) (*replicav1.SnapshotChangesResponse, error) {
	rs, next, err := c.Replica.Changes(req.GetSnapshot(), req.GetBase(), req.GetOffset(), req.GetLength(), int(req.GetMaxRanges()))
	if err != nil {
		return nil, grpcErr(err)
	}
	out := &replicav1.SnapshotChangesResponse{Ranges: make([]*replicav1.ByteRange, 0, len(rs)), NextOffset: next}
	for _, r := range rs {
		out.Ranges = append(out.Ranges, &replicav1.ByteRange{Offset: r.Offset, Length: r.Length})
	}
	return out, nil
}
