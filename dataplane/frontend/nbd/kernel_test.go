//go:build linux

package nbd

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/cairn-io/cairn/dataplane/internal/uml"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// TestConnectMessageLayout checks NBD_CMD_CONNECT's and
// NBD_CMD_RECONFIGURE's attributes byte for
// byte against linux/nbd-netlink.h: {len, type} headers in host order,
// values padded to 4 bytes, sockets nested as ITEM{FD}.
func TestConnectMessageLayout(t *testing.T) {
	opts := KernelOptions{TimeoutSeconds: 30, Backend: "vol", DeadConnTimeoutSeconds: 120}
	got := connectMessage(1<<30, 0x16d, opts, []int{7, 9})
	var want []byte
	ne := binary.NativeEndian
	hdr := func(n, typ uint16) { want = ne.AppendUint16(ne.AppendUint16(want, n), typ) }
	sockets := func() {
		hdr(4+2*12, 7|0x8000) // SOCKETS, nested
		for _, fd := range []uint32{7, 9} {
			hdr(12, 1|0x8000) // SOCK_ITEM, nested
			hdr(8, 1)         // SOCK_FD
			want = ne.AppendUint32(want, fd)
		}
	}
	hdr(12, 2) // SIZE_BYTES
	want = ne.AppendUint64(want, 1<<30)
	hdr(12, 3) // BLOCK_SIZE_BYTES
	want = ne.AppendUint64(want, 4096)
	hdr(12, 5) // SERVER_FLAGS
	want = ne.AppendUint64(want, 0x16d)
	hdr(12, 4) // TIMEOUT
	want = ne.AppendUint64(want, 30)
	hdr(12, 8) // DEAD_CONN_TIMEOUT
	want = ne.AppendUint64(want, 120)
	hdr(8, 10) // BACKEND_IDENTIFIER "vol\0"
	want = append(want, 'v', 'o', 'l', 0)
	sockets()
	if !bytes.Equal(got, want) {
		t.Fatalf("connect attributes\n got %x\nwant %x", []byte(got), want)
	}

	// NBD_CMD_RECONFIGURE: the index, the backend (the kernel requires
	// the device's own), the size, the timeouts, new sockets; no flags.
	got = reconfigureMessage(3, 2<<30, opts, []int{7, 9})
	want = nil
	hdr(8, 1) // INDEX
	want = ne.AppendUint32(want, 3)
	hdr(8, 10)
	want = append(want, 'v', 'o', 'l', 0)
	hdr(12, 2)
	want = ne.AppendUint64(want, 2<<30)
	hdr(12, 4)
	want = ne.AppendUint64(want, 30)
	hdr(12, 8)
	want = ne.AppendUint64(want, 120)
	sockets()
	if !bytes.Equal(got, want) {
		t.Fatalf("reconfigure attributes\n got %x\nwant %x", []byte(got), want)
	}

	// A resize: index, backend and size only (an empty SOCKETS would be
	// a reconnect of nothing).
	got = reconfigureMessage(3, 2<<30, KernelOptions{Backend: "vol"}, nil)
	want = nil
	hdr(8, 1)
	want = ne.AppendUint32(want, 3)
	hdr(8, 10)
	want = append(want, 'v', 'o', 'l', 0)
	hdr(12, 2)
	want = ne.AppendUint64(want, 2<<30)
	if !bytes.Equal(got, want) {
		t.Fatalf("resize attributes\n got %x\nwant %x", []byte(got), want)
	}
}

// TestDecodeGenl feeds kernel-shaped replies: the CONNECT reply carrying
// the device index followed by the ack, and an error.
func TestDecodeGenl(t *testing.T) {
	ne := binary.NativeEndian
	msg := func(typ uint16, seq uint32, body []byte) []byte {
		b := ne.AppendUint32(nil, uint32(16+len(body)))
		b = ne.AppendUint16(b, typ)
		b = ne.AppendUint16(b, 0)
		b = ne.AppendUint32(b, seq)
		b = ne.AppendUint32(b, 0)
		return append(b, body...)
	}
	var index attrs
	index.u32(nbdAttrIndex, 3)
	reply := msg(30, 5, append([]byte{nbdCmdConnect, 1, 0, 0}, index...))
	ack := msg(unix.NLMSG_ERROR, 5, make([]byte, 20))
	done, got, err := decodeGenl(append(reply, ack...), 5)
	if err != nil || !done {
		t.Fatalf("done=%v err=%v", done, err)
	}
	if i, ok := findU32(got, nbdAttrIndex); !ok || i != 3 {
		t.Fatalf("index %d %v", i, ok)
	}
	// The reply alone is not the end; a message for another request is
	// ignored.
	if done, _, _ := decodeGenl(reply, 5); done {
		t.Fatal("done before the ack")
	}
	if _, got, _ := decodeGenl(reply, 6); got != nil {
		t.Fatal("took another request's reply")
	}
	eperm := msg(unix.NLMSG_ERROR, 5, append(ne.AppendUint32(nil, uint32(0xffffffff)), make([]byte, 16)...)) // -EPERM
	if _, _, err := decodeGenl(eperm, 5); !errors.Is(err, unix.EPERM) {
		t.Fatalf("error reply: %v", err)
	}
	// Truncated datagrams are errors, not panics.
	if _, _, err := decodeGenl(reply[:len(reply)-3], 5); err == nil {
		t.Fatal("truncated reply accepted")
	}
}

// TestGenlAgainstKernel asks this kernel's generic netlink controller for
// its own family: the request encoding and reply parsing meet a real
// kernel, on any host.
func TestGenlAgainstKernel(t *testing.T) {
	g, err := dialGenl()
	if err != nil {
		t.Skipf("no netlink socket here: %v", err)
	}
	defer g.close()
	id, err := g.familyID("nlctrl")
	if err != nil || id != unix.GENL_ID_CTRL {
		t.Fatalf("nlctrl family id %d, %v; want %d", id, err, unix.GENL_ID_CTRL)
	}
	if _, err := g.familyID("cairn-nofamily"); !errors.Is(err, unix.ENOENT) {
		t.Fatalf("unknown family: %v, want ENOENT", err)
	}
}

// socketPair returns the two ends of a unix stream socket pair, as
// ConnectKernel makes them: the server's end and the kernel's.
func socketPair(t *testing.T) (srv, client net.Conn) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	conn := func(fd int) net.Conn {
		f := os.NewFile(uintptr(fd), "pair")
		defer f.Close()
		c, err := net.FileConn(f)
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	return conn(fds[1]), conn(fds[0])
}

// TestServeTransmission drives the transmission-only path the kernel uses:
// requests on one end of a socket pair, no handshake.
func TestServeTransmission(t *testing.T) {
	dev := &memDevice{data: make([]byte, 1<<20)}
	s := NewServer(dev, Options{})
	srv, c := socketPair(t)
	defer c.Close()
	ended := make(chan struct{})
	go func() { s.ServeTransmission(srv); close(ended) }()
	req := func(typ, flags uint16, handle, off uint64, length uint32, payload []byte) {
		b := binary.BigEndian.AppendUint32(nil, magicRequest)
		b = binary.BigEndian.AppendUint16(b, flags)
		b = binary.BigEndian.AppendUint16(b, typ)
		b = binary.BigEndian.AppendUint64(b, handle)
		b = binary.BigEndian.AppendUint64(b, off)
		b = binary.BigEndian.AppendUint32(b, length)
		if _, err := c.Write(append(b, payload...)); err != nil {
			t.Fatal(err)
		}
	}
	replyOf := func(handle uint64, n int) []byte {
		r := make([]byte, 16+n)
		readFull(t, c, r)
		if binary.BigEndian.Uint32(r) != magicSimpleRep || binary.BigEndian.Uint64(r[8:]) != handle || binary.BigEndian.Uint32(r[4:]) != 0 {
			t.Fatalf("reply %x for handle %d", r[:16], handle)
		}
		return r[16:]
	}
	data := bytes.Repeat([]byte("cairn-kernel-nbd"), 512) // 8 KiB
	req(cmdWrite, cmdFlagFUA, 1, 64<<10, uint32(len(data)), data)
	replyOf(1, 0)
	req(cmdRead, 0, 2, 64<<10, uint32(len(data)), nil)
	if got := replyOf(2, len(data)); !bytes.Equal(got, data) {
		t.Fatal("read back differs from what was written")
	}
	req(cmdFlush, 0, 3, 0, 0, nil)
	replyOf(3, 0)
	req(cmdTrim, 0, 4, 64<<10, 4096, nil)
	replyOf(4, 0)
	dev.mu.Lock()
	fua, flushes, trimmed := dev.fua, dev.flushes, bytes.Equal(dev.data[64<<10:68<<10], make([]byte, 4096))
	dev.mu.Unlock()
	if fua != 1 || flushes != 1 || !trimmed {
		t.Fatalf("device saw fua=%d flushes=%d, trimmed range zero=%v", fua, flushes, trimmed)
	}
	req(cmdDisc, 0, 5, 0, 0, nil)
	select {
	case <-ended:
	case <-time.After(deadline.Scale(10 * time.Second)):
		t.Fatal("ServeTransmission did not return after DISC")
	}
	s.Close()
}

// TestConnectKernel attaches a device through the kernel's nbd driver and
// does I/O on /dev/nbdN. Where the driver is missing (as on the CI
// machines) it checks that ConnectKernel says so with ErrNoKernelNBD, which
// the engine turns into "serving the NBD socket only".
func TestConnectKernel(t *testing.T) {
	dev := &memDevice{data: make([]byte, 16<<20)}
	s := NewServer(dev, Options{})
	defer s.Close()
	kd, err := ConnectKernel(s, KernelOptions{Conns: 2, Backend: "cairn-test"})
	if errors.Is(err, ErrNoKernelNBD) {
		if _, serr := os.Stat("/sys/module/nbd"); serr == nil {
			t.Fatalf("the nbd module is loaded, yet: %v", err)
		}
		t.Skipf("no kernel nbd driver here: %v", err)
	}
	if errors.Is(err, unix.EPERM) {
		t.Skipf("not allowed to configure nbd devices: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = kd.Disconnect() }() // for an early exit; the test disconnects and checks that itself
	f := openDevice(t, kd.Path(), os.O_RDWR)
	data := bytes.Repeat([]byte{0x5a}, 64<<10)
	if _, err := f.WriteAt(data, 1<<20); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	f.Close()
	dev.mu.Lock()
	ok := bytes.Equal(dev.data[1<<20:1<<20+len(data)], data)
	dev.mu.Unlock()
	if !ok {
		t.Fatalf("a write to %s did not reach the device", kd.Path())
	}
	if err := kd.Disconnect(); err != nil {
		t.Fatal(err)
	}
}

// grownDevice is a memDevice whose size can grow up to its data's.
type grownDevice struct {
	*memDevice
	size atomic.Int64
}

func (g *grownDevice) Size() int64 { return g.size.Load() }

// deviceSize is the size of the block device f as the kernel has it.
func deviceSize(t *testing.T, f *os.File) int64 {
	t.Helper()
	var n uint64
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, f.Fd(), unix.BLKGETSIZE64, uintptr(unsafe.Pointer(&n))); errno != 0 {
		t.Fatalf("BLKGETSIZE64 on %s: %v", f.Name(), errno)
	}
	return int64(n)
}

// TestResizeKernel: a device attached with 16 MiB and grown to 48 MiB
// shows 48 MiB to the kernel after Resize (BLKGETSIZE64 and sysfs), and
// I/O beyond the old end reaches the server; a device reattached to a
// server of a grown volume takes the new size too.
func TestResizeKernel(t *testing.T) {
	dev := &grownDevice{memDevice: &memDevice{data: make([]byte, 64<<20)}}
	dev.size.Store(16 << 20)
	s := NewServer(dev, Options{})
	defer s.Close()
	opts := KernelOptions{Conns: 2, Backend: "cairn-resize", DeadConnTimeoutSeconds: 60}
	kd, err := ConnectKernel(s, opts)
	if errors.Is(err, ErrNoKernelNBD) {
		t.Skipf("no kernel nbd driver here (TestConnectKernelInUML runs this inside User-Mode Linux): %v", err)
	}
	if errors.Is(err, unix.EPERM) {
		t.Skipf("not allowed to configure nbd devices: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = kd.Disconnect() }() // for an early exit; fails harmlessly once the test drops kd for kd2
	f := openDevice(t, kd.Path(), os.O_RDWR|unix.O_DIRECT)
	defer f.Close()
	if got := deviceSize(t, f); got != 16<<20 {
		t.Fatalf("%s has %d bytes, want 16 MiB", kd.Path(), got)
	}
	dev.size.Store(48 << 20)
	if err := kd.Resize(48 << 20); err != nil {
		t.Fatalf("%v\n%s", err, uml.KernelLog(15))
	}
	if got := deviceSize(t, f); got != 48<<20 {
		t.Fatalf("after Resize %s has %d bytes, want 48 MiB\n%s", kd.Path(), got, uml.KernelLog(15))
	}
	sectors, _ := os.ReadFile(fmt.Sprintf("/sys/block/nbd%d/size", kd.Index))
	if strings.TrimSpace(string(sectors)) != fmt.Sprint(48<<20/512) {
		t.Fatalf("sysfs size %q, want %d sectors", sectors, 48<<20/512)
	}
	if _, err := f.WriteAt(alignedBlock(64<<10, 0xc3), 40<<20); err != nil {
		t.Fatalf("writing beyond the old end: %v", err)
	}
	dev.mu.Lock()
	ok := bytes.Equal(dev.data[40<<20:40<<20+64<<10], bytes.Repeat([]byte{0xc3}, 64<<10))
	dev.mu.Unlock()
	if !ok {
		t.Fatal("the write beyond the old end did not reach the device")
	}
	if err := kd.Resize(1000); err == nil {
		t.Fatal("Resize to a size that is not a multiple of 4096 was accepted")
	}

	// The server goes away without a disconnect; the volume grows
	// meanwhile; a reattach brings the new size.
	kd.closeConns()
	kd.done.Wait()
	kd.nl.close()
	dev.size.Store(64 << 20)
	s2 := NewServer(dev, Options{})
	defer s2.Close()
	kd2, err := ReattachKernel(s2, kd.Index, opts)
	if err != nil {
		t.Fatalf("%v\n%s", err, uml.KernelLog(15))
	}
	defer func() { _ = kd2.Disconnect() }() // for an early exit; the test disconnects and checks that itself
	if got := deviceSize(t, f); got != 64<<20 {
		t.Fatalf("after a reattach to a grown volume %s has %d bytes, want 64 MiB", kd.Path(), got)
	}
	f.Close()
	if err := kd2.Disconnect(); err != nil {
		t.Fatal(err)
	}
}

// openDevice opens a block device, polling while its node appears (udev
// or devtmpfs create it asynchronously).
func openDevice(t *testing.T, path string, flags int) *os.File {
	t.Helper()
	until := deadline.After(10 * time.Second)
	for {
		f, err := os.OpenFile(path, flags, 0)
		if err == nil {
			return f
		}
		if time.Now().After(until) {
			t.Fatal(err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// alignedBlock is a 4 KiB-aligned buffer of n bytes of v, for O_DIRECT.
//
//nolint:unparam // n: every call spells out the size it writes
func alignedBlock(n int, v byte) []byte {
	b := make([]byte, n+4096)
	off := 4096 - int(uintptr(unsafe.Pointer(&b[0]))%4096)
	b = b[off%4096 : off%4096+n]
	for i := range b {
		b[i] = v
	}
	return b
}

// TestReattachKernel: when the engine serving /dev/nbdN dies (its
// sockets close without a disconnect), the device stays configured and
// holds new I/O; FindKernelDevice finds it by backend name, and
// ReattachKernel with a new server completes the held write and serves
// the old data.
func TestReattachKernel(t *testing.T) {
	dev := &memDevice{data: make([]byte, 16<<20)}
	s1 := NewServer(dev, Options{})
	opts := KernelOptions{Conns: 2, Backend: "cairn-reattach", DeadConnTimeoutSeconds: 60}
	kd, err := ConnectKernel(s1, opts)
	if errors.Is(err, ErrNoKernelNBD) {
		t.Skipf("no kernel nbd driver here (TestReattachKernelInUML runs this inside User-Mode Linux): %v", err)
	}
	if errors.Is(err, unix.EPERM) {
		t.Skipf("not allowed to configure nbd devices: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	f := openDevice(t, kd.Path(), os.O_RDWR|unix.O_DIRECT)
	defer f.Close()
	if _, err := f.WriteAt(alignedBlock(64<<10, 0xa1), 0); err != nil {
		t.Fatal(err)
	}
	// The engine dies: its ends of the sockets close, nobody disconnects.
	kd.closeConns()
	kd.done.Wait()
	kd.nl.close()
	s1.Close()

	index, found := FindKernelDevice("cairn-reattach")
	if !found || index != kd.Index {
		t.Fatalf("FindKernelDevice: %d, %v; want %d", index, found, kd.Index)
	}
	if _, found := FindKernelDevice("cairn-nosuch"); found {
		t.Fatal("FindKernelDevice found a backend nobody has")
	}
	pid, _ := os.ReadFile(fmt.Sprintf("/sys/block/nbd%d/pid", index))
	t.Logf("orphaned /dev/nbd%d, pid file %q", index, strings.TrimSpace(string(pid)))

	held := make(chan error, 1)
	go func() {
		_, err := f.WriteAt(alignedBlock(64<<10, 0xb2), 1<<20)
		held <- err
	}()
	s2 := NewServer(dev, Options{})
	defer s2.Close()
	kd2, err := ReattachKernel(s2, index, opts)
	if err != nil {
		t.Fatalf("%v\n%s", err, uml.KernelLog(15))
	}
	defer func() { _ = kd2.Disconnect() }() // for an early exit; the test disconnects and checks that itself
	select {
	case err := <-held:
		if err != nil {
			t.Fatalf("the write held while no engine served: %v", err)
		}
	case <-time.After(deadline.Scale(30 * time.Second)):
		t.Fatal("the held write did not complete after the reattach")
	}
	dev.mu.Lock()
	ok := bytes.Equal(dev.data[1<<20:1<<20+64<<10], bytes.Repeat([]byte{0xb2}, 64<<10))
	dev.mu.Unlock()
	if !ok {
		t.Fatal("the held write did not reach the new server")
	}
	got := alignedBlock(64<<10, 0)
	if _, err := f.ReadAt(got, 0); err != nil || !bytes.Equal(got, bytes.Repeat([]byte{0xa1}, 64<<10)) {
		t.Fatalf("reading the first engine's write through the new one: %v", err)
	}
	pid, _ = os.ReadFile(fmt.Sprintf("/sys/block/nbd%d/pid", index))
	t.Logf("reattached, pid file %q", strings.TrimSpace(string(pid)))
	f.Close()
	if err := kd2.Disconnect(); err != nil {
		t.Fatal(err)
	}
	if _, found := FindKernelDevice("cairn-reattach"); found {
		t.Fatal("the device is still configured after Disconnect")
	}
}

// gatedDevice is a memDevice whose writes at offset at wait for release,
// after telling entered.
type gatedDevice struct {
	*memDevice
	at       int64
	entered  chan struct{}
	release  chan struct{}
	gateOnce sync.Once
}

func (g *gatedDevice) WriteAt(ctx context.Context, p []byte, off int64, fua bool) error {
	if off == g.at {
		g.gateOnce.Do(func() { close(g.entered) })
		<-g.release
	}
	return g.memDevice.WriteAt(ctx, p, off, fua)
}

// TestLeaveKernel: Leave answers the write it is serving before it lets
// go (the application gets its acknowledgement from this server, not a
// resend to the next one), and leaves /dev/nbdN configured with its I/O
// held, as a dead engine would: a write issued afterwards waits, and
// completes once a new server reattaches the device, which reads back
// everything written.
func TestLeaveKernel(t *testing.T) {
	dev := &gatedDevice{memDevice: &memDevice{data: make([]byte, 16<<20)}, at: 2 << 20,
		entered: make(chan struct{}), release: make(chan struct{})}
	s1 := NewServer(dev, Options{})
	opts := KernelOptions{Conns: 2, Backend: "cairn-leave", DeadConnTimeoutSeconds: 120}
	kd, err := ConnectKernel(s1, opts)
	if errors.Is(err, ErrNoKernelNBD) {
		t.Skipf("no kernel nbd driver here (TestReattachKernelInUML runs this inside User-Mode Linux): %v", err)
	}
	if errors.Is(err, unix.EPERM) {
		t.Skipf("not allowed to configure nbd devices: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	f := openDevice(t, kd.Path(), os.O_RDWR|unix.O_DIRECT)
	defer f.Close()
	if _, err := f.WriteAt(alignedBlock(64<<10, 0xa1), 0); err != nil {
		t.Fatal(err)
	}
	inFlight := make(chan error, 1)
	go func() {
		_, err := f.WriteAt(alignedBlock(64<<10, 0xc3), dev.at)
		inFlight <- err
	}()
	select {
	case <-dev.entered:
	case <-time.After(deadline.Scale(30 * time.Second)):
		t.Fatal("the write never reached the server")
	}
	// Leave's first step, taken here so that the server has stopped
	// reading before the write it serves finishes.
	kd.stopReading()
	left := make(chan struct{})
	go func() {
		kd.Leave()
		s1.Close()
		close(left)
	}()
	close(dev.release)
	select {
	case err := <-inFlight:
		if err != nil {
			t.Fatalf("the write the server had when it left: %v\n%s", err, uml.KernelLog(15))
		}
	case <-time.After(deadline.Scale(60 * time.Second)):
		t.Fatalf("the write the server had when it left was not answered by it\n%s", uml.KernelLog(15))
	}
	select {
	case <-left:
	case <-time.After(deadline.Scale(30 * time.Second)):
		t.Fatal("Leave did not return")
	}

	index, found := FindKernelDevice("cairn-leave")
	if !found || index != kd.Index {
		t.Fatalf("after Leave, FindKernelDevice: %d, %v; want %d (still configured)", index, found, kd.Index)
	}
	held := make(chan error, 1)
	go func() {
		_, err := f.WriteAt(alignedBlock(64<<10, 0xd4), 4<<20)
		held <- err
	}()
	s2 := NewServer(dev.memDevice, Options{})
	defer s2.Close()
	kd2, err := ReattachKernel(s2, index, opts)
	if err != nil {
		t.Fatalf("%v\n%s", err, uml.KernelLog(15))
	}
	defer func() { _ = kd2.Disconnect() }()
	select {
	case err := <-held:
		if err != nil {
			t.Fatalf("the write held while no server served: %v\n%s", err, uml.KernelLog(15))
		}
	case <-time.After(deadline.Scale(60 * time.Second)):
		t.Fatalf("the held write did not complete after the reattach\n%s", uml.KernelLog(15))
	}
	for _, w := range []struct {
		off int64
		v   byte
	}{{0, 0xa1}, {2 << 20, 0xc3}, {4 << 20, 0xd4}} {
		got := alignedBlock(64<<10, 0)
		if _, err := f.ReadAt(got, w.off); err != nil || !bytes.Equal(got, bytes.Repeat([]byte{w.v}, 64<<10)) {
			t.Fatalf("reading back %#x at %d after the reattach: %v", w.v, w.off, err)
		}
	}
	f.Close()
	if err := kd2.Disconnect(); err != nil {
		t.Fatal(err)
	}
	if _, found := FindKernelDevice("cairn-leave"); found {
		t.Fatal("the device is still configured after Disconnect")
	}
}

// TestReattachKernelInUML runs TestReattachKernel and TestLeaveKernel
// inside User-Mode Linux with the nbd module.
func TestReattachKernelInUML(t *testing.T) {
	if uml.Inside() {
		t.Skip("already inside UML")
	}
	uml.Run(t, uml.Options{Tests: []string{"TestReattachKernel", "TestLeaveKernel"}, Modules: []string{"nbd"}})
}

// TestPipelinedReplies sends 256 reads and writes without waiting, so
// that replies finish concurrently and leave in batches, and checks that
// every reply carries its own handle and data.
func TestPipelinedReplies(t *testing.T) {
	const n = 256
	dev := &memDevice{data: make([]byte, n*4096)}
	for i := range n {
		copy(dev.data[i*4096:], bytes.Repeat([]byte{byte(i)}, 4096))
	}
	s := NewServer(dev, Options{MaxInFlight: 64})
	defer s.Close()
	srv, c := socketPair(t)
	defer c.Close()
	go s.ServeTransmission(srv)
	go func() {
		var b []byte
		for i := range n {
			typ, length := uint16(cmdRead), uint32(4096)
			b = binary.BigEndian.AppendUint32(b, magicRequest)
			if i%4 == 3 { // every fourth a write of 512 bytes into block i
				typ = cmdWrite
				length = 512
			}
			b = binary.BigEndian.AppendUint16(b, 0)
			b = binary.BigEndian.AppendUint16(b, typ)
			b = binary.BigEndian.AppendUint64(b, uint64(1000+i))
			b = binary.BigEndian.AppendUint64(b, uint64(i*4096+int(length%4096)))
			b = binary.BigEndian.AppendUint32(b, length)
			if typ == cmdWrite {
				b = append(b, bytes.Repeat([]byte{0xee}, int(length))...)
			}
		}
		if _, err := c.Write(b); err != nil {
			t.Error(err)
		}
	}()
	seen := map[uint64]bool{}
	for range n {
		r := make([]byte, 16)
		readFull(t, c, r)
		h := binary.BigEndian.Uint64(r[8:])
		i := int(h) - 1000
		if binary.BigEndian.Uint32(r) != magicSimpleRep || binary.BigEndian.Uint32(r[4:]) != 0 || i < 0 || i >= n || seen[h] {
			t.Fatalf("bad or repeated reply %x", r)
		}
		seen[h] = true
		if i%4 == 3 {
			continue // write: no data
		}
		got := make([]byte, 4096)
		readFull(t, c, got)
		if !bytes.Equal(got, bytes.Repeat([]byte{byte(i)}, 4096)) {
			t.Fatalf("reply for handle %d carries another block's data", h)
		}
	}
}

// TestMain lets TestConnectKernelInUML run this package's tests as init
// of a User-Mode Linux kernel.
func TestMain(m *testing.M) { os.Exit(uml.Main(m)) }

// TestConnectKernelInUML runs TestConnectKernel and TestResizeKernel
// inside User-Mode Linux with the nbd module loaded, so the netlink
// attach, I/O on /dev/nbdN, the resize and the disconnect meet the
// kernel's real nbd driver on every host,
// including those (like CI's) whose kernel has none.
func TestConnectKernelInUML(t *testing.T) {
	if uml.Inside() {
		t.Skip("already inside UML")
	}
	uml.Run(t, uml.Options{Tests: []string{"TestConnectKernel", "TestResizeKernel"}, Modules: []string{"nbd"}})
}
