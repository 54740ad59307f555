package imserver

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"

	imv1 "github.com/cairn-io/cairn/dataplane/api/instancemanager/v1"
	im "github.com/cairn-io/cairn/dataplane/instancemanager"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// These tests call the InstanceManagerService as the manager does, over a
// gRPC connection (bufconn), against a real Supervisor starting real
// processes: a shell script stands in for cairn-data, so that a test says
// how its process behaves. The instance manager with cairn-data's own
// engines and replicas is tested in cmd/cairn-data.

// within bounds every wait: generous, for a loaded machine.
var within = deadline.Scale(60 * time.Second)

// child is the script run as "child <kind> <args...>": it prints what it
// was started as, and reports ready on descriptor 3 with the addresses its
// arguments give, then sleeps until it is stopped. An engine
// of volume "broken" fails instead, as one whose replicas are gone would.
const child = `#!/bin/sh
kind=$1; shift
echo "started $kind"
prev=""; ctl=""; data=""; local=""
for a in "$@"; do
	case "$prev" in
	--control-listen) ctl=$a ;;
	--listen) if [ "$kind" = engine ]; then ctl=$a; else data=$a; fi ;;
	--listen-local) local=$a ;;
	--name) [ "$a" = broken ] && { echo "open volume broken: no replica answers" >&2; exit 2; } ;;
	esac
	prev=$a
done
printf '{"data":"%s","localData":"%s","control":"%s","size":4096}\n' "$data" "$local" "$ctl" >&3
exec 3>&-
exec sleep 600
`

// nextPorts spreads the rigs' port ranges apart within the test binary.
var nextPorts atomic.Int32

type rig struct {
	s    *im.Supervisor
	c    imv1.InstanceManagerServiceClient
	data string
}

// newRig serves a Supervisor with ports ports to hand out.
func newRig(t *testing.T, ports int) *rig {
	t.Helper()
	dir := t.TempDir()
	bin := filepath.Join(dir, "child")
	if err := os.WriteFile(bin, []byte(child), 0o755); err != nil {
		t.Fatal(err)
	}
	data := filepath.Join(dir, "data")
	if err := os.MkdirAll(data, 0o750); err != nil {
		t.Fatal(err)
	}
	base := 26000 + os.Getpid()%3000 + int(nextPorts.Add(1))*16
	s, err := im.New(im.Options{Binary: bin, PortMin: base, PortMax: base + ports - 1, DataDirs: []string{data},
		LogDir: filepath.Join(dir, "logs"), RunDir: filepath.Join(dir, "run"), StopGrace: 10 * time.Second, Logger: logr.Discard()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	l := bufconn.Listen(1 << 20)
	gs := grpc.NewServer()
	imv1.RegisterInstanceManagerServiceServer(gs, &Server{S: s, NodeName: "node-a", Version: "v-test", DataDirs: []string{data}})
	go func() { _ = gs.Serve(l) }() // nil after Stop at cleanup; a failure shows as the calls failing
	t.Cleanup(gs.Stop)
	cc, err := grpc.NewClient("passthrough:///bufnet", grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) {
		return l.DialContext(ctx)
	}), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return &rig{s: s, c: imv1.NewInstanceManagerServiceClient(cc), data: data}
}

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), within)
	t.Cleanup(cancel)
	return c
}

func (r *rig) replica(name string) *imv1.ProcessCreateRequest {
	return &imv1.ProcessCreateRequest{Name: name, Spec: &imv1.ProcessCreateRequest_Replica{
		Replica: &imv1.ReplicaSpec{DataDir: filepath.Join(r.data, strings.ReplaceAll(name, "/", "-")), SizeBytes: 1 << 20}}}
}

func engine(name, volume string) *imv1.ProcessCreateRequest {
	return &imv1.ProcessCreateRequest{Name: name, Spec: &imv1.ProcessCreateRequest_Engine{Engine: &imv1.EngineSpec{
		VolumeName: volume, Frontend: imv1.Frontend_FRONTEND_NBD, NbdKernel: imv1.NBDKernel_NBD_KERNEL_OFF,
		Replicas: []*imv1.ReplicaAddress{{Data: "127.0.0.1:1", Control: "127.0.0.1:2"}}}}}
}

// until reads the watch until ok accepts an event.
func until(t *testing.T, w imv1.InstanceManagerService_ProcessWatchClient, what string, ok func(*imv1.ProcessEvent) bool) *imv1.ProcessEvent {
	t.Helper()
	for {
		ev, err := w.Recv()
		if err != nil {
			t.Fatalf("waiting for %s: %v", what, err)
		}
		if ok(ev) {
			return ev
		}
	}
}

// waitLogLine waits for the process's log to begin with want. The
// child's output reaches the log through a pipe the instance manager
// copies, so its first line can come after its ready report.
func waitLogLine(ctx context.Context, t *testing.T, c imv1.InstanceManagerServiceClient, name, want string) {
	t.Helper()
	first := func() string {
		logs, err := c.ProcessLog(ctx, &imv1.ProcessLogRequest{Name: name})
		if err != nil {
			t.Fatal(err)
		}
		line, err := logs.Recv()
		if err != nil && !errors.Is(err, io.EOF) {
			t.Fatal(err)
		}
		return line.GetLine()
	}
	for end := time.Now().Add(within); first() != want; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(end) {
			t.Fatalf("log of %s: no first line %q within %v (it is %q)", name, want, within, first())
		}
	}
}

func is(name string, typ imv1.ProcessEvent_Type, st imv1.ProcessState) func(*imv1.ProcessEvent) bool {
	return func(ev *imv1.ProcessEvent) bool {
		return ev.GetType() == typ && ev.GetProcess().GetName() == name && ev.GetProcess().GetState() == st
	}
}

// TestProcessLifeCycle: a replica created over the API is watched from
// starting to running with the addresses it reported (its data port, the
// unix socket beside it, its control port), read back with Get,
// List and Log, created again (AlreadyExists, with the process), and
// deleted (its process stopped, the watch told, Get NotFound).
func TestProcessLifeCycle(t *testing.T) {
	r := newRig(t, 16)
	c := ctx(t)
	w, err := r.c.ProcessWatch(c, &imv1.ProcessWatchRequest{})
	if err != nil {
		t.Fatal(err)
	}
	first, err := w.Recv()
	if err != nil || first.GetType() != imv1.ProcessEvent_TYPE_SNAPSHOT || len(first.GetProcesses()) != 0 {
		t.Fatalf("first event %v %v", first, err)
	}
	req := r.replica("ns/r1")
	p, err := r.c.ProcessCreate(c, req)
	if err != nil {
		t.Fatal(err)
	}
	if p.GetKind() != imv1.ProcessKind_PROCESS_KIND_REPLICA || len(p.GetPorts()) != 2 || p.GetPid() == 0 ||
		p.GetReplica().GetDataDir() != req.GetReplica().GetDataDir() || !slices.Contains(p.GetArgs(), "--control-listen") {
		t.Fatalf("created %v", p)
	}
	ev := until(t, w, "running", is("ns/r1", imv1.ProcessEvent_TYPE_UPDATE, imv1.ProcessState_PROCESS_STATE_RUNNING))
	if want := net.JoinHostPort("127.0.0.1", strconv.Itoa(int(p.GetPorts()[1]))); ev.GetProcess().GetControlAddress() != want || ev.GetSeq() <= first.GetSeq() {
		t.Fatalf("running %v, want control address %s", ev.GetProcess(), want)
	}
	local := ev.GetProcess().GetLocalDataAddress()
	if want := net.JoinHostPort("127.0.0.1", strconv.Itoa(int(p.GetPorts()[0]))); ev.GetProcess().GetDataAddress() != want ||
		!strings.HasPrefix(local, "unix:") || !slices.Contains(p.GetArgs(), local) {
		t.Fatalf("running %v, want data address %s and the --listen-local socket as the local one", ev.GetProcess(), want)
	}
	if g, err := r.c.ProcessGet(c, &imv1.ProcessGetRequest{Name: "ns/r1"}); err != nil || g.GetState() != imv1.ProcessState_PROCESS_STATE_RUNNING {
		t.Fatalf("get %v %v", g, err)
	}
	if l, err := r.c.ProcessList(c, &imv1.ProcessListRequest{}); err != nil || len(l.GetProcesses()) != 1 {
		t.Fatalf("list %v %v", l, err)
	}
	waitLogLine(c, t, r.c, "ns/r1", "started replica")
	_, err = r.c.ProcessCreate(c, req)
	if status.Code(err) != codes.AlreadyExists {
		t.Fatalf("create again: %v", err)
	}
	details := status.Convert(err).Details()
	if len(details) != 1 || details[0].(*imv1.Process).GetPid() != p.GetPid() {
		t.Fatalf("create again: details %v, want the existing process", details)
	}
	if _, err := r.c.ProcessDelete(c, &imv1.ProcessDeleteRequest{Name: "ns/r1"}); err != nil {
		t.Fatal(err)
	}
	until(t, w, "deleted", is("ns/r1", imv1.ProcessEvent_TYPE_DELETE, imv1.ProcessState_PROCESS_STATE_STOPPED))
	if _, err := r.c.ProcessGet(c, &imv1.ProcessGetRequest{Name: "ns/r1"}); status.Code(err) != codes.NotFound {
		t.Fatalf("get after delete: %v", err)
	}
	if _, err := r.c.ReplicaDataDelete(c, &imv1.ReplicaDataDeleteRequest{DataDir: req.GetReplica().GetDataDir()}); err != nil {
		t.Fatalf("delete the data once the process is gone: %v", err)
	}
}

// TestProcessFails: an engine that exits before it is ready is in error
// with its exit code and the last lines it wrote, and its spec reads back
// as it was given.
func TestProcessFails(t *testing.T) {
	r := newRig(t, 16)
	c := ctx(t)
	w, err := r.c.ProcessWatch(c, &imv1.ProcessWatchRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.c.ProcessCreate(c, engine("ns/e1", "broken")); err != nil {
		t.Fatal(err)
	}
	p := until(t, w, "error", is("ns/e1", imv1.ProcessEvent_TYPE_UPDATE, imv1.ProcessState_PROCESS_STATE_ERROR)).GetProcess()
	if p.GetExitCode() != 2 || !slices.Contains(p.GetLogTail(), "open volume broken: no replica answers") {
		t.Fatalf("failed engine %v", p)
	}
	e := p.GetEngine()
	if p.GetKind() != imv1.ProcessKind_PROCESS_KIND_ENGINE || e.GetVolumeName() != "broken" || e.GetFrontend() != imv1.Frontend_FRONTEND_NBD ||
		e.GetNbdKernel() != imv1.NBDKernel_NBD_KERNEL_OFF || len(e.GetReplicas()) != 1 || e.GetReplicas()[0].GetControl() != "127.0.0.1:2" {
		t.Fatalf("engine spec read back %v", e)
	}
}

// TestBadRequests: each refused request gets the code that says why, and
// no process is started for it.
func TestBadRequests(t *testing.T) {
	r := newRig(t, 4)
	c := ctx(t)
	running := r.replica("held")
	if _, err := r.c.ProcessCreate(c, running); err != nil {
		t.Fatal(err)
	}
	withEngine := func(mutate func(*imv1.EngineSpec)) *imv1.ProcessCreateRequest {
		req := engine("e", "v")
		mutate(req.GetEngine())
		return req
	}
	create := func(req *imv1.ProcessCreateRequest) func() error {
		return func() error { _, err := r.c.ProcessCreate(c, req); return err }
	}
	other := r.replica("held")
	other.GetReplica().SizeBytes *= 2
	outside := r.replica("x")
	outside.GetReplica().DataDir = "/elsewhere/x"
	odd := r.replica("odd")
	odd.GetReplica().SizeBytes = 1000
	for _, tc := range []struct {
		name string
		call func() error
		want codes.Code
	}{
		{"no spec", create(&imv1.ProcessCreateRequest{Name: "n"}), codes.InvalidArgument},
		{"bad name", create(r.replica("Bad_Name")), codes.InvalidArgument},
		{"unknown frontend", create(withEngine(func(e *imv1.EngineSpec) { e.Frontend = 99 })), codes.InvalidArgument},
		{"unknown nbd kernel", create(withEngine(func(e *imv1.EngineSpec) { e.NbdKernel = 99 })), codes.InvalidArgument},
		{"negative replica timeout", create(withEngine(func(e *imv1.EngineSpec) { e.ReplicaTimeoutMs = -1 })), codes.InvalidArgument},
		{"too many replicas", create(withEngine(func(e *imv1.EngineSpec) {
			for range im.MaxReplicas {
				e.Replicas = append(e.Replicas, e.Replicas[0])
			}
		})), codes.InvalidArgument},
		{"no replicas", create(withEngine(func(e *imv1.EngineSpec) { e.Replicas = nil })), codes.InvalidArgument},
		{"data outside the data directories", create(outside), codes.InvalidArgument},
		{"size not in blocks", create(odd), codes.InvalidArgument},
		{"same name, another spec", create(other), codes.FailedPrecondition},
		{"no ports left", create(r.replica("r2")), codes.OK}, // takes the last two ports
		{"no ports left", create(r.replica("r3")), codes.ResourceExhausted},
		{"data of a running replica", func() error {
			_, err := r.c.ReplicaDataDelete(c, &imv1.ReplicaDataDeleteRequest{DataDir: running.GetReplica().GetDataDir()})
			return err
		}, codes.FailedPrecondition},
		{"data dir outside", func() error {
			_, err := r.c.ReplicaDataDelete(c, &imv1.ReplicaDataDeleteRequest{DataDir: "/etc"})
			return err
		}, codes.InvalidArgument},
		{"get a missing process", func() error { _, err := r.c.ProcessGet(c, &imv1.ProcessGetRequest{Name: "nope"}); return err }, codes.NotFound},
		{"log of a missing process", func() error {
			s, err := r.c.ProcessLog(c, &imv1.ProcessLogRequest{Name: "nope"})
			if err == nil {
				_, err = s.Recv()
			}
			return err
		}, codes.NotFound},
		{"delete a missing process", func() error {
			_, err := r.c.ProcessDelete(c, &imv1.ProcessDeleteRequest{Name: "nope"})
			return err
		}, codes.OK},
	} {
		if got := status.Code(tc.call()); got != tc.want {
			t.Errorf("%s: %s, want %s", tc.name, got, tc.want)
		}
	}
	l, err := r.c.ProcessList(c, &imv1.ProcessListRequest{})
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, p := range l.GetProcesses() {
		names = append(names, p.GetName())
	}
	if !slices.Equal(names, []string{"held", "r2"}) {
		t.Fatalf("processes %v after the refused requests, want held and r2", names)
	}
}

// TestNodeInfo: the node's name, version and data directories with their
// filesystem's size; a data directory that cannot be read is an Internal
// error naming it.
func TestNodeInfo(t *testing.T) {
	r := newRig(t, 4)
	c := ctx(t)
	ni, err := r.c.NodeInfo(c, &imv1.NodeInfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if ni.GetNodeName() != "node-a" || ni.GetVersion() != "v-test" || len(ni.GetDataDirs()) != 1 {
		t.Fatalf("node info %v", ni)
	}
	d := ni.GetDataDirs()[0]
	if d.GetPath() != r.data || d.GetTotalBytes() <= 0 || d.GetAvailableBytes() <= 0 || d.GetAvailableBytes() > d.GetTotalBytes() || d.GetFilesystem() == "" {
		t.Fatalf("data directory %v", d)
	}
	missing := filepath.Join(t.TempDir(), "gone")
	srv := &Server{S: r.s, NodeName: "node-a", DataDirs: []string{missing}}
	if _, err := srv.NodeInfo(c, &imv1.NodeInfoRequest{}); status.Code(err) != codes.Internal || !strings.Contains(err.Error(), missing) {
		t.Fatalf("node info with a missing data directory: %v", err)
	}
}

// TestWatchEndsOnClose: a watch ends with Unavailable (watch again) when
// the instance manager stops.
func TestWatchEndsOnClose(t *testing.T) {
	r := newRig(t, 4)
	c := ctx(t)
	w, err := r.c.ProcessWatch(c, &imv1.ProcessWatchRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.Recv(); err != nil {
		t.Fatal(err)
	}
	r.s.Close()
	for {
		_, err := w.Recv()
		if err != nil {
			if status.Code(err) != codes.Unavailable {
				t.Fatalf("watch ended with %v, want Unavailable", err)
			}
			return
		}
	}
}
