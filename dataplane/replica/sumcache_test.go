package replica

import (
	"bytes"
	"testing"
)

// TestChecksumOfARead: the checksum of a range just read (a rebuild's
// verification of the chunk it copied) is the one computed from the
// disk, for a layer's own data and for the view, holes included; it is
// the checksum of what was read (here the layer file is changed behind
// the replica's back after the read), and is used once; a layer write or
// a change to the chain after the read makes the replica read again.
func TestChecksumOfARead(t *testing.T) {
	const size = 8 << 20
	r := open(t, t.TempDir(), size)
	defer r.Close()
	fill := func(v byte, off, n int64) {
		t.Helper()
		if _, err := r.WriteAt(bytes.Repeat([]byte{v}, int(n)), off); err != nil {
			t.Fatal(err)
		}
	}
	fill(1, 0, 1<<20)
	fill(2, 3<<20, 64<<10)
	fill(3, 5<<20, 4096)
	if err := r.Snapshot(SnapshotOptions{Name: "s1"}); err != nil {
		t.Fatal(err)
	}
	fill(4, 512<<10, 1<<20)
	fill(5, 7<<20, 8192)
	if err := r.Snapshot(SnapshotOptions{Name: "s2"}); err != nil {
		t.Fatal(err)
	}
	fill(6, 0, size) // the head: never part of a snapshot's view

	for _, name := range []string{"s1", "s2"} {
		for _, rg := range [][2]int64{{0, size}, {1 << 20, 4 << 20}, {3 * 4096, 17 * 4096}, {6 << 20, 1 << 20}} {
			off, n := rg[0], rg[1]
			layer, err := r.LayerChecksum(name, off, n)
			if err != nil {
				t.Fatal(err)
			}
			view, err := r.Checksum(name, off, n)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := r.ReadLayer(name, off, n); err != nil {
				t.Fatal(err)
			}
			if got, _ := r.LayerChecksum(name, off, n); got != layer {
				t.Fatalf("%s %d+%d: layer checksum after a read %08x, from the disk %08x", name, off, n, got, layer)
			}
			if _, err := r.ReadSnapshot(name, off, n); err != nil {
				t.Fatal(err)
			}
			if got, _ := r.Checksum(name, off, n); got != view {
				t.Fatalf("%s %d+%d: view checksum after a read %08x, from the disk %08x", name, off, n, got, view)
			}
		}
	}

	// What was read, once: the file changed behind the replica's back
	// shows in the next checksum only.
	before, _ := r.LayerChecksum("s1", 0, size)
	if _, err := r.ReadLayer("s1", 0, size); err != nil {
		t.Fatal(err)
	}
	if _, err := r.layers[0].f.File.WriteAt(bytes.Repeat([]byte{9}, 4096), 0); err != nil {
		t.Fatal(err)
	}
	if got, _ := r.LayerChecksum("s1", 0, size); got != before {
		t.Fatal("the checksum of a range just read was not the read's")
	}
	after, _ := r.LayerChecksum("s1", 0, size)
	if after == before {
		t.Fatal("the read's checksum was used twice")
	}

	// A layer write after the read: read again.
	if _, err := r.ReadLayer("s1", 0, size); err != nil {
		t.Fatal(err)
	}
	if err := r.WriteLayer("s1", bytes.Repeat([]byte{7}, 4096), 4<<20); err != nil {
		t.Fatal(err)
	}
	got, _ := r.LayerChecksum("s1", 0, size)
	if again, _ := r.LayerChecksum("s1", 0, size); got != again || got == after {
		t.Fatal("a layer write after the read did not show in the checksum")
	}

	// A change to the chain after the read: read again.
	if _, err := r.ReadSnapshot("s1", 0, size); err != nil {
		t.Fatal(err)
	}
	view, _ := r.Checksum("s1", 0, size)
	if _, err := r.ReadSnapshot("s1", 0, size); err != nil {
		t.Fatal(err)
	}
	if _, err := r.layers[0].f.File.WriteAt(bytes.Repeat([]byte{8}, 4096), 0); err != nil {
		t.Fatal(err)
	}
	if err := r.Snapshot(SnapshotOptions{Name: "s3"}); err != nil {
		t.Fatal(err)
	}
	got, _ = r.Checksum("s1", 0, size)
	if again, _ := r.Checksum("s1", 0, size); got != again || got == view {
		t.Fatal("a change to the chain after the read did not make the replica read again")
	}
}
