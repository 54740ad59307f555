package replicaserver

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	replicav1 "github.com/cairn-io/cairn/dataplane/api/replica/v1"
	"github.com/cairn-io/cairn/dataplane/replica"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// TestRebuildRPCCodes: the rebuild calls refuse bad requests with the
// gRPC code that says why, and a refused ReplaceChain leaves the data.
func TestRebuildRPCCodes(t *testing.T) {
	r, c := serve(t)
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
	_, err := c.ReplaceChain(ctx, &replicav1.ReplaceChainRequest{Snapshots: append(chain, &replicav1.Snapshot{Name: "a"}), Epoch: 2})
	if status.Code(err) != codes.InvalidArgument {
		t.Fatalf("ReplaceChain naming a snapshot twice: %v", err)
	}
	if _, err := c.ReplaceChain(ctx, &replicav1.ReplaceChainRequest{Snapshots: chain, Epoch: 2}); err != nil {
		t.Fatal(err)
	}
	list, err := c.SnapshotList(ctx, &replicav1.SnapshotListRequest{})
	if err != nil || len(list.Snapshots) != 2 || list.Snapshots[1].Name != "b" || list.Snapshots[1].Parent != "a" {
		t.Fatalf("after ReplaceChain: %v %v", list, err)
	}
}

// serve starts a new replica with its control API and returns it and a
// client of that API.
func serve(t *testing.T) (*replica.Replica, replicav1.ReplicaServiceClient) {
	t.Helper()
	r, err := replica.Open(filepath.Join(t.TempDir(), "r"), replica.Options{Size: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	data, ctl := listen(t), listen(t)
	run := Start(r, Options{Data: data, Control: ctl})
	t.Cleanup(run.Kill)
	conn, err := grpc.NewClient(ctl.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return r, replicav1.NewReplicaServiceClient(conn)
}

// TestStaleEpochRefusedWithDetail: a change carrying an epoch that is not
// the replica's, and a SetEpoch going back or taking the replica's epoch
// from its owner, are FAILED_PRECONDITION with a StaleEpoch detail naming
// both epochs, and change nothing; at the current epoch a change goes
// through.
func TestStaleEpochRefusedWithDetail(t *testing.T) {
	r, c := serve(t)
	ctx := context.Background()
	if _, err := c.SnapshotCreate(ctx, &replicav1.SnapshotCreateRequest{Name: "s1"}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.SetEpoch(ctx, &replicav1.SetEpochRequest{Epoch: 3, Owner: "new-engine"}); err != nil {
		t.Fatal(err)
	}
	before, _ := r.Info()
	for _, tc := range []struct {
		what string
		call func() error
		want *replicav1.StaleEpoch
	}{
		{"snapshot create", func() error {
			_, err := c.SnapshotCreate(ctx, &replicav1.SnapshotCreateRequest{Name: "s2", Epoch: 2})
			return err
		}, &replicav1.StaleEpoch{RequestEpoch: 2, ReplicaEpoch: 3}},
		{"snapshot delete", func() error {
			_, err := c.SnapshotDelete(ctx, &replicav1.SnapshotDeleteRequest{Name: "s1", Epoch: 2})
			return err
		}, &replicav1.StaleEpoch{RequestEpoch: 2, ReplicaEpoch: 3}},
		{"snapshot revert", func() error {
			_, err := c.SnapshotRevert(ctx, &replicav1.SnapshotRevertRequest{Name: "s1"})
			return err
		}, &replicav1.StaleEpoch{RequestEpoch: 0, ReplicaEpoch: 3}},
		{"expand", func() error {
			_, err := c.Expand(ctx, &replicav1.ExpandRequest{Size: 2 << 20, Epoch: 4})
			return err
		}, &replicav1.StaleEpoch{RequestEpoch: 4, ReplicaEpoch: 3}},
		{"layer write", func() error {
			_, err := c.LayerWrite(ctx, &replicav1.LayerWriteRequest{Snapshot: "s1", Data: make([]byte, 4096), Epoch: 2})
			return err
		}, &replicav1.StaleEpoch{RequestEpoch: 2, ReplicaEpoch: 3}},
		{"replace chain", func() error {
			_, err := c.ReplaceChain(ctx, &replicav1.ReplaceChainRequest{Snapshots: []*replicav1.Snapshot{{Name: "x"}}, Epoch: 2})
			return err
		}, &replicav1.StaleEpoch{RequestEpoch: 2, ReplicaEpoch: 3}},
		{"set epoch going back", func() error {
			_, err := c.SetEpoch(ctx, &replicav1.SetEpochRequest{Epoch: 2, Owner: "old-engine"})
			return err
		}, &replicav1.StaleEpoch{RequestEpoch: 2, ReplicaEpoch: 3}},
		{"set epoch 3 by another owner", func() error {
			_, err := c.SetEpoch(ctx, &replicav1.SetEpochRequest{Epoch: 3, Owner: "old-engine"})
			return err
		}, &replicav1.StaleEpoch{RequestEpoch: 3, ReplicaEpoch: 3, OtherOwner: true}},
	} {
		err := tc.call()
		st := status.Convert(err)
		var got *replicav1.StaleEpoch
		for _, d := range st.Details() {
			got, _ = d.(*replicav1.StaleEpoch)
		}
		if st.Code() != codes.FailedPrecondition || got == nil || !proto.Equal(got, tc.want) {
			t.Errorf("%s: %v (detail %v), want FailedPrecondition with %v", tc.what, err, got, tc.want)
			continue
		}
		wants := []string{fmt.Sprintf("request epoch %d", tc.want.RequestEpoch), fmt.Sprintf("replica epoch %d", tc.want.ReplicaEpoch)}
		if tc.want.OtherOwner {
			wants = []string{fmt.Sprintf("epoch %d", tc.want.RequestEpoch), "another engine"}
		}
		for _, want := range wants {
			if !strings.Contains(st.Message(), want) {
				t.Errorf("%s: message %q does not say %q", tc.what, st.Message(), want)
			}
		}
	}
	if after, _ := r.Info(); fmt.Sprint(after.Snapshots) != fmt.Sprint(before.Snapshots) || after.Size != before.Size || after.Epoch != 3 {
		t.Fatalf("refused calls changed the replica:\nbefore %+v\nafter  %+v", before, after)
	}
	if _, err := c.SnapshotCreate(ctx, &replicav1.SnapshotCreateRequest{Name: "s2", Epoch: 3}); err != nil {
		t.Fatalf("snapshot at the current epoch: %v", err)
	}
	if _, err := c.SetEpoch(ctx, &replicav1.SetEpochRequest{Epoch: 3, Owner: "new-engine", Degraded: true}); err != nil {
		t.Fatalf("the owner sets its epoch again: %v", err)
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

// TestSnapshotChangesRPC: the change listing over gRPC, and its refusals
// with the code that says why.
func TestSnapshotChangesRPC(t *testing.T) {
	r, c := serve(t)
	ctx := context.Background()
	if _, err := r.WriteAt(make([]byte, 4096), 8192); err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{"s1", "s2"} {
		if _, err := c.SnapshotCreate(ctx, &replicav1.SnapshotCreateRequest{Name: s}); err != nil {
			t.Fatal(err)
		}
	}
	size := r.Size()
	resp, err := c.SnapshotChanges(ctx, &replicav1.SnapshotChangesRequest{Snapshot: "s2", Length: size, MaxRanges: 10})
	if err != nil || len(resp.Ranges) != 1 || resp.Ranges[0].Offset != 8192 || resp.Ranges[0].Length != 4096 || resp.NextOffset != size {
		t.Fatalf("changes of s2 from zeros: %v, %v", resp, err)
	}
	resp, err = c.SnapshotChanges(ctx, &replicav1.SnapshotChangesRequest{Snapshot: "s2", Base: "s1", Length: size, MaxRanges: 10})
	if err != nil || len(resp.Ranges) != 0 || resp.NextOffset != size {
		t.Fatalf("changes of s2 since s1 (none written): %v, %v", resp, err)
	}
	for _, tc := range []struct {
		what string
		req  *replicav1.SnapshotChangesRequest
		want codes.Code
	}{
		{"missing snapshot", &replicav1.SnapshotChangesRequest{Snapshot: "nope", Length: 4096, MaxRanges: 1}, codes.NotFound},
		{"missing base", &replicav1.SnapshotChangesRequest{Snapshot: "s2", Base: "nope", Length: 4096, MaxRanges: 1}, codes.NotFound},
		{"base not older", &replicav1.SnapshotChangesRequest{Snapshot: "s1", Base: "s2", Length: 4096, MaxRanges: 1}, codes.InvalidArgument},
		{"past the end", &replicav1.SnapshotChangesRequest{Snapshot: "s2", Offset: size, Length: 4096, MaxRanges: 1}, codes.OutOfRange},
		{"negative length", &replicav1.SnapshotChangesRequest{Snapshot: "s2", Length: -4096, MaxRanges: 1}, codes.OutOfRange},
		{"unaligned", &replicav1.SnapshotChangesRequest{Snapshot: "s2", Offset: 1, Length: 4096, MaxRanges: 1}, codes.InvalidArgument},
		{"no max", &replicav1.SnapshotChangesRequest{Snapshot: "s2", Length: 4096}, codes.InvalidArgument},
		{"max too large", &replicav1.SnapshotChangesRequest{Snapshot: "s2", Length: 4096, MaxRanges: replica.MaxChangeRanges + 1}, codes.InvalidArgument},
	} {
		if _, err := c.SnapshotChanges(ctx, tc.req); status.Code(err) != tc.want {
			t.Errorf("%s: %v, want %v", tc.what, err, tc.want)
		}
	}
}

// TestSnapshotReadBufferComesBack: the data of SnapshotRead replies is
// read into the codec's recycled buffers, and each comes back once gRPC
// has sent its reply; a reply with no data, or a refused read, keeps no
// buffer.
func TestSnapshotReadBufferComesBack(t *testing.T) {
	r, c := serve(t)
	ctx := context.Background()
	want := make([]byte, 256<<10)
	for i := range want {
		want[i] = byte(i * 13)
	}
	if _, err := r.WriteAt(want, 64<<10); err != nil {
		t.Fatal(err)
	}
	if _, err := c.SnapshotCreate(ctx, &replicav1.SnapshotCreateRequest{Name: "s1"}); err != nil {
		t.Fatal(err)
	}
	before := codec.SentBack()
	const reads = 8
	for i := range reads {
		resp, err := c.SnapshotRead(ctx, &replicav1.SnapshotReadRequest{Snapshot: "s1", Length: 1 << 20, LayerOnly: i%2 == 0})
		if err != nil {
			t.Fatal(err)
		}
		if len(resp.Extents) != 1 || resp.Extents[0].Offset != 64<<10 || !bytes.Equal(resp.Extents[0].Data, want) {
			t.Fatalf("read %d: %d extents, not the data written", i, len(resp.Extents))
		}
	}
	if resp, err := c.SnapshotRead(ctx, &replicav1.SnapshotReadRequest{Snapshot: "s1", Offset: 512 << 10, Length: 4096}); err != nil || len(resp.Extents) != 0 {
		t.Fatalf("a hole: %v, %v", resp, err)
	}
	if _, err := c.SnapshotRead(ctx, &replicav1.SnapshotReadRequest{Snapshot: "nope", Length: 4096}); status.Code(err) != codes.NotFound {
		t.Fatalf("a missing snapshot: %v", err)
	}
	for end := deadline.After(10 * time.Second); codec.SentBack()-before < reads; {
		if time.Now().After(end) {
			t.Fatalf("%d of %d reply buffers came back", codec.SentBack()-before, reads)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestSnapshotReadWithoutLending: every read of a Control served by a
// gRPC server of its own (whose codec never gives a buffer back) is read
// into memory of its own: the data is right and no buffer is lent. A
// read longer than the replica serves is refused there as through Start.
func TestSnapshotReadWithoutLending(t *testing.T) {
	r, err := replica.Open(filepath.Join(t.TempDir(), "r"), replica.Options{Size: 16 << 20})
	if err != nil {
		t.Fatal(err)
	}
	want := make([]byte, 6<<20)
	for i := range want {
		want[i] = byte(i * 7)
	}
	if _, err := r.WriteAt(want, 0); err != nil {
		t.Fatal(err)
	}
	// A server of the test's own, with gRPC's default codec.
	ctl := listen(t)
	gs := grpc.NewServer(grpc.MaxSendMsgSize(MaxControlMessage))
	replicav1.RegisterReplicaServiceServer(gs, &Control{Replica: r})
	go func() { _ = gs.Serve(ctl) }()
	t.Cleanup(gs.Stop)
	conn, err := grpc.NewClient(ctl.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(MaxControlMessage)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	c := replicav1.NewReplicaServiceClient(conn)
	ctx := context.Background()
	if _, err := c.SnapshotCreate(ctx, &replicav1.SnapshotCreateRequest{Name: "s1"}); err != nil {
		t.Fatal(err)
	}
	before := codec.Lent()
	for _, off := range []int64{0, 4 << 20} {
		resp, err := c.SnapshotRead(ctx, &replicav1.SnapshotReadRequest{Snapshot: "s1", Offset: off, Length: 4 << 20})
		if err != nil {
			t.Fatalf("a read at %d: %v", off, err)
		}
		var got []byte
		for _, e := range resp.Extents {
			if e.Offset != off+int64(len(got)) {
				t.Fatalf("a read at %d: an extent at %d after %d bytes", off, e.Offset, len(got))
			}
			got = append(got, e.Data...)
		}
		if end := min(off+4<<20, int64(len(want))); !bytes.Equal(got, want[off:end]) {
			t.Fatalf("a read at %d: %d bytes back, not the data written", off, len(got))
		}
	}
	if _, err := c.SnapshotRead(ctx, &replicav1.SnapshotReadRequest{Snapshot: "s1", Length: 8 << 20}); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("a read of 8 MiB: %v, want InvalidArgument", err)
	}
	if n := codec.Lent() - before; n != 0 {
		t.Fatalf("%d buffers lent by a server whose codec never gives them back", n)
	}
	_, c2 := serve(t)
	if _, err := c2.SnapshotRead(ctx, &replicav1.SnapshotReadRequest{Length: 8 << 20}); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("a read of 8 MiB through Start: %v, want InvalidArgument", err)
	}
}
