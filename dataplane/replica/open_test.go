package replica

import (
	"encoding/json"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"
	"testing"
)

// TestOpenErrorsKeepTheirCause: a replica that cannot be opened because a
// file it names cannot be opened (missing, a directory, unreadable) fails
// with that cause reachable through errors.Is, and is not called corrupt:
// every open error used to be ErrCorrupt, its cause flattened into text.
// Metadata that does not decode is ErrCorrupt, with the decoder's error
// reachable too.
func TestOpenErrorsKeepTheirCause(t *testing.T) {
	// replicaWithSnapshot returns the directory of a closed replica with
	// one snapshot, and its metadata (to find the layer files).
	replicaWithSnapshot := func(t *testing.T) (string, metadata) {
		t.Helper()
		dir := filepath.Join(t.TempDir(), "r")
		r := open(t, dir, 1<<20)
		if _, err := r.WriteAt(make([]byte, BlockSize), 0); err != nil {
			t.Fatal(err)
		}
		if err := r.Snapshot(SnapshotOptions{Name: "s1"}); err != nil {
			t.Fatal(err)
		}
		if err := r.Close(); err != nil {
			t.Fatal(err)
		}
		m, err := readMeta(dir)
		if err != nil {
			t.Fatal(err)
		}
		return dir, m
	}
	reopen := func(dir string) error {
		r, err := Open(dir, Options{})
		if err == nil {
			r.Close()
		}
		return err
	}

	t.Run("missing snapshot layer", func(t *testing.T) {
		dir, m := replicaWithSnapshot(t)
		if err := os.Remove(filepath.Join(dir, m.Snapshots[0].File)); err != nil {
			t.Fatal(err)
		}
		err := reopen(dir)
		if !errors.Is(err, fs.ErrNotExist) || errors.Is(err, ErrCorrupt) {
			t.Fatalf("open with a layer file missing: %v; want ENOENT reachable, not ErrCorrupt", err)
		}
	})
	t.Run("head is a directory", func(t *testing.T) {
		dir, m := replicaWithSnapshot(t)
		head := filepath.Join(dir, m.Head)
		if err := os.Remove(head); err != nil {
			t.Fatal(err)
		}
		if err := os.Mkdir(head, 0o700); err != nil {
			t.Fatal(err)
		}
		err := reopen(dir)
		if !errors.Is(err, syscall.EISDIR) || errors.Is(err, ErrCorrupt) {
			t.Fatalf("open with a directory for the head: %v; want EISDIR reachable, not ErrCorrupt", err)
		}
	})
	t.Run("unreadable head", func(t *testing.T) {
		if os.Geteuid() == 0 {
			t.Skip("root opens a file of mode 000: run as another user for the EACCES case")
		}
		dir, m := replicaWithSnapshot(t)
		if err := os.Chmod(filepath.Join(dir, m.Head), 0); err != nil {
			t.Fatal(err)
		}
		err := reopen(dir)
		if !errors.Is(err, fs.ErrPermission) || errors.Is(err, ErrCorrupt) {
			t.Fatalf("open with an unreadable head: %v; want EACCES reachable, not ErrCorrupt", err)
		}
	})
	t.Run("metadata that does not decode", func(t *testing.T) {
		dir, _ := replicaWithSnapshot(t)
		if err := os.WriteFile(filepath.Join(dir, metaFileName), []byte(`{"formatVersion": 1, "size": `), 0o600); err != nil {
			t.Fatal(err)
		}
		err := reopen(dir)
		var syntax *json.SyntaxError
		if !errors.Is(err, ErrCorrupt) || !errors.As(err, &syntax) {
			t.Fatalf("open with truncated metadata: %v; want ErrCorrupt with the decoder's error reachable", err)
		}
	})
}
