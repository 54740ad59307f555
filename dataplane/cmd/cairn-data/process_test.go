package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	grpcstatus "google.golang.org/grpc/status"

	replicav1 "github.com/cairn-io/cairn/dataplane/api/replica/v1"
	"github.com/cairn-io/cairn/dataplane/dataconn"
	"github.com/cairn-io/cairn/dataplane/internal/uml"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// TestMain lets tests run this package's main code as a real child
// process: with CAIRN_DATA_EXEC=1 the test binary acts as cairn-data.
// Inside User-Mode Linux (the *InUML tests) it is init.
func TestMain(m *testing.M) {
	if os.Getenv("CAIRN_DATA_EXEC") == "1" {
		main()
		return
	}
	os.Exit(uml.Main(m))
}

// proc is a running cairn-data child process.
type proc struct {
	cmd      *exec.Cmd
	data     string
	local    string // a replica's --listen-local, from its ready line
	control  string
	endpoint string
	stderr   *syncBuffer
	exited   chan struct{}
	waitErr  error
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// command returns a cairn-data command from the test binary.
func command(args ...string) *exec.Cmd {
	cmd := exec.Command(os.Args[0], args...)
	cmd.Env = append(os.Environ(), "CAIRN_DATA_EXEC=1")
	return cmd
}

// start runs cairn-data with args and waits for its "ready" line.
func start(t testing.TB, args ...string) *proc {
	t.Helper()
	return startCmd(t, command(args...))
}

// startCmd is start with a command made by command (and set up further,
// e.g. with descriptors to inherit).
func startCmd(t testing.TB, cmd *exec.Cmd) *proc {
	t.Helper()
	args := cmd.Args[1:]
	p := &proc{cmd: cmd, stderr: &syncBuffer{}, exited: make(chan struct{})}
	out, err := p.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	p.cmd.Stderr = p.stderr
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { p.waitErr = p.cmd.Wait(); close(p.exited) }()
	t.Cleanup(func() { p.cmd.Process.Kill(); <-p.exited })
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		<-p.exited
		t.Fatalf("cairn-data %v exited before ready: %v\n%s", args, err, p.stderr.String())
	}
	p.readyFields(line)
	if !strings.HasPrefix(line, "ready ") {
		t.Fatalf("unexpected first line %q", line)
	}
	go func() { _, _ = io.Copy(io.Discard, out) }() // drains the output; ends with the process
	return p
}

// readyFields fills p's addresses from its ready line.
func (p *proc) readyFields(line string) {
	for _, f := range strings.Fields(line) {
		if v, ok := strings.CutPrefix(f, "data="); ok {
			p.data = v
		}
		if v, ok := strings.CutPrefix(f, "local="); ok {
			p.local = v
		}
		if v, ok := strings.CutPrefix(f, "control="); ok {
			p.control = v
		}
		if v, ok := strings.CutPrefix(f, "endpoint="); ok {
			p.endpoint = v
		}
	}
}

func (p *proc) waitExit(t testing.TB) int {
	t.Helper()
	select {
	case <-p.exited:
	case <-time.After(deadline.Scale(60 * time.Second)):
		t.Fatalf("cairn-data did not exit\n%s", p.stderr.String())
	}
	return p.cmd.ProcessState.ExitCode()
}

// stopClean sends the process SIGTERM and fails the test unless it exits
// with status 0; what names it in the failure ("engine", "replica").
func (p *proc) stopClean(t testing.TB, what string) {
	t.Helper()
	p.cmd.Process.Signal(syscall.SIGTERM)
	if code := p.waitExit(t); code != 0 {
		t.Fatalf("%s exit %d\n%s", what, code, p.stderr.String())
	}
}

// logged reports whether the process's stderr says s within 30 s (scaled). Its
// stderr reaches the buffer through a pipe the exec package copies from,
// so a line logged before the ready line may arrive after it.
func (p *proc) logged(s string) bool {
	until := deadline.After(30 * time.Second)
	for !strings.Contains(p.stderr.String(), s) {
		if time.Now().After(until) {
			return false
		}
		time.Sleep(10 * time.Millisecond)
	}
	return true
}

func dialData(t testing.TB, addr string, epoch uint64) *dataconn.Client {
	t.Helper()
	c, err := dataconn.Dial(context.Background(), "tcp", addr, dataconn.ClientOptions{Conns: 2})
	if err != nil {
		t.Fatal(err)
	}
	c.SetEpoch(epoch)
	t.Cleanup(func() { c.Close() })
	return c
}

func dialControl(t testing.TB, addr string) replicav1.ReplicaServiceClient {
	t.Helper()
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return replicav1.NewReplicaServiceClient(cc)
}

// runExit runs cairn-data to completion and returns its exit code and
// stderr. Every call expects the process to end by itself: one still
// running after runExitWait is killed and fails the test with its stderr,
// rather than holding the package until go test's own timeout.
func runExit(t *testing.T, args ...string) (int, string) {
	t.Helper()
	cmd := command(args...)
	var stderr syncBuffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(deadline.Scale(runExitWait)):
		_ = cmd.Process.Kill()
		<-done
		t.Fatalf("cairn-data %v did not exit within %v; its stderr:\n%s", args, deadline.Scale(runExitWait), stderr.String())
	}
	return cmd.ProcessState.ExitCode(), stderr.String()
}

// runExitWait is how long runExit lets a process run.
const runExitWait = 3 * time.Minute

func TestReplicaCommandErrors(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(dir+"/afile", []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	// A replica to conflict with.
	p := start(t, "replica", "--dir", dir+"/r", "--size", "4Mi", "--listen", "127.0.0.1:0")
	pu := start(t, "replica", "--dir", dir+"/u", "--size", "4Mi", "--listen", "unix:"+dir+"/u.sock")
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"missing flags", []string{"replica"}, "usage: cairn-data replica"},
		{"bad size", []string{"replica", "--dir", dir + "/x", "--size", "ten", "--listen", "127.0.0.1:0"}, "--size: \"ten\" is not a size"},
		{"dir is a file", []string{"replica", "--dir", dir + "/afile", "--size", "4Mi", "--listen", "127.0.0.1:0"}, "is a file, not a directory"},
		{"size mismatch", []string{"replica", "--dir", dir + "/r", "--size", "8Mi", "--listen", "127.0.0.1:0"}, "holds a replica of 4194304 bytes, but 8388608 were asked for"},
		{"port in use", []string{"replica", "--dir", dir + "/y", "--size", "4Mi", "--listen", p.data}, "the port is already in use"},
		{"socket in use", []string{"replica", "--dir", dir + "/z", "--size", "4Mi", "--listen", pu.data}, "another server is listening on it"},
		{"local socket in use", []string{"replica", "--dir", dir + "/z", "--size", "4Mi", "--listen", "127.0.0.1:0", "--listen-local", pu.data}, "--listen-local " + strings.TrimPrefix(pu.data, "unix:") + ": another server is listening on it"},
		{"local listener on TCP", []string{"replica", "--dir", dir + "/z", "--size", "4Mi", "--listen", "127.0.0.1:0", "--listen-local", "127.0.0.1:0"}, "--listen-local 127.0.0.1:0: give unix:PATH"},
		{"local listener without a path", []string{"replica", "--dir", dir + "/z", "--size", "4Mi", "--listen", "127.0.0.1:0", "--listen-local", "unix:"}, "--listen-local unix:: give unix:PATH"},
		{"local listener beside a unix one", []string{"replica", "--dir", dir + "/z", "--size", "4Mi", "--listen", "unix:" + dir + "/d.sock", "--listen-local", "unix:" + dir + "/l.sock"}, "is already a unix socket; --listen-local adds one beside a TCP --listen"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			code, stderr := runExit(t, tc.args...)
			if code == 0 || !strings.Contains(stderr, tc.want) {
				t.Fatalf("exit %d, stderr:\n%s\nwant it to contain %q", code, stderr, tc.want)
			}
		})
	}
}

// TestReplicaUnixSocket serves a replica's data on a unix socket: a socket
// file left by a replica that died is replaced, and a clean stop removes
// the socket.
func TestReplicaUnixSocket(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "r.sock")
	stale, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	stale.SetUnlinkOnClose(false)
	stale.Close()
	p := start(t, "replica", "--dir", filepath.Join(dir, "r"), "--size", "4Mi", "--listen", "unix:"+sock)
	if p.data != "unix:"+sock {
		t.Fatalf("ready line data=%q, want unix:%s", p.data, sock)
	}
	c, err := dataconn.Dial(context.Background(), "unix", sock, dataconn.ClientOptions{Conns: 2})
	if err != nil {
		t.Fatal(err)
	}
	want := bytes.Repeat([]byte{0xc3}, 8192)
	if err := c.WriteAt(context.Background(), want, 4096, false); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(want))
	if err := c.ReadAt(context.Background(), got, 4096); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("read back over the unix socket: err=%v equal=%v", err, bytes.Equal(got, want))
	}
	c.Close()
	p.stopClean(t, "replica")
	if _, err := os.Stat(sock); !os.IsNotExist(err) {
		t.Fatalf("the replica left its socket behind: %v", err)
	}
}

func TestReplicaServesAndControls(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	p := start(t, "replica", "--dir", dir, "--size", "16Mi", "--listen", "127.0.0.1:0", "--control-listen", "127.0.0.1:0")
	ctl := dialControl(t, p.control)
	if _, err := ctl.SetEpoch(ctx, &replicav1.SetEpochRequest{Epoch: 3}); err != nil {
		t.Fatal(err)
	}
	d := dialData(t, p.data, 3)
	if err := d.WriteAt(ctx, bytes.Repeat([]byte{7}, 8192), 1<<20, false); err != nil {
		t.Fatal(err)
	}
	if _, err := ctl.SnapshotCreate(ctx, &replicav1.SnapshotCreateRequest{Name: "snap1", UserCreated: true, Epoch: 3}); err != nil {
		t.Fatal(err)
	}
	if err := d.WriteAt(ctx, bytes.Repeat([]byte{8}, 4096), 1<<20, true); err != nil {
		t.Fatal(err)
	}
	in, err := ctl.Info(ctx, &replicav1.InfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if in.Size != 16<<20 || in.Epoch != 3 || len(in.Snapshots) != 1 || in.Snapshots[0].DataBytes != 8192 || in.HeadBytes != 4096 || in.Dirty.Dirty != 1 || in.DataAddress != p.data {
		t.Fatalf("info: %+v", in)
	}
	// A client with an old epoch is refused.
	old := dialData(t, p.data, 2)
	if err := old.WriteAt(ctx, []byte("x"), 0, false); !errors.Is(err, dataconn.CodeStaleEpoch) {
		t.Fatalf("stale client: %v", err)
	}
	if _, err := ctl.SnapshotCreate(ctx, &replicav1.SnapshotCreateRequest{Name: "snap1", Epoch: 3}); code(err) != "AlreadyExists" {
		t.Fatalf("duplicate snapshot: %v", err)
	}
	if _, err := ctl.SnapshotDelete(ctx, &replicav1.SnapshotDeleteRequest{Name: "nope", Epoch: 3}); code(err) != "NotFound" {
		t.Fatalf("missing snapshot: %v", err)
	}
	if _, err := ctl.Expand(ctx, &replicav1.ExpandRequest{Size: 1 << 20, Epoch: 3}); code(err) != "InvalidArgument" {
		t.Fatalf("shrink: %v", err)
	}
	if _, err := ctl.Expand(ctx, &replicav1.ExpandRequest{Size: 32 << 20, Epoch: 3}); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 8192)
	if err := d.ReadAt(ctx, got, 1<<20); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got[:4096], bytes.Repeat([]byte{8}, 4096)) || !bytes.Equal(got[4096:], bytes.Repeat([]byte{7}, 4096)) {
		t.Fatal("reads through the chain are wrong")
	}
	if _, err := ctl.SnapshotRevert(ctx, &replicav1.SnapshotRevertRequest{Name: "snap1", Epoch: 3}); err != nil {
		t.Fatal(err)
	}
	if err := d.ReadAt(ctx, got, 1<<20); err != nil || !bytes.Equal(got, bytes.Repeat([]byte{7}, 8192)) {
		t.Fatalf("after revert: %v", err)
	}
	if _, err := ctl.Close(ctx, &replicav1.CloseRequest{}); err != nil {
		t.Fatal(err)
	}
	if code := p.waitExit(t); code != 0 {
		t.Fatalf("exit %d after Close\n%s", code, p.stderr.String())
	}
}

// code is the gRPC status code of err, as a name ("OK" for nil).
func code(err error) string { return grpcstatus.Code(err).String() }

func TestReplicaSIGTERM(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	p := start(t, "replica", "--dir", dir, "--size", "4Mi", "--listen", "127.0.0.1:0")
	d := dialData(t, p.data, 0)
	if err := d.WriteAt(ctx, []byte("kept"), 0, false); err != nil {
		t.Fatal(err)
	}
	p.stopClean(t, "replica")
	p = start(t, "replica", "--dir", dir, "--listen", "127.0.0.1:0")
	d = dialData(t, p.data, 0)
	got := make([]byte, 4)
	if err := d.ReadAt(ctx, got, 0); err != nil || string(got) != "kept" {
		t.Fatalf("after restart: %q, %v", got, err)
	}
}
