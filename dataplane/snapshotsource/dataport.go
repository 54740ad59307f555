package snapshotsource

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/go-logr/logr"

	replicav1 "github.com/cairn-io/cairn/dataplane/api/replica/v1"
	"github.com/cairn-io/cairn/dataplane/dataconn"
	"github.com/cairn-io/cairn/dataplane/replica"
)

// DataPort says how to reach a replica's data port (dataconn), where the
// replica serves a snapshot's bytes as raw frames read into the caller's
// buffers (dataconn.OpSnapshotRead): for a replica, a read from its layer
// files and a write to the socket, against SnapshotRead's extents
// allocated per call, checksummed for a rebuild's verification and
// framed by gRPC. The connections authenticate as the volume's engine
// does: the volume's key and, where the data port serves TLS, TLS.
//
// The first read checks that the port serves snapshot reads (one block of
// the snapshot). When it does not (a replica from before them closes the
// connection at the op it does not know; one without them answers
// unsupported; a port that cannot be reached or refuses the key), the
// Client reads through SnapshotRead instead and DataPortInUse says why:
// the backup is the same, only dearer.
type DataPort struct {
	// Address is the data port's address ("host:port", or "unix:PATH");
	// empty: the address the replica reports in Info.
	Address string
	// Key is the volume's key (dataconn.ClientOptions.Key); nil for a
	// data port that asks for none.
	Key []byte
	// TLS, when the data port serves TLS, is the client's configuration
	// (dataconn.ClientOptions.TLS).
	TLS *tls.Config
	// Conns is how many connections to open. Default 2.
	Conns int
	// Logger is told when reads fall back to SnapshotRead, and why.
	Logger logr.Logger
	// CheckTimeout bounds the dial and the first read that decide
	// whether the port is used (default DefaultDataPortCheck): a port
	// that drops packets (a network policy that lets the control port
	// through and not this one) falls back soon, not after the calls'
	// own timeout, which a caller's stall watch may be shorter than.
	CheckTimeout time.Duration
}

// DefaultDataPortCheck is DataPort.CheckTimeout's default.
const DefaultDataPortCheck = 15 * time.Second

// dataReadMax bounds one snapshot read on the data port: the payload
// bound both ends of a data port keep by default.
const dataReadMax = dataconn.DefaultMaxPayload

// dataPath is a Client's data-port connection, opened and checked on the
// first read and kept until Close.
type dataPath struct {
	mu    sync.Mutex
	tried bool
	dc    *dataconn.Client // nil: reads go through SnapshotRead
	err   error            // why the data port is not used
}

func (d *dataPath) close() {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.dc != nil {
		_ = d.dc.Close() // always nil
		d.dc = nil
	}
}

// DataPortInUse reports whether snapshot reads go over the data port;
// when a DataPort was set and is not used, err says why. Before the first
// read it reports false and nil.
func (c *Client) DataPortInUse() (bool, error) {
	c.data.mu.Lock()
	defer c.data.mu.Unlock()
	return c.data.dc != nil, c.data.err
}

// dataClient returns the data-port client reads of snapshot snap go
// through, or nil for SnapshotRead. The first call opens and checks it.
func (c *Client) dataClient(ctx context.Context, snap string) *dataconn.Client {
	if c.DataPort == nil {
		return nil
	}
	c.data.mu.Lock()
	defer c.data.mu.Unlock()
	if !c.data.tried {
		c.data.tried = true
		c.data.dc, c.data.err = c.openDataPort(ctx, snap)
		if c.data.err != nil {
			c.DataPort.Logger.Info("snapshot reads go through the control API: the replica's data port does not serve them", "reason", c.data.err.Error())
		}
	}
	return c.data.dc
}

// openDataPort dials the data port and reads the first block of snap.
func (c *Client) openDataPort(ctx context.Context, snap string) (*dataconn.Client, error) {
	addr := c.DataPort.Address
	if addr == "" {
		var err error
		if addr, err = c.dataAddress(ctx); err != nil {
			return nil, err
		}
	}
	timeout := c.Timeout
	if timeout <= 0 {
		timeout = DefaultTimeout
	}
	conns := c.DataPort.Conns
	if conns <= 0 {
		conns = 2
	}
	check := c.DataPort.CheckTimeout
	if check <= 0 {
		check = DefaultDataPortCheck
	}
	dctx, cancel := context.WithTimeout(ctx, check)
	defer cancel()
	network, address := dataconn.SplitNetwork(addr)
	// Requests and liveness pings get the control calls' bound: a
	// backup on a loaded node waits for a slow replica rather than fail
	// the attempt on the engine's 5 s ping bound.
	dc, err := dataconn.Dial(dctx, network, address, dataconn.ClientOptions{
		Conns: conns, Key: c.DataPort.Key, TLS: c.DataPort.TLS, RequestTimeout: timeout, PingTimeout: timeout, Logger: c.DataPort.Logger,
	})
	if err != nil {
		return nil, err
	}
	if err := dc.ReadSnapshotAt(dctx, make([]byte, replica.BlockSize), snap, 0); err != nil {
		_ = dc.Close() // always nil
		return nil, fmt.Errorf("data port %s: snapshot read: %w", addr, err)
	}
	c.replied()
	return dc, nil
}

// dataAddress is the data address the replica reports.
func (c *Client) dataAddress(ctx context.Context) (string, error) {
	ctx, cancel := c.call(ctx)
	defer cancel()
	in, err := c.ctl.Info(ctx, &replicav1.InfoRequest{})
	if err != nil {
		return "", fmt.Errorf("replica info: %w", err)
	}
	if in.GetDataAddress() == "" {
		return "", errors.New("the replica reports no data address")
	}
	return in.GetDataAddress(), nil
}

// readData fills p with the view from off over the data port: the blocks
// p covers whole are read straight into it, up to dataReadMax at a time;
// a block it covers in part (at an unaligned edge) through a scratch
// block.
func (s *snapshotReader) readData(dc *dataconn.Client, p []byte, off int64) error {
	lo, hi := blockSpan(off, int64(len(p)))
	end := off + int64(len(p))
	var scratch []byte
	for pos := lo; pos < hi; {
		if pos < off || pos+replica.BlockSize > end {
			if scratch == nil {
				scratch = make([]byte, replica.BlockSize)
			}
			if err := s.readSnapshot(dc, scratch, pos); err != nil {
				return err
			}
			from, to := max(pos, off), min(pos+replica.BlockSize, end)
			copy(p[from-off:to-off], scratch[from-pos:to-pos])
			pos += replica.BlockSize
			continue
		}
		n := min((end-pos)/replica.BlockSize*replica.BlockSize, dataReadMax)
		if err := s.readSnapshot(dc, p[pos-off:pos-off+n], pos); err != nil {
			return err
		}
		pos += n
	}
	return nil
}

func (s *snapshotReader) readSnapshot(dc *dataconn.Client, p []byte, pos int64) error {
	if err := dc.ReadSnapshotAt(s.ctx, p, s.snap, pos); err != nil {
		return fmt.Errorf("read snapshot %s at %d over the data port: %w", s.snap, pos, err)
	}
	s.c.replied()
	return nil
}
