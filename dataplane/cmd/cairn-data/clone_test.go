package main

import (
	"strings"
	"testing"
)

// TestEngineCloneCtl: one engine process fills its volume from another
// volume's replica process at a snapshot (ctl clone --wait), through the
// control API; the clone reads the snapshot's data, not what was written
// to the source after it.
func TestEngineCloneCtl(t *testing.T) {
	needTool(t, "qemu-io")
	src := startVolume(t, 2, "16Mi")
	qemuIO(t, src.uri, "write -P 0x61 0 2M", "write -P 0x62 10M 1M", "flush")
	src.ctl(t, "snapshot", "create", "s1")
	qemuIO(t, src.uri, "write -P 0x63 0 1M", "flush")

	dst := startVolume(t, 2, "16Mi")
	out := src.ctl(t, "snapshot", "list")
	if !strings.Contains(out, "s1") {
		t.Fatalf("snapshot list:\n%s", out)
	}
	out = dst.ctl(t, "clone", src.replicas[1].control, "s1", "--wait")
	if !strings.Contains(out, "complete") {
		t.Fatalf("clone --wait:\n%s", out)
	}
	qemuIO(t, dst.uri, "read -P 0x61 0 2M", "read -P 0 2M 8M", "read -P 0x62 10M 1M", "read -P 0 11M 5M")
	if r := dst.ctl(t, "replicas"); strings.Count(r, "RW") != 2 {
		t.Fatalf("the clone's replicas after the copy:\n%s", r)
	}
}
