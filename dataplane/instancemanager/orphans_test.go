package instancemanager

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/go-logr/logr"

	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// TestKillOrphans: a child recorded by a previous instance manager is
// killed; a record whose pid now belongs to another process is not.
func TestKillOrphans(t *testing.T) {
	dir := t.TempDir()
	orphan := exec.Command("sleep", "60")
	orphan.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := orphan.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = orphan.Wait(); close(done) }() // killed: the error is its signal
	writePIDFile(dir, "old-replica", orphan.Process.Pid)

	bystander := exec.Command("sleep", "60")
	if err := bystander.Start(); err != nil {
		t.Fatal(err)
	}
	defer bystander.Process.Kill()
	// A record with the right pid but another start time: a reused pid.
	if err := os.WriteFile(filepath.Join(dir, "stale.pid"), []byte(fmt.Sprintf("%d 1\n", bystander.Process.Pid)), 0o600); err != nil {
		t.Fatal(err)
	}

	if n := killOrphans(dir, logr.Discard()); n != 1 {
		t.Fatalf("killed %d, want 1", n)
	}
	select {
	case <-done:
	case <-time.After(deadline.Scale(10 * time.Second)):
		t.Fatal("the orphan survived")
	}
	if err := bystander.Process.Signal(syscall.Signal(0)); err != nil {
		t.Fatal("a process that merely reused a recorded pid was killed")
	}
	if files, _ := filepath.Glob(filepath.Join(dir, "*.pid")); len(files) != 0 {
		t.Fatalf("records left: %v", files)
	}
}

func TestPortRange(t *testing.T) {
	r, err := newPortRange(100, 104)
	if err != nil {
		t.Fatal(err)
	}
	a, _ := r.alloc(2, nil)
	b, _ := r.alloc(2, nil)
	if _, ok := r.alloc(2, nil); ok {
		t.Fatal("allocated past the end")
	}
	r.release(a)
	c, ok := r.alloc(2, nil)
	if !ok || c[0] != 100 || b[0] != 102 {
		t.Fatalf("a=%v b=%v c=%v", a, b, c)
	}
	if _, err := newPortRange(5, 4); err == nil {
		t.Fatal("an inverted range was accepted")
	}
}

// TestPortRangeSkipsBusyPorts: a port of the range that another program
// holds (here a listener; in practice often an outgoing connection's local
// port) is not handed to a child, which would fail to listen on it again
// on every retry.
func TestPortRangeSkipsBusyPorts(t *testing.T) {
	held, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	busy := held.Addr().(*net.TCPAddr).Port
	if busy+3 > 65535 {
		t.Skip("the kernel gave a port at the top of the range")
	}
	r, err := newPortRange(busy, busy+3)
	if err != nil {
		t.Fatal(err)
	}
	free := func(p int) bool { return bindable("127.0.0.1", p) }
	got, ok := r.alloc(2, free)
	if !ok {
		t.Skipf("ports after %d are in use here", busy)
	}
	if got[0] == busy || got[1] == busy {
		t.Fatalf("allocated %v, which includes the held port %d", got, busy)
	}
	if _, ok := r.alloc(2, func(int) bool { return false }); ok {
		t.Fatal("allocated a block although no port was free")
	}
}
