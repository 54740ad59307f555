//go:build linux

// Package uml runs a package's tests inside User-Mode Linux, for the code
// paths that need a kernel driver the host does not have (the nbd block
// driver: CI machines and many cloud kernels ship without it, and some
// cannot load modules at all).
//
// Debian's user-mode-linux package is a Linux kernel built as a program
// (`linux.uml`), with its drivers as modules. Run boots it with the host's
// root filesystem as its own (hostfs, so every host binary and library is
// there), and the calling test binary as init. Main, called from the
// package's TestMain, notices that it is init inside UML: it mounts
// /proc, /sys, /dev and a tmpfs for TMPDIR, loads the wanted modules,
// brings up loopback, runs the selected tests with their output in a host
// file, and powers the kernel off. The outer test then reads the output
// and fails unless every selected test passed (a skip is a failure: inside
// UML nothing may be missing).
//
// The kernel is real (Debian's 6.1 long-term kernel) and the tests run as
// root inside it; only the kernel's view of the host's disks and clock is
// virtual. Boot takes about a second.
package uml

import (
	"bytes"
	"context"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Environment the outer test gives init on the kernel command line (the
// kernel hands "NAME=value" words it does not know to init as its
// environment).
const (
	envDir     = "CAIRN_UML_DIR"     // host directory for output, rc and scratch
	envModules = "CAIRN_UML_MODULES" // comma-separated module names to load
)

// Kernel is the program Run boots.
const Kernel = "linux.uml"

// Available says whether UML can be booted here, and why not.
func Available() error {
	if _, err := exec.LookPath(Kernel); err != nil {
		return fmt.Errorf("%s not installed (Debian package user-mode-linux; make test installs it: hack/install-test-tools.sh)", Kernel)
	}
	return nil
}

// Inside reports whether this process is the init of a UML kernel booted
// by Run.
func Inside() bool { return os.Getpid() == 1 && os.Getenv(envDir) != "" }

// Options configure Run.
type Options struct {
	// Tests names the tests to run inside; each must report PASS.
	Tests []string
	// Modules are kernel modules to load before the tests (e.g. "nbd").
	Modules []string
	// Memory is the kernel's memory (default 1536M); the tests' TMPDIR is
	// a tmpfs inside it.
	Memory string
	// Timeout bounds the whole boot (default 5 minutes).
	Timeout time.Duration
}

// Run boots UML with this test binary as init, runs opts.Tests inside and
// fails t unless every one of them passed. It skips when UML is not
// installed, unless CAIRN_REQUIRE_UML=1 (make test sets it after
// installing the package), where it fails.
func Run(t *testing.T, opts Options) {
	t.Helper()
	if err := Available(); err != nil {
		if os.Getenv("CAIRN_REQUIRE_UML") == "1" {
			t.Fatal(err)
		}
		t.Skip(err)
	}
	if opts.Memory == "" {
		opts.Memory = "1536M"
	}
	if opts.Timeout == 0 {
		opts.Timeout = 5 * time.Minute
	}
	pattern := "^(" + strings.Join(opts.Tests, "|") + ")$"
	dir := t.TempDir()
	self, err := filepath.Abs(os.Args[0])
	if err != nil {
		t.Fatal(err)
	}
	if raceEnabled {
		self = buildWithoutRace(t, dir)
	}
	// The kernel command line splits on spaces; a path with one cannot be
	// passed.
	if strings.ContainsAny(self+dir, " \t\n\"") {
		t.Skipf("UML needs paths without spaces: %q, %q", self, dir)
	}
	if err := os.Mkdir(filepath.Join(dir, "tmp"), 0o755); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), opts.Timeout)
	defer cancel()
	args := []string{
		"mem=" + opts.Memory,
		"rootfstype=hostfs", "rootflags=/", "rw",
		"init=" + self,
		// The console goes to a file: kernel messages, and a panic's
		// trace if init dies.
		"con=null", "con0=null,fd:1",
		envDir + "=" + dir,
		envModules + "=" + strings.Join(opts.Modules, ","),
		"--",
		"-test.run=" + pattern, "-test.v", "-test.count=1",
		"-test.timeout=" + (opts.Timeout - 10*time.Second).String(),
	}
	console, err := os.Create(filepath.Join(dir, "console"))
	if err != nil {
		t.Fatal(err)
	}
	defer console.Close()
	cmd := exec.CommandContext(ctx, Kernel, args...)
	cmd.Stdout, cmd.Stderr = console, console
	// UML keeps its memory in a file under TMPDIR and its control
	// socket under $HOME/.uml; keep both in the test's directory.
	cmd.Env = append(os.Environ(), "TMPDIR="+dir, "HOME="+dir)
	cmd.WaitDelay = 5 * time.Second
	begin := time.Now()
	runErr := cmd.Run()
	out, _ := os.ReadFile(filepath.Join(dir, "out"))
	rc, rcErr := os.ReadFile(filepath.Join(dir, "rc"))
	t.Logf("UML %s (%s, %.1fs); the tests inside said:\n%s", Kernel, pattern, time.Since(begin).Seconds(), out)
	if rcErr != nil {
		cons, _ := os.ReadFile(console.Name())
		skipIfHostCannotRun(t, cons)
		t.Fatalf("the tests inside UML did not finish (%v, %v); kernel console:\n%s", runErr, rcErr, tail(cons, 60))
	}
	if code := strings.TrimSpace(string(rc)); code != "0" {
		t.Errorf("the tests inside UML exited %s", code)
	}
	for _, name := range opts.Tests {
		if !regexp.MustCompile(`(?m)^--- PASS: ` + regexp.QuoteMeta(name) + ` `).Match(out) {
			t.Errorf("%s did not pass inside UML", name)
		}
	}
	if bytes.Contains(out, []byte("--- SKIP")) {
		t.Errorf("a test skipped inside UML, where nothing should be missing")
	}
}

// buildWithoutRace builds the package under test (the working directory
// of a test) without the race detector, whose shadow memory UML's address
// space cannot hold.
func buildWithoutRace(t *testing.T, dir string) string {
	t.Helper()
	// go test puts its own toolchain first in PATH.
	bin := filepath.Join(dir, "pkg.test")
	out, err := exec.Command("go", "test", "-c", "-race=false", "-o", bin, ".").CombinedOutput()
	if err != nil {
		t.Fatalf("building the tests without -race for UML: %v\n%s", err, out)
	}
	return bin
}

// KernelLog is the last lines of the kernel's log (dmesg), for a failure's
// message inside UML.
func KernelLog(lines int) string {
	out, _ := exec.Command("dmesg").CombinedOutput()
	return string(tail(bytes.TrimSpace(out), lines))
}

func tail(b []byte, lines int) []byte {
	l := bytes.Split(b, []byte("\n"))
	if len(l) > lines {
		l = l[len(l)-lines:]
	}
	return bytes.Join(l, []byte("\n"))
}

// Main is for TestMain: inside UML it sets the kernel up, runs the tests
// and powers off, never returning; elsewhere it returns m.Run()'s code.
func Main(m *testing.M) int {
	if !Inside() {
		return m.Run()
	}
	dir := os.Getenv(envDir)
	report := func(code int, msg string) {
		if msg != "" {
			fmt.Fprintln(os.Stderr, msg)
		}
		if err := os.WriteFile(filepath.Join(dir, "rc"), []byte(strconv.Itoa(code)+"\n"), 0o644); err != nil {
			fmt.Fprintln(os.Stderr, "uml: writing the exit code:", err)
		}
		unix.Sync()
		// Nothing else to do if the reboot fails; init must not exit.
		_ = unix.Reboot(unix.LINUX_REBOOT_CMD_POWER_OFF)
		select {}
	}
	out, err := os.Create(filepath.Join(dir, "out"))
	if err != nil {
		report(100, err.Error())
	}
	for _, fd := range []int{1, 2} {
		if err := unix.Dup3(int(out.Fd()), fd, 0); err != nil {
			report(100, "uml: redirecting output: "+err.Error())
		}
	}
	if err := setup(dir); err != nil {
		report(101, "uml: "+err.Error())
	}
	report(m.Run(), "")
	return 0
}

// setup prepares the fresh kernel for tests: filesystems, environment,
// modules and loopback.
func setup(dir string) error {
	scratch := filepath.Join(dir, "tmp")
	for _, m := range []struct{ fs, at string }{
		{"proc", "/proc"}, {"sysfs", "/sys"}, {"devtmpfs", "/dev"}, {"tmpfs", scratch},
	} {
		if err := unix.Mount(m.fs, m.at, m.fs, 0, ""); err != nil && err != unix.EBUSY {
			return fmt.Errorf("mount %s on %s: %w", m.fs, m.at, err)
		}
	}
	// The kernel gives init only HOME and TERM.
	os.Setenv("TMPDIR", scratch)
	if os.Getenv("PATH") == "" {
		os.Setenv("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
	}
	for _, name := range strings.Split(os.Getenv(envModules), ",") {
		if name == "" {
			continue
		}
		if err := loadModule(name); err != nil {
			return err
		}
	}
	return loopbackUp()
}

// loadModule loads name.ko from the UML package's module tree (the host's
// root has no modules for this kernel in /lib/modules).
func loadModule(name string) error {
	var rel unix.Utsname
	if err := unix.Uname(&rel); err != nil {
		return fmt.Errorf("uname: %w", err)
	}
	root := filepath.Join("/usr/lib/uml/modules", unix.ByteSliceToString(rel.Release[:]))
	var path string
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err == nil && d.Name() == name+".ko" {
			path = p
			return fs.SkipAll
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("looking for %s.ko in %s: %w", name, root, err)
	}
	if path == "" {
		return fmt.Errorf("module %s not found under %s", name, root)
	}
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := unix.FinitModule(int(f.Fd()), "", 0); err != nil && err != unix.EEXIST {
		return fmt.Errorf("load %s: %w", path, err)
	}
	return nil
}

// loopbackUp sets lo up, for tests that talk over 127.0.0.1.
func loopbackUp() error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("loopback: %w", err)
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq("lo")
	if err != nil {
		return err
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return fmt.Errorf("loopback flags: %w", err)
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	if err := unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr); err != nil {
		return fmt.Errorf("loopback up: %w", err)
	}
	return nil
}

// fpRegsFailure is what a UML kernel prints when it cannot give its first
// process the host CPU's full register state (seen with Debian bookworm's
// 6.1 UML on hosts with AMX).
const fpRegsFailure = "ptrace set fp regs failed"

// skipIfHostCannotRun skips t when the kernel console shows that UML
// cannot run user space on this host at all: not the tests' failure, and
// nothing the project can change, so it skips (loudly) even under
// CAIRN_REQUIRE_UML.
func skipIfHostCannotRun(t *testing.T, console []byte) {
	t.Helper()
	if bytes.Contains(console, []byte(fpRegsFailure)) {
		t.Skipf("UML cannot run user space on this host: its kernel (%s) failed to set a process's FPU registers through ptrace (%q): "+
			"the host CPU's extended register state (AVX-512/AMX here: %s) is larger than this UML kernel handles. "+
			"A newer user-mode-linux, or a host CPU without it, runs these tests", Kernel, fpRegsFailure, hostFPUFeatures())
	}
}

// hostFPUFeatures lists the host CPU flags that enlarge its register
// state, for the skip message.
func hostFPUFeatures() string {
	info, _ := os.ReadFile("/proc/cpuinfo")
	var found []string
	for _, f := range []string{"avx512f", "amx_tile"} {
		if bytes.Contains(info, []byte(" "+f+" ")) || bytes.Contains(info, []byte(" "+f+"\n")) {
			found = append(found, f)
		}
	}
	if len(found) == 0 {
		return "none of avx512f, amx_tile"
	}
	return strings.Join(found, ", ")
}
