package instancemanager

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestConfine(t *testing.T) {
	root := t.TempDir()
	outside := t.TempDir()
	if err := os.MkdirAll(filepath.Join(root, "replicas", "a"), 0o750); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outside, filepath.Join(root, "out")); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "file"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		dir string
		ok  bool
	}{
		{filepath.Join(root, "replicas", "a"), true},
		{filepath.Join(root, "replicas", "new", "deeper"), true},
		{filepath.Join(root, "r"), true},
		{root, false},
		{root + "/", false},
		{filepath.Dir(root), false},
		{root + "/replicas/../../x", false},
		{root + "x/r", false}, // a sibling with the root as its prefix
		{filepath.Join(root, "out"), false},
		{filepath.Join(root, "out", "r"), false},
		{filepath.Join(root, "file", "r"), false},
		{"replicas/a", false},
		{"", false},
		{outside, false},
	} {
		err := confine([]string{filepath.Join(t.TempDir(), "other"), root}, c.dir)
		if (err == nil) != c.ok || (err != nil && !errors.Is(err, ErrInvalid)) {
			t.Errorf("confine(%q): %v, want ok=%v", c.dir, err, c.ok)
		}
	}
}

// TestArgs: a spec becomes a command line with the instance manager's
// ports and paths, and --ready-fd. A TCP replica serves a unix socket too,
// at the path a replica with UnixSocket serves its only data listener.
func TestArgs(t *testing.T) {
	pl := placement{host: "10.0.0.5", runDir: "/run/cairn", ports: []int{10000, 10001}, name: "ns/v-r-0", readyF: 3}
	got := strings.Join(args(ReplicaSpec{DataDir: "/var/lib/cairn/r", SizeBytes: 4096, DirectIO: true}, pl), " ")
	if got != "--dir /var/lib/cairn/r --size 4096 --listen 10.0.0.5:10000 --listen-local unix:/run/cairn/r-"+shortName("ns/v-r-0")+".sock --control-listen 10.0.0.5:10001 --direct-io --ready-fd 3" {
		t.Fatalf("replica: %s", got)
	}
	got = strings.Join(args(ReplicaSpec{DataDir: "/d/r", SizeBytes: 4096, UnixSocket: true}, pl), " ")
	if got != "--dir /d/r --size 4096 --listen unix:/run/cairn/r-"+shortName("ns/v-r-0")+".sock --control-listen 10.0.0.5:10000 --ready-fd 3" {
		t.Fatalf("unix replica: %s", got)
	}
	e := withDefaults(EngineSpec{VolumeName: "v", Replicas: []ReplicaAddress{{"10.0.0.6:1", "10.0.0.6:2"}, {"unix:/run/cairn/r.sock", "10.0.0.5:3"}}})
	got = strings.Join(args(e, pl), " ")
	if got != "--name v --replica 10.0.0.6:1,10.0.0.6:2 --replica unix:/run/cairn/r.sock,10.0.0.5:3 --frontend fuse --fuse-dir /run/cairn/fuse/"+
		shortName("ns/v-r-0")+" --listen 10.0.0.5:10000 --ready-fd 3" {
		t.Fatalf("engine: %s", got)
	}
	// An encrypted engine reads its key from descriptor encF; only the
	// key's public check is on the command line.
	enc := e.(EngineSpec)
	enc.EncryptionKey, enc.EncryptionKeyCheck = strings.Repeat("k", 64), "0123abcd"
	pl.encF = 5
	got = strings.Join(args(enc, pl), " ")
	if !strings.Contains(got, " --encryption-key-fd 5 --encryption-key-check 0123abcd ") || strings.Contains(got, "kkkk") {
		t.Fatalf("encrypted engine: %s", got)
	}
	// A spec that spells the defaults out is the same spec.
	if !sameSpec(e, withDefaults(EngineSpec{VolumeName: "v", Replicas: e.(EngineSpec).Replicas, Frontend: FrontendFUSE, NBDKernel: NBDKernelAuto, Wanted: 2})) {
		t.Fatal("defaults spelled out make another spec")
	}
}
