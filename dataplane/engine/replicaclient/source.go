package replicaclient

import (
	"context"
	"crypto/tls"
	"fmt"
	"time"

	"google.golang.org/grpc"

	replicav1 "github.com/cairn-io/cairn/dataplane/api/replica/v1"
	"github.com/cairn-io/cairn/dataplane/engine"
)

// Source is a read-only connection to another volume's replica, through
// its control API only: what a clone reads (engine.CloneSource). It never
// sets an epoch or writes, so it does not disturb the engine that serves
// that volume, if one does.
type Source struct {
	cc      *grpc.ClientConn
	ctl     replicav1.ReplicaServiceClient
	timeout time.Duration
}

var _ engine.CloneSource = (*Source)(nil)

// DialSource connects to the replica control API at controlAddr, with
// mutual TLS when tlsCfg is set. Each call is bounded by timeout (default
// 30 s).
func DialSource(controlAddr string, timeout time.Duration, tlsCfg *tls.Config) (*Source, error) {
	if timeout <= 0 {
		timeout = 30 * time.Second
	}
	cc, err := grpc.NewClient(controlAddr, controlCreds(tlsCfg),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(16<<20), grpc.MaxCallSendMsgSize(16<<20)))
	if err != nil {
		return nil, fmt.Errorf("control %s: %w", controlAddr, err)
	}
	return &Source{cc: cc, ctl: replicav1.NewReplicaServiceClient(cc), timeout: timeout}, nil
}

// Info reports the replica's size and snapshots.
func (s *Source) Info(ctx context.Context) (engine.ReplicaInfo, error) {
	ctx, cancel := context.WithTimeout(ctx, s.timeout)
	defer cancel()
	in, err := s.ctl.Info(ctx, &replicav1.InfoRequest{})
	if err != nil {
		return engine.ReplicaInfo{}, mapErr(err)
	}
	out := engine.ReplicaInfo{ID: in.Id, Rebuilding: in.Rebuilding, Size: in.Size, Epoch: in.Epoch, HeadBytes: in.HeadBytes}
	for _, x := range in.Snapshots {
		out.Snapshots = append(out.Snapshots, engine.SnapshotInfo{Name: x.Name, Parent: x.Parent,
			Created: time.Unix(0, x.CreatedUnixNano), UserCreated: x.UserCreated, DataBytes: x.DataBytes})
	}
	return out, nil
}

// ReadSnapshot returns the data extents of the view at snapshot name.
func (s *Source) ReadSnapshot(ctx context.Context, name string, off, n int64) ([]engine.Extent, error) {
	ctx, cancel := context.WithTimeout(ctx, s.timeout)
	defer cancel()
	resp, err := s.ctl.SnapshotRead(ctx, &replicav1.SnapshotReadRequest{Snapshot: name, Offset: off, Length: n})
	if err != nil {
		return nil, mapErr(err)
	}
	out := make([]engine.Extent, 0, len(resp.Extents))
	for _, x := range resp.Extents {
		out = append(out, engine.Extent{Offset: x.Offset, Data: x.Data})
	}
	return out, nil
}

// Checksum is the CRC-32C of the view at snapshot name.
func (s *Source) Checksum(ctx context.Context, name string, off, n int64) (uint32, error) {
	ctx, cancel := context.WithTimeout(ctx, s.timeout)
	defer cancel()
	resp, err := s.ctl.Checksum(ctx, &replicav1.ChecksumRequest{Snapshot: name, Offset: off, Length: n})
	if err != nil {
		return 0, mapErr(err)
	}
	return resp.Crc32C, nil
}

// Close ends the connection.
func (s *Source) Close() error { return s.cc.Close() }
