package backupstore

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
	"github.com/cairn-io/cairn/dataplane/testutil/nfsserver"
)

// newNFSTestTarget serves a fresh directory with go-nfs and returns a
// target in it and the directory its prefix maps to on the server.
func newNFSTestTarget(t *testing.T) (*NFSTarget, string) {
	t.Helper()
	dir := t.TempDir()
	cfg := startNFSServer(t, nfsserver.Options{Dir: dir})
	tg, err := NewNFSTarget(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tg.Close() })
	return tg, filepath.Join(dir, "cluster-a")
}

func getAll(ctx context.Context, tg Target, key string) ([]byte, error) {
	rc, err := tg.Get(ctx, key)
	if err != nil {
		return nil, err
	}
	defer func() { _ = rc.Close() }()
	return io.ReadAll(rc)
}

// TestNFSTargetObjects checks the Target contract against a real NFSv3
// server: read-after-write across overwrites, objects larger than one
// WRITE, ErrNotFound, idempotent Delete, List by prefix with the server's
// mtimes, and files laid out under the prefix directory.
func TestNFSTargetObjects(t *testing.T) {
	ctx := testCtx(t)
	tg, dir := newNFSTestTarget(t)

	big := bytes.Repeat([]byte("0123456789abcdef"), 3<<20/16+7) // several WRITEs and READs
	for _, v := range [][]byte{[]byte("v1"), big, {}, []byte("v3")} {
		if err := tg.Put(ctx, "volumes/vol-1/index", v); err != nil {
			t.Fatal(err)
		}
		got, err := getAll(ctx, tg, "volumes/vol-1/index")
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, v) {
			t.Fatalf("read %d bytes after writing %d", len(got), len(v))
		}
	}
	onDisk, err := os.ReadFile(filepath.Join(dir, "volumes", "vol-1", "index"))
	if err != nil || string(onDisk) != "v3" {
		t.Fatalf("file on the server: %q, %v", onDisk, err)
	}

	if _, err := tg.Get(ctx, "volumes/vol-1/missing"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Get of a missing key: %v, want ErrNotFound", err)
	}
	if _, err := tg.Get(ctx, "volumes/nothere/index"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Get under a missing directory: %v, want ErrNotFound", err)
	}
	for _, k := range []string{"volumes/vol-1/blocks/aa/1", "volumes/vol-1/blocks/bb/2", "volumes/vol-10/index"} {
		if err := tg.Put(ctx, k, []byte(k)); err != nil {
			t.Fatal(err)
		}
	}
	// A temporary file a crashed writer left is never listed.
	if err := os.WriteFile(filepath.Join(dir, "volumes", "vol-1", tempPrefix+"x"), nil, 0o644); err != nil {
		t.Fatal(err)
	}

	keys := listKeys(t, tg, "volumes/vol-1/")
	want := []string{"volumes/vol-1/index", "volumes/vol-1/blocks/aa/1", "volumes/vol-1/blocks/bb/2"}
	if len(keys) != len(want) {
		t.Fatalf("listed %v, want %v", keys, want)
	}
	for _, k := range want {
		o, ok := keys[k]
		if !ok {
			t.Fatalf("listed %v, want %v", keys, want)
		}
		st, err := os.Stat(filepath.Join(dir, filepath.FromSlash(k)))
		if err != nil {
			t.Fatal(err)
		}
		if o.Size != st.Size() || !o.ModTime.Equal(st.ModTime()) {
			t.Fatalf("%s listed as %d bytes at %v, the server has %d at %v", k, o.Size, o.ModTime, st.Size(), st.ModTime())
		}
	}
	if got := listKeys(t, tg, "volumes/vol-1"); len(got) != 4 {
		t.Fatalf("prefix volumes/vol-1 listed %v, want vol-1's and vol-10's keys", got)
	}
	if got := listKeys(t, tg, "nothing/here/"); len(got) != 0 {
		t.Fatalf("a missing directory listed %v", got)
	}

	for range 2 { // a missing key is not an error
		if err := tg.Delete(ctx, "volumes/vol-1/blocks/aa/1"); err != nil {
			t.Fatal(err)
		}
	}
	if err := tg.Delete(ctx, "no/such/dir/key"); err != nil {
		t.Fatal(err)
	}
	if _, err := tg.Get(ctx, "volumes/vol-1/blocks/aa/1"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Get after Delete: %v", err)
	}
}

// TestNFSTargetBadKeys checks that keys that would escape the target's
// directory are refused before anything reaches the server.
func TestNFSTargetBadKeys(t *testing.T) {
	ctx := testCtx(t)
	tg, dir := newNFSTestTarget(t)
	for _, k := range []string{"", "/abs", "a/../../x", "a//b", "a/./b", "dir/", strings.Repeat("n", nfsMaxName+1)} {
		if err := tg.Put(ctx, k, []byte("x")); err == nil || errors.Is(err, ErrTransient) {
			t.Errorf("Put(%q) = %v, want a permanent error", k, err)
		}
	}
	if _, err := os.Stat(dir); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("bad keys created %s: %v", dir, err)
	}
}

// TestNFSTargetMountErrors checks that a missing export, a refused client
// and an unreachable server are told apart, and only the last is worth
// a retry.
func TestNFSTargetMountErrors(t *testing.T) {
	ctx := testCtx(t)
	cfg := startNFSServer(t, nfsserver.Options{})
	cfg.Export = "/elsewhere"
	put := func(cfg NFSConfig) error {
		tg, err := NewNFSTarget(cfg)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tg.Close() }()
		return tg.Put(ctx, "k", []byte("x"))
	}
	if err := put(cfg); !errors.Is(err, ErrExportNotFound) || errors.Is(err, ErrTransient) {
		t.Errorf("wrong export: %v, want ErrExportNotFound", err)
	}
	refused := startNFSServer(t, nfsserver.Options{Refuse: true})
	if err := put(refused); !errors.Is(err, fs.ErrPermission) || errors.Is(err, ErrTransient) {
		t.Errorf("refused client: %v, want fs.ErrPermission", err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := l.Addr().(*net.TCPAddr).Port
	_ = l.Close()
	cfg = NFSConfig{Server: "127.0.0.1", Export: "/export", MountPort: closed, NFSPort: closed}
	if err := put(cfg); !errors.Is(err, ErrTransient) {
		t.Errorf("unreachable server: %v, want a transient error", err)
	}
	if _, err := NewNFSTarget(NFSConfig{Server: "127.0.0.1", Export: "relative"}); err == nil {
		t.Error("a relative export was accepted")
	}
}

// TestNFSTargetServerRestart checks that after the server restarts (and
// forgets its file handles) a failed call is transient and the next one
// mounts again and succeeds.
func TestNFSTargetServerRestart(t *testing.T) {
	ctx := testCtx(t)
	dir := t.TempDir()
	srv, err := nfsserver.Start(nfsserver.Options{Dir: dir})
	if err != nil {
		t.Fatal(err)
	}
	cfg := NFSConfig{Server: srv.Host, Export: srv.Export, Prefix: "p", MountPort: srv.Port, NFSPort: srv.Port}
	tg, err := NewNFSTarget(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tg.Close() }()
	if err := tg.Put(ctx, "a/b", []byte("one")); err != nil {
		t.Fatal(err)
	}
	srv.Stop()
	srv, err = nfsserver.Start(nfsserver.Options{Dir: dir, Addr: net.JoinHostPort(cfg.Server, strconv.Itoa(cfg.MountPort))})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Stop()
	var lastErr error
	for range 3 {
		lastErr = tg.Put(ctx, "a/b", []byte("two"))
		if lastErr == nil {
			break
		}
		if !errors.Is(lastErr, ErrTransient) {
			t.Fatalf("Put after a restart: %v, want success or a transient error", lastErr)
		}
	}
	if lastErr != nil {
		t.Fatalf("Put kept failing after a restart: %v", lastErr)
	}
	if got, err := getAll(ctx, tg, "a/b"); err != nil || string(got) != "two" {
		t.Fatalf("read %q, %v after a restart", got, err)
	}
}

// TestNFSTargetPortmapper checks that with no ports given the target asks
// the portmapper for the MOUNT and NFS ports (a portmapper that answers
// GETPORT from a table, in front of the real go-nfs server).
func TestNFSTargetPortmapper(t *testing.T) {
	ctx := testCtx(t)
	cfg := startNFSServer(t, nfsserver.Options{})
	var asked atomic.Int32
	pm := startPortmapper(t, map[uint32]uint32{mountProg: uint32(cfg.MountPort), nfsProg: uint32(cfg.NFSPort)}, &asked)
	cfg.MountPort, cfg.NFSPort = 0, 0
	tg, err := NewNFSTarget(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tg.Close() }()
	tg.pmapPort = pm
	if err := tg.Put(ctx, "k", []byte("v")); err != nil {
		t.Fatal(err)
	}
	if got, err := getAll(ctx, tg, "k"); err != nil || string(got) != "v" {
		t.Fatalf("read %q, %v", got, err)
	}
	if n := asked.Load(); n != 2 {
		t.Fatalf("portmapper asked %d times, want 2 (MOUNT and NFS)", n)
	}

	// A program the portmapper does not know is a clear error.
	pm = startPortmapper(t, map[uint32]uint32{}, &asked)
	tg2, err := NewNFSTarget(cfg)
	if err != nil {
		t.Fatal(err)
	}
	tg2.pmapPort = pm
	if err := tg2.Put(ctx, "k", []byte("v")); err == nil || errors.Is(err, ErrTransient) {
		t.Fatalf("unregistered program: %v, want a permanent error", err)
	}
}

// startPortmapper answers PMAPPROC_GETPORT calls from ports, counting
// them in asked, and returns its port.
func startPortmapper(t *testing.T, ports map[uint32]uint32, asked *atomic.Int32) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go servePortmapper(c, ports, asked)
		}
	}()
	return l.Addr().(*net.TCPAddr).Port
}

func servePortmapper(c net.Conn, ports map[uint32]uint32, asked *atomic.Int32) {
	defer func() { _ = c.Close() }()
	for {
		rec, err := readRecord(c, 4096)
		if err != nil {
			return
		}
		d := &xdrDec{b: rec}
		xid := d.u32()
		d.take(5 * 4) // CALL, rpcvers, prog, vers, proc
		d.u32()
		d.opaque(400) // credential
		d.u32()
		d.opaque(400) // verifier
		prog := d.u32()
		if d.err != nil {
			return
		}
		asked.Add(1)
		var e xdrEnc
		e.u32(0)
		for _, v := range []uint32{xid, 1, 0, 0, 0, 0, ports[prog]} {
			e.u32(v)
		}
		binary.BigEndian.PutUint32(e.b, 0x80000000|uint32(len(e.b)-4))
		if _, err := c.Write(e.b); err != nil {
			return
		}
	}
}

// TestNFSTargetBoundsReplies checks that a server announcing a huge reply
// or sending a truncated one gets an error, not an allocation of what it
// announced or a panic.
func TestNFSTargetBoundsReplies(t *testing.T) {
	ctx := testCtx(t)
	replies := map[string]func(xid uint32) []byte{
		"huge record": func(uint32) []byte { return []byte{0xff, 0xff, 0xff, 0xff} },
		"truncated reply": func(xid uint32) []byte {
			var e xdrEnc
			e.u32(0x80000000 | 8)
			e.u32(xid)
			e.u32(1)
			return e.b
		},
		"huge file handle": func(xid uint32) []byte {
			var e xdrEnc
			e.u32(0)
			for _, v := range []uint32{xid, 1, 0, 0, 0, 0, 0, 1 << 30} {
				e.u32(v)
			}
			binary.BigEndian.PutUint32(e.b, 0x80000000|uint32(len(e.b)-4))
			return e.b
		},
	}
	for name, reply := range replies {
		t.Run(name, func(t *testing.T) {
			l, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = l.Close() }()
			go func() {
				c, err := l.Accept()
				if err != nil {
					return
				}
				defer func() { _ = c.Close() }()
				rec, err := readRecord(c, 4096)
				if err != nil || len(rec) < 4 {
					return
				}
				_, _ = c.Write(reply(binary.BigEndian.Uint32(rec)))
				_, _ = io.Copy(io.Discard, c)
			}()
			port := l.Addr().(*net.TCPAddr).Port
			tg, err := NewNFSTarget(NFSConfig{Server: "127.0.0.1", Export: "/export", MountPort: port, NFSPort: port})
			if err != nil {
				t.Fatal(err)
			}
			cctx, cancel := context.WithTimeout(ctx, time.Minute)
			defer cancel()
			err = tg.Put(cctx, "k", []byte("v"))
			if !errors.Is(err, errRPCMalformed) {
				t.Fatalf("Put against a bad server: %v, want errRPCMalformed", err)
			}
		})
	}
}

// TestNFSTargetListsManyObjects: a directory with more entries than one
// READDIRPLUS reply holds is listed page by page (the server's cookies),
// each object exactly once.
func TestNFSTargetListsManyObjects(t *testing.T) {
	ctx := testCtx(t)
	tg, dir := newNFSTestTarget(t)
	const n = 1500
	blocks := filepath.Join(dir, "volumes", "v", "blocks")
	if err := os.MkdirAll(blocks, 0o755); err != nil {
		t.Fatal(err)
	}
	for i := range n {
		if err := os.WriteFile(filepath.Join(blocks, fmt.Sprintf("b%05d", i)), []byte{byte(i)}, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	seen := map[string]int{}
	if err := tg.List(ctx, "volumes/v/blocks/", func(o Object) error { seen[o.Key]++; return nil }); err != nil {
		t.Fatal(err)
	}
	if len(seen) != n {
		t.Fatalf("listed %d objects, want %d", len(seen), n)
	}
	for k, c := range seen {
		if c != 1 {
			t.Fatalf("%s listed %d times", k, c)
		}
	}
}

// TestNFSTargetCloseLeavesNoConnection: Close while calls run closes
// every connection, those of the running calls once they end; the server
// ends up holding none, and calls after Close fail with ErrTargetClosed.
func TestNFSTargetCloseLeavesNoConnection(t *testing.T) {
	// With the collector off, an unclosed connection stays open on the
	// server (collected, a finalizer would close its descriptor).
	defer debug.SetGCPercent(debug.SetGCPercent(-1))
	ctx := testCtx(t)
	srv, err := nfsserver.Start(nfsserver.Options{Dir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Stop)
	tg, err := NewNFSTarget(NFSConfig{Server: srv.Host, Export: srv.Export, Prefix: "cluster-a/", MountPort: srv.Port, NFSPort: srv.Port})
	if err != nil {
		t.Fatal(err)
	}
	big := bytes.Repeat([]byte{7}, 8<<20) // many WRITEs: the calls are still running when Close comes
	var wg sync.WaitGroup
	for i := range 4 {
		wg.Go(func() { _ = tg.Put(ctx, fmt.Sprintf("volumes/v/blocks/%d", i), big) })
	}
	waitConns := func(done func(int) bool, what string) {
		t.Helper()
		dl := time.Now().Add(deadline.Scale(30 * time.Second))
		for n := srv.OpenConns(); !done(n); n = srv.OpenConns() {
			if time.Now().After(dl) {
				t.Fatalf("the server holds %d connections: want %s", n, what)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	waitConns(func(n int) bool { return n > 0 }, "some, the calls running")
	if err := tg.Close(); err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	waitConns(func(n int) bool { return n == 0 }, "none after Close")
	if err := tg.Put(ctx, "volumes/v/after", []byte("x")); !errors.Is(err, ErrTargetClosed) {
		t.Fatalf("Put after Close: %v, want ErrTargetClosed", err)
	}
}

// TestNFSTargetSendsItsIDs: every call carries AUTH_UNIX with the
// configured uid and gid (NFSConfig.UID/GID, a BackupTarget's spec.nfs.uid
// and gid), the identity the server gives the files the target writes.
func TestNFSTargetSendsItsIDs(t *testing.T) {
	ctx := testCtx(t)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = l.Close() }()
	type cred struct {
		flavor, uid, gid uint32
		err              error
	}
	got := make(chan cred, 1)
	go func() {
		c, err := l.Accept()
		if err != nil {
			got <- cred{err: err}
			return
		}
		defer func() { _ = c.Close() }()
		rec, err := readRecord(c, 4096)
		if err != nil {
			got <- cred{err: err}
			return
		}
		d := &xdrDec{b: rec}
		for range 6 { // xid, CALL, RPC version, program, version, procedure
			d.u32()
		}
		flavor := d.u32()
		body := &xdrDec{b: d.opaque(400)}
		body.u32()       // stamp
		body.opaque(255) // machine name
		uid, gid := body.u32(), body.u32()
		got <- cred{flavor: flavor, uid: uid, gid: gid, err: errors.Join(d.err, body.err)}
	}()
	port := l.Addr().(*net.TCPAddr).Port
	tg, err := NewNFSTarget(NFSConfig{Server: "127.0.0.1", Export: "/export", MountPort: port, NFSPort: port, UID: 1234, GID: 5678})
	if err != nil {
		t.Fatal(err)
	}
	cctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	_ = tg.Put(cctx, "k", []byte("v")) // fails: the server hangs up after reading the call
	c := <-got
	if c.err != nil {
		t.Fatal(c.err)
	}
	if c.flavor != 1 || c.uid != 1234 || c.gid != 5678 {
		t.Fatalf("credential: flavor %d uid %d gid %d, want AUTH_UNIX (1) uid 1234 gid 5678", c.flavor, c.uid, c.gid)
	}
}
