package imclient

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	. "github.com/onsi/gomega"

	imv1 "github.com/cairn-io/cairn/dataplane/api/instancemanager/v1"
)

var cairnData string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "imclient")
	if err != nil {
		panic(err)
	}
	cairnData = filepath.Join(dir, "cairn-data")
	build := exec.Command("go", "build", "-o", cairnData, "github.com/cairn-io/cairn/dataplane/cmd/cairn-data")
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "imclient: build cairn-data:", err)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// startIM runs a real instance manager on addr and returns it once ready.
func startIM(t *testing.T, addr, dir string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(cairnData, "instance-manager", "--listen", addr, "--node", "n1", "--data-dir", dir,
		"--log-dir", filepath.Join(dir, "logs"), "--port-range", freeRange(t, 8), "--stop-grace", "5s")
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil || !strings.HasPrefix(line, "ready ") {
		t.Fatalf("instance manager: %q %v", line, err)
	}
	return cmd
}

func freeAddr(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

func freeRange(t *testing.T, n int) string {
	for base := 30000 + os.Getpid()%20000; base < 60000; base += n {
		ok := true
		for p := base; p < base+n && ok; p++ {
			l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", p))
			if err != nil {
				ok = false
				continue
			}
			l.Close()
		}
		if ok {
			return fmt.Sprintf("%d-%d", base, base+n-1)
		}
	}
	t.Fatal("no free port range")
	return ""
}

// TestPoolFollowsWatch: the pool's copy of an instance manager's
// processes follows its watch stream; when the instance manager goes, the
// copy says it is not current, and when one comes back on the address the
// copy is current again with what that one reports.
func TestPoolFollowsWatch(t *testing.T) {
	g := NewWithT(t)
	dir := t.TempDir()
	addr := freeAddr(t)
	im := startIM(t, addr, dir)
	var changes atomic.Int32
	pool := New(Options{MinBackoff: 20 * time.Millisecond, MaxBackoff: 200 * time.Millisecond, OnChange: func(string) { changes.Add(1) }})
	defer pool.Close()
	c, err := pool.Get(addr)
	g.Expect(err).NotTo(HaveOccurred())
	again, _ := pool.Get(addr)
	g.Expect(again).To(BeIdenticalTo(c), "one connection per instance manager")
	g.Eventually(func() bool { _, cur, _ := c.Processes(); return cur }, 20*time.Second, 10*time.Millisecond).Should(BeTrue())

	_, err = c.Client.ProcessCreate(context.Background(), &imv1.ProcessCreateRequest{Name: "ns/v-r-0",
		Spec: &imv1.ProcessCreateRequest_Replica{Replica: &imv1.ReplicaSpec{DataDir: filepath.Join(dir, "r0"), SizeBytes: 16 << 20}}})
	g.Expect(err).NotTo(HaveOccurred())
	g.Eventually(func() string {
		p, ok, cur := c.Process("ns/v-r-0")
		if !ok || !cur || p.GetState() != imv1.ProcessState_PROCESS_STATE_RUNNING {
			return ""
		}
		return p.GetDataAddress()
	}, 30*time.Second, 10*time.Millisecond).ShouldNot(BeEmpty())
	g.Expect(changes.Load()).To(BeNumerically(">=", 3), "snapshot, starting, running each notify")

	before := changes.Load()
	im.Process.Signal(syscall.SIGKILL)
	im.Wait()
	g.Eventually(func() bool { _, cur, _ := c.Processes(); return cur }, 20*time.Second, 10*time.Millisecond).Should(BeFalse())
	_, _, err = c.Processes()
	g.Expect(err).To(HaveOccurred(), "the copy says why it is not current")
	g.Expect(changes.Load()).To(BeNumerically(">", before), "losing the stream notifies")

	startIM(t, addr, dir)
	g.Eventually(func() bool { _, cur, _ := c.Processes(); return cur }, 30*time.Second, 10*time.Millisecond).Should(BeTrue())
	procs, _, _ := c.Processes()
	g.Expect(procs).To(BeEmpty(), "the new instance manager killed the old one's children and reports none")
}
