package main

import (
	"bytes"
	"encoding/hex"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cairn-io/cairn/dataplane/volcrypt"
)

// Encryption at rest end to end: real engine and replica processes, the
// volume written and read through the NBD frontend (qemu-io, qemu-img)
// or the FUSE frontend's file, and the replicas' files on disk searched
// for the plaintext.

// plaintextLine is what the tests write, repeated: recognisable text, 64
// bytes, so that any 64-byte run of a write holds one whole copy of it in
// some rotation, and the line itself is found wherever a 4 KiB block of
// the plaintext lies on a disk.
const plaintextLine = "cairn plaintext marker: the quick brown fox jumps over the dog.\n"

// plaintext is n bytes of plaintextLine.
func plaintext(n int) []byte {
	return bytes.Repeat([]byte(plaintextLine), n/len(plaintextLine)+1)[:n]
}

// testKey is an encryption key (seed picks it) and its check.
func testKey(seed byte) ([]byte, string) {
	k := make([]byte, volcrypt.KeySize)
	for i := range k {
		k[i] = seed ^ byte(i*37+11)
	}
	return k, volcrypt.KeyCheck(k)
}

// keyPipe returns the read end of a pipe holding key, for a child to
// inherit.
func keyPipe(t *testing.T, key []byte) *os.File {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.Write(key); err != nil {
		t.Fatal(err)
	}
	w.Close()
	t.Cleanup(func() { r.Close() })
	return r
}

// encryptedCmd is cairn-data with args and the encryption key on
// descriptor 3, its check as given.
func encryptedCmd(t *testing.T, args []string, key []byte, check string) *exec.Cmd {
	t.Helper()
	cmd := command(append(slicesClone(args), "--encryption-key-fd", "3", "--encryption-key-check", check)...)
	cmd.ExtraFiles = []*os.File{keyPipe(t, key)}
	return cmd
}

func slicesClone(s []string) []string { return append([]string(nil), s...) }

// filesHolding lists the files under dirs whose bytes contain any of
// needles.
func filesHolding(t *testing.T, dirs []string, needles ...[]byte) []string {
	t.Helper()
	var found []string
	for _, dir := range dirs {
		err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
			if err != nil || !d.Type().IsRegular() {
				return err
			}
			b, err := os.ReadFile(path)
			if err != nil {
				return err
			}
			for _, n := range needles {
				if bytes.Contains(b, n) {
					found = append(found, path)
					break
				}
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	return found
}

// volumeBytes reads the whole volume through the NBD socket (qemu-img).
func volumeBytes(t *testing.T, uri string) []byte {
	t.Helper()
	out := filepath.Join(t.TempDir(), "volume.raw")
	sh(t, "qemu-img", "convert", "-f", "raw", "-O", "raw", uri, out)
	b, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// sameBytes fails the test if got differs from want, saying where.
func sameBytes(t *testing.T, what string, got, want []byte) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: %d bytes, want %d", what, len(got), len(want))
	}
	for i := range got {
		if got[i] != want[i] {
			t.Fatalf("%s: first difference at byte %d (%#x, want %#x)", what, i, got[i], want[i])
		}
	}
}

// TestEncryptedVolumeProcesses: an engine process encrypting a volume of
// three replica processes (one on a unix socket with shared memory).
// Written through NBD, the data reads back as written while no replica
// file holds a 64-byte run, or a 16-byte piece, of the plaintext; an
// unencrypted volume given the same writes holds it in every replica
// (the search can fail). Unwritten and discarded ranges read as zeros.
// A snapshot and revert, then an online expansion (the new range zeros,
// then data) read correctly. An engine given another key (with the right
// check) exits non-zero, saying why, before it opens a replica; with the
// right key the data reads back. A replica killed and a new one rebuilt
// while writes go on: the new replica's files hold no plaintext either,
// and alone it serves every byte.
func TestEncryptedVolumeProcesses(t *testing.T) {
	needTool(t, "qemu-io")
	needTool(t, "qemu-img")
	const mib = 1 << 20
	key, check := testKey(1)
	pat := filepath.Join(t.TempDir(), "plaintext")
	if err := os.WriteFile(pat, plaintext(mib), 0o644); err != nil {
		t.Fatal(err)
	}
	needles := [][]byte{[]byte(plaintextLine), []byte(plaintextLine[20:36])}
	writes := []string{"write -s " + pat + " 0 1M", "write -s " + pat + " 4M 1M", "discard 4352k 256k", "write -s " + pat + " 31M 1M", "flush"}
	model := make([]byte, 32*mib)
	copy(model, plaintext(mib))
	copy(model[4*mib:], plaintext(mib))
	clear(model[4352<<10 : 4608<<10])
	copy(model[31*mib:], plaintext(mib))

	plain := startVolume(t, 3, "32Mi")
	qemuIO(t, plain.uri, writes...)
	for _, dir := range plain.dirs {
		if len(filesHolding(t, []string{dir}, needles...)) == 0 {
			t.Fatalf("the unencrypted volume's replica %s holds no plaintext: the search cannot tell", dir)
		}
	}

	v := volumeReplicas(t, 3, 1, "32Mi")
	v.engine = startCmd(t, encryptedCmd(t, v.args, key, check))
	if !v.engine.logged(`"encrypted"=true`) {
		t.Fatalf("the engine does not say the volume is encrypted:\n%s", v.engine.stderr.String())
	}
	qemuIO(t, v.uri, writes...)
	sameBytes(t, "the encrypted volume", volumeBytes(t, v.uri), model)
	if f := filesHolding(t, v.dirs, needles...); len(f) > 0 {
		t.Fatalf("plaintext on the replicas of an encrypted volume: %v", f)
	}

	// Snapshot, overwrite, revert.
	v.ctl(t, "snapshot", "create", "s1")
	qemuIO(t, v.uri, "write -P 0x77 0 64k", "flush")
	qemuIO(t, v.uri, "read -P 0x77 0 64k")
	v.ctl(t, "snapshot", "revert", "s1")
	sameBytes(t, "after the revert", volumeBytes(t, v.uri), model)

	// Online expansion: the new range reads as zeros, then as written.
	v.ctl(t, "expand", "48Mi")
	qemuIO(t, v.uri, "read -P 0 32M 16M", "write -s "+pat+" 40M 1M", "flush")
	model = append(model, make([]byte, 16*mib)...)
	copy(model[40*mib:], plaintext(mib))
	sameBytes(t, "after the expansion", volumeBytes(t, v.uri), model)

	// Another key, with the volume's check: refused before any replica is
	// opened; the key shows nowhere.
	v.engine.stopClean(t, "engine")
	other, otherCheck := testKey(2)
	cmd := encryptedCmd(t, v.args, other, check)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	_ = cmd.Run()
	want := fmt.Sprintf("the encryption key given is not the key volume vol was created with (key check %s, want %s): "+
		"give the volume's own key; data written with another key cannot be read", otherCheck, check)
	if cmd.ProcessState.ExitCode() == 0 || !strings.Contains(stderr.String(), want) {
		t.Fatalf("an engine with another key: exit %d\n%s\nwant %q", cmd.ProcessState.ExitCode(), stderr.String(), want)
	}
	if strings.Contains(stderr.String(), "engine opened") || strings.Contains(stderr.String(), hex.EncodeToString(other)) ||
		bytes.Contains(stderr.Bytes(), other) {
		t.Fatalf("the engine with another key opened the replicas, or showed its key:\n%s", stderr.String())
	}
	v.engine = startCmd(t, encryptedCmd(t, v.args, key, check))
	sameBytes(t, "with the right key again", volumeBytes(t, v.uri), model)

	// A replica killed, a new one rebuilt while writes go on.
	v.replicas[2].cmd.Process.Kill()
	v.replicas[2].waitExit(t)
	freshDir := filepath.Join(t.TempDir(), "fresh")
	fresh := start(t, "replica", "--dir", freshDir, "--size", "48Mi", "--listen", "127.0.0.1:0", "--control-listen", "127.0.0.1:0")
	var bg []string
	for i := range 8 {
		bg = append(bg, fmt.Sprintf("write -s %s %dM 1M", pat, 8+i))
	}
	io := exec.Command("qemu-io", append(qemuArgs(append(bg, "flush")), v.uri)...)
	ioOut := &syncBuffer{}
	io.Stdout, io.Stderr = ioOut, ioOut
	if err := io.Start(); err != nil {
		t.Fatal(err)
	}
	out := v.ctl(t, "add", fresh.data+","+fresh.control, "--wait")
	if err := io.Wait(); err != nil || strings.Contains(ioOut.String(), "error") {
		t.Fatalf("writes during the rebuild: %v\n%s", err, ioOut.String())
	}
	if !strings.Contains(out, "complete") {
		t.Fatalf("add --wait:\n%s", out)
	}
	for i := range 8 {
		copy(model[(8+i)*mib:], plaintext(mib))
	}
	v.ctl(t, "remove", v.addrs[0])
	v.ctl(t, "remove", v.addrs[1])
	if r := v.ctl(t, "replicas"); strings.Count(r, "RW") != 1 || !strings.Contains(r, fresh.data) {
		t.Fatalf("replicas:\n%s", r)
	}
	sameBytes(t, "from the rebuilt replica alone", volumeBytes(t, v.uri), model)
	if f := filesHolding(t, []string{freshDir}, needles...); len(f) > 0 {
		t.Fatalf("plaintext on the rebuilt replica: %v", f)
	}
}

// qemuArgs is qemu-io's arguments for cmds (the image comes after).
func qemuArgs(cmds []string) []string {
	args := []string{"-f", "raw"}
	for _, c := range cmds {
		args = append(args, "-c", c)
	}
	return args
}

// TestEncryptedEngineFlags: the encryption flags are refused alone, with
// a key of the wrong size, or with a check of another key, each saying
// why, before any replica is opened (the replica address here does not
// exist).
func TestEncryptedEngineFlags(t *testing.T) {
	key, check := testKey(3)
	base := []string{"engine", "--name", "vol", "--frontend", "nbd", "--nbd-socket", filepath.Join(t.TempDir(), "s"), "--nbd-kernel", "off",
		"--replica", "127.0.0.1:1,127.0.0.1:2"}
	run := func(cmd *exec.Cmd) (int, string) {
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		_ = cmd.Run()
		return cmd.ProcessState.ExitCode(), stderr.String()
	}
	for _, tc := range []struct {
		name string
		cmd  *exec.Cmd
		want string
	}{
		{"check alone", command(append(slicesClone(base), "--encryption-key-check", check)...), "--encryption-key-check needs --encryption-key-fd"},
		{"key alone", func() *exec.Cmd {
			c := command(append(slicesClone(base), "--encryption-key-fd", "3")...)
			c.ExtraFiles = []*os.File{keyPipe(t, key)}
			return c
		}(), "--encryption-key-fd needs --encryption-key-check"},
		{"short key", encryptedCmd(t, base, key[:32], check), "--encryption-key-fd 3: read 32 bytes of key, want 64"},
		{"long key", encryptedCmd(t, base, append(slicesClone2(key), 1), check), "read 65 bytes of key, want 64"},
		{"not a descriptor", command(append(slicesClone(base), "--encryption-key-fd", "9", "--encryption-key-check", check)...), "--encryption-key-fd 9: not an open descriptor"},
		{"another key's check", encryptedCmd(t, base, key, "00112233445566778899aabbccddeeff"), "the encryption key given is not the key volume vol was created with"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			code, stderr := run(tc.cmd)
			if code == 0 || !strings.Contains(stderr, tc.want) || strings.Contains(stderr, "engine opened") {
				t.Fatalf("exit %d, stderr:\n%s\nwant it to contain %q", code, stderr, tc.want)
			}
		})
	}
	var help bytes.Buffer
	cmd := command("engine", "--help")
	cmd.Stderr = &help
	_ = cmd.Run()
	for _, f := range []string{"-encryption-key-fd", "-encryption-key-check", "AES-256-XTS"} {
		if !strings.Contains(help.String(), f) {
			t.Fatalf("engine --help does not document %s:\n%s", f, help.String())
		}
	}
}

func slicesClone2(b []byte) []byte { return append([]byte(nil), b...) }

// TestEncryptedFUSEUnaligned: the FUSE frontend's volume file, read and
// written directly at byte offsets that are not whole sectors (the
// kernel passes them through: direct I/O), on an encrypted volume: every
// read returns what was written; then ext4 on the loop device with files
// written and read back, and no replica file holds their plaintext.
func TestEncryptedFUSEUnaligned(t *testing.T) {
	needRoot(t)
	needTool(t, "mkfs.ext4")
	dir := t.TempDir()
	fuseDir := filepath.Join(dir, "fuse")
	reps, args := filesystemEngineArgs(t, dir, "64Mi", "--frontend", "fuse", "--fuse-dir", fuseDir)
	t.Cleanup(func() { _ = exec.Command("umount", "-l", fuseDir).Run() })
	key, check := testKey(4)
	eng := startCmd(t, encryptedCmd(t, args, key, check))
	f, err := os.OpenFile(filepath.Join(fuseDir, "vol"), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	model := make([]byte, 1<<20)
	for i, w := range []struct{ off, n int }{{1, 10}, {511, 2}, {4095, 4098}, {12345, 6789}, {100000, 1}, {65536 - 7, 600}, {0, 3}} {
		p := plaintext(w.n + i)[i:]
		if _, err := f.WriteAt(p, int64(w.off)); err != nil {
			t.Fatalf("write %d bytes at %d: %v", w.n, w.off, err)
		}
		copy(model[w.off:], p)
		got := make([]byte, w.n+300)
		if _, err := f.ReadAt(got, int64(w.off)-min(int64(w.off), 150)); err != nil {
			t.Fatalf("read around %d: %v", w.off, err)
		}
		from := w.off - min(w.off, 150)
		sameBytes(t, fmt.Sprintf("read around the write of %d bytes at %d", w.n, w.off), got, model[from:from+len(got)])
	}
	got := make([]byte, len(model))
	if _, err := f.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	sameBytes(t, "the first MiB", got, model)
	f.Close()

	mnt := filepath.Join(dir, "mnt")
	t.Cleanup(func() { _ = exec.Command("umount", "-l", mnt).Run() })
	sh(t, "mkfs.ext4", "-q", "-F", eng.endpoint)
	if err := os.MkdirAll(mnt, 0o755); err != nil {
		t.Fatal(err)
	}
	sh(t, "mount", eng.endpoint, mnt)
	if err := writeFiles(mnt, 0, 10); err != nil {
		t.Fatal(err)
	}
	checkFiles(t, mnt, 10)
	sh(t, "umount", mnt)
	t.Log(sh(t, "e2fsck", "-fn", eng.endpoint))
	var dirs []string
	for i := range reps {
		dirs = append(dirs, filepath.Join(dir, fmt.Sprint("r", i)))
	}
	if found := filesHolding(t, dirs, []byte(strings.Repeat("file 3 ", 10)), []byte(plaintextLine[:32])); len(found) > 0 {
		t.Fatalf("plaintext on the replicas of an encrypted volume: %v", found)
	}
	eng.stopClean(t, "engine")
}
