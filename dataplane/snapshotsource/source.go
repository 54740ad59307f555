// Package snapshotsource reads a replica's snapshot through the replica's
// read-only control calls (Info, SnapshotList, SnapshotChanges,
// SnapshotRead) and backs it up with the backup store: the data path of
// `cairn-data backup` and of the manager's Backup reconciler. With a
// DataPort it reads the snapshot's bytes over the replica's data port
// instead (dataconn's snapshot read, see dataport.go), where a replica
// serves them for a fraction of the CPU. It never sets an epoch or writes
// to the replica, so it runs beside the engine serving the volume.
package snapshotsource

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"time"

	"google.golang.org/grpc"

	replicav1 "github.com/cairn-io/cairn/dataplane/api/replica/v1"
	"github.com/cairn-io/cairn/dataplane/backupstore"
	"github.com/cairn-io/cairn/dataplane/replica"
	"github.com/cairn-io/cairn/dataplane/replica/replicaserver"
)

// SnapshotLabel is the label a backup keeps with the name of the replica
// snapshot it was taken from; an incremental backup checks its base
// backup's against the base snapshot.
const SnapshotLabel = "cairn.io/snapshot"

// ErrReply is a reply from the replica that breaks the API's rules.
var ErrReply = errors.New("invalid reply from the replica")

// DefaultTimeout bounds each call to the replica unless Client.Timeout says
// otherwise.
const DefaultTimeout = 2 * time.Minute

// Client is a read-only client of one replica's control API.
type Client struct {
	cc  *grpc.ClientConn
	ctl replicav1.ReplicaServiceClient
	// Timeout bounds each call (DefaultTimeout if zero).
	Timeout time.Duration
	// OnReply, if set, is called after each call the replica answered:
	// a caller watching for a stalled transfer sees the change map's
	// pages, not only the data, as progress.
	OnReply func()
	// DataPort, if set before the first read, makes the Reader read the
	// snapshot's bytes over the replica's data port, falling back to
	// SnapshotRead when the port does not serve them (see dataport.go).
	DataPort *DataPort

	data dataPath
}

// Dial connects to the replica's control address with opts (transport
// credentials among them).
func Dial(addr string, opts ...grpc.DialOption) (*Client, error) {
	// A reply holds at most replicaserver.MaxSnapshotRead bytes of data or
	// MaxChangeRanges ranges; 16 MiB leaves room and bounds what a
	// misbehaving replica can make this process take per call.
	opts = append(slices.Clip(opts), grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(16<<20)))
	cc, err := grpc.NewClient(addr, opts...)
	if err != nil {
		return nil, fmt.Errorf("replica %s: %w", addr, err)
	}
	return &Client{cc: cc, ctl: replicav1.NewReplicaServiceClient(cc)}, nil
}

// Close closes the connections.
func (c *Client) Close() {
	c.data.close()
	_ = c.cc.Close()
}

// replied tells OnReply, if set, that a call was answered.
func (c *Client) replied() {
	if c.OnReply != nil {
		c.OnReply()
	}
}

func (c *Client) call(ctx context.Context) (context.Context, context.CancelFunc) {
	t := c.Timeout
	if t <= 0 {
		t = DefaultTimeout
	}
	return context.WithTimeout(ctx, t)
}

// Size is the replica's size, checked to be whole replica blocks and at
// most the largest volume the store takes.
func (c *Client) Size(ctx context.Context) (int64, error) {
	ctx, cancel := c.call(ctx)
	defer cancel()
	in, err := c.ctl.Info(ctx, &replicav1.InfoRequest{})
	if err != nil {
		return 0, fmt.Errorf("replica info: %w", err)
	}
	c.replied()
	if in.Size <= 0 || in.Size%replica.BlockSize != 0 || in.Size > backupstore.MaxVolumeSize {
		return 0, fmt.Errorf("%w: replica reports size %d: not a multiple of %d up to %d", ErrReply, in.Size, replica.BlockSize, backupstore.MaxVolumeSize)
	}
	return in.Size, nil
}

// HasSnapshot reports whether the replica's chain holds snapshot name.
func (c *Client) HasSnapshot(ctx context.Context, name string) (bool, error) {
	ctx, cancel := c.call(ctx)
	defer cancel()
	resp, err := c.ctl.SnapshotList(ctx, &replicav1.SnapshotListRequest{})
	if err != nil {
		return false, fmt.Errorf("replica snapshot list: %w", err)
	}
	c.replied()
	return slices.ContainsFunc(resp.GetSnapshots(), func(s *replicav1.Snapshot) bool { return s.GetName() == name }), nil
}

// Changes lists the byte ranges where snapshot snap may differ from base
// (from zeros without one), page by page, rounded out to whole backup
// blocks of bs and merged as they come so that the list stays at most one
// range per backup block however fragmented the replica's layers are.
func (c *Client) Changes(ctx context.Context, snap, base string, size, bs int64) ([]backupstore.Range, error) {
	out := []backupstore.Range{} // not nil: nil would mean the whole volume
	for off := int64(0); off < size; {
		resp, err := c.changesPage(ctx, snap, base, off, size-off)
		if err != nil {
			return nil, err
		}
		next, err := checkChangesPage(resp, off, size)
		if err != nil {
			return nil, err
		}
		for _, r := range resp.Ranges {
			out = appendBlockRange(out, r.Offset, r.Length, bs, size)
		}
		off = next
	}
	return out, nil
}

func (c *Client) changesPage(ctx context.Context, snap, base string, off, n int64) (*replicav1.SnapshotChangesResponse, error) {
	ctx, cancel := c.call(ctx)
	defer cancel()
	resp, err := c.ctl.SnapshotChanges(ctx, &replicav1.SnapshotChangesRequest{Snapshot: snap, Base: base, Offset: off, Length: n, MaxRanges: replica.MaxChangeRanges})
	if err != nil {
		return nil, fmt.Errorf("replica changes of %s since %q: %w", snap, base, err)
	}
	c.replied()
	return resp, nil
}

// checkChangesPage checks one page of ranges asked from off: sorted,
// disjoint, inside [off, next), and next past off and at most size. It
// returns next.
func checkChangesPage(resp *replicav1.SnapshotChangesResponse, off, size int64) (int64, error) {
	next := resp.GetNextOffset()
	if next <= off || next > size {
		return 0, fmt.Errorf("%w: changes continue at %d after %d (size %d)", ErrReply, next, off, size)
	}
	pos := off
	for _, r := range resp.GetRanges() {
		if r.GetOffset() < pos || r.GetLength() <= 0 || r.GetOffset() > next-r.GetLength() {
			return 0, fmt.Errorf("%w: changed range %d+%d outside [%d, %d) or out of order", ErrReply, r.GetOffset(), r.GetLength(), pos, next)
		}
		pos = r.GetOffset() + r.GetLength()
	}
	return next, nil
}

// appendBlockRange adds [off, off+n) rounded out to blocks of bs (and cut
// at size) to rs, merging it into the last range when they overlap or
// touch. Ranges must come in increasing order.
func appendBlockRange(rs []backupstore.Range, off, n, bs, size int64) []backupstore.Range {
	lo := off / bs * bs
	hi := min((off+n+bs-1)/bs*bs, size)
	if k := len(rs) - 1; k >= 0 && rs[k].Offset+rs[k].Length >= lo {
		rs[k].Length = max(rs[k].Length, hi-rs[k].Offset)
		return rs
	}
	return append(rs, backupstore.Range{Offset: lo, Length: hi - lo})
}

// Reader returns the view at snapshot snap of a replica of size bytes as
// an io.ReaderAt (the backup store's source): holes come back as zeros
// without crossing the network. Every read runs under ctx.
func (c *Client) Reader(ctx context.Context, snap string, size int64) io.ReaderAt {
	return &snapshotReader{ctx: ctx, c: c, snap: snap, size: size}
}

type snapshotReader struct {
	ctx  context.Context
	c    *Client
	snap string
	size int64
}

func (s *snapshotReader) ReadAt(p []byte, off int64) (int, error) {
	if off < 0 || off > s.size {
		return 0, fmt.Errorf("read at %d outside the volume's %d bytes", off, s.size)
	}
	n := min(int64(len(p)), s.size-off)
	var err error
	if dc := s.c.dataClient(s.ctx, s.snap); dc != nil {
		err = s.readData(dc, p[:n], off)
	} else {
		err = s.readControl(p[:n], off)
	}
	if err != nil {
		return 0, err
	}
	if n < int64(len(p)) {
		return int(n), io.EOF
	}
	return int(n), nil
}

// blockSpan rounds [off, off+n) out to whole replica blocks: the replica
// serves block-aligned spans, and the volume's size is whole blocks, so
// the rounded span stays inside it.
func blockSpan(off, n int64) (lo, hi int64) {
	return off / replica.BlockSize * replica.BlockSize, (off + n + replica.BlockSize - 1) / replica.BlockSize * replica.BlockSize
}

// readControl fills p with the view from off through SnapshotRead calls.
func (s *snapshotReader) readControl(p []byte, off int64) error {
	clear(p) // the replica sends no holes
	lo, hi := blockSpan(off, int64(len(p)))
	for pos := lo; pos < hi; pos += replicaserver.MaxSnapshotRead {
		if err := s.readSpan(p, off, pos, min(hi-pos, replicaserver.MaxSnapshotRead)); err != nil {
			return err
		}
	}
	return nil
}

// readSpan reads [pos, pos+n) of the view and copies what overlaps p
// (which holds the bytes from off).
func (s *snapshotReader) readSpan(p []byte, off, pos, n int64) error {
	ctx, cancel := s.c.call(s.ctx)
	defer cancel()
	resp, err := s.c.ctl.SnapshotRead(ctx, &replicav1.SnapshotReadRequest{Snapshot: s.snap, Offset: pos, Length: n})
	if err != nil {
		return fmt.Errorf("read snapshot %s at %d: %w", s.snap, pos, err)
	}
	s.c.replied()
	for _, e := range resp.GetExtents() {
		eo, ed := e.GetOffset(), e.GetData()
		if eo < pos || eo > pos+n-int64(len(ed)) {
			return fmt.Errorf("%w: extent %d+%d outside the span read %d+%d", ErrReply, eo, len(ed), pos, n)
		}
		// Copy the overlap of [eo, eo+len) with [off, off+len(p)).
		from, to := max(eo, off), min(eo+int64(len(ed)), off+int64(len(p)))
		if from < to {
			copy(p[from-off:to-off], ed[from-eo:to-eo])
		}
	}
	return nil
}
