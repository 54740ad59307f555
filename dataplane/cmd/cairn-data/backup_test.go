package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	replicav1 "github.com/cairn-io/cairn/dataplane/api/replica/v1"
	"github.com/cairn-io/cairn/dataplane/backupstore"
	"github.com/cairn-io/cairn/dataplane/dataconn"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
	"github.com/cairn-io/cairn/dataplane/testutil/versitygw"
)

// backupEnv is where a test's backups go: the target flags and the
// environment the backup and restore commands get.
type backupEnv struct {
	flags []string
	env   []string
	open  func(t *testing.T) backupstore.Target
}

func dirBackupEnv(t *testing.T) backupEnv {
	dir := t.TempDir()
	return backupEnv{flags: []string{"--target-dir", dir}, open: func(t *testing.T) backupstore.Target {
		tg, err := backupstore.NewDirTarget(dir)
		if err != nil {
			t.Fatal(err)
		}
		return tg
	}}
}

// s3BackupEnv runs versitygw (hack/install-versitygw.sh builds it; see
// docs/backup.md, Testing) over a temporary directory with a bucket, and
// passes the credentials through the environment, as an operator would.
func s3BackupEnv(t *testing.T) backupEnv {
	srv, err := versitygw.Start(versitygw.Options{Dir: t.TempDir(), Bucket: "backups"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		srv.Stop()
		if t.Failed() {
			t.Logf("versitygw log:\n%s", srv.Log())
		}
	})
	access, secret := versitygw.AccessKey, versitygw.SecretKey
	cfg := backupstore.S3Config{Endpoint: srv.Endpoint, Bucket: "backups", Prefix: "cluster-a", Region: "us-east-1", PathStyle: true, AccessKeyID: access, SecretAccessKey: secret}
	return backupEnv{
		flags: []string{"--s3-endpoint", cfg.Endpoint, "--s3-bucket", cfg.Bucket, "--s3-prefix", cfg.Prefix, "--s3-region", cfg.Region, "--s3-path-style"},
		env:   []string{"AWS_ACCESS_KEY_ID=" + access, "AWS_SECRET_ACCESS_KEY=" + secret},
		open: func(t *testing.T) backupstore.Target {
			tg, err := backupstore.NewS3Target(cfg)
			if err != nil {
				t.Fatal(err)
			}
			return tg
		},
	}
}

// runTool runs a cairn-data command to completion with the env's
// environment and returns its exit code, stdout and stderr.
func (e backupEnv) runTool(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	cmd := command(args...)
	cmd.Env = append(cmd.Env, e.env...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	done := make(chan struct{})
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { _ = cmd.Wait(); close(done) }() // the exit code is what counts
	select {
	case <-done:
	case <-time.After(deadline.Scale(3 * time.Minute)):
		_ = cmd.Process.Kill()
		<-done
		t.Fatalf("cairn-data %v did not finish\n%s", args, stderr.String())
	}
	return cmd.ProcessState.ExitCode(), stdout.String(), stderr.String()
}

// backupResult is the final line of a backup's output, by key.
func backupResult(t *testing.T, out string) map[string]string {
	t.Helper()
	lines := strings.Split(strings.TrimSpace(out), "\n")
	last := lines[len(lines)-1]
	if !strings.HasPrefix(last, "backup ") {
		t.Fatalf("backup's last line %q, want the result", last)
	}
	res := map[string]string{"name": strings.Fields(last)[1]}
	for _, f := range strings.Fields(last)[2:] {
		k, v, _ := strings.Cut(f, "=")
		res[k] = v
	}
	return res
}

func resultInt(t *testing.T, res map[string]string, k string) int64 {
	t.Helper()
	n, err := strconv.ParseInt(res[k], 10, 64)
	if err != nil {
		t.Fatalf("backup result %v: %s: %v", res, k, err)
	}
	return n
}

// testVolume is a real replica process, written through its data port.
type testVolume struct {
	p    *proc
	ctl  replicav1.ReplicaServiceClient
	data *dataconn.Client
	size int64
}

const backupTestEpoch = 1

func startTestVolume(t *testing.T, size int64) *testVolume {
	p := start(t, "replica", "--dir", t.TempDir(), "--size", strconv.FormatInt(size, 10), "--listen", "127.0.0.1:0", "--control-listen", "127.0.0.1:0")
	v := &testVolume{p: p, ctl: dialControl(t, p.control), size: size}
	if _, err := v.ctl.SetEpoch(context.Background(), &replicav1.SetEpochRequest{Epoch: backupTestEpoch}); err != nil {
		t.Fatal(err)
	}
	v.data = dialData(t, p.data, backupTestEpoch)
	return v
}

func (v *testVolume) write(t *testing.T, p []byte, off int64) {
	t.Helper()
	if err := v.data.WriteAt(context.Background(), p, off, false); err != nil {
		t.Fatal(err)
	}
}

func (v *testVolume) unmap(t *testing.T, off, n int64) {
	t.Helper()
	if err := v.data.Unmap(context.Background(), off, n); err != nil {
		t.Fatal(err)
	}
}

// snapshot takes a snapshot and returns the volume's bytes at it.
func (v *testVolume) snapshot(t *testing.T, name string) []byte {
	t.Helper()
	ctx := context.Background()
	if err := v.data.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := v.ctl.SnapshotCreate(ctx, &replicav1.SnapshotCreateRequest{Name: name, UserCreated: true, Epoch: backupTestEpoch}); err != nil {
		t.Fatal(err)
	}
	all := make([]byte, v.size)
	for off := int64(0); off < v.size; off += 1 << 20 {
		if err := v.data.ReadAt(ctx, all[off:off+1<<20], off); err != nil {
			t.Fatal(err)
		}
	}
	return all
}

func randomBytes(rng *rand.Rand, n int) []byte {
	p := make([]byte, n)
	for i := range p {
		p[i] = byte(rng.Uint32())
	}
	return p
}

// TestBackupRestoreReplicaSnapshots: a real replica process, backed up
// by the backup command to a directory and to a real S3 server. The full
// backup reads only the written ranges; after more writes and a second
// snapshot, the incremental backup reads and uploads only the changed
// blocks; both restore, with the restore command, to exactly the bytes
// the volume held at their snapshots. Writes after the second snapshot
// are in no backup.
func TestBackupRestoreReplicaSnapshots(t *testing.T) {
	for _, kind := range []struct {
		name string
		env  func(*testing.T) backupEnv
	}{{"dir", dirBackupEnv}, {"s3", s3BackupEnv}} {
		t.Run(kind.name, func(t *testing.T) { testBackupRestore(t, kind.env(t)) })
	}
}

func testBackupRestore(t *testing.T, env backupEnv) {
	const size, bs = 64 << 20, 1 << 20
	rng := rand.New(rand.NewPCG(28, 1))
	v := startTestVolume(t, size)
	v.write(t, randomBytes(rng, 2<<20), 0)      // blocks 0, 1
	v.write(t, randomBytes(rng, 4096), 10<<20)  // block 10
	v.write(t, make([]byte, 4096), 20<<20)      // block 20: written, but zeros
	v.write(t, randomBytes(rng, 3<<20), 40<<20) // blocks 40-42
	s1 := v.snapshot(t, "s1")
	backupArgs := append([]string{"backup", "--replica", v.p.control, "--volume", "vol-a", "--block-size", "1Mi"}, env.flags...)

	code, out, errOut := env.runTool(t, slices.Concat(backupArgs, []string{"--snapshot", "s1", "--name", "b1"})...)
	if code != 0 {
		t.Fatalf("full backup: exit %d\n%s", code, errOut)
	}
	if !strings.Contains(out, fmt.Sprintf("progress %d/%d bytes (100%%)", 7*bs, 7*bs)) {
		t.Errorf("full backup printed no final progress line:\n%s", out)
	}
	full := backupResult(t, out)
	// Read: the 7 blocks the layers hold (not the 64 the volume has);
	// uploaded: the 6 that are not zeros.
	if full["name"] != "vol-a/b1" || resultInt(t, full, "read-bytes") != 7*bs || resultInt(t, full, "uploaded-blocks") != 6 {
		t.Errorf("full backup: %v; want vol-a/b1, 7 MiB read, 6 blocks uploaded", full)
	}

	v.write(t, randomBytes(rng, 4096), 10<<20+8192) // block 10 again
	v.write(t, randomBytes(rng, 8192), 50<<20)      // block 50
	v.unmap(t, 41<<20, 1<<20)                       // block 41: zeros over s1's data
	s2 := v.snapshot(t, "s2")
	v.write(t, randomBytes(rng, 4096), 60<<20) // after s2: in no backup

	code, out, errOut = env.runTool(t, slices.Concat(backupArgs, []string{"--snapshot", "s2", "--name", "b2", "--base-snapshot", "s1", "--base-backup", "b1"})...)
	if code != 0 {
		t.Fatalf("incremental backup: exit %d\n%s", code, errOut)
	}
	inc := backupResult(t, out)
	// Read: blocks 10, 41 and 50; uploaded: 10 and 50 (41 is zeros now).
	if resultInt(t, inc, "read-bytes") != 3*bs || resultInt(t, inc, "uploaded-blocks") != 2 || inc["parent"] != "b1" {
		t.Errorf("incremental backup: %v; want 3 MiB read, 2 blocks uploaded, parent b1", inc)
	}

	checkRestore(t, env, "b1", s1)
	checkRestore(t, env, "b2", s2)
	refusals(t, env, backupArgs)

	code, out, errOut = env.runTool(t, slices.Concat([]string{"restore", "--volume", "vol-a", "--list"}, env.flags)...)
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if code != 0 || len(lines) != 2 || !strings.HasPrefix(lines[0], "b1 ") || !strings.Contains(lines[0], "snapshot=s1 parent= ") ||
		!strings.HasPrefix(lines[1], "b2 ") || !strings.Contains(lines[1], "snapshot=s2 parent=b1 ") {
		t.Errorf("restore --list: exit %d\n%s%s", code, out, errOut)
	}
}

// TestRestoreToBlockDevice: a restore onto a block device (a loop device
// over a file full of other bytes) writes every block, zeros included, so
// the device then holds exactly the snapshot; a device someone holds open
// exclusively (as a mount does) is refused and left as it was.
func TestRestoreToBlockDevice(t *testing.T) {
	needTool(t, "losetup")
	env := dirBackupEnv(t)
	const size = 8 << 20
	rng := rand.New(rand.NewPCG(28, 2))
	v := startTestVolume(t, size)
	v.write(t, randomBytes(rng, 1<<20), 3<<20)
	want := v.snapshot(t, "s1")
	if code, _, errOut := env.runTool(t, slices.Concat([]string{"backup", "--replica", v.p.control, "--volume", "vol-a", "--snapshot", "s1", "--name", "b1"}, env.flags)...); code != 0 {
		t.Fatalf("backup: exit %d\n%s", code, errOut)
	}
	backing := filepath.Join(t.TempDir(), "disk.img")
	if err := os.WriteFile(backing, bytes.Repeat([]byte{0xee}, size+1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("losetup", "--find", "--show", backing).CombinedOutput()
	if err != nil {
		t.Skipf("no loop device here: %v: %s", err, out)
	}
	dev := strings.TrimSpace(string(out))
	t.Cleanup(func() { _ = exec.Command("losetup", "--detach", dev).Run() })
	restoreArgs := slices.Concat([]string{"restore", "--volume", "vol-a", "--backup", "b1", "--to", dev}, env.flags)

	held, err := os.OpenFile(dev, os.O_RDONLY|os.O_EXCL, 0)
	if err != nil {
		t.Fatal(err)
	}
	code, _, errOut := env.runTool(t, restoreArgs...)
	held.Close()
	if code != 1 || !strings.Contains(errOut, "in use") {
		t.Errorf("restore onto a device held exclusively: exit %d, %q; want a refusal", code, errOut)
	}
	if got := readDevice(t, dev, size); !bytes.Equal(got, bytes.Repeat([]byte{0xee}, size)) {
		t.Fatal("a refused restore wrote to the device")
	}

	if code, _, errOut := env.runTool(t, restoreArgs...); code != 0 {
		t.Fatalf("restore onto %s: exit %d\n%s", dev, code, errOut)
	}
	if i := firstDiff(readDevice(t, dev, size), want); i >= 0 {
		t.Fatalf("the device differs from the snapshot first at byte %d", i)
	}
	if tail := readDevice(t, dev, size+1<<20)[size:]; !bytes.Equal(tail, bytes.Repeat([]byte{0xee}, 1<<20)) {
		t.Fatal("the restore wrote past the backup's size")
	}
}

func readDevice(t *testing.T, dev string, n int) []byte {
	t.Helper()
	f, err := os.OpenFile(dev, os.O_RDONLY|syscall.O_DIRECT, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf := directBuf(n)
	if _, err := io.ReadFull(f, buf); err != nil {
		t.Fatal(err)
	}
	return buf
}

// directBuf is n bytes aligned for O_DIRECT.
func directBuf(n int) []byte {
	b := make([]byte, n+4096)
	off := int(4096 - uintptr(unsafe.Pointer(&b[0]))%4096)
	return b[off%4096 : off%4096+n]
}

// checkRestore restores a backup with the restore command into a new file
// and compares it with want, byte for byte.
func checkRestore(t *testing.T, env backupEnv, name string, want []byte) {
	t.Helper()
	dst := filepath.Join(t.TempDir(), name+".img")
	code, out, errOut := env.runTool(t, append([]string{"restore", "--volume", "vol-a", "--backup", name, "--to", dst}, env.flags...)...)
	if code != 0 {
		t.Fatalf("restore %s: exit %d\n%s", name, code, errOut)
	}
	if !strings.Contains(out, "restored vol-a/"+name) {
		t.Errorf("restore %s printed:\n%s", name, out)
	}
	got, err := os.ReadFile(dst)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != len(want) {
		t.Fatalf("restore %s: %d bytes, want %d", name, len(got), len(want))
	}
	if i := firstDiff(got, want); i >= 0 {
		t.Fatalf("restore %s differs from the snapshot first at byte %d (block %d)", name, i, i>>20)
	}
}

func firstDiff(a, b []byte) int {
	for i := range a {
		if a[i] != b[i] {
			return i
		}
	}
	return -1
}

// refusals: bad requests fail with a clear message and change nothing on
// the target or the destination.
func refusals(t *testing.T, env backupEnv, backupArgs []string) {
	t.Helper()
	existing := filepath.Join(t.TempDir(), "existing.img")
	if err := os.WriteFile(existing, []byte("keep me"), 0o600); err != nil {
		t.Fatal(err)
	}
	restoreArgs := append([]string{"restore", "--volume", "vol-a"}, env.flags...)
	for _, tc := range []struct {
		what string
		args []string
		code int
		says string
	}{
		{"base backup of another snapshot", slices.Concat(backupArgs, []string{"--snapshot", "s2", "--name", "b3", "--base-snapshot", "s2", "--base-backup", "b1"}), 1, `taken from snapshot "s1"`},
		{"base not older", slices.Concat(backupArgs, []string{"--snapshot", "s1", "--name", "b3", "--base-snapshot", "s2", "--base-backup", "b2"}), 1, "not older"},
		{"missing snapshot", slices.Concat(backupArgs, []string{"--snapshot", "nope", "--name", "b3"}), 1, "not found"},
		{"name taken", slices.Concat(backupArgs, []string{"--snapshot", "s2", "--name", "b1"}), 1, "already exists"},
		{"bad name", slices.Concat(backupArgs, []string{"--snapshot", "s2", "--name", "B_3"}), 1, "backup name"},
		{"base half given", slices.Concat(backupArgs, []string{"--snapshot", "s2", "--base-snapshot", "s1"}), 2, "go together"},
		{"restore over a file", slices.Concat(restoreArgs, []string{"--backup", "b1", "--to", existing}), 1, "not a block device"},
		{"restore a missing backup", slices.Concat(restoreArgs, []string{"--backup", "nope", "--to", existing + ".new"}), 1, "backup not found"},
		{"list and restore at once", slices.Concat(restoreArgs, []string{"--list", "--backup", "b1", "--to", existing + ".new"}), 2, "usage"},
	} {
		code, _, errOut := env.runTool(t, tc.args...)
		if code != tc.code || !strings.Contains(errOut, tc.says) {
			t.Errorf("%s: exit %d, stderr %q; want exit %d saying %q", tc.what, code, errOut, tc.code, tc.says)
		}
	}
	if got, _ := os.ReadFile(existing); string(got) != "keep me" {
		t.Errorf("a refused restore changed the existing file: %q", got)
	}
	if _, err := os.Stat(existing + ".new"); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a refused restore left a file: %v", err)
	}
	store, err := backupstore.New(env.open(t), backupstore.Options{})
	if err != nil {
		t.Fatal(err)
	}
	list, err := store.List(context.Background(), "vol-a")
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, b := range list {
		names = append(names, b.Name)
	}
	slices.Sort(names)
	if !slices.Equal(names, []string{"b1", "b2"}) {
		t.Errorf("backups after the refusals: %v, want [b1 b2]", names)
	}
}

func TestS3Credentials(t *testing.T) {
	dir := t.TempDir()
	file := func(s string) string {
		p := filepath.Join(dir, strconv.Itoa(len(s)))
		if err := os.WriteFile(p, []byte(s), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	env := map[string]string{"AWS_ACCESS_KEY_ID": "env-id", "AWS_SECRET_ACCESS_KEY": "env-secret"}
	got, err := s3Credentials("", func(k string) string { return env[k] })
	if err != nil || got["AWS_ACCESS_KEY_ID"] != "env-id" || got["AWS_SECRET_ACCESS_KEY"] != "env-secret" {
		t.Errorf("from the environment: %v, %v", got, err)
	}
	got, err = s3Credentials(file("# creds\nAWS_ACCESS_KEY_ID=id\n\nexport AWS_SECRET_ACCESS_KEY=\"s=cret\"\n"), nil)
	if err != nil || got["AWS_ACCESS_KEY_ID"] != "id" || got["AWS_SECRET_ACCESS_KEY"] != "s=cret" {
		t.Errorf("from a file: %v, %v", got, err)
	}
	_, err = s3Credentials(file("AWS_ACCESS_KEY_ID=id\nhunter2-alone\n"), nil)
	if err == nil || strings.Contains(err.Error(), "hunter2") {
		t.Errorf("a bad line: %v; want an error that does not quote the line", err)
	}
	if _, err := s3Credentials(file(strings.Repeat("#", maxCredentialsFile+1)), nil); err == nil {
		t.Errorf("a file over %d bytes was read", maxCredentialsFile)
	}
}

// TestBackupEncryptedVolume: volumes written through real engines (NBD),
// one encrypted, each backed up from its replica (full, then
// incremental). The encrypted volume's backup restores to exactly its
// replica's ciphertext at the snapshot, and neither it nor any object on
// the target holds the plaintext; the unencrypted volume's restores to
// the plaintext the engine served (the search can fail).
func TestBackupEncryptedVolume(t *testing.T) {
	needTool(t, "qemu-io")
	needTool(t, "qemu-img")
	const size = 16 << 20
	pat := filepath.Join(t.TempDir(), "plaintext")
	if err := os.WriteFile(pat, plaintext(1<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	needles := [][]byte{[]byte(plaintextLine), []byte(plaintextLine[20:36])}
	key, check := testKey(3)
	plain := startVolume(t, 1, "16Mi")
	enc := volumeReplicas(t, 1, 0, "16Mi")
	enc.engine = startCmd(t, encryptedCmd(t, enc.args, key, check))

	for _, tc := range []struct {
		name      string
		v         *volume
		encrypted bool
	}{{"plain", plain, false}, {"enc", enc, true}} {
		env := dirBackupEnv(t)
		qemuIO(t, tc.v.uri, "write -s "+pat+" 0 1M", "write -s "+pat+" 8M 1M", "flush")
		tc.v.ctl(t, "snapshot", "create", "s1")
		qemuIO(t, tc.v.uri, "write -P 0x5a 4M 1M", "flush") // not a copy of another block: uploaded
		tc.v.ctl(t, "snapshot", "create", "s2")
		served := volumeBytes(t, tc.v.uri)
		args := slices.Concat([]string{"backup", "--replica", tc.v.replicas[0].control, "--volume", "vol-a"}, env.flags)
		if code, _, errOut := env.runTool(t, slices.Concat(args, []string{"--snapshot", "s1", "--name", "b1"})...); code != 0 {
			t.Fatalf("%s: full backup: exit %d\n%s", tc.name, code, errOut)
		}
		code, out, errOut := env.runTool(t, slices.Concat(args, []string{"--snapshot", "s2", "--name", "b2", "--base-snapshot", "s1", "--base-backup", "b1"})...)
		if code != 0 {
			t.Fatalf("%s: incremental backup: exit %d\n%s", tc.name, code, errOut)
		}
		if res := backupResult(t, out); resultInt(t, res, "uploaded-blocks") != 1 {
			t.Errorf("%s: the incremental backup after 1 MiB written uploaded %v, want 1 block", tc.name, res)
		}
		dst := filepath.Join(t.TempDir(), "restored.img")
		if code, _, errOut := env.runTool(t, slices.Concat([]string{"restore", "--volume", "vol-a", "--backup", "b2", "--to", dst}, env.flags)...); code != 0 {
			t.Fatalf("%s: restore: exit %d\n%s", tc.name, code, errOut)
		}
		restored, err := os.ReadFile(dst)
		if err != nil {
			t.Fatal(err)
		}
		if !tc.encrypted {
			sameBytes(t, "the unencrypted volume's restore", restored, served)
			if len(filesHolding(t, []string{dst}, needles...)) == 0 {
				t.Fatal("the unencrypted volume's restore holds no plaintext: the search cannot tell")
			}
			continue
		}
		sameBytes(t, "the encrypted volume's restore", restored, snapshotView(t, tc.v.replicas[0].control, "s2", size))
		if f := filesHolding(t, []string{dst, env.flags[1]}, needles...); len(f) > 0 {
			t.Fatalf("plaintext in the encrypted volume's backup: %v", f)
		}
	}
}

// snapshotView reads the view at snapshot name from a replica's control
// API.
func snapshotView(t *testing.T, control, name string, size int64) []byte {
	t.Helper()
	ctl := dialControl(t, control)
	out := make([]byte, size)
	for off := int64(0); off < size; off += 4 << 20 {
		resp, err := ctl.SnapshotRead(context.Background(), &replicav1.SnapshotReadRequest{Snapshot: name, Offset: off, Length: 4 << 20})
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range resp.Extents {
			copy(out[e.Offset:], e.Data)
		}
	}
	return out
}
