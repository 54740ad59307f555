package replicaserver

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"strconv"
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	replicav1 "github.com/cairn-io/cairn/dataplane/api/replica/v1"
	"github.com/cairn-io/cairn/dataplane/replica"
)

// maxSources bounds the connections a replica keeps to the replicas it
// pulls rebuild data from. One rebuild at a time copies into a replica,
// from one source, so a few cover a source that moved (a new address
// after its instance manager was replaced) with room to spare.
const maxSources = 4

// Sources are the connections LayerPull reads over, one per source
// control address, the least recently used closed beyond maxSources.
type Sources struct {
	tls *tls.Config // nil: plain, as the control API is served

	mu     sync.Mutex
	conns  map[string]*sourceConn
	tick   uint64
	closed bool
}

type sourceConn struct {
	cc   *grpc.ClientConn
	ctl  replicav1.ReplicaServiceClient
	used uint64
	id   string // the replica ID last seen at the address; under Sources.mu
}

// NewSources returns the connections of a replica server that pulls
// rebuild data, with mutual TLS when tlsCfg is set (the control API's
// client side: the certificate the instance manager's processes share).
func NewSources(tlsCfg *tls.Config) *Sources {
	return &Sources{tls: tlsCfg, conns: map[string]*sourceConn{}}
}

// checkSource accepts HOST:PORT with a port in 1..65535: a source is
// another replica's control API over TCP.
func checkSource(addr string) error {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("source %q is not HOST:PORT: %w", addr, err)
	}
	if p, err := strconv.Atoi(port); host == "" || err != nil || p < 1 || p > 65535 {
		return fmt.Errorf("source %q is not HOST:PORT with a port in 1..65535", addr)
	}
	return nil
}

// get returns the connection to the source at addr, connecting (lazily,
// as gRPC does) on first use.
func (s *Sources) get(addr string) (*sourceConn, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, replica.ErrClosed
	}
	s.tick++
	if c, ok := s.conns[addr]; ok {
		c.used = s.tick
		return c, nil
	}
	creds := insecure.NewCredentials()
	if s.tls != nil {
		creds = credentials.NewTLS(s.tls)
	}
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(creds),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(MaxControlMessage), grpc.MaxCallSendMsgSize(MaxControlMessage), grpc.ForceCodecV2(newCodec())),
		// As the engine's client: windows that hold a 4 MiB reply
		// whole, buffers that read it in few system calls.
		grpc.WithInitialWindowSize(16<<20), grpc.WithInitialConnWindowSize(32<<20),
		grpc.WithWriteBufferSize(1<<20), grpc.WithReadBufferSize(1<<20))
	if err != nil {
		return nil, err
	}
	if len(s.conns) >= maxSources {
		var oldest string
		for a, c := range s.conns {
			if oldest == "" || c.used < s.conns[oldest].used {
				oldest = a
			}
		}
		s.conns[oldest].cc.Close()
		delete(s.conns, oldest)
	}
	c := &sourceConn{cc: cc, ctl: replicav1.NewReplicaServiceClient(cc), used: s.tick}
	s.conns[addr] = c
	return c, nil
}

// check makes sure the replica at c is replica id, asking it (Info) the
// first time and whenever another ID was seen there: an address can
// reach another replica than the engine meant (another node's loopback,
// a port reused after the source moved).
func (s *Sources) check(ctx context.Context, c *sourceConn, addr, id string) error {
	s.mu.Lock()
	seen := c.id
	s.mu.Unlock()
	if seen == id {
		return nil
	}
	in, err := c.ctl.Info(ctx, &replicav1.InfoRequest{})
	if err != nil {
		return sourceErr(addr, err)
	}
	if in.GetId() != id {
		return status.Errorf(codes.Unavailable, "source %s is replica %q, not %q", addr, in.GetId(), id)
	}
	s.mu.Lock()
	c.id = id
	s.mu.Unlock()
	return nil
}

// Close closes every connection; pulls fail from then on.
func (s *Sources) Close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closed = true
	for a, c := range s.conns {
		c.cc.Close()
		delete(s.conns, a)
	}
}

// LayerPull reads the range from the source replica and writes it into
// this replica's layer, as the engine would with SnapshotRead and
// LayerWrite: the data goes from replica to replica instead of through
// the engine. The request is checked before anything is dialed or read.
func (c *Control) LayerPull(ctx context.Context, req *replicav1.LayerPullRequest) (*replicav1.LayerPullResponse, error) {
	if c.Sources == nil {
		return nil, status.Error(codes.Unimplemented, "this replica server pulls no rebuild data (it has no connection settings for other replicas)")
	}
	n := req.GetLength()
	if n < 0 || n > MaxSnapshotRead {
		return nil, status.Errorf(codes.InvalidArgument, "layer pulls are limited to 0..%d bytes per call, got %d", MaxSnapshotRead, n)
	}
	if err := checkSource(req.GetSource()); err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	if req.GetSourceId() == "" {
		return nil, status.Error(codes.InvalidArgument, "the source's replica ID is required")
	}
	src, err := c.Sources.get(req.GetSource())
	if err != nil {
		return nil, grpcErr(err)
	}
	if err := c.Sources.check(ctx, src, req.GetSource(), req.GetSourceId()); err != nil {
		return nil, err
	}
	resp, err := src.ctl.SnapshotRead(ctx, &replicav1.SnapshotReadRequest{Snapshot: req.GetSnapshot(), Offset: req.GetOffset(), Length: n, LayerOnly: req.GetLayerOnly()})
	if err != nil {
		return nil, sourceErr(req.GetSource(), err)
	}
	// The data is written (or the call failed) before this returns, and
	// the replica keeps none of it: its buffer can take the next pull.
	defer releaseSnapshotRead(resp)
	ext := resp.GetExtents()
	for _, x := range ext {
		if x.GetOffset() < req.GetOffset() || x.GetOffset()+int64(len(x.GetData())) > req.GetOffset()+n {
			return nil, status.Errorf(codes.Internal, "source %s answered with bytes %d..%d, outside the %d..%d asked for",
				req.GetSource(), x.GetOffset(), x.GetOffset()+int64(len(x.GetData())), req.GetOffset(), req.GetOffset()+n)
		}
	}
	if !req.GetLayerOnly() && !whole(ext, req.GetOffset(), n) {
		// The view is written whole: this replica may hold stale data
		// where the source has holes.
		buf := make([]byte, n)
		for _, x := range ext {
			copy(buf[x.GetOffset()-req.GetOffset():], x.GetData())
		}
		ext = []*replicav1.Extent{{Offset: req.GetOffset(), Data: buf}}
	}
	f := c.Replica.At(req.GetEpoch())
	var written int64
	for _, x := range ext {
		if err := f.WriteLayer(req.GetSnapshot(), x.GetData(), x.GetOffset()); err != nil {
			return nil, grpcErr(err)
		}
		written += int64(len(x.GetData()))
	}
	return &replicav1.LayerPullResponse{Written: written}, nil
}

// whole reports whether ext is one extent of [off, off+n).
func whole(ext []*replicav1.Extent, off, n int64) bool {
	return len(ext) == 1 && ext[0].GetOffset() == off && int64(len(ext[0].GetData())) == n
}

// sourceErr is a failed read from a pull's source: its own refusals keep
// their code, named as the source's; a source this replica cannot reach
// (or that took too long) is UNAVAILABLE, so the engine copies the data
// itself instead.
func sourceErr(addr string, err error) error {
	st := status.Convert(err)
	switch st.Code() {
	case codes.Unavailable, codes.DeadlineExceeded, codes.Unknown:
		return status.Errorf(codes.Unavailable, "source %s cannot be read from this replica: %s", addr, st.Message())
	case codes.Canceled:
		return status.Error(codes.Canceled, st.Message())
	}
	if errors.Is(err, context.Canceled) {
		return status.Error(codes.Canceled, err.Error())
	}
	return status.Errorf(st.Code(), "source %s: %s", addr, st.Message())
}
