// Package imserver puts an instancemanager.Supervisor on the network: it
// implements the gRPC InstanceManagerService, converting between the
// protocol's messages and the supervisor's types, and maps the
// supervisor's errors to gRPC codes.
package imserver

import (
	"context"
	"errors"
	"fmt"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	imv1 "github.com/cairn-io/cairn/dataplane/api/instancemanager/v1"
	im "github.com/cairn-io/cairn/dataplane/instancemanager"
	"github.com/cairn-io/cairn/dataplane/internal/ready"
)

// Server implements the gRPC InstanceManagerService over a Supervisor.
type Server struct {
	imv1.UnimplementedInstanceManagerServiceServer
	S        *im.Supervisor
	NodeName string
	Version  string
	DataDirs []string
}

var stateToProto = map[im.State]imv1.ProcessState{
	im.StateStarting: imv1.ProcessState_PROCESS_STATE_STARTING,
	im.StateRunning:  imv1.ProcessState_PROCESS_STATE_RUNNING,
	im.StateStopping: imv1.ProcessState_PROCESS_STATE_STOPPING,
	im.StateStopped:  imv1.ProcessState_PROCESS_STATE_STOPPED,
	im.StateError:    imv1.ProcessState_PROCESS_STATE_ERROR,
}

var endpointKindToProto = map[ready.EndpointKind]imv1.EndpointKind{
	ready.EndpointBlockDevice: imv1.EndpointKind_ENDPOINT_KIND_BLOCK_DEVICE,
	ready.EndpointLoopDevice:  imv1.EndpointKind_ENDPOINT_KIND_LOOP_DEVICE,
	ready.EndpointNBDSocket:   imv1.EndpointKind_ENDPOINT_KIND_NBD_SOCKET,
}

var frontendToProto = map[im.Frontend]imv1.Frontend{im.FrontendFUSE: imv1.Frontend_FRONTEND_FUSE, im.FrontendNBD: imv1.Frontend_FRONTEND_NBD}
var nbdKernelToProto = map[im.NBDKernel]imv1.NBDKernel{
	im.NBDKernelAuto: imv1.NBDKernel_NBD_KERNEL_AUTO, im.NBDKernelOn: imv1.NBDKernel_NBD_KERNEL_ON, im.NBDKernelOff: imv1.NBDKernel_NBD_KERNEL_OFF}

// ToProto converts a Process.
func ToProto(p im.Process) *imv1.Process {
	out := &imv1.Process{Name: p.Name, State: stateToProto[p.State], Args: p.Args, Pid: int32(p.PID),
		ExitCode: int32(p.ExitCode), Error: p.Error, LogTail: p.LogTail, Waiting: p.Waiting,
		DataAddress: p.DataAddress, LocalDataAddress: p.LocalDataAddress, ControlAddress: p.ControlAddress, SizeBytes: p.SizeBytes}
	switch spec := p.Spec.(type) {
	case im.EngineSpec:
		out.Kind = imv1.ProcessKind_PROCESS_KIND_ENGINE
		out.Spec = &imv1.Process_Engine{Engine: engineSpecToProto(spec)}
	case im.ReplicaSpec:
		out.Kind = imv1.ProcessKind_PROCESS_KIND_REPLICA
		out.Spec = &imv1.Process_Replica{Replica: &imv1.ReplicaSpec{DataDir: spec.DataDir, SizeBytes: spec.SizeBytes,
			DirectIo: spec.DirectIO, UnixSocket: spec.UnixSocket}}
	}
	if p.Endpoint.Path != "" {
		out.Endpoint = &imv1.Endpoint{Path: p.Endpoint.Path, Kind: endpointKindToProto[p.Endpoint.Kind],
			Socket: p.Endpoint.Socket, Fallback: p.Endpoint.Fallback, Resumed: p.Endpoint.Resumed}
	}
	for _, port := range p.Ports {
		out.Ports = append(out.Ports, int32(port))
	}
	return out
}

func engineSpecToProto(e im.EngineSpec) *imv1.EngineSpec {
	out := &imv1.EngineSpec{VolumeName: e.VolumeName, SizeBytes: e.SizeBytes, Wanted: int32(e.Wanted),
		Frontend: frontendToProto[e.Frontend], NbdKernel: nbdKernelToProto[e.NBDKernel], ReplicaTimeoutMs: e.ReplicaTimeout.Milliseconds(),
		AcceptLostMembers: e.AcceptLostMembers}
	for _, r := range e.Replicas {
		out.Replicas = append(out.Replicas, &imv1.ReplicaAddress{Data: r.Data, Control: r.Control})
	}
	return out
}

// specFromProto converts a create request's spec; unknown enum values are
// refused here, so the supervisor sees only known ones.
func specFromProto(req *imv1.ProcessCreateRequest) (im.Spec, error) {
	switch spec := req.GetSpec().(type) {
	case *imv1.ProcessCreateRequest_Replica:
		r := spec.Replica
		return im.ReplicaSpec{DataDir: r.GetDataDir(), SizeBytes: r.GetSizeBytes(), DirectIO: r.GetDirectIo(), UnixSocket: r.GetUnixSocket(),
			AuthKey: string(r.GetAuthKey())}, nil
	case *imv1.ProcessCreateRequest_Engine:
		e := spec.Engine
		if len(e.GetReplicas()) > im.MaxReplicas {
			return nil, fmt.Errorf("engine with %d replicas: give 1 to %d", len(e.GetReplicas()), im.MaxReplicas)
		}
		out := im.EngineSpec{VolumeName: e.GetVolumeName(), SizeBytes: e.GetSizeBytes(), Wanted: int(e.GetWanted()),
			ReplicaTimeout: time.Duration(e.GetReplicaTimeoutMs()) * time.Millisecond, AuthKey: string(e.GetAuthKey()),
			EncryptionKey: string(e.GetEncryptionKey()), EncryptionKeyCheck: e.GetEncryptionKeyCheck(), AcceptLostMembers: e.GetAcceptLostMembers()}
		if e.GetReplicaTimeoutMs() < 0 || e.GetReplicaTimeoutMs() > int64(time.Hour/time.Millisecond) {
			return nil, fmt.Errorf("replica timeout %d ms: use 0 (the default) up to 600000", e.GetReplicaTimeoutMs())
		}
		switch e.GetFrontend() {
		case imv1.Frontend_FRONTEND_UNSPECIFIED, imv1.Frontend_FRONTEND_FUSE:
			out.Frontend = im.FrontendFUSE
		case imv1.Frontend_FRONTEND_NBD:
			out.Frontend = im.FrontendNBD
		default:
			return nil, fmt.Errorf("frontend %v: use FRONTEND_FUSE or FRONTEND_NBD", e.GetFrontend())
		}
		switch e.GetNbdKernel() {
		case imv1.NBDKernel_NBD_KERNEL_AUTO:
			out.NBDKernel = im.NBDKernelAuto
		case imv1.NBDKernel_NBD_KERNEL_ON:
			out.NBDKernel = im.NBDKernelOn
		case imv1.NBDKernel_NBD_KERNEL_OFF:
			out.NBDKernel = im.NBDKernelOff
		default:
			return nil, fmt.Errorf("nbd kernel %v: use NBD_KERNEL_AUTO, _ON or _OFF", e.GetNbdKernel())
		}
		for _, r := range e.GetReplicas() {
			out.Replicas = append(out.Replicas, im.ReplicaAddress{Data: r.GetData(), Control: r.GetControl()})
		}
		return out, nil
	}
	return nil, errors.New("give an engine or a replica spec")
}

func grpcErr(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, im.ErrInvalid):
		return status.Error(codes.InvalidArgument, err.Error())
	case errors.Is(err, im.ErrNotFound):
		return status.Error(codes.NotFound, err.Error())
	case errors.Is(err, im.ErrNoPorts):
		return status.Error(codes.ResourceExhausted, err.Error())
	case errors.Is(err, im.ErrShuttingDown):
		return status.Error(codes.Unavailable, err.Error())
	case errors.Is(err, im.ErrConflict), errors.Is(err, im.ErrInUse):
		return status.Error(codes.FailedPrecondition, err.Error())
	case errors.Is(err, im.ErrStillStopping):
		if errors.Is(err, context.Canceled) {
			return status.Error(codes.Canceled, err.Error())
		}
		return status.Error(codes.DeadlineExceeded, err.Error())
	}
	return status.Error(codes.Internal, err.Error())
}

func (s *Server) ProcessCreate(_ context.Context, req *imv1.ProcessCreateRequest) (*imv1.Process, error) {
	spec, err := specFromProto(req)
	if err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	p, err := s.S.Create(req.GetName(), spec)
	if errors.Is(err, im.ErrExists) {
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

func (s *Server) ReplicaDataDelete(_ context.Context, req *imv1.ReplicaDataDeleteRequest) (*imv1.ReplicaDataDeleteResponse, error) {
	return &imv1.ReplicaDataDeleteResponse{}, grpcErr(s.S.DeleteData(req.GetDataDir()))
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
		st, err := im.StatDataDir(d)
		if err != nil {
			return nil, status.Errorf(codes.Internal, "data directory %s: %v", d, err)
		}
		out.DataDirs = append(out.DataDirs, &imv1.DataDir{Path: st.Path, TotalBytes: st.Total, AvailableBytes: st.Available, Filesystem: st.Filesystem})
	}
	return out, nil
}
