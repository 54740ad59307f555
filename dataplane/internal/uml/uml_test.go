//go:build linux

package uml

import (
	"net"
	"os"
	"os/exec"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

func TestMain(m *testing.M) { os.Exit(Main(m)) }

// TestInsideSetup runs inside UML (TestBoot): the module is loaded,
// loopback works, TMPDIR is a tmpfs and PATH finds host programs.
func TestInsideSetup(t *testing.T) {
	if !Inside() {
		t.Skip("runs inside UML (TestBoot)")
	}
	if _, err := os.Stat("/sys/module/nbd"); err != nil {
		t.Errorf("nbd module not loaded: %v", err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("loopback: %v", err)
	}
	defer l.Close()
	c, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatalf("loopback: %v", err)
	}
	c.Close()
	var st unix.Statfs_t
	if err := unix.Statfs(os.TempDir(), &st); err != nil || st.Type != unix.TMPFS_MAGIC {
		t.Errorf("TMPDIR %s is not a tmpfs (type %#x, %v)", os.TempDir(), st.Type, err)
	}
	if _, err := exec.LookPath("mkfs.ext4"); err != nil {
		t.Errorf("PATH: %v", err)
	}
	var u unix.Utsname
	if err := unix.Uname(&u); err != nil {
		t.Fatal(err)
	}
	t.Logf("kernel %s", unix.ByteSliceToString(u.Release[:]))
}

// TestBoot boots UML and runs TestInsideSetup in it.
func TestBoot(t *testing.T) {
	if Inside() {
		t.Skip("already inside UML")
	}
	Run(t, Options{Tests: []string{"TestInsideSetup"}, Modules: []string{"nbd"}})
}

// TestFailsInside and TestSkipsInside fail and skip inside UML; the
// selftest subprocesses of TestRunReports run them there.
func TestFailsInside(t *testing.T) {
	if Inside() {
		t.Fatal("failing inside on purpose")
	}
}

func TestSkipsInside(t *testing.T) {
	if Inside() {
		t.Skip("skipping inside on purpose")
	}
}

func TestSelftestRun(t *testing.T) {
	name := os.Getenv("CAIRN_UML_SELFTEST")
	if name == "" || Inside() {
		t.Skip("a subprocess of TestRunReports")
	}
	Run(t, Options{Tests: []string{name}})
}

// TestRunReports: a test that fails inside UML, or skips there, fails
// the outer test, and says which.
func TestRunReports(t *testing.T) {
	if Inside() {
		t.Skip("already inside UML")
	}
	if err := Available(); err != nil {
		t.Skip(err)
	}
	for name, want := range map[string]string{
		"TestFailsInside": "failing inside on purpose",
		"TestSkipsInside": "a test skipped inside UML",
	} {
		cmd := exec.Command(os.Args[0], "-test.run=^TestSelftestRun$", "-test.v")
		cmd.Env = append(os.Environ(), "CAIRN_UML_SELFTEST="+name)
		out, err := cmd.CombinedOutput()
		if err == nil && strings.Contains(string(out), fpRegsFailure) {
			t.Skipf("%s: UML cannot run user space on this host:\n%s", name, out)
		}
		if err == nil || !strings.Contains(string(out), want) || !strings.Contains(string(out), "--- FAIL: TestSelftestRun") {
			t.Errorf("%s inside UML: outer test %v, want a failure saying %q:\n%s", name, err, want, out)
		}
	}
}
