// Package replicaclient connects the engine to a replica process: data
// over dataconn, control over gRPC. It implements engine.Replica.
//
// Every change a client makes to the replica's chain or size carries the
// epoch the client last set through SetEpoch (before that, the replica's
// epoch when the client connected), and the replica refuses it unless that
// epoch is still its own: an engine that a newer one fenced out cannot
// change the replica any more. The engine passes no epoch to these calls;
// the client keeps it.
package replicaclient

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
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
	"github.com/cairn-io/cairn/dataplane/dataconn"
	"github.com/cairn-io/cairn/dataplane/engine"
	"github.com/cairn-io/cairn/dataplane/internal/rebuildcodec"
	"github.com/cairn-io/cairn/dataplane/replica/replicaserver"
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
	// Owner identifies the engine to the replicas when it sets their epoch:
	// a replica accepts its current epoch again only from the owner that
	// set it, so two engines that reach the same epoch number cannot both
	// hold it. Default: one made up per Dialer (per Dial when dialing
	// directly) from the host name, the process ID and random bytes.
	Owner string
	// ControlTLS, when set, is the mutual TLS of the replicas' control
	// API; default: none (loopback tests).
	ControlTLS *tls.Config
}

// controlCreds are the transport credentials of a control connection.
func controlCreds(cfg *tls.Config) grpc.DialOption {
	if cfg == nil {
		return grpc.WithTransportCredentials(insecure.NewCredentials())
	}
	return grpc.WithTransportCredentials(credentials.NewTLS(cfg))
}

// Errors. Callers test them with errors.Is.
var (
	// ErrStaleEpoch: the replica refused a call for its epoch (the error
	// is a *StaleEpochError). A newer engine has taken the replica over.
	ErrStaleEpoch = errors.New("stale epoch")
	// ErrNoControlAPI: the data address answers but nothing serves the
	// replica's control API at its control address (the error is a
	// *NoControlAPIError).
	ErrNoControlAPI = errors.New("no replica control API")
	// ErrControlTLS: the replica's control address answered, but the TLS
	// handshake with it failed (the error is a *ControlTLSError).
	ErrControlTLS = errors.New("replica control API TLS handshake failed")
)

// StaleEpochError is a call the replica refused for its epoch. It is
// ErrStaleEpoch for errors.Is, and keeps the gRPC status
// (FAILED_PRECONDITION) for status.Code.
type StaleEpochError struct {
	// Request is the epoch the call carried; Replica the replica's.
	Request, Replica uint64
	// OtherOwner: a SetEpoch of the replica's current epoch, which
	// another engine set.
	OtherOwner bool
	status     *status.Status
}

func (e *StaleEpochError) Error() string              { return e.status.Message() }
func (e *StaleEpochError) Is(target error) bool       { return target == ErrStaleEpoch }
func (e *StaleEpochError) GRPCStatus() *status.Status { return e.status }

// newOwner makes up an owner for Options.Owner.
func newOwner() string {
	b := make([]byte, 6)
	rand.Read(b)
	host, _ := os.Hostname()
	return fmt.Sprintf("%s/%d/%s", host, os.Getpid(), hex.EncodeToString(b))
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

// Dialer returns an engine.Dialer with these options. Every client it
// dials has the same owner (Options.Owner): one engine.
func Dialer(opts Options) engine.Dialer {
	if opts.Owner == "" {
		opts.Owner = newOwner()
	}
	return func(ctx context.Context, addr string) (engine.Replica, error) { return Dial(ctx, addr, opts) }
}

// Dial connects to the replica at addr: its data address, then its
// control API, whose Info gives the epoch the client's changes carry
// until it sets one. A control address where nothing answers fails the
// dial with ErrNoControlAPI, naming the address and the flag; a replica
// that refuses the data connection's authentication (another volume's,
// or the wrong key) fails it with engine.ErrRefused too.
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
	if opts.Owner == "" {
		opts.Owner = newOwner()
	}
	dataAddr, ctlAddr, err := SplitAddress(addr)
	if err != nil {
		return nil, err
	}
	cc, err := grpc.NewClient(ctlAddr, append(rebuildcodec.DialOptions(), controlCreds(opts.ControlTLS),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(16<<20), grpc.MaxCallSendMsgSize(16<<20), grpc.ForceCodecV2(newCodec())))...)
	if err != nil {
		return nil, fmt.Errorf("control %s: %w", ctlAddr, err)
	}
	network, address := dataconn.SplitNetwork(dataAddr)
	d, err := dataconn.Dial(ctx, network, address, opts.Data)
	if err != nil {
		cc.Close()
		if errors.Is(err, dataconn.ErrAuthRefused) { // another volume's replica, or the wrong key: for good
			err = fmt.Errorf("%w: %w", engine.ErrRefused, err)
		}
		return nil, err
	}
	c := &Client{data: d, cc: cc, ctl: replicav1.NewReplicaServiceClient(cc), timeout: opts.ControlTimeout, quick: opts.QuickTimeout, owner: opts.Owner, ctlAddr: ctlAddr}
	if err := c.probe(ctx, addr, ctlAddr, opts.ControlTLS != nil); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

// probe reads the replica's epoch from its control API. When that fails
// although the data address answered, the error says why and what to
// do: a replica started without --control-listen otherwise shows up as a
// bare gRPC dial error on a port the user never gave (data + 1), and a
// certificate one side refuses as "connection error" from gRPC.
func (c *Client) probe(ctx context.Context, addr, ctlAddr string, useTLS bool) error {
	qctx, cancel := c.qctx(ctx)
	defer cancel()
	in, err := c.ctl.Info(qctx, &replicav1.InfoRequest{})
	switch {
	case err == nil:
		c.epoch = in.Epoch
		return nil
	case status.Code(err) == codes.Unavailable:
		msg := status.Convert(err).Message()
		closed := closedByPeer(msg)
		if why := tlsFailure(msg, useTLS, closed); why != "" {
			return &ControlTLSError{Replica: addr, Control: ctlAddr, Why: why, Err: err}
		}
		return &NoControlAPIError{Replica: addr, Control: ctlAddr, Derived: !strings.Contains(addr, ","), Closed: closed, Err: err}
	}
	return fmt.Errorf("replica %s: control API on %s: %w", addr, ctlAddr, err)
}

// closedByPeer says whether a gRPC connection error's message is of a
// connection accepted and then closed by the other side (not refused).
func closedByPeer(msg string) bool {
	for _, s := range []string{"server preface", "EOF", "connection reset by peer", "broken pipe"} {
		if strings.Contains(msg, s) {
			return true
		}
	}
	return false
}

// tlsFailure says, from a gRPC connection error's message, what failed
// in the TLS handshake of a client with TLS (useTLS), or "" if the
// handshake is not what failed; closed: the other side accepted the
// connection and closed it. Go's crypto/tls and gRPC give no typed
// error across the connection's goroutines, so the message is what there
// is to go by.
func tlsFailure(msg string, useTLS, closed bool) string {
	if !useTLS {
		return ""
	}
	switch {
	case strings.Contains(msg, "first record does not look like a TLS handshake"):
		return "it serves no TLS, while this client connects with TLS: give both sides TLS (the instance manager's --tls-cert and --tls-client-ca) or neither"
	case strings.Contains(msg, "failed to verify certificate"):
		return "this client does not accept the certificate it presented: the CA that issued the instance manager's serving certificate must be among the client's trusted CAs, and the certificate must be current and name the address's host"
	case strings.Contains(msg, "remote error: tls:"):
		return "it refused this client's certificate: " + needClientCert
	case strings.Contains(msg, "authentication handshake failed"):
		return "the TLS handshake failed"
	case closed:
		// TLS 1.3: the client's handshake ends before the server has
		// checked its certificate, so a refusal can reach it as the
		// connection closing under its first write or read.
		return "it closed the connection at the TLS handshake, as it does when it refuses the client's certificate: " + needClientCert
	}
	return ""
}

// needClientCert is what to check when a control API refuses the
// client's certificate, however the refusal reached the client.
const needClientCert = "the client needs a current certificate from a CA the instance manager trusts (its --tls-client-ca file)"

// ControlTLSError: the replica's control address answered and the TLS
// handshake with it failed. It is ErrControlTLS for errors.Is and
// unwraps to the gRPC error.
type ControlTLSError struct {
	// Replica is the address the client was given; Control the control
	// address dialed; Why what failed and what to check.
	Replica, Control, Why string
	Err                   error
}

func (e *ControlTLSError) Error() string {
	return fmt.Sprintf("replica %s: TLS with its control API on %s failed: %s (%v)", e.Replica, e.Control, e.Why, e.Err)
}

func (e *ControlTLSError) Is(target error) bool { return target == ErrControlTLS }
func (e *ControlTLSError) Unwrap() error        { return e.Err }

// NoControlAPIError: the replica's data address answered, its control
// address did not. It is ErrNoControlAPI for errors.Is and unwraps to the
// gRPC error.
type NoControlAPIError struct {
	// Replica is the address the engine was given; Control the control
	// address dialed.
	Replica, Control string
	// Derived: Control is the data port + 1 (Replica is HOST:PORT).
	Derived bool
	// Closed: something accepted this plain client's connection on
	// Control and closed it without a word of gRPC, as a control API
	// that requires TLS does.
	Closed bool
	Err    error
}

func (e *NoControlAPIError) Error() string {
	switch {
	case e.Closed:
		return fmt.Sprintf("replica %s answers on its data address, and its control address %s accepted this client's plain connection and closed it, as a control API that requires TLS does: give the client the control API's TLS (Cairn's CA and a client certificate from it) (%v)",
			e.Replica, e.Control, e.Err)
	case e.Derived:
		return fmt.Sprintf("replica %s has no control API on %s (the data port + 1, where the engine looks when given HOST:PORT): start the replica with --control-listen %s, or give the engine DATA,CONTROL (%v)",
			e.Replica, e.Control, e.Control, e.Err)
	}
	return fmt.Sprintf("replica %s answers on its data address, but nothing serves its control API on %s: is it started with --control-listen %s? (%v)",
		e.Replica, e.Control, e.Control, e.Err)
}

func (e *NoControlAPIError) Is(target error) bool { return target == ErrNoControlAPI }
func (e *NoControlAPIError) Unwrap() error        { return e.Err }

// Client is a connected replica.
type Client struct {
	data    *dataconn.Client
	cc      *grpc.ClientConn
	ctl     replicav1.ReplicaServiceClient
	timeout time.Duration
	quick   time.Duration
	owner   string
	// ctlAddr is the control API's address, where another replica pulls
	// rebuild data from this one (PullLayer).
	ctlAddr string

	mu sync.Mutex
	// epoch is what the client's changes carry: the epoch it last set, or
	// the replica's when it connected.
	epoch uint64
	// setting is closed when the SetEpoch in flight returns; nil if none.
	setting chan struct{}
}

var (
	_ engine.Replica      = (*Client)(nil)
	_ engine.WriteStarter = (*Client)(nil)
	_ engine.LayerPuller  = (*Client)(nil)
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

// mapErr turns gRPC codes the engine cares about into its sentinels, and
// a refusal for the epoch into a *StaleEpochError.
func mapErr(err error) error {
	if err == nil {
		return nil
	}
	st := status.Convert(err)
	if st.Code() == codes.NotFound {
		return fmt.Errorf("%w: %s", engine.ErrSnapshotNotFound, st.Message())
	}
	if st.Code() == codes.FailedPrecondition {
		for _, d := range st.Details() {
			if se, ok := d.(*replicav1.StaleEpoch); ok {
				return &StaleEpochError{Request: se.RequestEpoch, Replica: se.ReplicaEpoch, OtherOwner: se.OtherOwner, status: st}
			}
		}
	}
	return err
}

// fenced makes a change to the replica carrying the client's epoch. A
// change refused for its epoch while this client's own SetEpoch moved the
// replica to a newer one is sent again with that epoch: the engine bumps
// its epoch while a rebuild copies or a deletion merges, and a refused
// change did nothing. Any other refusal is returned (ErrStaleEpoch).
func (c *Client) fenced(ctx context.Context, call func(epoch uint64) error) error {
	c.mu.Lock()
	epoch := c.epoch
	c.mu.Unlock()
	for {
		err := mapErr(call(epoch))
		if !errors.Is(err, ErrStaleEpoch) {
			return err
		}
		next, werr := c.settledEpoch(ctx)
		if werr != nil || next == epoch {
			return err
		}
		epoch = next
	}
}

// settledEpoch waits for a SetEpoch in flight, if any, and returns the
// client's epoch.
func (c *Client) settledEpoch(ctx context.Context) (uint64, error) {
	if err := c.lockSettled(ctx); err != nil {
		return 0, err
	}
	defer c.mu.Unlock()
	return c.epoch, nil
}

// lockSettled locks c.mu once no SetEpoch is in flight; on error (ctx
// ended first) it is not held.
func (c *Client) lockSettled(ctx context.Context) error {
	c.mu.Lock()
	for c.setting != nil {
		ch := c.setting
		c.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		}
		c.mu.Lock()
	}
	return nil
}

func (c *Client) Info(ctx context.Context) (engine.ReplicaInfo, error) {
	ctx, cancel := c.qctx(ctx)
	defer cancel()
	in, err := c.ctl.Info(ctx, &replicav1.InfoRequest{})
	if err != nil {
		return engine.ReplicaInfo{}, err
	}
	out := engine.ReplicaInfo{ID: in.Id, Rebuilding: in.Rebuilding, Size: in.Size, Epoch: in.Epoch, EpochMembers: in.EpochMembers, DirtyKeptSince: in.DirtyKeptSince, HeadBytes: in.HeadBytes}
	if d := in.Dirty; d != nil {
		out.DirtyRegionSize, out.DirtyCount, out.Dirty = d.RegionSize, d.Count, d.Bits
	}
	for _, s := range in.Snapshots {
		out.Snapshots = append(out.Snapshots, engine.SnapshotInfo{Name: s.Name, Parent: s.Parent,
			Created: time.Unix(0, s.CreatedUnixNano), UserCreated: s.UserCreated, DataBytes: s.DataBytes})
	}
	return out, nil
}

// SetEpoch sets the replica's epoch as this client's owner; once it
// succeeds, the client's changes carry that epoch. A replica at a newer
// epoch, or at this one set by another owner, refuses (ErrStaleEpoch).
func (c *Client) SetEpoch(ctx context.Context, st engine.EpochState) error {
	if err := c.lockSettled(ctx); err != nil { // one at a time
		return err
	}
	done := make(chan struct{})
	c.setting = done
	c.mu.Unlock()
	qctx, cancel := c.qctx(ctx)
	defer cancel()
	req := &replicav1.SetEpochRequest{Epoch: st.Epoch, Owner: c.owner, Degraded: st.Degraded,
		Rebuilding: st.Rebuilding, Members: st.Members}
	for _, m := range st.Mark {
		req.Mark = append(req.Mark, &replicav1.ByteRange{Offset: m.Off, Length: m.N})
	}
	_, err := c.ctl.SetEpoch(qctx, req)
	c.mu.Lock()
	if err == nil {
		c.epoch = st.Epoch
	}
	c.setting = nil
	c.mu.Unlock()
	close(done)
	return mapErr(err)
}

func (c *Client) Snapshot(ctx context.Context, s engine.SnapshotInfo) error {
	ctx, cancel := c.qctx(ctx)
	defer cancel()
	return c.fenced(ctx, func(epoch uint64) error {
		req := &replicav1.SnapshotCreateRequest{Name: s.Name, UserCreated: s.UserCreated, Epoch: epoch}
		if !s.Created.IsZero() {
			req.CreatedUnixNano = s.Created.UnixNano()
		}
		_, err := c.ctl.SnapshotCreate(ctx, req)
		return err
	})
}

func (c *Client) DeleteSnapshot(ctx context.Context, name string) error {
	return c.fenced(ctx, func(epoch uint64) error {
		_, err := c.ctl.SnapshotDelete(ctx, &replicav1.SnapshotDeleteRequest{Name: name, Epoch: epoch})
		return err
	})
}

func (c *Client) Revert(ctx context.Context, name string) error {
	ctx, cancel := c.cctx(ctx)
	defer cancel()
	return c.fenced(ctx, func(epoch uint64) error {
		_, err := c.ctl.SnapshotRevert(ctx, &replicav1.SnapshotRevertRequest{Name: name, Epoch: epoch})
		return err
	})
}

func (c *Client) Expand(ctx context.Context, size int64) error {
	ctx, cancel := c.cctx(ctx)
	defer cancel()
	return c.fenced(ctx, func(epoch uint64) error {
		_, err := c.ctl.Expand(ctx, &replicav1.ExpandRequest{Size: size, Epoch: epoch})
		return err
	})
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
	return c.fenced(ctx, func(epoch uint64) error {
		_, err := c.ctl.LayerWrite(ctx, &replicav1.LayerWriteRequest{Snapshot: name, Offset: off, Data: p, Epoch: epoch})
		return err
	})
}

// PullLayer has the replica copy the chunk from src itself (LayerPull),
// reading src's control API. ErrNoPull when src is not a *Client whose
// control address a replica can pull from (replicaserver.CheckSource),
// when the replica predates LayerPull (UNIMPLEMENTED), or when it says
// it cannot read from src (UNAVAILABLE with a PullSourceUnreadable
// detail): the engine then copies the data itself. Any other failure,
// the replica's own included, is returned as it is.
func (c *Client) PullLayer(ctx context.Context, src engine.Replica, srcID, name string, off, n int64, layerOnly bool) (int64, error) {
	s, ok := src.(*Client)
	if !ok {
		return 0, fmt.Errorf("%w: the source is reached another way than a replica client", engine.ErrNoPull)
	}
	if err := replicaserver.CheckSource(s.ctlAddr); err != nil {
		return 0, fmt.Errorf("%w: %w", engine.ErrNoPull, err)
	}
	ctx, cancel := c.cctx(ctx)
	defer cancel()
	var written int64
	err := c.fenced(ctx, func(epoch uint64) error {
		resp, err := c.ctl.LayerPull(ctx, &replicav1.LayerPullRequest{Snapshot: name, Offset: off, Length: n, LayerOnly: layerOnly,
			Source: s.ctlAddr, SourceId: srcID, Epoch: epoch})
		written = resp.GetWritten()
		return err
	})
	if noPull(err) {
		return 0, fmt.Errorf("%w: %s", engine.ErrNoPull, status.Convert(err).Message())
	}
	return written, err
}

// noPull says whether a LayerPull failed for a reason the engine copies
// the chunk itself for: the replica predates the call, or it could not
// read the source.
func noPull(err error) bool {
	st := status.Convert(err)
	switch st.Code() {
	case codes.Unimplemented:
		return true
	case codes.Unavailable:
		for _, d := range st.Details() {
			if _, ok := d.(*replicav1.PullSourceUnreadable); ok {
				return true
			}
		}
	}
	return false
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
	return c.fenced(ctx, func(epoch uint64) error {
		req.Epoch = epoch
		_, err := c.ctl.ReplaceChain(ctx, req)
		return err
	})
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
