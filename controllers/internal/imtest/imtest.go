// Package imtest runs real instance managers (cairn-data built from this
// repository) for the controllers' tests.
package imtest

import (
	"bufio"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
)

var (
	buildOnce sync.Once
	binary    string
	buildErr  error
)

// binDirPrefix names the directories, one per test process, that hold
// the cairn-data it built: cairn-data-bin-PID in the temporary directory.
const binDirPrefix = "cairn-data-bin-"

// Binary builds cairn-data once per test binary and returns its path. A
// test binary has no hook at its exit to remove it, so each one removes
// the directories of test processes that are gone.
func Binary(t testing.TB) string {
	t.Helper()
	buildOnce.Do(func() {
		sweepBinaries()
		dir := filepath.Join(os.TempDir(), binDirPrefix+strconv.Itoa(os.Getpid()))
		if err := os.MkdirAll(dir, 0o755); err != nil {
			buildErr = err
			return
		}
		binary = filepath.Join(dir, "cairn-data")
		cmd := exec.Command("go", "build", "-o", binary, "github.com/cairn-io/cairn/dataplane/cmd/cairn-data")
		out, err := cmd.CombinedOutput()
		if err != nil {
			buildErr = fmt.Errorf("build cairn-data: %w\n%s", err, out)
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return binary
}

// sweepBinaries removes the binary directories of test processes that
// have exited (20 MB each).
func sweepBinaries() {
	dirs, _ := filepath.Glob(filepath.Join(os.TempDir(), binDirPrefix+"*"))
	for _, d := range dirs {
		pid, err := strconv.Atoi(strings.TrimPrefix(filepath.Base(d), binDirPrefix))
		if err == nil && pid > 0 && syscall.Kill(pid, 0) == syscall.ESRCH {
			os.RemoveAll(d)
		}
	}
}

// IM is a running instance manager.
type IM struct {
	Addr    string
	DataDir string
	Cmd     *exec.Cmd
}

// Start runs an instance manager for node on addr ("" picks a free
// address), with DataDir as its data directory, until the test ends;
// extra flags (e.g. --tls-cert ...) are added to its command line.
func Start(t testing.TB, node, addr, dataDir string, extra ...string) *IM {
	t.Helper()
	if addr == "" {
		addr = FreeAddr(t)
	}
	cmd := exec.Command(Binary(t), "instance-manager", "--listen", addr, "--node", node, "--data-dir", dataDir,
		"--log-dir", filepath.Join(dataDir, ".logs"), "--port-range", FreeRange(t, 64), "--stop-grace", "5s")
	cmd.Args = append(cmd.Args, extra...)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		_ = cmd.Wait() // killed: it exits with an error by design
	})
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil || !strings.HasPrefix(line, "ready ") {
		t.Fatalf("instance manager: %q %v", line, err)
	}
	return &IM{Addr: addr, DataDir: dataDir, Cmd: cmd}
}

// Kill kills the instance manager (and with it, its children).
func (im *IM) Kill() {
	im.Cmd.Process.Kill()
	_ = im.Cmd.Wait() // killed: it exits with an error by design
}

// FreeAddr returns a free 127.0.0.1 address.
func FreeAddr(t testing.TB) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// Ranges come from below Linux's default ephemeral ports (32768-60999), so
// that outgoing connections are not given the ports handed to processes
// (the instance manager also skips ports it finds taken).
var (
	rangeMu   sync.Mutex
	rangeNext = 20000 + os.Getpid()%8000
)

// FreeRange returns n consecutive free ports as "A-B", never the same
// range twice in one test binary.
func FreeRange(t testing.TB, n int) string {
	t.Helper()
	rangeMu.Lock()
	defer rangeMu.Unlock()
	for ; rangeNext+n <= 32768; rangeNext += n {
		ok := true
		for p := rangeNext; p < rangeNext+n && ok; p++ {
			l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", p))
			if err != nil {
				ok = false
				continue
			}
			l.Close()
		}
		if ok {
			base := rangeNext
			rangeNext += n
			return fmt.Sprintf("%d-%d", base, base+n-1)
		}
	}
	t.Fatal("no free port range")
	return ""
}
