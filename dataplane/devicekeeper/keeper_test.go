package devicekeeper_test

import (
	"context"
	"encoding/json"
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr/testr"
	"golang.org/x/sys/unix"

	"github.com/cairn-io/cairn/dataplane/devicekeeper"
	"github.com/cairn-io/cairn/dataplane/frontend/fuse"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// memDevice is a volume in memory.
type memDevice struct {
	mu   sync.Mutex
	data []byte
}

func (d *memDevice) ReadAt(_ context.Context, p []byte, off int64) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	copy(p, d.data[off:])
	return nil
}

func (d *memDevice) WriteAt(_ context.Context, p []byte, off int64, _ bool) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	copy(d.data[off:], p)
	return nil
}

func (d *memDevice) Flush(context.Context) error { return nil }

func (d *memDevice) Unmap(_ context.Context, off, n int64) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	clear(d.data[off : off+n])
	return nil
}

func (d *memDevice) Size() int64 { return int64(len(d.data)) }

func needRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: a real FUSE mount and loop device (CI runs as root)")
	}
}

// keeperAt runs a keeper on a socket in a new directory.
func keeperAt(t *testing.T, opts devicekeeper.Options) (*devicekeeper.Keeper, string) {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "keeper", "k.sock")
	l, err := devicekeeper.Listen(sock)
	if err != nil {
		t.Fatal(err)
	}
	opts.Logger = testr.New(t)
	k := devicekeeper.New(opts)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		if err := k.Serve(ctx, l); err != nil {
			t.Errorf("the keeper stopped serving: %v", err)
		}
		close(done)
	}()
	t.Cleanup(func() { cancel(); <-done; k.Close() })
	return k, sock
}

// startVolume serves a 16 MiB volume with the fuse frontend, deposited
// with the keeper at sock.
func startVolume(t *testing.T, sock, name string) (*fuse.Frontend, *devicekeeper.Client) {
	t.Helper()
	c := devicekeeper.NewClient(sock, testr.New(t))
	dir := filepath.Join(t.TempDir(), "fuse")
	t.Cleanup(func() { _ = exec.Command("umount", "-l", dir).Run() }) // not mounted if Stop unmounted it
	f, err := fuse.Start(&memDevice{data: make([]byte, 16<<20)}, fuse.Options{Name: name, Dir: dir, Logger: testr.New(t), Keeper: c})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = f.Stop(); c.Close() }) // best effort: the tests check the keeper, not the frontend's stop
	return f, c
}

// rawConn is a connection that sends whatever a test wants.
type rawConn struct{ c *net.UnixConn }

func dialRaw(t *testing.T, sock string) *rawConn {
	t.Helper()
	c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: sock, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return &rawConn{c}
}

// ask sends msg with fds and returns the refusal's code ("" if none) and
// how many descriptors came back (closed).
func (r *rawConn) ask(t *testing.T, msg []byte, fds ...int) (string, int) {
	t.Helper()
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	if _, _, err := r.c.WriteMsgUnix(msg, oob, nil); err != nil {
		t.Fatal(err)
	}
	if err := r.c.SetReadDeadline(deadline.After(30 * time.Second)); err != nil {
		t.Fatal(err)
	}
	buf, oobb := make([]byte, devicekeeper.MaxMessage), make([]byte, 256)
	n, oobn, _, _, err := r.c.ReadMsgUnix(buf, oobb)
	if err != nil {
		t.Fatalf("no answer: %v", err)
	}
	got := 0
	if msgs, _ := unix.ParseSocketControlMessage(oobb[:oobn]); len(msgs) > 0 {
		for _, m := range msgs {
			back, _ := unix.ParseUnixRights(&m)
			for _, fd := range back {
				unix.Close(fd)
			}
			got += len(back)
		}
	}
	var resp struct {
		Error *struct{ Code string } `json:"error"`
	}
	if err := json.Unmarshal(buf[:n], &resp); err != nil {
		t.Fatalf("answer %q: %v", buf[:n], err)
	}
	if resp.Error == nil {
		return "", got
	}
	return resp.Error.Code, got
}

// pipeWatch is a pipe whose write end is given away: closed tells whether
// every copy of that end is closed.
type pipeWatch struct{ r, w int }

func newPipeWatch(t *testing.T) *pipeWatch {
	var p [2]int
	if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(p[0]) })
	return &pipeWatch{r: p[0], w: p[1]}
}

// closed closes this process's write end and says whether the keeper
// closed its copy (the read end then polls as hung up).
func (p *pipeWatch) closed(t *testing.T) bool {
	t.Helper()
	if p.w >= 0 {
		unix.Close(p.w)
		p.w = -1
	}
	fds := []unix.PollFd{{Fd: int32(p.r), Events: unix.POLLIN}}
	n, err := unix.Poll(fds, 10000)
	return err == nil && n == 1 && fds[0].Revents&unix.POLLHUP != 0
}

// TestKeeperRefusesBadInput: malformed, oversize and mismatched requests
// are refused with a code, leave the table as it was, and every
// descriptor they carried is closed; the connection goes on answering.
func TestKeeperRefusesBadInput(t *testing.T) {
	needRoot(t)
	k, sock := keeperAt(t, devicekeeper.Options{})
	f, _ := startVolume(t, sock, "vol-a")
	before := k.Held()
	if len(before) != 1 || before[0].Session.Volume != "vol-a" || !before[0].Attended || before[0].Session.LoopPath != f.Endpoint() {
		t.Fatalf("held after the deposit: %+v", before)
	}
	session, err := json.Marshal(before[0].Session)
	if err != nil {
		t.Fatal(err)
	}
	r := dialRaw(t, sock)
	for _, tc := range []struct {
		name  string
		msg   string
		pipes int // descriptors sent along: pipe write ends
		want  string
	}{
		{"oversize", `{"op":"claim","volume":"` + strings.Repeat("a", devicekeeper.MaxMessage) + `"}`, 1, "invalid"},
		{"not JSON", "\x00\x01garbage", 0, "invalid"},
		{"unknown op", `{"op":"list"}`, 0, "invalid"},
		{"unknown field", `{"op":"claim","volume":"vol-a","steal":true}`, 0, "invalid"},
		{"claim with descriptors", `{"op":"claim","volume":"vol-a"}`, 2, "invalid"},
		{"four descriptors", `{"op":"deposit","session":` + string(session) + `}`, 4, "invalid"},
		{"deposit of pipes", `{"op":"deposit","session":` + string(session) + `}`, 3, "invalid"},
		{"unknown volume", `{"op":"claim","volume":"vol-z"}`, 0, "no-session"},
		{"drop of an unknown volume", `{"op":"drop","volume":"vol-z"}`, 0, "no-session"},
		{"claim of an attended session", `{"op":"claim","volume":"vol-a"}`, 0, "busy"},
		{"drop of an attended session", `{"op":"drop","volume":"vol-a"}`, 0, "busy"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var pipes []*pipeWatch
			var fds []int
			for range tc.pipes {
				p := newPipeWatch(t)
				pipes, fds = append(pipes, p), append(fds, p.w)
			}
			code, back := r.ask(t, []byte(tc.msg), fds...)
			if code != tc.want || back != 0 {
				t.Fatalf("answer: code %q with %d descriptors, want %q with none", code, back, tc.want)
			}
			for i, p := range pipes {
				if i < 3 && !p.closed(t) { // a fourth never reached the keeper: the kernel dropped it
					t.Fatalf("the keeper kept descriptor %d of a refused request", i)
				}
			}
			if after := k.Held(); !reflect.DeepEqual(sessions(after), sessions(before)) || !after[0].Attended {
				t.Fatalf("held after a refused request: %+v", after)
			}
		})
	}
	if code, _ := r.ask(t, []byte(`{"op":"release","volume":"vol-z"}`)); code != "no-session" {
		t.Fatalf("the connection stopped answering properly: %q", code)
	}
}

func sessions(st []devicekeeper.Status) []devicekeeper.Session {
	var out []devicekeeper.Session
	for _, s := range st {
		out = append(out, s.Session)
	}
	return out
}

// TestKeeperHoldsUntilTakenOver: a session whose engine went is held
// (unattended) and can be claimed once; the claimer gets working
// descriptors of the same connection and loop device; a session nobody
// takes over is let go after HoldFor.
func TestKeeperHoldsUntilTakenOver(t *testing.T) {
	needRoot(t)
	k, sock := keeperAt(t, devicekeeper.Options{HoldFor: 500 * time.Millisecond, SweepEvery: 50 * time.Millisecond})
	f, c := startVolume(t, sock, "vol-b")
	c.Close() // the engine's link goes: the session is alone
	waitHeld(t, k, func(st []devicekeeper.Status) bool { return len(st) == 1 && !st[0].Attended })

	c2 := devicekeeper.NewClient(sock, testr.New(t))
	defer c2.Close()
	ctx, cancel := context.WithTimeout(context.Background(), deadline.Scale(30*time.Second))
	defer cancel()
	s, files, err := c2.Claim(ctx, "vol-b")
	if err != nil {
		t.Fatal(err)
	}
	defer files.Close()
	if s.LoopPath != f.Endpoint() || s.Volume != "vol-b" || !s.FUSE.Resend {
		t.Fatalf("claimed %+v, the frontend serves %s", s, f.Endpoint())
	}
	if err := devicekeeper.Check(s, files); err != nil {
		t.Fatalf("the claimed descriptors: %v", err)
	}
	// Attended again: never let go, while a second claimer is refused.
	c3 := devicekeeper.NewClient(sock, testr.New(t))
	defer c3.Close()
	short, cancel3 := context.WithTimeout(context.Background(), deadline.Scale(300*time.Millisecond)) // retried while busy until it ends
	defer cancel3()
	if _, _, err := c3.Claim(short, "vol-b"); !errors.Is(err, devicekeeper.ErrBusy) {
		t.Fatalf("a second claim: %v, want ErrBusy", err)
	}
	if st := k.Held(); len(st) != 1 || !st[0].Attended {
		t.Fatalf("held while claimed: %+v", st)
	}
	if err := c2.Release(ctx, "vol-b"); err != nil {
		t.Fatal(err)
	}
	waitHeld(t, k, func(st []devicekeeper.Status) bool { return len(st) == 0 })
}

func waitHeld(t *testing.T, k *devicekeeper.Keeper, ok func([]devicekeeper.Status) bool) {
	t.Helper()
	until := deadline.After(30 * time.Second)
	for !ok(k.Held()) {
		if time.Now().After(until) {
			t.Fatalf("held: %+v", k.Held())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestKeeperLock: a second keeper on the same socket is refused.
func TestKeeperLock(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "k.sock")
	l, err := devicekeeper.Lock(sock)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if _, err := devicekeeper.Lock(sock); err == nil {
		t.Fatal("a second lock of the same socket was granted")
	}
}
