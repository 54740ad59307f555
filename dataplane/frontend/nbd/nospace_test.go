package nbd

import (
	"bytes"
	"context"
	"encoding/binary"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cairn-io/cairn/dataplane/dataconn"
	"github.com/cairn-io/cairn/dataplane/engine"
	"github.com/cairn-io/cairn/dataplane/engine/replicaclient"
	"github.com/cairn-io/cairn/dataplane/replica"
	"github.com/cairn-io/cairn/dataplane/replica/replicaserver"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// TestFullReplicaDiskIsENOSPC: a volume whose replica lives on a disk
// that fills up (a 2 MiB tmpfs under a 64 MiB volume) is written through
// the real stack, NBD client → NBD server → engine → dataconn → replica,
// until the disk is full. The client must be told ENOSPC, which a
// filesystem on the device reports as a full disk, not EIO, which it
// reports as a broken one.
func TestFullReplicaDiskIsENOSPC(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to mount a small tmpfs for the replica")
	}
	disk := t.TempDir()
	if err := unix.Mount("tmpfs", disk, "tmpfs", 0, "size=2m"); err != nil {
		t.Skipf("cannot mount a tmpfs: %v", err)
	}
	t.Cleanup(func() { _ = unix.Unmount(disk, unix.MNT_DETACH) })

	const size = 64 << 20
	r, err := replica.Open(filepath.Join(disk, "r0"), replica.Options{Size: size})
	if err != nil {
		t.Fatal(err)
	}
	listen := func() net.Listener {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		return l
	}
	dl, cl := listen(), listen()
	run := replicaserver.Start(r, replicaserver.Options{Data: dl, Control: cl})
	t.Cleanup(run.Kill)
	ctx := context.Background()
	e, err := engine.Open(ctx, engine.Options{
		Name:     "full",
		Replicas: []string{dl.Addr().String() + "," + cl.Addr().String()},
		Dial: replicaclient.Dialer(replicaclient.Options{Data: dataconn.ClientOptions{
			Conns: 1, RequestTimeout: deadline.Scale(10 * time.Second), PingInterval: -1}}),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })

	sock := filepath.Join(t.TempDir(), "nbd.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	s := NewServer(e, Options{ExportName: "full"})
	go func() { _ = s.Serve(l) }() // nil or the closed listener's error at cleanup; a failure shows as the client's calls failing
	t.Cleanup(func() { s.Close(); l.Close() })
	c := dialExport(t, sock, "full", size)
	defer c.Close()

	// Write 256 KiB at a time until a write fails: the disk holds 2 MiB,
	// so that happens within the first few MiB of the volume.
	block := bytes.Repeat([]byte("cairn fills its disk "), 256<<10/21+1)[:256<<10]
	for i := uint64(0); i*uint64(len(block)) < size; i++ {
		b := binary.BigEndian.AppendUint32(nil, magicRequest)
		b = binary.BigEndian.AppendUint16(b, 0)
		b = binary.BigEndian.AppendUint16(b, cmdWrite)
		b = binary.BigEndian.AppendUint64(b, i)
		b = binary.BigEndian.AppendUint64(b, i*uint64(len(block)))
		b = binary.BigEndian.AppendUint32(b, uint32(len(block)))
		if _, err := c.Write(append(b, block...)); err != nil {
			t.Fatal(err)
		}
		rep := make([]byte, 16)
		readFull(t, c, rep)
		if binary.BigEndian.Uint32(rep) != magicSimpleRep || binary.BigEndian.Uint64(rep[8:]) != i {
			t.Fatalf("reply %x to write %d", rep, i)
		}
		switch errno := binary.BigEndian.Uint32(rep[4:]); errno {
		case 0:
			continue
		case errNoSpc:
			return
		default:
			t.Fatalf("write %d (at %d MiB) on a full disk: NBD error %d (%v), want ENOSPC (%d)",
				i, i*uint64(len(block))>>20, errno, unix.Errno(errno), errNoSpc)
		}
	}
	t.Fatalf("%d MiB written to a replica on a 2 MiB disk without an error", size>>20)
}
