package main

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cairn-io/cairn/dataplane/dataconn"
)

// TestReplicaListenLocal: a replica with a TCP --listen and --listen-local
// serves its data on both and reports both (ready line and ready report).
// An engine given the socket writes through it with shared memory; after
// it stops, an engine given the TCP port reads every byte back. A clean
// stop removes the socket.
func TestReplicaListenLocal(t *testing.T) {
	needTool(t, "qemu-io")
	dir := t.TempDir()
	sock := filepath.Join(dir, "r.sock")
	r, rep := startReady(t, "replica", "--dir", filepath.Join(dir, "r"), "--size", "16Mi",
		"--listen", "127.0.0.1:0", "--listen-local", "unix:"+sock, "--control-listen", "127.0.0.1:0")
	if r.local != "unix:"+sock || rep.LocalData != "unix:"+sock || rep.Data != r.data || strings.HasPrefix(r.data, "unix:") {
		t.Fatalf("ready line data=%s local=%s, report %+v; want a TCP data address and local=unix:%s", r.data, r.local, rep, sock)
	}

	nbd := filepath.Join(dir, "vol.sock")
	uri := "nbd+unix:///vol?socket=" + nbd
	engine := func(replica string) *proc {
		return start(t, "engine", "--name", "vol", "--frontend", "nbd", "--nbd-socket", nbd, "--nbd-kernel", "off",
			"--listen", "127.0.0.1:0", "--replica", replica+","+r.control)
	}
	local := engine(r.local)
	if !local.logged("shared memory attached") {
		t.Fatalf("the engine on the replica's socket did not attach shared memory:\n%s", local.stderr.String())
	}
	if n := memfdMappings(t, r.cmd.Process.Pid); n == 0 {
		t.Fatal("the replica maps none of the engine's shared memory")
	}
	qemuIO(t, uri, "write -P 0x4d 0 4M", "write -P 0x5e 6M 1M", "flush")
	local.stopClean(t, "engine")

	overTCP := engine(r.data)
	qemuIO(t, uri, "read -P 0x4d 0 4M", "read -P 0 4M 2M", "read -P 0x5e 6M 1M")
	overTCP.stopClean(t, "engine")

	r.stopClean(t, "replica")
	if _, err := os.Stat(sock); !os.IsNotExist(err) {
		t.Fatalf("the replica left its local socket behind: %v", err)
	}
}

// TestReplicaListenLocalDataTLS: with --data-tls and a volume key, the
// TCP port serves only TLS clients with the key, and the --listen-local
// socket serves plain clients with the key (an engine on the node does not
// wrap unix connections in TLS); what one writes, the other reads.
func TestReplicaListenLocalDataTLS(t *testing.T) {
	dir := t.TempDir()
	pki := newTestPKI(t, dir, "cairn-instance-manager")
	key := bytes.Repeat([]byte{9}, dataconn.KeySize)
	sock := filepath.Join(dir, "r.sock")
	cmd := command(append([]string{"replica", "--dir", filepath.Join(dir, "r"), "--size", "4Mi",
		"--listen", "127.0.0.1:0", "--listen-local", "unix:" + sock, "--data-tls", "--auth-key-fd", "3"}, pki.flags...)...)
	cmd.ExtraFiles = []*os.File{keyPipe(t, key)}
	r := startCmd(t, cmd)
	ctx := context.Background()

	opts := dataconn.ClientOptions{Conns: 1, Key: key, HandshakeTimeout: 5 * time.Second}
	plain, err := dataconn.Dial(ctx, "unix", sock, opts)
	if err != nil {
		t.Fatalf("the local socket refused a plain client with the key: %v", err)
	}
	defer plain.Close()
	want := bytes.Repeat([]byte("through the socket"), 4096/18+1)[:4096]
	if err := plain.WriteAt(ctx, want, 4096, true); err != nil {
		t.Fatalf("write through the local socket: %v", err)
	}

	refused, err := dataconn.Dial(ctx, "tcp", r.data, opts)
	if err == nil {
		err = refused.ReadAt(ctx, make([]byte, 4096), 0)
		refused.Close()
	}
	if err == nil {
		t.Fatal("the TCP port served a client without TLS")
	}
	tlsOpts := opts
	tlsOpts.TLS = pki.manager(t)
	overTLS, err := dataconn.Dial(ctx, "tcp", r.data, tlsOpts)
	if err != nil {
		t.Fatalf("the TCP port refused a TLS client with the key: %v", err)
	}
	defer overTLS.Close()
	got := make([]byte, 4096)
	if err := overTLS.ReadAt(ctx, got, 4096); err != nil || !bytes.Equal(got, want) {
		var remote *dataconn.RemoteError
		t.Fatalf("read back over TLS: %v (remote %v, equal %v)", err, errors.As(err, &remote), bytes.Equal(got, want))
	}
}
