package imclient

import (
	"context"
	"net"
	"path/filepath"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	. "github.com/onsi/gomega"

	"github.com/cairn-io/cairn/controllers/internal/imtest"
	imv1 "github.com/cairn-io/cairn/dataplane/api/instancemanager/v1"
	"github.com/cairn-io/cairn/dataplane/grpcalive"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// TestPoolFollowsWatch: the pool's copy of an instance manager's
// processes follows its watch stream; when the instance manager goes, the
// copy says it is not current, and when one comes back on the address the
// copy is current again with what that one reports.
func TestPoolFollowsWatch(t *testing.T) {
	g := NewWithT(t)
	dir := t.TempDir()
	im := imtest.Start(t, "n1", "", dir)
	addr := im.Addr
	var changes atomic.Int32
	pool := New(Options{MinBackoff: 20 * time.Millisecond, MaxBackoff: 200 * time.Millisecond, OnChange: func(string) { changes.Add(1) }})
	defer pool.Close()
	c, err := pool.Get(addr)
	g.Expect(err).NotTo(HaveOccurred())
	again, _ := pool.Get(addr)
	g.Expect(again).To(BeIdenticalTo(c), "one connection per instance manager")
	g.Eventually(func() bool { _, cur, _ := c.Processes(); return cur }, deadline.Scale(20*time.Second), 10*time.Millisecond).Should(BeTrue())

	_, err = c.Client.ProcessCreate(context.Background(), &imv1.ProcessCreateRequest{Name: "ns/v-r-0",
		Spec: &imv1.ProcessCreateRequest_Replica{Replica: &imv1.ReplicaSpec{DataDir: filepath.Join(dir, "r0"), SizeBytes: 16 << 20}}})
	g.Expect(err).NotTo(HaveOccurred())
	g.Eventually(func() string {
		p, ok, cur := c.Process("ns/v-r-0")
		if !ok || !cur || p.GetState() != imv1.ProcessState_PROCESS_STATE_RUNNING {
			return ""
		}
		return p.GetDataAddress()
	}, deadline.Scale(30*time.Second), 10*time.Millisecond).ShouldNot(BeEmpty())
	g.Expect(changes.Load()).To(BeNumerically(">=", 3), "snapshot, starting, running each notify")

	before := changes.Load()
	im.Kill()
	g.Eventually(func() bool { _, cur, _ := c.Processes(); return cur }, deadline.Scale(20*time.Second), 10*time.Millisecond).Should(BeFalse())
	_, _, err = c.Processes()
	g.Expect(err).To(HaveOccurred(), "the copy says why it is not current")
	g.Expect(changes.Load()).To(BeNumerically(">", before), "losing the stream notifies")

	imtest.Start(t, "n1", addr, dir)
	g.Eventually(func() bool { _, cur, _ := c.Processes(); return cur }, deadline.Scale(30*time.Second), 10*time.Millisecond).Should(BeTrue())
	procs, _, _ := c.Processes()
	g.Expect(procs).To(BeEmpty(), "the new instance manager killed the old one's children and reports none")
}

// TestPoolNoticesASilentInstanceManager: an instance manager that stops
// answering without closing its connection (SIGSTOP: as a node powered
// off or cut from the network looks) is noticed by keepalive within
// grpcalive's ping interval and timeout, not when TCP gives up minutes
// later; when it answers again the copy is current again.
func TestPoolNoticesASilentInstanceManager(t *testing.T) {
	g := NewWithT(t)
	im := imtest.Start(t, "n1", "", t.TempDir())
	pool := New(Options{MinBackoff: 20 * time.Millisecond, MaxBackoff: 200 * time.Millisecond})
	defer pool.Close()
	c, err := pool.Get(im.Addr)
	g.Expect(err).NotTo(HaveOccurred())
	g.Eventually(func() bool { _, cur, _ := c.Processes(); return cur }, deadline.Scale(20*time.Second), 10*time.Millisecond).Should(BeTrue())

	g.Expect(im.Cmd.Process.Signal(syscall.SIGSTOP)).To(Succeed())
	t.Cleanup(func() { im.Cmd.Process.Signal(syscall.SIGCONT) })
	stopped := time.Now()
	limit := grpcalive.PingEvery + grpcalive.PingTimeout + deadline.Scale(10*time.Second)
	g.Eventually(func() bool { _, cur, _ := c.Processes(); return cur }, limit, 50*time.Millisecond).Should(BeFalse(),
		"a silent instance manager is noticed within %s", limit)
	t.Logf("noticed after %s", time.Since(stopped).Round(100*time.Millisecond))

	g.Expect(im.Cmd.Process.Signal(syscall.SIGCONT)).To(Succeed())
	g.Eventually(func() bool { _, cur, _ := c.Processes(); return cur }, deadline.Scale(30*time.Second), 50*time.Millisecond).Should(BeTrue())
}

// TestWaitSettled: on a new connection WaitSettled returns once the first
// watch has answered: to a running instance manager the copy is then
// current (a reconciler reports its processes, not "unknown"); to an
// address nothing listens on, the copy is not current and says why.
func TestWaitSettled(t *testing.T) {
	g := NewWithT(t)
	im := imtest.Start(t, "n1", "", t.TempDir())
	pool := New(Options{MinBackoff: 20 * time.Millisecond, MaxBackoff: 200 * time.Millisecond})
	defer pool.Close()
	c, err := pool.Get(im.Addr)
	g.Expect(err).NotTo(HaveOccurred())
	c.WaitSettled(context.Background())
	_, cur, _ := c.Processes()
	g.Expect(cur).To(BeTrue(), "the first snapshot is in when WaitSettled returns")

	im.Kill()
	dead, err := pool.Get("127.0.0.1:1")
	g.Expect(err).NotTo(HaveOccurred())
	dead.WaitSettled(context.Background())
	_, cur, werr := dead.Processes()
	g.Expect(cur).To(BeFalse())
	g.Expect(werr).To(HaveOccurred(), "a failed first watch settles with its cause")
}

// TestWaitSettledGivesUp: an address that accepts connections and never
// answers keeps the first watch from settling; the first WaitSettled
// waits FirstSyncWait, and later ones on that connection do not wait.
func TestWaitSettledGivesUp(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() { // accept and stay silent
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			defer c.Close()
		}
	}()
	pool := New(Options{MinBackoff: 20 * time.Millisecond, MaxBackoff: 200 * time.Millisecond})
	defer pool.Close()
	c, err := pool.Get(ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	c.WaitSettled(context.Background())
	if d := time.Since(start); d < FirstSyncWait {
		t.Fatalf("the first wait on a silent peer returned after %v, before FirstSyncWait", d)
	}
	start = time.Now()
	c.WaitSettled(context.Background())
	if d := time.Since(start); d >= FirstSyncWait {
		t.Fatalf("a second wait on the same silent peer waited %v", d)
	}
}

// TestPoolClosesIdleUnreachable: a connection whose instance manager is
// gone and that nobody asks for any more (its InstanceManager now names a
// new pod's address) is closed after the idle timeout; one whose watch is
// current, or that is still asked for, stays.
func TestPoolClosesIdleUnreachable(t *testing.T) {
	g := NewWithT(t)
	im := imtest.Start(t, "n-idle", "", t.TempDir())
	pool := New(Options{MinBackoff: 20 * time.Millisecond, MaxBackoff: 100 * time.Millisecond, IdleTimeout: 300 * time.Millisecond})
	defer pool.Close()
	held := func(addr string) bool {
		pool.mu.Lock()
		defer pool.mu.Unlock()
		_, ok := pool.conns[addr]
		return ok
	}
	live, err := pool.Get(im.Addr)
	g.Expect(err).NotTo(HaveOccurred())
	g.Eventually(func() bool { _, cur, _ := live.Processes(); return cur }, deadline.Scale(20*time.Second), 10*time.Millisecond).Should(BeTrue())
	gone, asked := imtest.FreeAddr(t), imtest.FreeAddr(t)
	_, err = pool.Get(gone)
	g.Expect(err).NotTo(HaveOccurred())
	_, err = pool.Get(asked)
	g.Expect(err).NotTo(HaveOccurred())

	g.Eventually(func(g Gomega) {
		_, err := pool.Get(asked)
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(held(gone)).To(BeFalse(), "the unreachable address nobody asks for is closed")
	}, deadline.Scale(20*time.Second), 20*time.Millisecond).Should(Succeed())
	g.Expect(held(asked)).To(BeTrue(), "an unreachable address still asked for is kept")
	g.Expect(held(im.Addr)).To(BeTrue(), "a current connection is kept however long nobody asks")
	again, err := pool.Get(gone)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(again).NotTo(BeNil(), "asked for again, it is dialled again")
}
