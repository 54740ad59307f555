package instancemanager

import (
	"context"
	"errors"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	imv1 "github.com/cairn-io/cairn/dataplane/api/instancemanager/v1"
)

// Server implements the gRPC InstanceManagerService over a Supervisor.
type Server struct {
	imv1.UnimplementedInstanceManagerServiceServer
	S        *Supervisor
	NodeName string
	Version  string
	DataDirs []string
}

var stateToProto = map[State]imv1.ProcessState{
	StateStarting: imv1.ProcessState_PROCESS_STATE_STARTING,
	StateRunning:  imv1.ProcessState_PROCESS_STATE_RUNNING,
	StateStopping: imv1.ProcessState_PROCESS_STATE_STOPPING,
	StateStopped:  imv1.ProcessState_PROCESS_STATE_STOPPED,
	StateError:    imv1.ProcessState_PROCESS_STATE_ERROR,
}

// ToProto converts a Process.
func ToProto(p Process) *imv1.Process {
	out := &imv1.Process{Name: p.Name, State: stateToProto[p.State], Args: p.Args, Pid: int32(p.PID),
		ExitCode: int32(p.ExitCode), Error: p.Error, LogTail: p.LogTail}
	switch p.Kind {
	case KindEngine:
		out.Kind = imv1.ProcessKind_PROCESS_KIND_ENGINE
	case KindReplica:
		out.Kind = imv1.ProcessKind_PROCESS_KIND_REPLICA
	}
	for _, port := range p.Ports {
		out.Ports = append(out.Ports, int32(port))
	}
	return out
}

func grpcErr(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, ErrInvalid):
		return status.Error(codes.InvalidArgument, err.Error())
	case errors.Is(err, ErrNotFound):
		return status.Error(codes.NotFound, err.Error())
	case errors.Is(err, ErrNoPorts):
		return status.Error(codes.ResourceExhausted, err.Error())
	case errors.Is(err, ErrShuttingDown):
		return status.Error(codes.Unavailable, err.Error())
	}
	return status.Error(codes.Internal, err.Error())
}

func (s *Server) ProcessCreate(_ context.Context, req *imv1.ProcessCreateRequest) (*imv1.Process, error) {
	var kind Kind
	switch req.GetKind() {
	case imv1.ProcessKind_PROCESS_KIND_ENGINE:
		kind = KindEngine
	case imv1.ProcessKind_PROCESS_KIND_REPLICA:
		kind = KindReplica
	default:
		return nil, status.Error(codes.InvalidArgument, "kind must be engine or replica")
	}
	p, err := s.S.Create(req.GetName(), kind, req.GetArgs(), int(req.GetPortCount()))
	if errors.Is(err, ErrExists) {
		// The existing process travels with the error, so a caller that
		// retries a create sees what it created the first time.
		st, derr := status.New(codes.AlreadyExists, err.Error()).WithDetails(ToProto(p))
		if derr != nil {
			return nil, status.Error(codes.AlreadyExists, err.Error())
		}
		return nil, st.Err()
	}
	if err != nil {
		return nil, grpcErr(err)
	}
	return ToProto(p), nil
}

func (s *Server) ProcessDelete(ctx context.Context, req *imv1.ProcessDeleteRequest) (*imv1.ProcessDeleteResponse, error) {
	return &imv1.ProcessDeleteResponse{}, grpcErr(s.S.Delete(ctx, req.GetName()))
}

func (s *Server) ProcessGet(_ context.Context, req *imv1.ProcessGetRequest) (*imv1.Process, error) {
	p, err := s.S.Get(req.GetName())
	if err != nil {
		return nil, grpcErr(err)
	}
	return ToProto(p), nil
}

func (s *Server) ProcessList(context.Context, *imv1.ProcessListRequest) (*imv1.ProcessListResponse, error) {
	out := &imv1.ProcessListResponse{}
	for _, p := range s.S.List() {
		out.Processes = append(out.Processes, ToProto(p))
	}
	return out, nil
}

func (s *Server) ProcessWatch(_ *imv1.ProcessWatchRequest, stream imv1.InstanceManagerService_ProcessWatchServer) error {
	snap, seq, events, cancel := s.S.Watch()
	defer cancel()
	first := &imv1.ProcessEvent{Type: imv1.ProcessEvent_TYPE_SNAPSHOT, Seq: seq}
	for _, p := range snap {
		first.Processes = append(first.Processes, ToProto(p))
	}
	if err := stream.Send(first); err != nil {
		return err
	}
	for {
		select {
		case <-stream.Context().Done():
			return nil
		case ev, ok := <-events:
			if !ok {
				return status.Error(codes.Unavailable, "the watch fell behind or the instance manager is stopping; watch again")
			}
			typ := imv1.ProcessEvent_TYPE_UPDATE
			if ev.Deleted {
				typ = imv1.ProcessEvent_TYPE_DELETE
			}
			if err := stream.Send(&imv1.ProcessEvent{Type: typ, Seq: ev.Seq, Process: ToProto(ev.Process)}); err != nil {
				return err
			}
		}
	}
}

func (s *Server) ProcessLog(req *imv1.ProcessLogRequest, stream imv1.InstanceManagerService_ProcessLogServer) error {
	lines, later, stop, err := s.S.Logs(req.GetName(), req.GetFollow())
	if err != nil {
		return grpcErr(err)
	}
	defer stop()
	for _, l := range lines {
		if err := stream.Send(&imv1.LogLine{Line: l}); err != nil {
			return err
		}
	}
	for {
		select {
		case <-stream.Context().Done():
			return nil
		case l, ok := <-later:
			if !ok {
				return nil
			}
			if err := stream.Send(&imv1.LogLine{Line: l}); err != nil {
				return err
			}
		}
	}
}

func (s *Server) NodeInfo(context.Context, *imv1.NodeInfoRequest) (*imv1.NodeInfoResponse, error) {
	out := &imv1.NodeInfoResponse{NodeName: s.NodeName, Version: s.Version}
	for _, d := range s.DataDirs {
		st, err := StatDataDir(d)
		if err != nil {
			return nil, status.Errorf(codes.Internal, "data directory %s: %v", d, err)
		}
		out.DataDirs = append(out.DataDirs, &imv1.DataDir{Path: st.Path, TotalBytes: st.Total, AvailableBytes: st.Available, Filesystem: st.Filesystem})
	}
	return out, nil
}
