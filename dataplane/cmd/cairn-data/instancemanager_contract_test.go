package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	grpcstatus "google.golang.org/grpc/status"

	imv1 "github.com/cairn-io/cairn/dataplane/api/instancemanager/v1"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// TestInstanceManagerNamespacedNames: two processes whose objects share a
// name in two namespaces are two processes, each with its own log.
func TestInstanceManagerNamespacedNames(t *testing.T) {
	ctx := context.Background()
	im := startIM(t, freePortRange(t, 8))
	for _, ns := range []string{"team-a", "team-b"} {
		if _, err := im.c.ProcessCreate(ctx, replicaReq(ns+"/vol-r-0", filepath.Join(im.dir, ns))); err != nil {
			t.Fatal(err)
		}
	}
	a := waitState(t, im.c, "team-a/vol-r-0", imv1.ProcessState_PROCESS_STATE_RUNNING)
	b := waitState(t, im.c, "team-b/vol-r-0", imv1.ProcessState_PROCESS_STATE_RUNNING)
	if a.Pid == b.Pid || a.DataAddress == b.DataAddress {
		t.Fatalf("namespaced processes share a process or address: %v %v", a, b)
	}
	for _, ns := range []string{"team-a", "team-b"} {
		if _, err := os.Stat(filepath.Join(im.logDir, ns+"_vol-r-0.log")); err != nil {
			t.Fatalf("log of %s/vol-r-0: %v", ns, err)
		}
	}
	for _, bad := range []string{"a/b/c", "/vol", "ns/", "NS/vol", "ns_x/vol"} {
		if _, err := im.c.ProcessCreate(ctx, replicaReq(bad, filepath.Join(im.dir, "x"))); grpcstatus.Code(err) != codes.InvalidArgument {
			t.Fatalf("name %q: %v", bad, err)
		}
	}
}

// TestInstanceManagerReplicaData: a replica's directory must be inside a
// data directory, with no link on the way; its data is deleted through the
// instance manager, and not while a process uses it.
func TestInstanceManagerReplicaData(t *testing.T) {
	ctx := context.Background()
	im := startIM(t, freePortRange(t, 8))
	dir := filepath.Join(im.dir, "replicas", "vol-r-0")
	if _, err := im.c.ProcessCreate(ctx, replicaReq("vol-r-0", dir)); err != nil {
		t.Fatal(err)
	}
	waitState(t, im.c, "vol-r-0", imv1.ProcessState_PROCESS_STATE_RUNNING)
	del := func(d string) error {
		_, err := im.c.ReplicaDataDelete(ctx, &imv1.ReplicaDataDeleteRequest{DataDir: d})
		return err
	}
	// In use: by the running replica, also through a parent directory.
	for _, d := range []string{dir, filepath.Dir(dir)} {
		if err := del(d); grpcstatus.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "vol-r-0") {
			t.Fatalf("deleting %s while the replica runs: %v", d, err)
		}
	}
	// A second process on the same directory is refused too.
	if _, err := im.c.ProcessCreate(ctx, replicaReq("vol-r-0-copy", dir)); grpcstatus.Code(err) != codes.FailedPrecondition {
		t.Fatalf("a second replica on %s: %v", dir, err)
	}
	if _, err := os.Stat(filepath.Join(dir, "volume.meta")); err != nil {
		t.Fatalf("the refused delete touched the replica: %v", err)
	}
	// Outside the data directories, or leading out through a link.
	outside := t.TempDir()
	victim := filepath.Join(outside, "keep")
	if err := os.WriteFile(victim, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(im.dir, "link")
	if err := os.Symlink(outside, link); err != nil {
		t.Fatal(err)
	}
	for _, d := range []string{outside, link, filepath.Join(link, "keep"), im.dir, "/", im.dir + "/replicas/../link", "replicas/vol-r-0"} {
		if err := del(d); grpcstatus.Code(err) != codes.InvalidArgument {
			t.Fatalf("deleting %q: %v", d, err)
		}
	}
	if _, err := im.c.ProcessCreate(ctx, replicaReq("linked", filepath.Join(link, "r"))); grpcstatus.Code(err) != codes.InvalidArgument {
		t.Fatalf("a replica through a link: %v", err)
	}
	if _, err := os.Stat(victim); err != nil {
		t.Fatalf("a file outside the data directories is gone: %v", err)
	}
	// Once the process is deleted, its data can be; twice is fine.
	if _, err := im.c.ProcessDelete(ctx, &imv1.ProcessDeleteRequest{Name: "vol-r-0"}); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if err := del(dir); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("replica directory after delete: %v", err)
	}
}

// fakeChild writes a script that stands in for cairn-data: it reports
// ready (unless silent), and on SIGTERM takes a second to finish (as an
// engine's final flush does) and records that it stopped cleanly.
func fakeChild(t *testing.T, silent bool) string {
	t.Helper()
	readyLine := `echo '{"size":4096}' >&3; exec 3>&-`
	if silent {
		readyLine = ":"
	}
	script := filepath.Join(t.TempDir(), "fake-cairn-data")
	body := fmt.Sprintf(`#!/bin/sh
trap 'sleep 1; echo clean > "$MARKER"; exit 0' TERM
env > "$MARKER.env"
%s
while :; do sleep 0.05; done
`, readyLine)
	if err := os.WriteFile(script, []byte(body), 0o755); err != nil {
		t.Fatal(err)
	}
	return script
}

// TestInstanceManagerDeleteDeadline: a ProcessDelete whose deadline is
// shorter than the process's shutdown returns DEADLINE_EXCEEDED but does
// not kill it: it stops cleanly, and the children's environment holds only
// what the instance manager was told to give them.
func TestInstanceManagerDeleteDeadline(t *testing.T) {
	ctx := context.Background()
	marker := filepath.Join(t.TempDir(), "stopped")
	t.Setenv("CAIRN_TEST_LEAK", "secret") // the instance manager's own environment
	im := startIM(t, freePortRange(t, 4), "--binary", fakeChild(t, false), "--child-env", "MARKER="+marker)
	w := watch(t, im.c)
	if _, err := im.c.ProcessCreate(ctx, replicaReq("slow", filepath.Join(im.dir, "slow"))); err != nil {
		t.Fatal(err)
	}
	waitState(t, im.c, "slow", imv1.ProcessState_PROCESS_STATE_RUNNING)
	env, err := os.ReadFile(marker + ".env")
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(env), "CAIRN_TEST_LEAK") || !strings.Contains(string(env), "MARKER=") || !strings.Contains(string(env), "PATH=") {
		t.Fatalf("child environment:\n%s", env)
	}
	dctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	if _, err := im.c.ProcessDelete(dctx, &imv1.ProcessDeleteRequest{Name: "slow"}); grpcstatus.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("delete with a short deadline: %v", err)
	}
	until := deadline.After(30 * time.Second)
	for !strings.Contains(strings.Join(w.states("slow"), ","), "DELETED") {
		if time.Now().After(until) {
			t.Fatalf("never deleted: %v", w.states("slow"))
		}
		time.Sleep(20 * time.Millisecond)
	}
	if b, err := os.ReadFile(marker); err != nil || strings.TrimSpace(string(b)) != "clean" {
		t.Fatalf("the process was killed instead of stopping cleanly: %q %v", b, err)
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, ev := range w.events {
		if ev.Process != nil && ev.Process.Name == "slow" && ev.Process.State == imv1.ProcessState_PROCESS_STATE_STOPPED && ev.Process.ExitCode != 0 {
			t.Fatalf("stopped with exit code %d, want 0", ev.Process.ExitCode)
		}
	}
}

// TestInstanceManagerReadyTimeout: a process that never reports ready is
// killed after the start timeout and shown in error with the reason.
func TestInstanceManagerReadyTimeout(t *testing.T) {
	ctx := context.Background()
	marker := filepath.Join(t.TempDir(), "stopped")
	im := startIM(t, freePortRange(t, 4), "--binary", fakeChild(t, true), "--child-env", "MARKER="+marker, "--start-timeout", "1s")
	if _, err := im.c.ProcessCreate(ctx, replicaReq("mute", filepath.Join(im.dir, "mute"))); err != nil {
		t.Fatal(err)
	}
	p := waitState(t, im.c, "mute", imv1.ProcessState_PROCESS_STATE_ERROR)
	if !strings.Contains(p.Error, "did not report ready within 1s") || alive(p.Pid) {
		t.Fatalf("mute process: error %q, alive %v", p.Error, alive(p.Pid))
	}
}

// TestInstanceManagerEngineEndpoint: an engine started from a typed spec
// with the replicas' reported addresses reports its endpoint and what it
// is: the NBD socket with the reason it has no /dev/nbdN (this host has no
// nbd driver), or the FUSE frontend's loop device.
func TestInstanceManagerEngineEndpoint(t *testing.T) {
	ctx := context.Background()
	im := startIM(t, freePortRange(t, 16))
	var addrs []*imv1.ReplicaAddress
	for i, unix := range []bool{false, true} {
		name := fmt.Sprintf("ns/v-r-%d", i)
		req := replicaReq(name, filepath.Join(im.dir, fmt.Sprintf("r%d", i)))
		req.GetReplica().UnixSocket = unix
		if _, err := im.c.ProcessCreate(ctx, req); err != nil {
			t.Fatal(err)
		}
		p := waitState(t, im.c, name, imv1.ProcessState_PROCESS_STATE_RUNNING)
		addrs = append(addrs, &imv1.ReplicaAddress{Data: p.DataAddress, Control: p.ControlAddress})
	}
	engine := func(name string, fe imv1.Frontend) *imv1.Process {
		t.Helper()
		_, err := im.c.ProcessCreate(ctx, &imv1.ProcessCreateRequest{Name: name, Spec: &imv1.ProcessCreateRequest_Engine{Engine: &imv1.EngineSpec{
			VolumeName: "v", Replicas: addrs, Frontend: fe}}})
		if err != nil {
			t.Fatal(err)
		}
		p := waitState(t, im.c, name, imv1.ProcessState_PROCESS_STATE_RUNNING)
		if p.ControlAddress == "" || p.SizeBytes != 16<<20 || p.Endpoint == nil {
			t.Fatalf("running engine: %v", p)
		}
		return p
	}
	stop := func(name string) {
		t.Helper()
		if _, err := im.c.ProcessDelete(ctx, &imv1.ProcessDeleteRequest{Name: name}); err != nil {
			t.Fatal(err)
		}
	}
	p := engine("ns/v-e-nbd", imv1.Frontend_FRONTEND_NBD)
	ep := p.Endpoint
	if ep.Kind != imv1.EndpointKind_ENDPOINT_KIND_NBD_SOCKET || ep.Path != ep.Socket || ep.Fallback == "" {
		t.Fatalf("nbd engine on a host without the nbd driver reports %v", ep)
	}
	if _, err := os.Stat(ep.Socket); err != nil {
		t.Fatalf("reported socket: %v", err)
	}
	stop("ns/v-e-nbd")
	if os.Geteuid() != 0 {
		t.Skip("the fuse frontend needs root (mount, loop devices)")
	}
	p = engine("ns/v-e-fuse", imv1.Frontend_FRONTEND_UNSPECIFIED) // the default: fuse
	ep = p.Endpoint
	if ep.Kind != imv1.EndpointKind_ENDPOINT_KIND_LOOP_DEVICE || !strings.HasPrefix(ep.Path, "/dev/loop") || ep.Fallback != "" {
		t.Fatalf("fuse engine reports %v", ep)
	}
	if fi, err := os.Stat(ep.Path); err != nil || fi.Mode()&os.ModeDevice == 0 {
		t.Fatalf("reported loop device %s: %v", ep.Path, err)
	}
	stop("ns/v-e-fuse")
}
