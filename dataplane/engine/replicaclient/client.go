// Package replicaclient connects the engine to a replica process: data
// over dataconn, control over gRPC. It implements engine.Replica.
package replicaclient

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	replicav1 "github.com/cairn-io/cairn/dataplane/api/replica/v1"
	"github.com/cairn-io/cairn/dataplane/dataconn"
	"github.com/cairn-io/cairn/dataplane/engine"
)

// Options configure Dial.
type Options struct {
	// Data are the dataconn client options (connections, timeouts).
	Data dataconn.ClientOptions
	// ControlTimeout bounds bulk control calls (rebuild reads and writes,
	// checksums, revert, expand). Default 30s.
	ControlTimeout time.Duration
	// QuickTimeout bounds the calls a failover waits on (SetEpoch, Info,
	// snapshot create), so a hung replica cannot stall the volume for
	// long. Default: Data.RequestTimeout, or 10s.
	QuickTimeout time.Duration
}

// SplitAddress parses a replica address: "HOST:PORT" means data on PORT and
// control on PORT+1 (the port pair an instance manager allocates);
// "DATA,CONTROL" gives both explicitly.
func SplitAddress(addr string) (data, control string, err error) {
	if d, c, ok := strings.Cut(addr, ","); ok {
		return d, c, nil
	}
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return "", "", fmt.Errorf("replica address %q: %w", addr, err)
	}
	p, err := strconv.Atoi(port)
	if err != nil || p <= 0 || p >= 65535 {
		return "", "", fmt.Errorf("replica address %q: the port must be 1..65534 (control listens on the next port)", addr)
	}
	return addr, net.JoinHostPort(host, strconv.Itoa(p+1)), nil
}

// Dialer returns an engine.Dialer with these options.
func Dialer(opts Options) engine.Dialer {
	return func(ctx context.Context, addr string) (engine.Replica, error) { return Dial(ctx, addr, opts) }
}

// Dial connects to the replica at addr.
func Dial(ctx context.Context, addr string, opts Options) (*Client, error) {
	if opts.ControlTimeout <= 0 {
		opts.ControlTimeout = 30 * time.Second
	}
	if opts.QuickTimeout <= 0 {
		opts.QuickTimeout = opts.Data.RequestTimeout
	}
	if opts.QuickTimeout <= 0 {
		opts.QuickTimeout = 10 * time.Second
	}
	dataAddr, ctlAddr, err := SplitAddress(addr)
	if err != nil {
		return nil, err
	}
	cc, err := grpc.NewClient(ctlAddr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(16<<20), grpc.MaxCallSendMsgSize(16<<20)))
	if err != nil {
		return nil, fmt.Errorf("control %s: %w", ctlAddr, err)
	}
	network, address := dataconn.SplitNetwork(dataAddr)
	d, err := dataconn.Dial(ctx, network, address, opts.Data)
	if err != nil {
		cc.Close()
		return nil, err
	}
	return &Client{data: d, cc: cc, ctl: replicav1.NewReplicaServiceClient(cc), timeout: opts.ControlTimeout, quick: opts.QuickTimeout}, nil
}

// Client is a connected replica.
type Client struct {
	data    *dataconn.Client
	cc      *grpc.ClientConn
	ctl     replicav1.ReplicaServiceClient
	timeout time.Duration
	quick   time.Duration
}

var (
	_ engine.Replica      = (*Client)(nil)
	_ engine.WriteStarter = (*Client)(nil)
)

func (c *Client) ReadAt(ctx context.Context, p []byte, off int64) error {
	return c.data.ReadAt(ctx, p, off)
}
func (c *Client) WriteAt(ctx context.Context, p []byte, off int64, fua bool) error {
	return c.data.WriteAt(ctx, p, off, fua)
}
func (c *Client) StartWriteAt(p []byte, off int64, fua bool) engine.Waiter {
	return c.data.StartWriteAt(p, off, fua)
}
func (c *Client) SharedWrites() uint64                          { return c.data.SharedWrites() }
func (c *Client) Flush(ctx context.Context) error               { return c.data.Flush(ctx) }
func (c *Client) Unmap(ctx context.Context, off, n int64) error { return c.data.Unmap(ctx, off, n) }
func (c *Client) SetRequestEpoch(e uint64)                      { c.data.SetEpoch(e) }
func (c *Client) Failed() <-chan struct{}                       { return c.data.Done() }
func (c *Client) Close() error                                  { c.data.Close(); return c.cc.Close() }
func (c *Client) cctx(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, c.timeout)
}

func (c *Client) qctx(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, c.quick)
}

// mapErr turns gRPC codes the engine cares about into its sentinels.
func mapErr(err error) error {
	if status.Code(err) == codes.NotFound {
		return fmt.Errorf("%w: %s", engine.ErrSnapshotNotFound, status.Convert(err).Message())
	}
	return err
}

func (c *Client) Info(ctx context.Context) (engine.ReplicaInfo, error) {
	ctx, cancel := c.qctx(ctx)
	defer cancel()
	in, err := c.ctl.Info(ctx, &replicav1.InfoRequest{})
	if err != nil {
		return engine.ReplicaInfo{}, err
	}
	out := engine.ReplicaInfo{ID: in.Id, Rebuilding: in.Rebuilding, Size: in.Size, Epoch: in.Epoch, HeadBytes: in.HeadBytes}
	if d := in.Dirty; d != nil {
		out.DirtyRegionSize, out.DirtyCount, out.Dirty = d.RegionSize, d.Count, d.Bits
	}
	for _, s := range in.Snapshots {
		out.Snapshots = append(out.Snapshots, engine.SnapshotInfo{Name: s.Name, Parent: s.Parent,
			Created: time.Unix(0, s.CreatedUnixNano), UserCreated: s.UserCreated, DataBytes: s.DataBytes})
	}
	return out, nil
}

func (c *Client) SetEpoch(ctx context.Context, epoch uint64, degraded, rebuilding bool) error {
	ctx, cancel := c.qctx(ctx)
	defer cancel()
	_, err := c.ctl.SetEpoch(ctx, &replicav1.SetEpochRequest{Epoch: epoch, Degraded: degraded, Rebuilding: rebuilding})
	return err
}

func (c *Client) Snapshot(ctx context.Context, s engine.SnapshotInfo) error {
	ctx, cancel := c.qctx(ctx)
	defer cancel()
	req := &replicav1.SnapshotCreateRequest{Name: s.Name, UserCreated: s.UserCreated}
	if !s.Created.IsZero() {
		req.CreatedUnixNano = s.Created.UnixNano()
	}
	_, err := c.ctl.SnapshotCreate(ctx, req)
	return err
}

func (c *Client) DeleteSnapshot(ctx context.Context, name string) error {
	_, err := c.ctl.SnapshotDelete(ctx, &replicav1.SnapshotDeleteRequest{Name: name})
	return mapErr(err)
}

func (c *Client) Revert(ctx context.Context, name string) error {
	ctx, cancel := c.cctx(ctx)
	defer cancel()
	_, err := c.ctl.SnapshotRevert(ctx, &replicav1.SnapshotRevertRequest{Name: name})
	return mapErr(err)
}

func (c *Client) Expand(ctx context.Context, size int64) error {
	ctx, cancel := c.cctx(ctx)
	defer cancel()
	_, err := c.ctl.Expand(ctx, &replicav1.ExpandRequest{Size: size})
	return err
}

func (c *Client) ReadSnapshot(ctx context.Context, name string, off, n int64) ([]engine.Extent, error) {
	return c.readExtents(ctx, &replicav1.SnapshotReadRequest{Snapshot: name, Offset: off, Length: n})
}

func (c *Client) ReadLayer(ctx context.Context, name string, off, n int64) ([]engine.Extent, error) {
	return c.readExtents(ctx, &replicav1.SnapshotReadRequest{Snapshot: name, Offset: off, Length: n, LayerOnly: true})
}

func (c *Client) readExtents(ctx context.Context, req *replicav1.SnapshotReadRequest) ([]engine.Extent, error) {
	ctx, cancel := c.cctx(ctx)
	defer cancel()
	resp, err := c.ctl.SnapshotRead(ctx, req)
	if err != nil {
		return nil, mapErr(err)
	}
	out := make([]engine.Extent, 0, len(resp.Extents))
	for _, x := range resp.Extents {
		out = append(out, engine.Extent{Offset: x.Offset, Data: x.Data})
	}
	return out, nil
}

func (c *Client) WriteLayer(ctx context.Context, name string, p []byte, off int64) error {
	ctx, cancel := c.cctx(ctx)
	defer cancel()
	_, err := c.ctl.LayerWrite(ctx, &replicav1.LayerWriteRequest{Snapshot: name, Offset: off, Data: p})
	return mapErr(err)
}

func (c *Client) SyncLayers(ctx context.Context) error {
	ctx, cancel := c.cctx(ctx)
	defer cancel()
	_, err := c.ctl.SyncLayers(ctx, &replicav1.SyncLayersRequest{})
	return err
}

func (c *Client) ReplaceChain(ctx context.Context, snaps []engine.SnapshotInfo) error {
	ctx, cancel := c.cctx(ctx)
	defer cancel()
	req := &replicav1.ReplaceChainRequest{}
	for _, s := range snaps {
		req.Snapshots = append(req.Snapshots, &replicav1.Snapshot{Name: s.Name, CreatedUnixNano: s.Created.UnixNano(), UserCreated: s.UserCreated})
	}
	_, err := c.ctl.ReplaceChain(ctx, req)
	return mapErr(err)
}

func (c *Client) Checksum(ctx context.Context, name string, off, n int64) (uint32, error) {
	return c.checksum(ctx, &replicav1.ChecksumRequest{Snapshot: name, Offset: off, Length: n})
}

func (c *Client) LayerChecksum(ctx context.Context, name string, off, n int64) (uint32, error) {
	return c.checksum(ctx, &replicav1.ChecksumRequest{Snapshot: name, Offset: off, Length: n, LayerOnly: true})
}

func (c *Client) checksum(ctx context.Context, req *replicav1.ChecksumRequest) (uint32, error) {
	ctx, cancel := c.cctx(ctx)
	defer cancel()
	resp, err := c.ctl.Checksum(ctx, req)
	if err != nil {
		return 0, mapErr(err)
	}
	return resp.Crc32C, nil
}
