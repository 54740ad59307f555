package fuse

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/go-logr/logr/testr"
	"golang.org/x/sys/unix"

	"github.com/cairn-io/cairn/dataplane/internal/shm"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// memDevice is a volume in memory. With a gate, every read and write
// waits at it, which counts how many are in flight at once.
type memDevice struct {
	mu      sync.Mutex
	data    []byte
	gate    *gate
	err     error        // what reads and writes fail with, if set
	onWrite func([]byte) // called with each write's payload, if set
}

func (d *memDevice) setErr(err error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.err = err
}

// setGate makes the requests from now on wait at g (nil: none).
func (d *memDevice) setGate(g *gate) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.gate = g
}

func (d *memDevice) wait() {
	d.mu.Lock()
	g := d.gate
	d.mu.Unlock()
	g.pass()
}

func (d *memDevice) ReadAt(ctx context.Context, p []byte, off int64) error {
	d.wait()
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.err != nil {
		return d.err
	}
	copy(p, d.data[off:])
	return nil
}

func (d *memDevice) WriteAt(ctx context.Context, p []byte, off int64, fua bool) error {
	d.wait()
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.err != nil {
		return d.err
	}
	if d.onWrite != nil {
		d.onWrite(p)
	}
	copy(d.data[off:], p)
	return nil
}

func (d *memDevice) Flush(ctx context.Context) error { return nil }

func (d *memDevice) Unmap(ctx context.Context, off, length int64) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	clear(d.data[off : off+length])
	return nil
}

func (d *memDevice) Size() int64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	return int64(len(d.data))
}

// gate holds the requests that reach it until want of them are in
// flight together, or until a deadline after the first one passes; from
// then on it holds none. It records the most it saw in flight.
type gate struct {
	want    int
	timeout time.Duration

	mu       sync.Mutex
	inFlight int
	most     int
	open     chan struct{}
	timer    *time.Timer
}

func newGate(want int, timeout time.Duration) *gate {
	return &gate{want: want, timeout: timeout, open: make(chan struct{})}
}

func (g *gate) pass() {
	if g == nil {
		return
	}
	g.mu.Lock()
	g.inFlight++
	g.most = max(g.most, g.inFlight)
	if g.timer == nil {
		g.timer = time.AfterFunc(g.timeout, g.release)
	}
	if g.inFlight >= g.want {
		g.releaseLocked()
	}
	g.mu.Unlock()
	<-g.open
	g.mu.Lock()
	g.inFlight--
	g.mu.Unlock()
}

func (g *gate) release() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.releaseLocked()
}

func (g *gate) releaseLocked() {
	select {
	case <-g.open:
	default:
		close(g.open)
	}
}

func (g *gate) mostInFlight() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.most
}

func needFUSE(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: a FUSE mount and loop devices (CI runs as root)")
	}
	for _, dev := range []string{"/dev/fuse", "/dev/loop-control"} {
		if _, err := os.Stat(dev); err != nil {
			t.Skipf("needs %s: %v", dev, err)
		}
	}
}

// startMem serves a memDevice of size bytes through the frontend.
func startMem(t *testing.T, size int) (*memDevice, *Frontend) {
	t.Helper()
	return startMemArena(t, size, nil)
}

// startMemArena is startMem with requests read into bufs.
func startMemArena(t *testing.T, size int, bufs *shm.Arena) (*memDevice, *Frontend) {
	t.Helper()
	needFUSE(t)
	dev := &memDevice{data: make([]byte, size)}
	dir := filepath.Join(t.TempDir(), "mnt")
	f, err := Start(dev, Options{Name: "vol", Dir: dir, Logger: testr.New(t), Buffers: bufs})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := f.Stop(); err != nil {
			t.Errorf("stop: %v", err)
		}
	})
	return dev, f
}

// alignedBuffer is n bytes aligned for O_DIRECT.
func alignedBuffer(t *testing.T, n int) []byte {
	t.Helper()
	b := make([]byte, n+4096)
	skip := (4096 - int(uintptr(unsafe.Pointer(&b[0]))%4096)) % 4096
	return b[skip : skip+n]
}

func openDirect(t *testing.T, path string) *os.File {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR|unix.O_DIRECT, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

// TestLoopDirectIO: the loop device reads and writes the volume file with
// direct I/O (the kernel shows dio 1), and data written through it with
// O_DIRECT reaches the device and reads back, at 4 KiB and at 1 MiB.
func TestLoopDirectIO(t *testing.T) {
	dev, f := startMem(t, 8<<20)
	if !f.loop.directIO {
		t.Fatalf("%s was attached without direct I/O", f.Endpoint())
	}
	sys := fmt.Sprintf("/sys/block/%s/loop/dio", strings.TrimPrefix(f.Endpoint(), "/dev/"))
	if b, err := os.ReadFile(sys); err != nil || strings.TrimSpace(string(b)) != "1" {
		t.Fatalf("%s: %q, %v; want 1", sys, b, err)
	}
	loop := openDirect(t, f.Endpoint())
	for _, c := range []struct {
		off int64
		n   int
	}{{4096, 4096}, {1 << 20, 1 << 20}, {8<<20 - 4096, 4096}} {
		buf := alignedBuffer(t, c.n)
		for i := range buf {
			buf[i] = byte(c.off/4096) + byte(i*7)
		}
		if _, err := loop.WriteAt(buf, c.off); err != nil {
			t.Fatalf("write %d bytes at %d: %v", c.n, c.off, err)
		}
		dev.mu.Lock()
		same := bytes.Equal(dev.data[c.off:c.off+int64(c.n)], buf)
		dev.mu.Unlock()
		if !same {
			t.Fatalf("the device does not hold the %d bytes written at %d", c.n, c.off)
		}
		got := alignedBuffer(t, c.n)
		if _, err := loop.ReadAt(got, c.off); err != nil || !bytes.Equal(got, buf) {
			t.Fatalf("read back %d bytes at %d: %v, equal %v", c.n, c.off, err, bytes.Equal(got, buf))
		}
	}
	if err := loop.Sync(); err != nil {
		t.Fatalf("fsync of the loop device: %v", err)
	}
}

// TestLoopRequestsInFlight: 32 reads, then 32 writes, issued at once on
// the loop device with O_DIRECT reach the engine side by side, as the
// requests of a queue depth of 32 do. Without direct I/O on the loop
// device, asynchronous direct I/O in FUSE and a max_background above 32
// the engine saw one at a time (or 12: go-fuse's default
// max_background), each waiting for the one before.
func TestLoopRequestsInFlight(t *testing.T) {
	const depth = 32
	dev, f := startMem(t, 8<<20)
	loop := openDirect(t, f.Endpoint())
	for _, write := range []bool{false, true} {
		name := map[bool]string{false: "reads", true: "writes"}[write]
		g := newGate(depth, deadline.Scale(5*time.Second))
		dev.setGate(g)
		var wg sync.WaitGroup
		errs := make(chan error, depth)
		for i := range depth {
			buf := alignedBuffer(t, 4096)
			wg.Go(func() {
				off := int64(i) * 64 << 10 // apart, so nothing merges them
				var err error
				if write {
					_, err = loop.WriteAt(buf, off)
				} else {
					_, err = loop.ReadAt(buf, off)
				}
				if err != nil {
					errs <- err
				}
			})
		}
		wg.Wait()
		dev.setGate(nil)
		close(errs)
		if err := errors.Join(func() (all []error) {
			for err := range errs {
				all = append(all, err)
			}
			return
		}()...); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if most := g.mostInFlight(); most < depth {
			t.Fatalf("%d %s issued at once reached the device at most %d at a time", depth, name, most)
		}
	}
}

// TestFUSEFileInMount: the mount (fuse.cairn, max_read 1 MiB) lists the
// volume file with the volume's size; a 1 MiB O_DIRECT write to the file
// reaches the device as one 1 MiB write (max_pages, max_write); the
// file's size cannot be changed through the mount; punching a hole
// unmaps; a device error is EIO, a full device ENOSPC; after the device
// grows, Resize shows the new size in the file and the loop device; after
// Stop nothing is mounted or attached. It opens the file with os.OpenFile
// in the serving process, which deadlocks (the test hangs) if the server
// did not disarm FUSE_POLL (disarmPoll).
func TestFUSEFileInMount(t *testing.T) {
	dev, f := startMem(t, 8<<20)
	dir := filepath.Dir(f.File())
	mounts, _ := os.ReadFile("/proc/self/mounts")
	var line string
	for _, l := range strings.Split(string(mounts), "\n") {
		if f := strings.Fields(l); len(f) > 1 && f[1] == dir {
			line = l
		}
	}
	if !strings.Contains(line, " fuse.cairn ") || !strings.Contains(line, "max_read=1048576") {
		t.Fatalf("mount of %s: %q", dir, line)
	}
	names, err := os.ReadDir(dir)
	if err != nil || len(names) != 1 || names[0].Name() != "vol" {
		t.Fatalf("the mount lists %v (%v), want only vol", names, err)
	}
	if fi, err := os.Stat(f.File()); err != nil || fi.Size() != 8<<20 || !fi.Mode().IsRegular() {
		t.Fatalf("stat %s: %v, %v", f.File(), fi, err)
	}

	largest := 0 // written with dev.mu held
	dev.mu.Lock()
	dev.onWrite = func(p []byte) { largest = max(largest, len(p)) }
	dev.mu.Unlock()
	file := openDirect(t, f.File())
	buf := alignedBuffer(t, 1<<20)
	for i := range buf {
		buf[i] = byte(i / 4096)
	}
	if _, err := file.WriteAt(buf, 2<<20); err != nil {
		t.Fatal(err)
	}
	dev.mu.Lock()
	dev.onWrite = nil
	dev.mu.Unlock()
	if largest != 1<<20 {
		t.Fatalf("a 1 MiB write reached the device in pieces of at most %d bytes", largest)
	}
	if err := os.Truncate(f.File(), 4<<20); err == nil {
		t.Fatal("truncating the volume file through the mount succeeded")
	}
	if err := unix.Fallocate(int(file.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, 2<<20, 4096); err != nil {
		t.Fatalf("punching a hole: %v", err)
	}
	dev.mu.Lock()
	punched := bytes.Equal(dev.data[2<<20:2<<20+4096], make([]byte, 4096)) && dev.data[2<<20+4096] == 1
	dev.mu.Unlock()
	if !punched {
		t.Fatal("the punched hole was not unmapped, or more was")
	}

	dev.setErr(errors.New("replica gone"))
	if _, err := file.ReadAt(alignedBuffer(t, 4096), 0); !errors.Is(err, unix.EIO) {
		t.Fatalf("reading from a failing device: %v, want EIO", err)
	}
	dev.setErr(fmt.Errorf("no room: %w", unix.ENOSPC))
	if _, err := file.WriteAt(buf[:4096], 0); !errors.Is(err, unix.ENOSPC) {
		t.Fatalf("writing to a full device: %v, want ENOSPC", err)
	}
	dev.setErr(nil)
	file.Close()

	dev.mu.Lock()
	dev.data = append(dev.data, make([]byte, 4<<20)...)
	dev.mu.Unlock()
	if err := f.Resize(12 << 20); err != nil {
		t.Fatalf("resize: %v", err)
	}
	var got uint64
	loop := openDirect(t, f.Endpoint())
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, loop.Fd(), unix.BLKGETSIZE64, uintptr(unsafe.Pointer(&got))); errno != 0 || got != 12<<20 {
		t.Fatalf("%s has %d bytes after the resize (%v)", f.Endpoint(), got, errno)
	}
	loop.Close()

	if err := f.Stop(); err != nil {
		t.Fatalf("stop: %v", err)
	}
	mounts, _ = os.ReadFile("/proc/self/mounts")
	if strings.Contains(string(mounts), " "+dir+" ") {
		t.Fatal("the FUSE mount is still there after Stop")
	}
	if _, err := os.Stat(fmt.Sprintf("/sys/block/%s/loop", strings.TrimPrefix(f.Endpoint(), "/dev/"))); err == nil {
		t.Fatalf("%s is still attached after Stop", f.Endpoint())
	}
}

// TestWritesInSharedMemory: with an arena over shared memory, the payload
// of every write, small or large, reaches the device in that memory (so
// that a replica on the node reads it from there) and starts on a 4 KiB
// boundary (so that a replica writing with O_DIRECT takes it as it is);
// what was written reads back.
func TestWritesInSharedMemory(t *testing.T) {
	region, err := shm.Create("fuse-test", 32<<20)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { region.Close() })
	dev, f := startMemArena(t, 8<<20, shm.NewArena(region))
	var bad []string // written with dev.mu held
	dev.mu.Lock()
	dev.onWrite = func(p []byte) {
		if at, ok := region.Offset(p); !ok || at%4096 != 0 {
			bad = append(bad, fmt.Sprintf("%d bytes (in shared memory %v, at %d)", len(p), ok, at))
		}
	}
	dev.mu.Unlock()
	loop := openDirect(t, f.Endpoint())
	for _, c := range []struct {
		off int64
		n   int
	}{{0, 4096}, {64 << 10, 64 << 10}, {1 << 20, 1 << 20}, {4 << 20, 12 << 10}} {
		buf := alignedBuffer(t, c.n)
		for i := range buf {
			buf[i] = byte(c.off>>12) ^ byte(i*13)
		}
		if _, err := loop.WriteAt(buf, c.off); err != nil {
			t.Fatalf("write %d bytes at %d: %v", c.n, c.off, err)
		}
		got := alignedBuffer(t, c.n)
		if _, err := loop.ReadAt(got, c.off); err != nil || !bytes.Equal(got, buf) {
			t.Fatalf("read back %d bytes at %d: %v, equal %v", c.n, c.off, err, bytes.Equal(got, buf))
		}
	}
	dev.mu.Lock()
	defer dev.mu.Unlock()
	if len(bad) > 0 {
		t.Fatalf("writes that reached the device outside shared memory or unaligned: %v", bad)
	}
}
