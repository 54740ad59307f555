package main

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	grpcstatus "google.golang.org/grpc/status"

	enginev1 "github.com/cairn-io/cairn/dataplane/api/engine/v1"
	imv1 "github.com/cairn-io/cairn/dataplane/api/instancemanager/v1"
	replicav1 "github.com/cairn-io/cairn/dataplane/api/replica/v1"
	"github.com/cairn-io/cairn/dataplane/dataconn"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

type imHandle struct {
	p      *proc
	c      imv1.InstanceManagerServiceClient
	dir    string
	logDir string
}

func startIM(t *testing.T, portRange string, extra ...string) *imHandle {
	t.Helper()
	dir := t.TempDir()
	h := &imHandle{dir: dir, logDir: filepath.Join(dir, "logs")}
	args := append([]string{"instance-manager", "--listen", "127.0.0.1:0", "--node", "node-a", "--data-dir", dir,
		"--port-range", portRange, "--log-dir", h.logDir, "--stop-grace", "5s", "--child-env", "CAIRN_DATA_EXEC=1"}, extra...)
	h.p = start(t, args...)
	cc, err := grpc.NewClient(h.p.control, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	h.c = imv1.NewInstanceManagerServiceClient(cc)
	return h
}

// freePortRange finds n free consecutive ports (best effort) for a test.
func freePortRange(t *testing.T, n int) string {
	t.Helper()
	for base := 20000 + os.Getpid()%20000; base < 60000; base += n {
		ok := true
		for p := base; p < base+n; p++ {
			l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", p))
			if err != nil {
				ok = false
				break
			}
			l.Close()
		}
		if ok {
			return fmt.Sprintf("%d-%d", base, base+n-1)
		}
	}
	t.Fatal("no free port range")
	return ""
}

// replicaReq asks for a 16 MiB replica in dir, served over TCP.
func replicaReq(name, dir string) *imv1.ProcessCreateRequest {
	return &imv1.ProcessCreateRequest{Name: name, Spec: &imv1.ProcessCreateRequest_Replica{
		Replica: &imv1.ReplicaSpec{DataDir: dir, SizeBytes: 16 << 20}}}
}

func alive(pid int32) bool { return syscall.Kill(int(pid), 0) == nil }

// watchAll collects events from a watch stream in the background.
type watchLog struct {
	mu     sync.Mutex
	events []*imv1.ProcessEvent
}

func (w *watchLog) states(name string) []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	var out []string
	for _, e := range w.events {
		if e.Process != nil && e.Process.Name == name {
			s := strings.TrimPrefix(e.Process.State.String(), "PROCESS_STATE_")
			if e.Type == imv1.ProcessEvent_TYPE_DELETE {
				s = "DELETED"
			}
			out = append(out, s)
		}
	}
	return out
}

func watch(t *testing.T, c imv1.InstanceManagerServiceClient) *watchLog {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	st, err := c.ProcessWatch(ctx, &imv1.ProcessWatchRequest{})
	if err != nil {
		t.Fatal(err)
	}
	first, err := st.Recv()
	if err != nil || first.Type != imv1.ProcessEvent_TYPE_SNAPSHOT {
		t.Fatalf("first watch event: %v %v", first, err)
	}
	w := &watchLog{events: []*imv1.ProcessEvent{first}}
	go func() {
		for {
			ev, err := st.Recv()
			if err != nil {
				return
			}
			w.mu.Lock()
			w.events = append(w.events, ev)
			w.mu.Unlock()
		}
	}()
	return w
}

func waitState(t *testing.T, c imv1.InstanceManagerServiceClient, name string, want imv1.ProcessState) *imv1.Process {
	t.Helper()
	until := deadline.After(60 * time.Second)
	for {
		p, err := c.ProcessGet(context.Background(), &imv1.ProcessGetRequest{Name: name})
		if err == nil && p.State == want {
			return p
		}
		if time.Now().After(until) {
			t.Fatalf("%s never reached %s: %v %v", name, want, p, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func TestInstanceManagerLifecycle(t *testing.T) {
	ctx := context.Background()
	im := startIM(t, freePortRange(t, 8))
	w := watch(t, im.c)

	req := replicaReq("vol-r-a", filepath.Join(im.dir, "ra"))
	running := createRunningReplica(ctx, t, im, req)
	checkCreateAgain(ctx, t, im, req, running)
	checkReplicaLog(ctx, t, im)
	followed := followReplicaLog(ctx, t, im)
	checkNodeInfo(ctx, t, im)
	checkDelete(ctx, t, im, running, followed)
	checkWatched(t, w)
}

// createRunningReplica creates the replica req asks for and checks it
// runs and serves at the addresses it reports: its data on the TCP port
// and on the unix socket beside it (what one writes the other reads).
func createRunningReplica(ctx context.Context, t *testing.T, im *imHandle, req *imv1.ProcessCreateRequest) *imv1.Process {
	t.Helper()
	p, err := im.c.ProcessCreate(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if len(p.Ports) != 2 || p.Kind != imv1.ProcessKind_PROCESS_KIND_REPLICA || p.GetReplica().GetDataDir() != filepath.Join(im.dir, "ra") {
		t.Fatalf("created: %v", p)
	}
	running := waitState(t, im.c, "vol-r-a", imv1.ProcessState_PROCESS_STATE_RUNNING)
	// The addresses are the ones the replica reported, and it serves there.
	if running.DataAddress != fmt.Sprintf("127.0.0.1:%d", running.Ports[0]) || running.ControlAddress != fmt.Sprintf("127.0.0.1:%d", running.Ports[1]) ||
		running.SizeBytes != 16<<20 {
		t.Fatalf("running replica reports data %q control %q size %d (ports %v)", running.DataAddress, running.ControlAddress, running.SizeBytes, running.Ports)
	}
	overTCP := dialData(t, running.DataAddress, 0)
	if err := overTCP.Ping(ctx); err != nil {
		t.Fatal(err)
	}
	sock, ok := strings.CutPrefix(running.LocalDataAddress, "unix:")
	if !ok || !slices.Contains(running.Args, running.LocalDataAddress) {
		t.Fatalf("running replica reports local data address %q, want the unix socket of its --listen-local (args %v)", running.LocalDataAddress, running.Args)
	}
	local, err := dataconn.Dial(ctx, "unix", sock, dataconn.ClientOptions{Conns: 1})
	if err != nil {
		t.Fatalf("local data address %s: %v", running.LocalDataAddress, err)
	}
	defer local.Close()
	want := bytes.Repeat([]byte{0x6e}, 4096)
	if err := local.WriteAt(ctx, want, 8192, true); err != nil {
		t.Fatalf("write through the local data address: %v", err)
	}
	got := make([]byte, len(want))
	if err := overTCP.ReadAt(ctx, got, 8192); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("read back through the data port: %v (equal %v)", err, bytes.Equal(got, want))
	}
	if _, err := dialControl(t, running.ControlAddress).Info(ctx, &replicav1.InfoRequest{}); err != nil {
		t.Fatalf("control address %s: %v", running.ControlAddress, err)
	}
	return running
}

// checkCreateAgain: creating the running replica again is idempotent, and
// the same name with another spec is a conflict.
func checkCreateAgain(ctx context.Context, t *testing.T, im *imHandle, req *imv1.ProcessCreateRequest, running *imv1.Process) {
	t.Helper()
	// Idempotent create: ALREADY_EXISTS with the existing process attached.
	_, err := im.c.ProcessCreate(ctx, req)
	st := grpcstatus.Convert(err)
	if st.Code() != codes.AlreadyExists || len(st.Details()) != 1 || st.Details()[0].(*imv1.Process).Pid != running.Pid {
		t.Fatalf("second create: %v %v", err, st.Details())
	}
	// The same name with another spec is a conflict, not "already exists".
	other := replicaReq("vol-r-a", filepath.Join(im.dir, "ra"))
	other.GetReplica().SizeBytes = 32 << 20
	if _, err := im.c.ProcessCreate(ctx, other); grpcstatus.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "another spec") {
		t.Fatalf("create with another spec: %v", err)
	}
	list, _ := im.c.ProcessList(ctx, &imv1.ProcessListRequest{})
	if len(list.Processes) != 1 {
		t.Fatalf("list: %v", list)
	}
}

// checkReplicaLog reads the replica's log to its current end.
func checkReplicaLog(ctx context.Context, t *testing.T, im *imHandle) {
	t.Helper()
	// Logs: the replica's own log lines.
	ls, err := im.c.ProcessLog(ctx, &imv1.ProcessLogRequest{Name: "vol-r-a"})
	if err != nil {
		t.Fatal(err)
	}
	var lines []string
	for {
		l, err := ls.Recv()
		if err != nil {
			break
		}
		lines = append(lines, l.Line)
	}
	if !strings.Contains(strings.Join(lines, "\n"), "replica opened") {
		t.Fatalf("log: %v", lines)
	}
}

// followReplicaLog follows the replica's log; the channel gets the lines
// seen once the stream ends.
func followReplicaLog(ctx context.Context, t *testing.T, im *imHandle) <-chan []string {
	t.Helper()
	// Follow: a stream that ends when the process is deleted.
	fctx, fcancel := context.WithCancel(ctx)
	t.Cleanup(fcancel)
	follow, err := im.c.ProcessLog(fctx, &imv1.ProcessLogRequest{Name: "vol-r-a", Follow: true})
	if err != nil {
		t.Fatal(err)
	}
	followed := make(chan []string, 1)
	go func() {
		var got []string
		for {
			l, err := follow.Recv()
			if err != nil {
				followed <- got
				return
			}
			got = append(got, l.Line)
		}
	}()
	return followed
}

func checkNodeInfo(ctx context.Context, t *testing.T, im *imHandle) {
	t.Helper()
	ni, err := im.c.NodeInfo(ctx, &imv1.NodeInfoRequest{})
	if err != nil || ni.NodeName != "node-a" || len(ni.DataDirs) != 1 || ni.DataDirs[0].Path != im.dir ||
		ni.DataDirs[0].TotalBytes <= 0 || ni.DataDirs[0].AvailableBytes <= 0 || ni.DataDirs[0].Filesystem == "" {
		t.Fatalf("node info: %v %v", ni, err)
	}
}

// checkDelete deletes the running replica: the follower sees its
// shutdown, the process is gone, and deleting it again succeeds.
func checkDelete(ctx context.Context, t *testing.T, im *imHandle, running *imv1.Process, followed <-chan []string) {
	t.Helper()
	if _, err := im.c.ProcessDelete(ctx, &imv1.ProcessDeleteRequest{Name: "vol-r-a"}); err != nil {
		t.Fatal(err)
	}
	select {
	case got := <-followed: // the replica logs its shutdown: the follower sees it, then the end
		if !strings.Contains(strings.Join(got, "\n"), "replica closed") {
			t.Fatalf("followed lines lack the shutdown: %q", got)
		}
	case <-time.After(deadline.Scale(30 * time.Second)):
		t.Fatal("the follow stream did not end when the process was deleted")
	}
	if alive(running.Pid) {
		t.Fatal("the process survived its deletion")
	}
	if _, err := os.Stat(strings.TrimPrefix(running.LocalDataAddress, "unix:")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the deleted replica's local socket is still there: %v", err)
	}
	if _, err := im.c.ProcessDelete(ctx, &imv1.ProcessDeleteRequest{Name: "vol-r-a"}); err != nil {
		t.Fatalf("deleting a missing process: %v", err)
	}
	if _, err := im.c.ProcessGet(ctx, &imv1.ProcessGetRequest{Name: "vol-r-a"}); grpcstatus.Code(err) != codes.NotFound {
		t.Fatalf("get after delete: %v", err)
	}
}

// checkWatched: the watcher saw every transition, in order, with
// consecutive seqs.
func checkWatched(t *testing.T, w *watchLog) {
	t.Helper()
	until := deadline.After(10 * time.Second)
	for len(w.states("vol-r-a")) < 5 && time.Now().Before(until) {
		time.Sleep(10 * time.Millisecond)
	}
	if got := strings.Join(w.states("vol-r-a"), ","); got != "STARTING,RUNNING,STOPPING,STOPPED,DELETED" {
		t.Fatalf("watched transitions: %s", got)
	}
	w.mu.Lock()
	for i := 1; i < len(w.events); i++ {
		if w.events[i].Seq != w.events[i-1].Seq+1 {
			t.Fatalf("watch seqs jump: %d then %d", w.events[i-1].Seq, w.events[i].Seq)
		}
	}
	w.mu.Unlock()
}

// TestInstanceManagerUnixReplica runs a replica the way docs/instance-
// manager.md describes for an engine on the same node: data on a unix
// socket, one allocated port for control, no second data address. Once
// the manager reports it running, the unix socket serves data at once.
func TestInstanceManagerUnixReplica(t *testing.T) {
	ctx := context.Background()
	im := startIM(t, freePortRange(t, 4))
	req := replicaReq("vol-r-unix", filepath.Join(im.dir, "ru"))
	req.GetReplica().UnixSocket = true
	p, err := im.c.ProcessCreate(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if len(p.Ports) != 1 {
		t.Fatalf("a replica with data on a unix socket got ports %v, want one (control)", p.Ports)
	}
	p = waitState(t, im.c, "vol-r-unix", imv1.ProcessState_PROCESS_STATE_RUNNING)
	sock, ok := strings.CutPrefix(p.DataAddress, "unix:")
	if !ok || p.ControlAddress != fmt.Sprintf("127.0.0.1:%d", p.Ports[0]) || p.LocalDataAddress != "" || slices.Contains(p.Args, "--listen-local") {
		t.Fatalf("reported data %q local data %q control %q (args %v)", p.DataAddress, p.LocalDataAddress, p.ControlAddress, p.Args)
	}
	c, err := dataconn.Dial(ctx, "unix", sock, dataconn.ClientOptions{Conns: 1})
	if err != nil {
		t.Fatalf("running replica's unix data socket: %v", err)
	}
	defer c.Close()
	if err := c.Ping(ctx); err != nil {
		t.Fatalf("ping over the unix data socket: %v", err)
	}
	fi, err := os.Stat(sock)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o600 {
		t.Fatalf("data socket %s has mode %v, want 0600", sock, fi.Mode().Perm())
	}
}

func TestInstanceManagerCrashAndPorts(t *testing.T) {
	ctx := context.Background()
	im := startIM(t, freePortRange(t, 4))
	// A child that fails at once: reported as error with its exit code and
	// the last lines of its log.
	// (A replica whose directory holds a file, not a replica, cannot open.)
	if err := os.WriteFile(filepath.Join(im.dir, "bad"), []byte("not a replica"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err := im.c.ProcessCreate(ctx, replicaReq("bad", filepath.Join(im.dir, "bad")))
	if err != nil {
		t.Fatal(err)
	}
	p := waitState(t, im.c, "bad", imv1.ProcessState_PROCESS_STATE_ERROR)
	if p.ExitCode != 1 || !strings.Contains(strings.Join(p.LogTail, "\n"), filepath.Join(im.dir, "bad")) || p.Error == "" {
		t.Fatalf("crashed child: exit %d, error %q, tail %q", p.ExitCode, p.Error, p.LogTail)
	}
	// Its port went back to the pool: 4 ports = two replicas of 2.
	for _, n := range []string{"a", "b"} {
		if _, err := im.c.ProcessCreate(ctx, replicaReq("r-"+n, filepath.Join(im.dir, n))); err != nil {
			t.Fatal(err)
		}
	}
	_, err = im.c.ProcessCreate(ctx, replicaReq("r-c", filepath.Join(im.dir, "c")))
	if grpcstatus.Code(err) != codes.ResourceExhausted {
		t.Fatalf("a third replica in a 4-port range: %v", err)
	}
	// Bad requests.
	engine := func(mutate func(*imv1.EngineSpec)) *imv1.ProcessCreateRequest {
		e := &imv1.EngineSpec{VolumeName: "v", Replicas: []*imv1.ReplicaAddress{{Data: "127.0.0.1:1", Control: "127.0.0.1:2"}}}
		mutate(e)
		return &imv1.ProcessCreateRequest{Name: "e", Spec: &imv1.ProcessCreateRequest_Engine{Engine: e}}
	}
	for _, req := range []*imv1.ProcessCreateRequest{
		replicaReq("Bad_Name", filepath.Join(im.dir, "x")),
		{Name: "x"},
		replicaReq("x", "/tmp/elsewhere"),
		replicaReq("x", im.dir),
		replicaReq("x", im.dir+"/a/../../etc"),
		replicaReq("x", "relative/dir"),
		engine(func(e *imv1.EngineSpec) { e.VolumeName = "Has_Underscore" }),
		engine(func(e *imv1.EngineSpec) { e.Replicas = nil }),
		engine(func(e *imv1.EngineSpec) {
			for range 17 {
				e.Replicas = append(e.Replicas, e.Replicas[0])
			}
		}),
		engine(func(e *imv1.EngineSpec) { e.Replicas[0].Control = "" }),
		engine(func(e *imv1.EngineSpec) { e.Replicas[0].Data = "a,b" }),
		engine(func(e *imv1.EngineSpec) { e.Wanted = 2 }),
		engine(func(e *imv1.EngineSpec) { e.Frontend = 7 }),
		engine(func(e *imv1.EngineSpec) { e.SizeBytes = 1000 }),
	} {
		if _, err := im.c.ProcessCreate(ctx, req); grpcstatus.Code(err) != codes.InvalidArgument {
			t.Fatalf("%v: %v", req, err)
		}
	}
}

func TestInstanceManagerConcurrentCreates(t *testing.T) {
	ctx := context.Background()
	im := startIM(t, freePortRange(t, 40))
	var wg sync.WaitGroup
	var mu sync.Mutex
	created, exists := 0, 0
	for range 10 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, err := im.c.ProcessCreate(ctx, replicaReq("same", filepath.Join(im.dir, "same")))
			mu.Lock()
			defer mu.Unlock()
			switch grpcstatus.Code(err) {
			case codes.OK:
				created++
			case codes.AlreadyExists:
				exists++
			default:
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	if created != 1 || exists != 9 {
		t.Fatalf("10 concurrent creates: %d created, %d already existed", created, exists)
	}
	list, _ := im.c.ProcessList(ctx, &imv1.ProcessListRequest{})
	if len(list.Processes) != 1 {
		t.Fatalf("%d processes", len(list.Processes))
	}
}

// TestInstanceManagerStopsChildren: SIGTERM stops every child (engines
// first) and leaves none; SIGKILL of the manager takes its children too.
func TestInstanceManagerStopsChildren(t *testing.T) {
	ctx := context.Background()
	for _, sig := range []syscall.Signal{syscall.SIGTERM, syscall.SIGKILL} {
		t.Run(sig.String(), func(t *testing.T) {
			im := startIM(t, freePortRange(t, 16))
			w := watch(t, im.c)
			var pids []int32
			var addrs []*imv1.ReplicaAddress
			for _, n := range []string{"a", "b"} {
				if _, err := im.c.ProcessCreate(ctx, replicaReq("r-"+n, filepath.Join(im.dir, n))); err != nil {
					t.Fatal(err)
				}
				p := waitState(t, im.c, "r-"+n, imv1.ProcessState_PROCESS_STATE_RUNNING)
				pids = append(pids, p.Pid)
				addrs = append(addrs, &imv1.ReplicaAddress{Data: p.DataAddress, Control: p.ControlAddress})
			}
			_, err := im.c.ProcessCreate(ctx, &imv1.ProcessCreateRequest{Name: "e", Spec: &imv1.ProcessCreateRequest_Engine{Engine: &imv1.EngineSpec{
				VolumeName: "v", Replicas: addrs, Frontend: imv1.Frontend_FRONTEND_NBD, NbdKernel: imv1.NBDKernel_NBD_KERNEL_OFF}}})
			if err != nil {
				t.Fatal(err)
			}
			pids = append(pids, waitState(t, im.c, "e", imv1.ProcessState_PROCESS_STATE_RUNNING).Pid)
			im.p.cmd.Process.Signal(sig)
			code := im.p.waitExit(t)
			if sig == syscall.SIGTERM && code != 0 {
				t.Fatalf("exit %d\n%s", code, im.p.stderr.String())
			}
			until := deadline.After(10 * time.Second)
			for _, pid := range pids {
				for alive(pid) {
					if time.Now().After(until) {
						t.Fatalf("child %d outlived the instance manager (%s)", pid, sig)
					}
					time.Sleep(10 * time.Millisecond)
				}
			}
			if sig == syscall.SIGTERM {
				// Engines stop before replicas: the engine is stopped before
				// any replica is asked to stop.
				w.mu.Lock()
				var engineStopped, firstReplicaStopping uint64
				for _, ev := range w.events {
					if ev.Process == nil {
						continue
					}
					switch {
					case ev.Process.Name == "e" && ev.Process.State == imv1.ProcessState_PROCESS_STATE_STOPPED:
						engineStopped = ev.Seq
					case ev.Process.Name != "e" && ev.Process.State == imv1.ProcessState_PROCESS_STATE_STOPPING && firstReplicaStopping == 0:
						firstReplicaStopping = ev.Seq
					}
				}
				w.mu.Unlock()
				if engineStopped == 0 || firstReplicaStopping == 0 || engineStopped > firstReplicaStopping {
					t.Fatalf("stop order: engine stopped at seq %d, first replica stopping at %d", engineStopped, firstReplicaStopping)
				}
			}
		})
	}
}

// TestInstanceManagerTLS: with mutual TLS, a client without a certificate
// from the CA is refused; one with it gets through. Without TLS, a
// non-loopback address is refused.
func TestInstanceManagerTLS(t *testing.T) {
	dir := t.TempDir()
	pki := newTestPKI(t, dir, "instance-manager")
	im := start(t, append([]string{"instance-manager", "--listen", "127.0.0.1:0", "--node", "n", "--log-dir", filepath.Join(dir, "logs"),
		"--port-range", freePortRange(t, 2)}, pki.flags...)...)
	call := func(cfg *tls.Config) error {
		cc, err := grpc.NewClient(im.control, grpc.WithTransportCredentials(credentials.NewTLS(cfg)))
		if err != nil {
			return err
		}
		defer cc.Close()
		ctx, cancel := context.WithTimeout(context.Background(), deadline.Scale(10*time.Second))
		defer cancel()
		_, err = imv1.NewInstanceManagerServiceClient(cc).NodeInfo(ctx, &imv1.NodeInfoRequest{})
		return err
	}
	if err := call(pki.client(nil, nil)); err == nil {
		t.Fatal("a client without a certificate got through")
	}
	other, otherKey := newCA(t) // a certificate from some other CA
	oc, ok := issue(t, other, otherKey, "intruder", false)
	if err := call(pki.client(oc, ok)); err == nil {
		t.Fatal("a client with a certificate from another CA got through")
	}
	if err := call(pki.manager(t)); err != nil {
		t.Fatalf("the manager's client was refused: %v", err)
	}
	// No TLS on a non-loopback address: refused with the reason.
	code, stderr := runExit(t, "instance-manager", "--listen", "0.0.0.0:0", "--node", "n", "--log-dir", filepath.Join(dir, "l2"))
	if code == 0 || !strings.Contains(stderr, "refusing to serve without TLS") {
		t.Fatalf("exit %d: %s", code, stderr)
	}
}

// TestInstanceManagerTLSReload: when the certificate files change (the
// manager renewed them or rotated the CA, kubelet replaced the mounted
// Secret's files), the next handshake uses them, with no restart: a client
// of the new CA gets through, one of the old CA no longer does; a set of
// files that cannot be loaded keeps the previous configuration.
func TestInstanceManagerTLSReload(t *testing.T) {
	dir := t.TempDir()
	files := func(ca *x509.Certificate, caKey *ecdsa.PrivateKey) {
		// Written beside and renamed into place, as kubelet swaps a
		// Secret volume's files atomically.
		srv, srvKey := issue(t, ca, caKey, "instance-manager", true)
		writePEM(t, filepath.Join(dir, "ca.new"), "CERTIFICATE", ca.Raw)
		writePEM(t, filepath.Join(dir, "srv.new"), "CERTIFICATE", srv.Raw)
		writeKey(t, filepath.Join(dir, "key.new"), srvKey)
		for from, to := range map[string]string{"ca.new": "ca.pem", "srv.new": "srv.pem", "key.new": "srv.key"} {
			if err := os.Rename(filepath.Join(dir, from), filepath.Join(dir, to)); err != nil {
				t.Fatal(err)
			}
		}
	}
	ca1, ca1Key := newCA(t)
	files(ca1, ca1Key)
	im := start(t, "instance-manager", "--listen", "127.0.0.1:0", "--node", "n", "--log-dir", filepath.Join(dir, "logs"),
		"--port-range", freePortRange(t, 2), "--tls-cert", filepath.Join(dir, "srv.pem"), "--tls-key", filepath.Join(dir, "srv.key"),
		"--tls-client-ca", filepath.Join(dir, "ca.pem"))
	// call connects afresh as a client of ca (trusting it for the server
	// too) and returns the error of one RPC.
	call := func(ca *x509.Certificate, caKey *ecdsa.PrivateKey) error {
		pool := x509.NewCertPool()
		pool.AddCert(ca)
		c, k := issue(t, ca, caKey, "cairn-manager", false)
		cc, err := grpc.NewClient(im.control, grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{RootCAs: pool,
			ServerName: "instance-manager", Certificates: []tls.Certificate{{Certificate: [][]byte{c.Raw}, PrivateKey: k}}})))
		if err != nil {
			return err
		}
		defer cc.Close()
		ctx, cancel := context.WithTimeout(context.Background(), deadline.Scale(10*time.Second))
		defer cancel()
		_, err = imv1.NewInstanceManagerServiceClient(cc).NodeInfo(ctx, &imv1.NodeInfoRequest{})
		return err
	}
	if err := call(ca1, ca1Key); err != nil {
		t.Fatalf("client of the first CA: %v", err)
	}
	ca2, ca2Key := newCA(t)
	files(ca2, ca2Key)
	if err := call(ca2, ca2Key); err != nil {
		t.Fatalf("client of the new CA after the files changed: %v", err)
	}
	if err := call(ca1, ca1Key); err == nil {
		t.Fatal("a client of the replaced CA still got through")
	}
	// A broken set (the key file emptied) is not taken: the last good
	// configuration keeps serving.
	if err := os.WriteFile(filepath.Join(dir, "srv.key"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := call(ca2, ca2Key); err != nil {
		t.Fatalf("after an unloadable change the previous files should still serve: %v", err)
	}
}

// waitPulled waits until the engine has two RW replicas, the second
// rebuilt, and checks that the rebuild went replica to replica.
func waitPulled(t *testing.T, ec enginev1.EngineServiceClient) {
	t.Helper()
	ctx := context.Background()
	until := deadline.After(60 * time.Second)
	for {
		l, err := ec.ReplicaList(ctx, &enginev1.ReplicaListRequest{})
		if err != nil {
			t.Fatal(err)
		}
		rs, err := ec.RebuildStatus(ctx, &enginev1.RebuildStatusRequest{})
		if err != nil {
			t.Fatal(err)
		}
		rw := 0
		for _, r := range l.Replicas {
			if r.Mode == "RW" {
				rw++
			}
		}
		// The status says complete just after the replica is RW.
		if rw == 2 && len(rs.Rebuilds) == 1 && rs.Rebuilds[0].State == "complete" {
			// The new replica pulled its data from the other over
			// mutual TLS, with the certificate the instance manager's
			// processes share: the rebuild did not fall back to
			// relaying it through the engine.
			if rs.Rebuilds[0].BytesCopied < 1<<20 || rs.Rebuilds[0].RelayReason != "" {
				t.Fatalf("rebuild %v; want 1 MiB copied replica to replica", rs.Rebuilds[0])
			}
			return
		}
		if time.Now().After(until) {
			t.Fatalf("the second replica never became RW with its rebuild complete: %v, %v", l.Replicas, rs.Rebuilds)
		}
		time.Sleep(50 * time.Millisecond) // poll interval
	}
}

// testPKI is a CA and a server certificate of it for a name, written to a
// directory as an instance manager's TLS files.
type testPKI struct {
	ca    *x509.Certificate
	caKey *ecdsa.PrivateKey
	name  string
	// flags are the instance manager's --tls-cert, --tls-key and
	// --tls-client-ca.
	flags []string
}

func newTestPKI(t *testing.T, dir, name string) *testPKI {
	t.Helper()
	p := &testPKI{name: name}
	p.ca, p.caKey = newCA(t)
	writePEM(t, filepath.Join(dir, "ca.pem"), "CERTIFICATE", p.ca.Raw)
	srvCert, srvKey := issue(t, p.ca, p.caKey, name, true)
	writePEM(t, filepath.Join(dir, "srv.pem"), "CERTIFICATE", srvCert.Raw)
	writeKey(t, filepath.Join(dir, "srv.key"), srvKey)
	p.flags = []string{"--tls-cert", filepath.Join(dir, "srv.pem"), "--tls-key", filepath.Join(dir, "srv.key"),
		"--tls-client-ca", filepath.Join(dir, "ca.pem")}
	return p
}

// client is a TLS client that trusts the CA for the server's name and
// presents cert, if any.
func (p *testPKI) client(cert *x509.Certificate, key *ecdsa.PrivateKey) *tls.Config {
	pool := x509.NewCertPool()
	pool.AddCert(p.ca)
	cfg := &tls.Config{RootCAs: pool, ServerName: p.name}
	if cert != nil {
		cfg.Certificates = []tls.Certificate{{Certificate: [][]byte{cert.Raw}, PrivateKey: key}}
	}
	return cfg
}

// manager is a client with a certificate of the CA, as the manager's.
func (p *testPKI) manager(t *testing.T) *tls.Config {
	t.Helper()
	c, k := issue(t, p.ca, p.caKey, "cairn-manager", false)
	return p.client(c, k)
}

func newCA(t *testing.T) (*x509.Certificate, *ecdsa.PrivateKey) {
	t.Helper()
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "cairn test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IsCA: true,
		KeyUsage: x509.KeyUsageCertSign, BasicConstraintsValid: true}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	c, _ := x509.ParseCertificate(der)
	return c, key
}

func issue(t *testing.T, ca *x509.Certificate, caKey *ecdsa.PrivateKey, name string, server bool) (*x509.Certificate, *ecdsa.PrivateKey) {
	t.Helper()
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(time.Now().UnixNano()), Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), KeyUsage: x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}
	if server {
		// As the manager issues a node's certificate: engines present it
		// to replicas too.
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}
		tmpl.DNSNames = []string{name}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	c, _ := x509.ParseCertificate(der)
	return c, key
}

func writePEM(t *testing.T, path, typ string, der []byte) {
	t.Helper()
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
}

func writeKey(t *testing.T, path string, key *ecdsa.PrivateKey) {
	t.Helper()
	der, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	writePEM(t, path, "EC PRIVATE KEY", der)
}

// TestInstanceManagerVolumeKey: a replica and an engine started with their
// volume's key, the engine also with an encryption key. The keys reach the
// processes through pipes: they are not in their arguments, their
// environment or the instance manager's reports. The
// replica's data port serves only clients that hold the key: with none,
// with another volume's, or without the handshake a client is refused and
// the replica's data stays as it was; the engine with the key opens it; an
// engine with another key cannot. An instance manager on a network address
// refuses a spec without a key.
func TestInstanceManagerVolumeKey(t *testing.T) {
	im := startIM(t, freePortRange(t, 8))
	key, other := bytes.Repeat([]byte{7}, 32), bytes.Repeat([]byte{9}, 32)
	req := replicaReq("ns/v-r", filepath.Join(im.dir, "v-r"))
	req.GetReplica().AuthKey = key
	if _, err := im.c.ProcessCreate(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	r := waitState(t, im.c, "ns/v-r", imv1.ProcessState_PROCESS_STATE_RUNNING)
	if len(r.GetReplica().GetAuthKey()) != 0 {
		t.Fatal("the instance manager reported the key back")
	}
	for _, f := range []string{"cmdline", "environ"} {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/%s", r.Pid, f))
		if err != nil {
			t.Fatal(err)
		}
		if bytes.Contains(b, key) {
			t.Fatalf("the key is in the replica's /proc/PID/%s", f)
		}
	}
	if !slices.Contains(r.Args, "--auth-key-fd") {
		t.Fatalf("args %v: no --auth-key-fd", r.Args)
	}
	ctx := context.Background()
	dial := func(k []byte) (*dataconn.Client, error) {
		return dataconn.Dial(ctx, "tcp", r.DataAddress, dataconn.ClientOptions{Conns: 1, Key: k, RequestTimeout: deadline.Scale(2 * time.Second)})
	}
	good, err := dial(key)
	if err != nil {
		t.Fatalf("the volume's key: %v", err)
	}
	pattern := bytes.Repeat([]byte("cairn!"), 4096/6+1)[:4096]
	if err := good.WriteAt(ctx, pattern, 0, true); err != nil {
		t.Fatal(err)
	}
	sum := func() [32]byte {
		b := make([]byte, 1<<20)
		if err := good.ReadAt(ctx, b, 0); err != nil {
			t.Fatal(err)
		}
		return sha256.Sum256(b)
	}
	before := sum()
	if _, err := dial(other); !errors.Is(err, dataconn.ErrAuthRefused) {
		t.Fatalf("another volume's key: %v", err)
	}
	if c, err := dial(nil); err == nil {
		if c.WriteAt(ctx, make([]byte, 4096), 0, true) == nil {
			t.Fatal("a client without the handshake wrote")
		}
		c.Close()
	}
	if sum() != before {
		t.Fatal("the replica's data changed under refused clients")
	}

	engine := func(name string, k []byte) *imv1.ProcessCreateRequest {
		return &imv1.ProcessCreateRequest{Name: name, Spec: &imv1.ProcessCreateRequest_Engine{Engine: &imv1.EngineSpec{
			VolumeName: "v", Replicas: []*imv1.ReplicaAddress{{Data: r.DataAddress, Control: r.ControlAddress}},
			Frontend: imv1.Frontend_FRONTEND_NBD, NbdKernel: imv1.NBDKernel_NBD_KERNEL_OFF, AuthKey: k}}}
	}
	if _, err := im.c.ProcessCreate(ctx, engine("ns/v-wrong", other)); err != nil {
		t.Fatal(err)
	}
	wrong := waitState(t, im.c, "ns/v-wrong", imv1.ProcessState_PROCESS_STATE_ERROR)
	if !strings.Contains(wrong.Error+strings.Join(wrong.LogTail, "\n"), "authentication") {
		t.Fatalf("the engine with another key failed, but not saying why: %s %v", wrong.Error, wrong.LogTail)
	}
	encKey, encCheck := testKey(5)
	withEnc := engine("ns/v-e", key)
	withEnc.GetEngine().EncryptionKey, withEnc.GetEngine().EncryptionKeyCheck = encKey, encCheck
	if _, err := im.c.ProcessCreate(ctx, withEnc); err != nil {
		t.Fatal(err)
	}
	e := waitState(t, im.c, "ns/v-e", imv1.ProcessState_PROCESS_STATE_RUNNING)
	if len(e.GetEngine().GetAuthKey()) != 0 || len(e.GetEngine().GetEncryptionKey()) != 0 {
		t.Fatal("the instance manager reported a key back")
	}
	for _, f := range []string{"cmdline", "environ"} {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/%s", e.Pid, f))
		if err != nil {
			t.Fatal(err)
		}
		if bytes.Contains(b, key) || bytes.Contains(b, encKey) {
			t.Fatalf("a key is in the engine's /proc/PID/%s", f)
		}
	}
	if a := strings.Join(e.Args, " "); !strings.Contains(a, "--auth-key-fd 4") || !strings.Contains(a, "--encryption-key-fd 5 --encryption-key-check "+encCheck) {
		t.Fatalf("engine args %v: no --auth-key-fd 4, --encryption-key-fd 5 with the check", e.Args)
	}
	good.Close()

	// A key of the wrong size is refused with the reason.
	bad := replicaReq("ns/v-bad", filepath.Join(im.dir, "v-bad"))
	bad.GetReplica().AuthKey = []byte("short")
	if _, err := im.c.ProcessCreate(ctx, bad); grpcstatus.Code(err) != codes.InvalidArgument {
		t.Fatalf("a 5-byte key: %v", err)
	}
}

// TestInstanceManagerEncryptedEngine: an engine spec with an encryption
// key (and no auth key: the encryption key alone on descriptor 5) starts
// an engine whose volume is encrypted: what is written through its NBD
// socket reads back, and no replica's files hold the plaintext. A spec
// whose key check is another key's makes an engine that fails before it
// opens a replica, the reason in the process's error or log tail, and the
// running engine is left serving.
func TestInstanceManagerEncryptedEngine(t *testing.T) {
	needTool(t, "qemu-io")
	ctx := context.Background()
	im := startIM(t, freePortRange(t, 16))
	var addrs []*imv1.ReplicaAddress
	var dirs []string
	for i, unix := range []bool{true, false} {
		name := fmt.Sprintf("ns/enc-r-%d", i)
		dirs = append(dirs, filepath.Join(im.dir, fmt.Sprintf("enc-r%d", i)))
		req := replicaReq(name, dirs[i])
		req.GetReplica().UnixSocket = unix
		if _, err := im.c.ProcessCreate(ctx, req); err != nil {
			t.Fatal(err)
		}
		p := waitState(t, im.c, name, imv1.ProcessState_PROCESS_STATE_RUNNING)
		addrs = append(addrs, &imv1.ReplicaAddress{Data: p.DataAddress, Control: p.ControlAddress})
	}
	key, check := testKey(6)
	engine := func(name, check string) *imv1.ProcessCreateRequest {
		return &imv1.ProcessCreateRequest{Name: name, Spec: &imv1.ProcessCreateRequest_Engine{Engine: &imv1.EngineSpec{
			VolumeName: "enc", Replicas: addrs, Frontend: imv1.Frontend_FRONTEND_NBD, NbdKernel: imv1.NBDKernel_NBD_KERNEL_OFF,
			EncryptionKey: key, EncryptionKeyCheck: check}}}
	}
	if _, err := im.c.ProcessCreate(ctx, engine("ns/enc-e", check)); err != nil {
		t.Fatal(err)
	}
	e := waitState(t, im.c, "ns/enc-e", imv1.ProcessState_PROCESS_STATE_RUNNING)
	if a := strings.Join(e.Args, " "); !strings.Contains(a, "--encryption-key-fd 5 --encryption-key-check "+check) || strings.Contains(a, "--auth-key-fd") {
		t.Fatalf("engine args: %v", e.Args)
	}
	pat := filepath.Join(t.TempDir(), "plaintext")
	if err := os.WriteFile(pat, plaintext(1<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	uri := "nbd+unix:///enc?socket=" + e.Endpoint.Socket
	qemuIO(t, uri, "write -s "+pat+" 1M 1M", "flush")
	qemuIO(t, uri, "read -P 0 0 1M", "read -P 0 2M 14M")
	if got := volumeBytes(t, uri); !bytes.Equal(got[1<<20:2<<20], plaintext(1<<20)) {
		t.Fatal("the encrypted volume does not read back what was written")
	}
	if f := filesHolding(t, dirs, []byte(plaintextLine)); len(f) > 0 {
		t.Fatalf("plaintext on the replicas of an engine given an encryption key: %v", f)
	}

	_, otherCheck := testKey(7)
	if _, err := im.c.ProcessCreate(ctx, engine("ns/enc-wrong", otherCheck)); err != nil {
		t.Fatal(err)
	}
	wrong := waitState(t, im.c, "ns/enc-wrong", imv1.ProcessState_PROCESS_STATE_ERROR)
	why := wrong.Error + "\n" + strings.Join(wrong.LogTail, "\n")
	if !strings.Contains(why, "the encryption key given is not the key volume enc was created with (key check "+check+", want "+otherCheck+")") ||
		!strings.Contains(why, "give the volume's own key") {
		t.Fatalf("the engine with a mismatching key check failed, but not saying why: %s", why)
	}
	if strings.Contains(why, "engine opened") {
		t.Fatalf("the engine with a mismatching key check opened the replicas:\n%s", why)
	}
	qemuIO(t, uri, "write -s "+pat+" 4M 1M", "flush")
	if got := volumeBytes(t, uri); !bytes.Equal(got[4<<20:5<<20], plaintext(1<<20)) {
		t.Fatal("the running engine stopped serving after the refused one")
	}
}

// TestInstanceManagerRequiresKeysOnTheNetwork: an instance manager whose
// processes serve a network address refuses a spec without a key.
func TestInstanceManagerRequiresKeysOnTheNetwork(t *testing.T) {
	dir := t.TempDir()
	pki := newTestPKI(t, dir, "instance-manager")
	// The rule looks at the address the processes serve and report
	// (--process-host): a name that is not loopback is enough to test it.
	im := start(t, append([]string{"instance-manager", "--listen", "127.0.0.1:0", "--process-host", "cairn-test-node.invalid", "--node", "n",
		"--log-dir", filepath.Join(dir, "logs"), "--data-dir", dir, "--port-range", freePortRange(t, 2)}, pki.flags...)...)
	conn, err := grpc.NewClient(im.control, grpc.WithTransportCredentials(credentials.NewTLS(pki.manager(t))))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_, err = imv1.NewInstanceManagerServiceClient(conn).ProcessCreate(context.Background(), replicaReq("ns/r", filepath.Join(dir, "r")))
	if grpcstatus.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "key") {
		t.Fatalf("a replica without a key on a network address: %v", err)
	}
}

// TestChildrenServeMutualTLS: an instance manager with mutual TLS hands
// its certificate files to its engines and replicas. Their control ports
// then refuse a client without a certificate of the CA (nothing can be
// read or written through the replica's control API), and serve the
// manager; the engine, a client of its replicas' control ports with the
// node's certificate, opens a replica, adds a second one and rebuilds it
// (the rebuild reads and writes over those ports) to RW. With --data-tls
// the replicas' data ports speak TLS too: a client with the volume's key
// but no TLS is refused there, one with TLS and the key is served, and
// the engine's volume reads back what qemu-io wrote through it.
func TestChildrenServeMutualTLS(t *testing.T) {
	for _, dataTLS := range []bool{false, true} {
		t.Run(fmt.Sprintf("data-tls=%v", dataTLS), func(t *testing.T) { childrenServeMutualTLS(t, dataTLS) })
	}
}

func childrenServeMutualTLS(t *testing.T, dataTLS bool) {
	pki := newTestPKI(t, t.TempDir(), "cairn-instance-manager")
	flags := pki.flags
	if dataTLS {
		flags = append(slices.Clone(flags), "--data-tls")
	}
	im := startIM(t, freePortRange(t, 8), flags...)
	manager := pki.manager(t)
	conn, err := grpc.NewClient(im.p.control, grpc.WithTransportCredentials(credentials.NewTLS(manager)))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	imc := imv1.NewInstanceManagerServiceClient(conn)
	ctx := context.Background()
	key := bytes.Repeat([]byte{3}, 32)
	var reps []*imv1.Process
	for _, n := range []string{"ns/v-r0", "ns/v-r1"} {
		req := replicaReq(n, filepath.Join(im.dir, strings.TrimPrefix(n, "ns/")))
		req.GetReplica().AuthKey = key
		if _, err := imc.ProcessCreate(ctx, req); err != nil {
			t.Fatal(err)
		}
		reps = append(reps, waitState(t, imc, n, imv1.ProcessState_PROCESS_STATE_RUNNING))
	}

	// Nobody without a certificate of the CA reaches the replica's
	// control API: not without TLS, not without a certificate, not with
	// another CA's.
	noCert := pki.client(nil, nil)
	otherCA := newTestPKI(t, t.TempDir(), "cairn-instance-manager")
	otherCert, otherKey := issue(t, otherCA.ca, otherCA.caKey, "cairn-manager", false)
	for _, creds := range []credentials.TransportCredentials{insecure.NewCredentials(), credentials.NewTLS(noCert), credentials.NewTLS(pki.client(otherCert, otherKey))} {
		cc, err := grpc.NewClient(reps[0].ControlAddress, grpc.WithTransportCredentials(creds))
		if err != nil {
			t.Fatal(err)
		}
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		_, err = replicav1.NewReplicaServiceClient(cc).Info(cctx, &replicav1.InfoRequest{})
		cancel()
		cc.Close()
		if err == nil {
			t.Fatal("the replica's control API answered a client without a certificate")
		}
	}

	if _, err := imc.ProcessCreate(ctx, &imv1.ProcessCreateRequest{Name: "ns/v-e", Spec: &imv1.ProcessCreateRequest_Engine{Engine: &imv1.EngineSpec{
		VolumeName: "v", Replicas: []*imv1.ReplicaAddress{{Data: reps[0].DataAddress, Control: reps[0].ControlAddress}},
		Frontend: imv1.Frontend_FRONTEND_NBD, NbdKernel: imv1.NBDKernel_NBD_KERNEL_OFF, AuthKey: key}}}); err != nil {
		t.Fatal(err)
	}
	e := waitState(t, imc, "ns/v-e", imv1.ProcessState_PROCESS_STATE_RUNNING)
	engineAPI := func(cfg *tls.Config) (enginev1.EngineServiceClient, func()) {
		cc, err := grpc.NewClient(e.ControlAddress, grpc.WithTransportCredentials(credentials.NewTLS(cfg)))
		if err != nil {
			t.Fatal(err)
		}
		return enginev1.NewEngineServiceClient(cc), func() { cc.Close() }
	}
	for _, cfg := range []*tls.Config{noCert, pki.client(otherCert, otherKey)} {
		rogue, done := engineAPI(cfg)
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		_, err = rogue.ReplicaList(cctx, &enginev1.ReplicaListRequest{})
		cancel()
		done()
		if err == nil {
			t.Fatal("the engine's control API answered a client without a certificate of its CA")
		}
	}
	ec, done := engineAPI(manager)
	defer done()
	needTool(t, "qemu-io")
	uri := "nbd+unix:///v?socket=" + e.Endpoint.Socket
	qemuIO(t, uri, "write -P 0x3c 0 1M", "flush") // data for the rebuild to copy
	second := reps[1].DataAddress + "," + reps[1].ControlAddress
	if _, err := ec.ReplicaAdd(ctx, &enginev1.ReplicaAddRequest{Address: second}); err != nil {
		t.Fatalf("add a replica through the engine: %v", err)
	}
	waitPulled(t, ec)
	if !dataTLS {
		return
	}
	qemuIO(t, uri, "read -P 0x3c 0 1M")
	plain, err := dataconn.Dial(ctx, "tcp", reps[1].DataAddress, dataconn.ClientOptions{Conns: 1, Key: key, HandshakeTimeout: 5 * time.Second})
	if err == nil {
		err = plain.ReadAt(ctx, make([]byte, 4096), 0)
		plain.Close()
	}
	if err == nil {
		t.Fatal("a replica with --data-tls served a data client without TLS")
	}
	tc := pki.manager(t)
	tc.ServerName = "cairn-instance-manager"
	c, err := dataconn.Dial(ctx, "tcp", reps[1].DataAddress, dataconn.ClientOptions{Conns: 1, Key: key, TLS: tc})
	if err != nil {
		t.Fatalf("a data client with TLS and the key: %v", err)
	}
	defer c.Close()
	// The replica answers (its epoch fence refuses a client that is not
	// the engine: an answer from the replica, not a dropped connection).
	var remote *dataconn.RemoteError
	if err := c.ReadAt(ctx, make([]byte, 4096), 0); !errors.As(err, &remote) || !strings.Contains(err.Error(), "epoch") {
		t.Fatalf("a read over TLS with the key was not answered by the replica: %v", err)
	}
	// The local socket stays on the node: a plain client with the key is
	// answered there.
	sock, ok := strings.CutPrefix(reps[1].LocalDataAddress, "unix:")
	if !ok {
		t.Fatalf("replica reports local data address %q, want unix:PATH", reps[1].LocalDataAddress)
	}
	lc, err := dataconn.Dial(ctx, "unix", sock, dataconn.ClientOptions{Conns: 1, Key: key})
	if err != nil {
		t.Fatalf("a plain client with the key on the local socket: %v", err)
	}
	defer lc.Close()
	if err := lc.ReadAt(ctx, make([]byte, 4096), 0); !errors.As(err, &remote) || !strings.Contains(err.Error(), "epoch") {
		t.Fatalf("a read on the local socket with the key was not answered by the replica: %v", err)
	}
}
