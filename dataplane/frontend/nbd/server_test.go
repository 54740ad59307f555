package nbd

import (
	"bytes"
	"context"
	"encoding/binary"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/go-logr/logr/funcr"

	"github.com/cairn-io/cairn/dataplane/internal/shm"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// memDevice is an in-memory Device for protocol tests; the end-to-end tests
// with the engine live in cmd/cairn-data.
type memDevice struct {
	mu      sync.Mutex
	data    []byte
	flushes int
	fua     int
}

func (m *memDevice) ReadAt(_ context.Context, p []byte, off int64) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	copy(p, m.data[off:])
	return nil
}

func (m *memDevice) WriteAt(_ context.Context, p []byte, off int64, fua bool) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	copy(m.data[off:], p)
	if fua {
		m.fua++
	}
	return nil
}

func (m *memDevice) Flush(context.Context) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.flushes++
	return nil
}

func (m *memDevice) Unmap(_ context.Context, off, n int64) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	clear(m.data[off : off+n])
	return nil
}

func (m *memDevice) Size() int64 { return int64(len(m.data)) }

func serve(t *testing.T, dev Device) string {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "nbd.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	s := NewServer(dev, Options{ExportName: "vol"})
	go func() { _ = s.Serve(l) }() // nil or the closed listener's error at cleanup; a failure shows as the client's calls failing
	t.Cleanup(func() { l.Close(); s.Close() })
	return sock
}

func need(t *testing.T, tool string) {
	t.Helper()
	if _, err := exec.LookPath(tool); err != nil {
		t.Skipf("%s not installed (make test installs it: apt-get install qemu-utils libnbd-bin fio)", tool)
	}
}

func run(t *testing.T, name string, args ...string) string {
	t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return string(out)
}

func TestQemuIO(t *testing.T) {
	need(t, "qemu-io")
	dev := &memDevice{data: make([]byte, 64<<20)}
	uri := "nbd+unix:///vol?socket=" + serve(t, dev)
	out := run(t, "qemu-io", "-f", "raw",
		"-c", "write -P 0xab 0 1M",
		"-c", "write -P 0xcd -f 1M 64k", // -f: FUA
		"-c", "write -z 2M 128k", // write zeroes
		"-c", "discard 4M 1M",
		"-c", "flush",
		"-c", "read -P 0xab 0 1M",
		"-c", "read -P 0xcd 1M 64k",
		"-c", "read -P 0 2M 128k",
		"-c", "read -P 0 4M 1M",
		uri)
	if strings.Contains(out, "Pattern verification failed") || strings.Contains(out, "error") {
		t.Fatalf("qemu-io:\n%s", out)
	}
	dev.mu.Lock()
	if !bytes.Equal(dev.data[:1<<20], bytes.Repeat([]byte{0xab}, 1<<20)) {
		t.Fatal("data did not reach the device")
	}
	if dev.flushes == 0 || dev.fua == 0 {
		t.Fatalf("flushes %d, FUA writes %d: both should be >0", dev.flushes, dev.fua)
	}
	dev.mu.Unlock()
	// A wrong pattern must be noticed (the check above can fail).
	bad, _ := exec.Command("qemu-io", "-f", "raw", "-c", "read -P 0x11 0 4k", uri).CombinedOutput()
	if !strings.Contains(string(bad), "Pattern verification failed") {
		t.Fatalf("qemu-io did not see the wrong pattern:\n%s", bad)
	}
}

func TestNbdinfo(t *testing.T) {
	need(t, "nbdinfo")
	dev := &memDevice{data: make([]byte, 8<<20)}
	sock := serve(t, dev)
	out := run(t, "nbdinfo", "nbd+unix:///vol?socket="+sock)
	for _, want := range []string{"export-size: 8388608", "can_flush: true", "can_fua: true", "can_trim: true",
		"can_zero: true", "can_multi_conn: true", "block_size_preferred: 4096"} {
		if !strings.Contains(out, want) {
			t.Errorf("nbdinfo lacks %q:\n%s", want, out)
		}
	}
	if out := run(t, "nbdinfo", "--list", "nbd+unix://?socket="+sock); !strings.Contains(out, `export="vol"`) {
		t.Errorf("export list:\n%s", out)
	}
	if out, err := exec.Command("nbdinfo", "nbd+unix:///nope?socket="+sock).CombinedOutput(); err == nil {
		t.Errorf("an unknown export was accepted:\n%s", out)
	}
}

// TestRawProtocolErrors speaks the protocol by hand for what clients do not
// send on their own: out-of-range requests and an unknown command.
func TestRawProtocolErrors(t *testing.T) {
	dev := &memDevice{data: make([]byte, 1<<20)}
	c := dialExport(t, serve(t, dev), "vol", 1<<20)
	defer c.Close()
	req := func(typ uint16, handle, off uint64, length uint32) {
		b := binary.BigEndian.AppendUint32(nil, magicRequest)
		b = binary.BigEndian.AppendUint16(b, 0)
		b = binary.BigEndian.AppendUint16(b, typ)
		b = binary.BigEndian.AppendUint64(b, handle)
		b = binary.BigEndian.AppendUint64(b, off)
		b = binary.BigEndian.AppendUint32(b, length)
		if _, err := c.Write(b); err != nil {
			t.Fatal(err)
		}
	}
	errnoOf := func(handle uint64) uint32 {
		r := make([]byte, 16)
		readFull(t, c, r)
		if binary.BigEndian.Uint32(r) != magicSimpleRep || binary.BigEndian.Uint64(r[8:]) != handle {
			t.Fatalf("reply %x for handle %d", r, handle)
		}
		return binary.BigEndian.Uint32(r[4:])
	}
	req(cmdRead, 1, 1<<20-512, 1024)
	if e := errnoOf(1); e != errInval {
		t.Fatalf("read past the end: errno %d", e)
	}
	req(cmdTrim, 2, 1<<20, 4096)
	if e := errnoOf(2); e != errNoSpc {
		t.Fatalf("trim past the end: errno %d", e)
	}
	req(42, 3, 0, 0)
	if e := errnoOf(3); e != errInval {
		t.Fatalf("unknown command: errno %d", e)
	}
	req(cmdDisc, 4, 0, 0)
	if _, err := c.Read(make([]byte, 1)); err == nil {
		t.Fatal("connection open after DISC")
	}
}

// dialExport connects to the NBD server on sock and negotiates the export
// name (fixed newstyle, EXPORT_NAME), checking that it has size bytes. The
// connection is then in the transmission phase.
func dialExport(t *testing.T, sock, name string, size uint64) net.Conn {
	t.Helper()
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	_ = c.SetDeadline(deadline.After(30 * time.Second))
	hello := make([]byte, 18)
	readFull(t, c, hello)
	if binary.BigEndian.Uint64(hello) != magicNBD || binary.BigEndian.Uint64(hello[8:]) != magicOpt {
		t.Fatalf("hello %x", hello)
	}
	if _, err := c.Write(binary.BigEndian.AppendUint32(nil, clientFixed|clientNoZeroes)); err != nil {
		t.Fatal(err)
	}
	opt := binary.BigEndian.AppendUint64(nil, magicOpt)
	opt = binary.BigEndian.AppendUint32(opt, optExportName)
	opt = binary.BigEndian.AppendUint32(opt, uint32(len(name)))
	if _, err := c.Write(append(opt, name...)); err != nil {
		t.Fatal(err)
	}
	info := make([]byte, 10)
	readFull(t, c, info)
	if got := binary.BigEndian.Uint64(info); got != size {
		t.Fatalf("export size %d, want %d", got, size)
	}
	return c
}

func readFull(t *testing.T, c net.Conn, b []byte) {
	t.Helper()
	for n := 0; n < len(b); {
		k, err := c.Read(b[n:])
		if err != nil {
			t.Fatal(err)
		}
		n += k
	}
}

// regionDevice records whether each write's payload lay in a region.
type regionDevice struct {
	memDevice
	region          *shm.Region
	inside, outside atomic.Int32
}

func (d *regionDevice) WriteAt(ctx context.Context, p []byte, off int64, fua bool) error {
	if _, ok := d.region.Offset(p); ok {
		d.inside.Add(1)
	} else {
		d.outside.Add(1)
	}
	return d.memDevice.WriteAt(ctx, p, off, fua)
}

// TestBuffersFromArena: with Options.Buffers over a shared region, write
// payloads are read from the client into the region (what lets the engine
// hand them to a local replica by reference), and every buffer goes back.
func TestBuffersFromArena(t *testing.T) {
	need(t, "qemu-io")
	region, err := shm.Create("nbd-test", 16<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer region.Close()
	arena := shm.NewArena(region)
	dev := &regionDevice{memDevice: memDevice{data: make([]byte, 64<<20)}, region: region}
	sock := filepath.Join(t.TempDir(), "nbd.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	s := NewServer(dev, Options{ExportName: "vol", Buffers: arena})
	go func() { _ = s.Serve(l) }() // nil or the closed listener's error at cleanup; a failure shows as the client's calls failing
	defer func() { l.Close(); s.Close() }()
	uri := "nbd+unix:///vol?socket=" + sock
	run(t, "qemu-io", "-f", "raw", "-c", "write -P 0x3c 0 1M", "-c", "write -P 0x4d 1M 4k", "-c", "read -P 0x3c 0 1M", "-c", "read -P 0x4d 1M 4k", uri)
	if in, out := dev.inside.Load(), dev.outside.Load(); in != 2 || out != 0 {
		t.Fatalf("writes with the payload in the region: %d, elsewhere: %d; want 2 and 0", in, out)
	}
	// A reply's buffer goes back just after it is sent: poll.
	for until := deadline.After(10 * time.Second); arena.InUse() != 0; time.Sleep(time.Millisecond) {
		if time.Now().After(until) {
			t.Fatalf("%d region buffers not returned after the client left", arena.InUse())
		}
	}
}

// emfileListener is a real listener whose first fails Accepts fail with
// EMFILE, as accept4 does when the process is out of descriptors.
type emfileListener struct {
	net.Listener
	mu    sync.Mutex
	fails int
	calls int
}

func (l *emfileListener) Accept() (net.Conn, error) {
	l.mu.Lock()
	l.calls++
	if l.fails > 0 {
		l.fails--
		l.mu.Unlock()
		return nil, &net.OpError{Op: "accept", Net: "unix", Addr: l.Addr(), Err: os.NewSyscallError("accept4", syscall.EMFILE)}
	}
	l.mu.Unlock()
	return l.Listener.Accept()
}

// TestServeRidesOutTransientAcceptErrors: a process out of descriptors
// fails accept for a while; Serve waits it out, says so once in the log,
// and serves the client that was waiting, then the next one.
func TestServeRidesOutTransientAcceptErrors(t *testing.T) {
	const fails = 4
	sock := filepath.Join(t.TempDir(), "nbd.sock")
	ul, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	l := &emfileListener{Listener: ul, fails: fails}
	var mu sync.Mutex
	var logs []string
	log := funcr.New(func(_, args string) { mu.Lock(); logs = append(logs, args); mu.Unlock() }, funcr.Options{})
	dev := &memDevice{data: make([]byte, 1<<20)}
	s := NewServer(dev, Options{ExportName: "vol", Logger: log})
	served := make(chan error, 1)
	go func() { served <- s.Serve(l) }()
	defer func() { l.Close(); s.Close() }()

	// Wait until Serve is past the failures, waiting in a real accept.
	for until := deadline.After(10 * time.Second); ; time.Sleep(time.Millisecond) {
		l.mu.Lock()
		calls := l.calls
		l.mu.Unlock()
		if calls > fails {
			break
		}
		select {
		case err := <-served:
			t.Fatalf("Serve returned on EMFILE: %v", err)
		default:
		}
		if time.Now().After(until) {
			t.Fatalf("Accept called %d times in 10 s", calls)
		}
	}
	for i := range 2 {
		c := dialExport(t, sock, "vol", 1<<20) // fails (deadline) if nobody accepts
		b := binary.BigEndian.AppendUint32(nil, magicRequest)
		b = binary.BigEndian.AppendUint16(b, 0)
		b = binary.BigEndian.AppendUint16(b, cmdFlush)
		b = binary.BigEndian.AppendUint64(b, uint64(i))
		b = binary.BigEndian.AppendUint64(b, 0)
		b = binary.BigEndian.AppendUint32(b, 0)
		if _, err := c.Write(b); err != nil {
			t.Fatal(err)
		}
		r := make([]byte, 16)
		readFull(t, c, r)
		if binary.BigEndian.Uint32(r) != magicSimpleRep || binary.BigEndian.Uint32(r[4:]) != 0 {
			t.Fatalf("flush reply %x", r)
		}
		c.Close()
	}
	select {
	case err := <-served:
		t.Fatalf("Serve returned: %v", err)
	default:
	}
	mu.Lock()
	all := strings.Join(logs, "\n")
	mu.Unlock()
	if n := strings.Count(all, "accepting connections fails"); n != 1 || !strings.Contains(all, "too many open files") {
		t.Fatalf("%d failure reports for %d failed accepts, want one naming the error:\n%s", n, fails, all)
	}
	s.Close()
	l.Close() // the listener's owner closes it (Close leaves it alone)
	select {
	case err := <-served:
		if err != nil {
			t.Fatalf("Serve after Close: %v", err)
		}
	case <-time.After(deadline.Scale(10 * time.Second)):
		t.Fatal("Serve did not return after Close")
	}
}
