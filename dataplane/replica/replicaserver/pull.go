package replicaserver

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	replicav1 "github.com/cairn-io/cairn/dataplane/api/replica/v1"
	"github.com/cairn-io/cairn/dataplane/grpcalive"
	"github.com/cairn-io/cairn/dataplane/internal/rebuildcodec"
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
}

// NewSources returns the connections of a replica server that pulls
// rebuild data, with mutual TLS when tlsCfg is set (the control API's
// client side: the certificate the instance manager's processes share).
func NewSources(tlsCfg *tls.Config) *Sources {
	return &Sources{tls: tlsCfg, conns: map[string]*sourceConn{}}
}

// Bounds of a LayerPull's strings, far above what they hold (an address,
// a replica ID of 16 hex digits).
const (
	maxSourceAddress = 256
	maxSourceID      = 128
)

// CheckSource accepts what a pull's source must be: HOST:PORT with a
// host and a port in 1..65535, another replica's control API over TCP.
// The engine checks the same before it asks a replica to pull.
func CheckSource(addr string) error {
	if len(addr) > maxSourceAddress {
		return fmt.Errorf("source address of %d bytes, at most %d", len(addr), maxSourceAddress)
	}
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
// as gRPC does) on first use. The address is dialed as the TCP address
// it is (passthrough), never read as a resolver scheme ("unix:...").
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
	cc, err := grpc.NewClient("passthrough:///"+addr, append(rebuildcodec.DialOptions(), grpc.WithTransportCredentials(creds), grpcalive.Dial(),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(MaxControlMessage), grpc.MaxCallSendMsgSize(MaxControlMessage), grpc.ForceCodecV2(newCodec())))...)
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

// readTimeout is how long a pull gives its read from the source, when its
// caller set no deadline.
const readTimeout = 30 * time.Second

// readDeadline is the context a pull reads from its source under: ahead
// of its caller's deadline by a quarter of the time left (1 to 5 s), so a
// source that does not answer in time fails the pull as the source's
// fault (the engine then copies the chunk itself) before the caller's
// own deadline fails the whole call.
func readDeadline(ctx context.Context) (context.Context, context.CancelFunc) {
	d, ok := ctx.Deadline()
	if !ok {
		return context.WithTimeout(ctx, readTimeout)
	}
	margin := min(max(time.Until(d)/4, time.Second), 5*time.Second)
	return context.WithDeadline(ctx, d.Add(-margin))
}

// LayerPull reads the range from the source replica and writes it into
// this replica's layer, as the engine would with SnapshotRead and
// LayerWrite: the data goes from replica to replica instead of through
// the engine. The request, and whether the write would be taken (the
// epoch, the snapshot, the range), are checked before anything is
// dialed or read; the source must be the replica the engine named, asked
// before each read and checked by the read itself.
func (c *Control) LayerPull(ctx context.Context, req *replicav1.LayerPullRequest) (*replicav1.LayerPullResponse, error) {
	if c.Sources == nil {
		return nil, status.Error(codes.Unimplemented, "this replica server pulls no rebuild data (it has no connection settings for other replicas)")
	}
	n := req.GetLength()
	if n < 0 || n > MaxSnapshotRead {
		return nil, status.Errorf(codes.InvalidArgument, "layer pulls are limited to 0..%d bytes per call, got %d", MaxSnapshotRead, n)
	}
	if err := CheckSource(req.GetSource()); err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	if id := req.GetSourceId(); id == "" || len(id) > maxSourceID {
		return nil, status.Errorf(codes.InvalidArgument, "the source's replica ID is required, at most %d bytes (got %d)", maxSourceID, len(id))
	}
	f := c.Replica.At(req.GetEpoch())
	if err := f.CheckLayerWrite(req.GetSnapshot(), req.GetOffset(), n); err != nil {
		return nil, grpcErr(err)
	}
	src, err := c.Sources.get(req.GetSource())
	if err != nil {
		return nil, grpcErr(err)
	}
	rctx, cancel := readDeadline(ctx)
	defer cancel()
	in, err := src.ctl.Info(rctx, &replicav1.InfoRequest{})
	if err != nil {
		return nil, sourceErr(ctx, req.GetSource(), err)
	}
	if in.GetId() != req.GetSourceId() {
		return nil, unreadable(req.GetSource(), fmt.Sprintf("it is replica %.64q, not %.64q", in.GetId(), req.GetSourceId()))
	}
	// The response is this call's own, so that its buffer is given back
	// whatever the call returns (the reply may have been decoded into it
	// before the call failed). Nothing keeps the data once written.
	resp := &replicav1.SnapshotReadResponse{}
	defer releaseSnapshotRead(resp)
	err = src.cc.Invoke(rctx, replicav1.ReplicaService_SnapshotRead_FullMethodName, &replicav1.SnapshotReadRequest{
		Snapshot: req.GetSnapshot(), Offset: req.GetOffset(), Length: n, LayerOnly: req.GetLayerOnly(), ExpectedId: req.GetSourceId()}, resp)
	if err != nil {
		return nil, sourceErr(ctx, req.GetSource(), err)
	}
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

// unreadable is a pull refused because its source could not be read from
// here: UNAVAILABLE with a PullSourceUnreadable detail, which the engine
// takes as the reason to copy the data itself.
func unreadable(addr, why string) error {
	st := status.Newf(codes.Unavailable, "source %s cannot be read from this replica: %s", addr, why)
	if d, err := st.WithDetails(&replicav1.PullSourceUnreadable{Source: addr}); err == nil {
		st = d
	}
	return st.Err()
}

// sourceErr is a failed call to a pull's source. The source's own
// refusals keep their code, named as the source's (a replica at the
// address that is not the one asked for is unreadable); a source this
// replica cannot reach or that does not answer in time, or a connection
// closed under the call while the caller still waits, is unreadable; the
// caller's own cancellation is CANCELED.
func sourceErr(ctx context.Context, addr string, err error) error {
	st := status.Convert(err)
	switch {
	case ctx.Err() != nil:
		return status.FromContextError(ctx.Err()).Err()
	case st.Code() == codes.FailedPrecondition && strings.HasPrefix(st.Message(), notExpected):
		return unreadable(addr, st.Message())
	case st.Code() == codes.Unavailable, st.Code() == codes.DeadlineExceeded, st.Code() == codes.Canceled, st.Code() == codes.Unknown:
		return unreadable(addr, st.Message())
	}
	return status.Errorf(st.Code(), "source %s: %s", addr, st.Message())
}
