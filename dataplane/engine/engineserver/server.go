// Package engineserver serves an engine's control API over gRPC.
package engineserver

import (
	"cmp"
	"context"
	"errors"
	"slices"
	"strings"
	"sync"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	enginev1 "github.com/cairn-io/cairn/dataplane/api/engine/v1"
	"github.com/cairn-io/cairn/dataplane/engine"
	"github.com/cairn-io/cairn/dataplane/internal/ready"
)

// Server implements EngineService for one engine.
type Server struct {
	enginev1.UnimplementedEngineServiceServer
	E        *engine.Engine
	Name     string
	Frontend string
	// Endpoint is where the frontend serves the volume, EndpointKind what
	// it is; Socket is the nbd frontend's socket.
	Endpoint     string
	EndpointKind ready.EndpointKind
	Socket       string
	// Fallback says why an engine asked for a kernel block device serves
	// only its NBD socket ("" when it got what it asked for).
	Fallback string
	// InUse says why the volume is in use by its frontend ("" when idle):
	// a revert then is refused, since whoever has it open would keep
	// reading its cached view of the old data.
	InUse func() string
	// Resize has the frontend's block device show the volume's size after
	// Expand grew it (/dev/nbdN, the loop device); nil when the frontend
	// has no device (an NBD socket: clients learn the size when they
	// connect).
	Resize func(ctx context.Context, size int64) error
	// DialSource connects to another volume's replica, by its control
	// address, for CloneFrom; nil: CloneFrom is refused.
	DialSource func(ctx context.Context, address string) (engine.CloneSource, error)

	resizing sync.Mutex // one Resize at a time, to the engine's latest size
	watch    watchers   // the Watch streams and what they were sent
}

func grpcErr(err error) error {
	if err == nil {
		return nil
	}
	var code codes.Code
	switch {
	case errors.Is(err, engine.ErrInvalid):
		code = codes.InvalidArgument
	case errors.Is(err, engine.ErrSnapshotNotFound):
		code = codes.NotFound
	case errors.Is(err, engine.ErrSnapshotExists):
		code = codes.AlreadyExists
	case errors.Is(err, engine.ErrNoReplica):
		code = codes.Unavailable
	case errors.Is(err, engine.ErrClosed):
		code = codes.FailedPrecondition
	case errors.Is(err, context.Canceled):
		code = codes.Canceled
	default:
		code = codes.Internal
	}
	return status.Error(code, err.Error())
}

func (s *Server) VolumeInfo(context.Context, *enginev1.VolumeInfoRequest) (*enginev1.VolumeInfoResponse, error) {
	return &enginev1.VolumeInfoResponse{Name: s.Name, Size: s.E.Size(), Frontend: s.Frontend, Endpoint: s.Endpoint,
		EndpointKind: string(s.EndpointKind), Socket: s.Socket, Fallback: s.Fallback,
		Robustness: s.E.Robustness(), Epoch: s.E.Epoch()}, nil
}

func (s *Server) ReplicaList(context.Context, *enginev1.ReplicaListRequest) (*enginev1.ReplicaListResponse, error) {
	return &enginev1.ReplicaListResponse{Replicas: s.replicas()}, nil
}

func (s *Server) replicas() []*enginev1.Replica {
	var out []*enginev1.Replica
	for _, r := range s.E.Replicas() {
		out = append(out, &enginev1.Replica{Address: r.Address, Mode: r.Mode.String(),
			SinceUnixNano: r.Since.UnixNano(), Error: r.Error})
	}
	return out
}

func (s *Server) ReplicaAdd(ctx context.Context, req *enginev1.ReplicaAddRequest) (*enginev1.ReplicaAddResponse, error) {
	if req.GetAddress() == "" {
		return nil, status.Error(codes.InvalidArgument, "address is required")
	}
	defer s.changed()
	return &enginev1.ReplicaAddResponse{}, grpcErr(s.E.AddReplica(ctx, req.GetAddress()))
}

func (s *Server) ReplicaRemove(ctx context.Context, req *enginev1.ReplicaRemoveRequest) (*enginev1.ReplicaRemoveResponse, error) {
	defer s.changed()
	return &enginev1.ReplicaRemoveResponse{}, grpcErr(s.E.RemoveReplica(ctx, req.GetAddress()))
}

func (s *Server) RebuildStatus(context.Context, *enginev1.RebuildStatusRequest) (*enginev1.RebuildStatusResponse, error) {
	return &enginev1.RebuildStatusResponse{Rebuilds: s.rebuilds()}, nil
}

// rebuilds lists the engine's rebuilds ordered by replica address, then
// start (the engine keeps them in a map).
func (s *Server) rebuilds() []*enginev1.Rebuild {
	var out []*enginev1.Rebuild
	for _, r := range s.E.Rebuilds() {
		rb := &enginev1.Rebuild{Replica: r.Replica, Source: r.Source, Snapshot: r.Snapshot, State: string(r.State),
			DirtyOnly: r.DirtyOnly, FullReason: r.FullReason, RelayReason: r.RelayReason, BytesDone: r.BytesDone, BytesTotal: r.BytesTotal, BytesCopied: r.BytesCopied,
			StartedUnixNano: r.Started.UnixNano(), Error: r.Error, Layers: r.Layers}
		if !r.Finished.IsZero() {
			rb.FinishedUnixNano = r.Finished.UnixNano()
		}
		out = append(out, rb)
	}
	slices.SortFunc(out, func(a, b *enginev1.Rebuild) int {
		return cmp.Or(strings.Compare(a.Replica, b.Replica), cmp.Compare(a.StartedUnixNano, b.StartedUnixNano))
	})
	return out
}

func (s *Server) RebuildCancel(_ context.Context, req *enginev1.RebuildCancelRequest) (*enginev1.RebuildCancelResponse, error) {
	defer s.changed()
	return &enginev1.RebuildCancelResponse{}, grpcErr(s.E.CancelRebuild(req.GetReplica()))
}

func (s *Server) SnapshotCreate(ctx context.Context, req *enginev1.SnapshotCreateRequest) (*enginev1.SnapshotCreateResponse, error) {
	if req.GetName() == "" {
		return nil, status.Error(codes.InvalidArgument, "name is required")
	}
	defer s.changed()
	return &enginev1.SnapshotCreateResponse{}, grpcErr(s.E.Snapshot(ctx, req.GetName()))
}

func (s *Server) SnapshotList(ctx context.Context, _ *enginev1.SnapshotListRequest) (*enginev1.SnapshotListResponse, error) {
	snaps, err := s.snapshots(ctx)
	if err != nil {
		return nil, grpcErr(err)
	}
	return &enginev1.SnapshotListResponse{Snapshots: snaps}, nil
}

func (s *Server) snapshots(ctx context.Context) ([]*enginev1.Snapshot, error) {
	snaps, err := s.E.Snapshots(ctx)
	if err != nil {
		return nil, err
	}
	return snapshotsOut(snaps), nil
}

func snapshotsOut(snaps []engine.SnapshotInfo) []*enginev1.Snapshot {
	var out []*enginev1.Snapshot
	for _, x := range snaps {
		out = append(out, &enginev1.Snapshot{Name: x.Name, Parent: x.Parent,
			CreatedUnixNano: x.Created.UnixNano(), UserCreated: x.UserCreated, DataBytes: x.DataBytes})
	}
	return out
}

func (s *Server) SnapshotDelete(ctx context.Context, req *enginev1.SnapshotDeleteRequest) (*enginev1.SnapshotDeleteResponse, error) {
	defer s.changed()
	return &enginev1.SnapshotDeleteResponse{}, grpcErr(s.E.DeleteSnapshot(ctx, req.GetName()))
}

func (s *Server) SnapshotRevert(ctx context.Context, req *enginev1.SnapshotRevertRequest) (*enginev1.SnapshotRevertResponse, error) {
	if s.InUse != nil {
		if why := s.InUse(); why != "" {
			return nil, status.Errorf(codes.FailedPrecondition,
				"revert to %s refused: volume %s is in use (%s); stop the workload and restart the engine with "+
					"--frontend nbd --nbd-kernel off, revert while no client is connected, then restart it as before",
				req.GetName(), s.Name, why)
		}
	}
	defer s.changed()
	return &enginev1.SnapshotRevertResponse{}, grpcErr(s.E.Revert(ctx, req.GetName()))
}

// CloneFrom starts the engine's copy from another volume's replica.
func (s *Server) CloneFrom(ctx context.Context, req *enginev1.CloneFromRequest) (*enginev1.CloneFromResponse, error) {
	if req.GetSource() == "" || req.GetSnapshot() == "" {
		return nil, status.Error(codes.InvalidArgument, "source and snapshot are required")
	}
	if s.DialSource == nil {
		return nil, status.Error(codes.Unimplemented, "this engine cannot reach other volumes' replicas")
	}
	if s.InUse != nil {
		if why := s.InUse(); why != "" {
			return nil, status.Errorf(codes.FailedPrecondition, "clone into volume %s refused: it is in use (%s); a clone fills a volume nobody uses", s.Name, why)
		}
	}
	src, err := s.DialSource(ctx, req.GetSource())
	if err != nil {
		return nil, status.Errorf(codes.Unavailable, "connect to the source replica %s: %v", req.GetSource(), err)
	}
	defer s.changed()
	return &enginev1.CloneFromResponse{}, grpcErr(s.E.CloneFrom(src, req.GetSource(), req.GetSnapshot()))
}

// cloneStatus is the last CloneFrom's progress, nil if none.
func (s *Server) cloneStatus() *enginev1.Clone {
	c, ok := s.E.Clone()
	if !ok {
		return nil
	}
	out := &enginev1.Clone{Source: c.Source, Snapshot: c.Snapshot, State: string(c.State), BytesDone: c.BytesDone,
		BytesTotal: c.BytesTotal, BytesCopied: c.BytesCopied, StartedUnixNano: c.Started.UnixNano(), Error: c.Error}
	if !c.Finished.IsZero() {
		out.FinishedUnixNano = c.Finished.UnixNano()
	}
	return out
}

// Expand grows the volume on the replicas, then the frontend's block
// device. If the device could not be resized, the volume is bigger than
// the device shows: the error says so, and an Expand to the same size
// (which the engine accepts) tries the device again.
func (s *Server) Expand(ctx context.Context, req *enginev1.ExpandRequest) (*enginev1.ExpandResponse, error) {
	defer s.changed()
	if err := s.E.Expand(ctx, req.GetSize()); err != nil {
		return nil, grpcErr(err)
	}
	if s.Resize == nil {
		return &enginev1.ExpandResponse{}, nil
	}
	// The engine's size, not the request's: with two expansions at once,
	// the device must end at the larger, whichever resize runs last.
	s.resizing.Lock()
	defer s.resizing.Unlock()
	size := s.E.Size()
	if err := s.Resize(ctx, size); err != nil {
		return nil, status.Errorf(codes.Internal, "volume %s grew to %d bytes, but %s does not show it: %v; expand to the same size again to retry",
			s.Name, size, s.Endpoint, err)
	}
	return &enginev1.ExpandResponse{}, nil
}

func opMetrics(m engine.OpMetrics) *enginev1.OpMetrics {
	return &enginev1.OpMetrics{Ops: m.Ops, Bytes: m.Bytes, Errors: m.Errors, Latency: m.Latency}
}

func (s *Server) Metrics(context.Context, *enginev1.MetricsRequest) (*enginev1.MetricsResponse, error) {
	m := s.E.Metrics()
	out := &enginev1.MetricsResponse{Read: opMetrics(m.Read), Write: opMetrics(m.Write), Flush: opMetrics(m.Flush), Unmap: opMetrics(m.Unmap)}
	for _, b := range engine.LatencyBuckets {
		out.LatencyBoundsNs = append(out.LatencyBoundsNs, b.Nanoseconds())
	}
	for addr, r := range m.Replicas {
		out.Replicas = append(out.Replicas, &enginev1.ReplicaMetrics{Address: addr, Read: opMetrics(r.Read),
			Write: opMetrics(r.Write), Flush: opMetrics(r.Flush), Unmap: opMetrics(r.Unmap), SharedWrites: r.SharedWrites})
	}
	return out, nil
}
