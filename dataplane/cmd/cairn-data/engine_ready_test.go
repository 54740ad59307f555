package main

import (
	"bufio"
	"context"
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	enginev1 "github.com/cairn-io/cairn/dataplane/api/engine/v1"
	"github.com/cairn-io/cairn/dataplane/internal/ready"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// startReady starts cairn-data with args and --ready-fd 3, descriptor 3
// being a pipe as the instance manager gives it, and returns the process
// (its fields from the ready line on stdout, as start fills them) and the
// report read from the pipe.
func startReady(t *testing.T, args ...string) (*proc, ready.Report) {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	p := &proc{cmd: command(append(args, "--ready-fd", "3")...), stderr: &syncBuffer{}, exited: make(chan struct{})}
	p.cmd.ExtraFiles = []*os.File{w} // descriptor 3 in the child
	out, err := p.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	p.cmd.Stderr = p.stderr
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	w.Close() // the child has its own; the report's end is the child's close
	go func() { p.waitErr = p.cmd.Wait(); close(p.exited) }()
	t.Cleanup(func() { p.cmd.Process.Kill(); <-p.exited })
	type result struct {
		r   ready.Report
		err error
	}
	got := make(chan result, 1)
	go func() {
		rep, err := ready.Read(r)
		got <- result{rep, err}
	}()
	var res result
	select {
	case res = <-got:
	case <-time.After(deadline.Scale(2 * time.Minute)):
		t.Fatalf("no ready report from cairn-data %v\n%s", args, p.stderr.String())
	}
	if res.err != nil {
		t.Fatalf("ready report of cairn-data %v: %v\n%s", args, res.err, p.stderr.String())
	}
	// The ready line on stdout comes first and stays as it was.
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil || !strings.HasPrefix(line, "ready ") {
		t.Fatalf("ready line %q, %v", line, err)
	}
	p.readyFields(line)
	go func() { _, _ = io.Copy(io.Discard, out) }() // drains the output; ends with the process
	return p, res.r
}

// volumeInfo asks an engine's control API for its VolumeInfo.
func volumeInfo(t *testing.T, control string) *enginev1.VolumeInfoResponse {
	t.Helper()
	cc, err := grpc.NewClient(control, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	in, err := enginev1.NewEngineServiceClient(cc).VolumeInfo(context.Background(), &enginev1.VolumeInfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	return in
}

// TestEngineReadyReport: an engine started with --ready-fd writes one
// report there once it serves: the endpoint and what it is, the NBD
// socket, the control address (none without --listen), the size, and,
// when --nbd-kernel auto found no kernel device, why. VolumeInfo says the
// same. The ready line on stdout is unchanged.
func TestEngineReadyReport(t *testing.T) {
	dir := t.TempDir()
	rep := start(t, "replica", "--dir", filepath.Join(dir, "r"), "--size", "16Mi", "--listen", "127.0.0.1:0", "--control-listen", "127.0.0.1:0")
	base := []string{"engine", "--name", "vol", "--replica", rep.data + "," + rep.control}
	stop := func(p *proc) { // SIGTERM: a killed fuse engine would leave its mount behind
		p.cmd.Process.Signal(syscall.SIGTERM)
		if code := p.waitExit(t); code != 0 {
			t.Errorf("engine exit %d\n%s", code, p.stderr.String())
		}
	}

	t.Run("socket only", func(t *testing.T) {
		sock := filepath.Join(dir, "off.sock")
		p, r := startReady(t, append(base, "--frontend", "nbd", "--nbd-socket", sock, "--nbd-kernel", "off")...)
		defer stop(p)
		want := ready.Report{Size: 16 << 20, Endpoint: sock, EndpointKind: ready.EndpointNBDSocket, Socket: sock}
		if r != want {
			t.Fatalf("report %+v, want %+v", r, want)
		}
		if p.endpoint != sock || p.control != "none" {
			t.Fatalf("ready line: endpoint=%s control=%s", p.endpoint, p.control)
		}
	})

	t.Run("auto without the driver", func(t *testing.T) { readyReportWithoutDriver(t, dir, base, stop) })

	t.Run("fuse", func(t *testing.T) {
		needRoot(t)
		p, r := startReady(t, append(base, "--frontend", "fuse", "--fuse-dir", filepath.Join(dir, "fuse"), "--listen", "127.0.0.1:0")...)
		defer stop(p)
		if r.EndpointKind != ready.EndpointLoopDevice || !strings.HasPrefix(r.Endpoint, "/dev/loop") || r.Endpoint != p.endpoint ||
			r.Socket != "" || r.Fallback != "" || r.Size != 16<<20 {
			t.Fatalf("report %+v (ready line endpoint=%s)", r, p.endpoint)
		}
		if in := volumeInfo(t, r.Control); in.EndpointKind != string(ready.EndpointLoopDevice) || in.Endpoint != r.Endpoint {
			t.Fatalf("VolumeInfo %v, report %+v", in, r)
		}
	})

	// A descriptor the engine was not given, or one of the standard three,
	// is refused before anything is opened.
	for _, fd := range []string{"99", "1"} {
		args := append(base, "--frontend", "nbd", "--nbd-socket", filepath.Join(dir, "bad.sock"), "--nbd-kernel", "off", "--ready-fd", fd)
		code, stderr := runExit(t, args...)
		if code == 0 || !strings.Contains(stderr, "--ready-fd "+fd+":") || strings.Contains(stderr, "engine opened") {
			t.Fatalf("--ready-fd %s: exit %d\n%s", fd, code, stderr)
		}
	}
}

// readyReportWithoutDriver: with --nbd-kernel auto on a host without the
// nbd driver, the report, VolumeInfo and ctl info name the socket and why
// there is no kernel device.
func readyReportWithoutDriver(t *testing.T, dir string, base []string, stop func(*proc)) {
	if _, err := os.Stat("/sys/module/nbd"); err == nil {
		t.Skip("this host has the nbd driver: auto attaches /dev/nbdN (TestNBDKernelExpand checks that report in UML)")
	}
	sock := filepath.Join(dir, "auto.sock")
	p, r := startReady(t, append(base, "--frontend", "nbd", "--nbd-socket", sock, "--nbd-kernel", "auto", "--listen", "127.0.0.1:0")...)
	defer stop(p)
	if r.EndpointKind != ready.EndpointNBDSocket || r.Endpoint != sock || r.Socket != sock || r.Size != 16<<20 {
		t.Fatalf("report %+v: want the socket %s as an nbd-socket endpoint", r, sock)
	}
	if !strings.Contains(r.Fallback, "nbd driver") {
		t.Fatalf("report %+v: the fallback should say the kernel has no nbd driver", r)
	}
	if r.Control == "" || r.Control != p.control {
		t.Fatalf("report control %q, ready line control=%s", r.Control, p.control)
	}
	in := volumeInfo(t, r.Control)
	if in.EndpointKind != string(ready.EndpointNBDSocket) || in.Fallback != r.Fallback || in.Socket != sock || in.Endpoint != sock {
		t.Fatalf("VolumeInfo %v, report %+v", in, r)
	}
	v := &volume{engine: p}
	if out := v.ctl(t, "info"); !strings.Contains(out, sock+" (nbd-socket)") || !strings.Contains(out, "no kernel block device: "+r.Fallback) {
		t.Fatalf("ctl info:\n%s", out)
	}
}
