//go:build linux

package nbd

import (
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// TestFrontendWithoutKernelDriver walks the Frontend's modes on a host
// without the nbd driver (where there is one, the engine's tests in UML
// cover the device): on fails at Claim and gives the socket back; auto
// serves the socket and says why there is no device; off says nothing;
// Stop removes the socket, also for a frontend claimed but never started.
func TestFrontendWithoutKernelDriver(t *testing.T) {
	if err := KernelDriver(); !errors.Is(err, ErrNoKernelNBD) {
		t.Skipf("this host has the nbd driver (or netlink says otherwise: %v); TestNBDKernelFilesystemInUML covers the device", err)
	}
	dir := t.TempDir()
	claim := func(mode KernelMode) (*Frontend, string, error) {
		sock := filepath.Join(dir, string(mode)+".sock")
		l, err := net.Listen("unix", sock)
		if err != nil {
			t.Fatal(err)
		}
		f, err := Claim(FrontendOptions{Name: "vol-" + string(mode), Listener: l, Socket: sock, Kernel: mode})
		return f, sock, err
	}
	gone := func(sock string) {
		t.Helper()
		if _, err := os.Stat(sock); !os.IsNotExist(err) {
			t.Fatalf("%s is still there: %v", sock, err)
		}
	}

	if _, sock, err := claim(KernelOn); !errors.Is(err, ErrNoKernelNBD) {
		t.Fatalf("on without the driver: %v", err)
	} else {
		gone(sock)
	}
	if _, sock, err := claim("maybe"); err == nil {
		t.Fatal("a mode that is not auto, on or off was accepted")
	} else {
		gone(sock)
	}

	f, sock, err := claim(KernelAuto)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Start(&memDevice{data: make([]byte, 1<<20)}); err != nil {
		t.Fatal(err)
	}
	if f.Endpoint() != sock || f.Socket() != sock || f.Device() != nil || !strings.Contains(f.Fallback(), "nbd driver") {
		t.Fatalf("auto without the driver: endpoint %q, device %v, fallback %q", f.Endpoint(), f.Device(), f.Fallback())
	}
	if f.InUse() != "" {
		t.Fatalf("in use with no client: %q", f.InUse())
	}
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(c, make([]byte, 18)); err != nil { // the server's greeting: it holds the client
		t.Fatal(err)
	}
	if got := f.InUse(); got != "1 NBD client connection(s)" {
		t.Fatalf("in use with a client: %q", got)
	}
	if err := f.Resize(2 << 20); err != nil {
		t.Fatalf("resize without a device: %v", err)
	}
	c.Close()
	if err := f.Stop(); err != nil {
		t.Fatal(err)
	}
	gone(sock)

	f, sock, err = claim(KernelOff)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Start(&memDevice{data: make([]byte, 1<<20)}); err != nil || f.Fallback() != "" {
		t.Fatalf("off: %v, fallback %q", err, f.Fallback())
	}
	if err := f.Stop(); err != nil {
		t.Fatal(err)
	}
	gone(sock)

	// Claimed, never started (the engine failed to open the replicas).
	f, sock, err = claim(KernelAuto)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- f.Stop() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(deadline.Scale(10 * time.Second)):
		t.Fatal("Stop of a frontend never started hangs")
	}
	gone(sock)
}
