package instancemanager

import (
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// threads is this process's number of OS threads.
func threads(t *testing.T) int {
	t.Helper()
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "Threads:"); ok {
			n, err := strconv.Atoi(strings.TrimSpace(v))
			if err != nil {
				t.Fatal(err)
			}
			return n
		}
	}
	t.Fatal("no Threads line in /proc/self/status")
	return 0
}

// Children being waited for hold no OS thread each: an instance manager
// with hundreds of children (four per attached volume) must not approach
// Go's limit of 10,000 threads.
func TestWaitingChildrenHoldNoThreads(t *testing.T) {
	const n = 100
	if fd, err := unix.PidfdOpen(os.Getpid(), 0); err != nil {
		t.Skipf("no pidfd here (%v): waiting children hold a thread each, as documented", err)
	} else {
		unix.Close(fd)
	}
	l := newExecLauncher("/bin/sh")
	base := threads(t)
	var children []Child
	defer func() {
		for _, c := range children {
			_ = c.Signal(syscall.SIGKILL)
		}
	}()
	for range n {
		c, err := l.Launch(Launch{Kind: "-c", Args: []string{"exec sleep 600"}})
		if err != nil {
			t.Fatal(err)
		}
		c.Ready().Close()
		children = append(children, c)
	}
	var waiting, ended atomic.Int32
	var wg sync.WaitGroup
	codes := make([]int, n)
	for i, c := range children {
		wg.Go(func() {
			waiting.Add(1)
			codes[i], _ = c.Wait()
			ended.Add(1)
		})
	}
	// Every waiter has started; a blocked wait would take a thread within
	// milliseconds. Watch the count for a while: it must stay near the
	// base, where a thread per child would add n.
	for end := time.Now().Add(deadline.Scale(10 * time.Second)); waiting.Load() < n; {
		if time.Now().After(end) {
			t.Fatalf("only %d of %d waiters started", waiting.Load(), n)
		}
		time.Sleep(time.Millisecond) // polling a counter; bounded above
	}
	peak := 0
	for end := time.Now().Add(time.Second); time.Now().Before(end); time.Sleep(10 * time.Millisecond) { // a window the bound must hold over, not a wait
		peak = max(peak, threads(t))
	}
	if peak > base+n/4 {
		t.Errorf("%d children being waited for: %d threads, %d before: a thread per waiting child", n, peak, base)
	}
	if got := ended.Load(); got != 0 {
		t.Fatalf("%d waits returned while every child still runs", got)
	}
	for _, c := range children {
		if err := c.Signal(syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
	}
	wg.Wait()
	for i, code := range codes {
		if code != -1 {
			t.Fatalf("child %d killed: exit code %d, want -1", i, code)
		}
	}
}
