package replicaserver

import (
	"context"
	"net"
	"path/filepath"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	replicav1 "github.com/cairn-io/cairn/dataplane/api/replica/v1"
	"github.com/cairn-io/cairn/dataplane/replica"
)

// TestRebuildRPCCodes: the rebuild calls refuse bad requests with the
// gRPC code that says why, and a refused ReplaceChain leaves the data.
func TestRebuildRPCCodes(t *testing.T) {
	r, err := replica.Open(filepath.Join(t.TempDir(), "r"), replica.Options{Size: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	data, ctl := listen(t), listen(t)
	run := Start(r, Options{Data: data, Control: ctl})
	defer run.Kill()
	conn, err := grpc.NewClient(ctl.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	c := replicav1.NewReplicaServiceClient(conn)
	ctx := context.Background()
	if _, err := r.WriteAt(make([]byte, 4096), 0); err != nil {
		t.Fatal(err)
	}
	if _, err := c.SnapshotCreate(ctx, &replicav1.SnapshotCreateRequest{Name: "s1"}); err != nil {
		t.Fatal(err)
	}
	chain := []*replicav1.Snapshot{{Name: "a"}, {Name: "b"}}
	for _, tc := range []struct {
		what string
		call func() error
		want codes.Code
	}{
		{"ReplaceChain on a replica not marked rebuilding", func() error {
			_, err := c.ReplaceChain(ctx, &replicav1.ReplaceChainRequest{Snapshots: chain})
			return err
		}, codes.FailedPrecondition},
		{"layer read of a missing snapshot", func() error {
			_, err := c.SnapshotRead(ctx, &replicav1.SnapshotReadRequest{Snapshot: "nope", Length: 4096, LayerOnly: true})
			return err
		}, codes.NotFound},
		{"layer read past the end", func() error {
			_, err := c.SnapshotRead(ctx, &replicav1.SnapshotReadRequest{Snapshot: "s1", Offset: 1 << 20, Length: 4096, LayerOnly: true})
			return err
		}, codes.OutOfRange},
		{"layer checksum unaligned", func() error {
			_, err := c.Checksum(ctx, &replicav1.ChecksumRequest{Snapshot: "s1", Offset: 1, Length: 4096, LayerOnly: true})
			return err
		}, codes.InvalidArgument},
	} {
		if got := status.Code(tc.call()); got != tc.want {
			t.Errorf("%s: %v, want %v", tc.what, got, tc.want)
		}
	}
	if in, _ := r.Info(); len(in.Snapshots) != 1 || in.Snapshots[0].DataBytes != 4096 {
		t.Fatalf("a refused request changed the replica: %+v", in.Snapshots)
	}
	if _, err := c.SetEpoch(ctx, &replicav1.SetEpochRequest{Epoch: 2, Rebuilding: true}); err != nil {
		t.Fatal(err)
	}
	_, err = c.ReplaceChain(ctx, &replicav1.ReplaceChainRequest{Snapshots: append(chain, &replicav1.Snapshot{Name: "a"})})
	if status.Code(err) != codes.InvalidArgument {
		t.Fatalf("ReplaceChain naming a snapshot twice: %v", err)
	}
	if _, err := c.ReplaceChain(ctx, &replicav1.ReplaceChainRequest{Snapshots: chain}); err != nil {
		t.Fatal(err)
	}
	list, err := c.SnapshotList(ctx, &replicav1.SnapshotListRequest{})
	if err != nil || len(list.Snapshots) != 2 || list.Snapshots[1].Name != "b" || list.Snapshots[1].Parent != "a" {
		t.Fatalf("after ReplaceChain: %v %v", list, err)
	}
}

func listen(t *testing.T) net.Listener {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	return l
}
