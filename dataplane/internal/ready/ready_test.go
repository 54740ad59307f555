package ready

import (
	"errors"
	"os"
	"slices"
	"strings"
	"syscall"
	"testing"
)

// pipeWriter returns a Writer on a pipe's write end (its own descriptor,
// as a child's --ready-fd) and the read end.
func pipeWriter(t *testing.T) (*Writer, *os.File) {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	fd, err := syscall.Dup(int(w.Fd()))
	if err != nil {
		t.Fatal(err)
	}
	w.Close()
	rw, err := NewWriter(fd)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	return rw, r
}

// TestWaitingLinesThenReport: waiting lines before the report reach
// ReadProgress in order, Read skips them, and the report after them is
// the one returned; a message longer than MaxWaiting is cut.
func TestWaitingLinesThenReport(t *testing.T) {
	w, r := pipeWriter(t)
	long := strings.Repeat("x", MaxWaiting+100)
	for _, msg := range []string{"waiting for replica a", "", "waiting for replica b", long} {
		if err := w.Waiting(msg); err != nil {
			t.Fatal(err)
		}
	}
	want := Report{Control: "127.0.0.1:9", Size: 1 << 20, Endpoint: "/dev/loop3", EndpointKind: EndpointLoopDevice}
	if err := w.Ready(want); err != nil {
		t.Fatal(err)
	}
	if err := w.Waiting("after the report"); err != nil {
		t.Fatalf("a waiting line after the report: %v, want it dropped", err)
	}
	var got []string
	rep, err := ReadProgress(r, func(msg string) { got = append(got, msg) })
	if err != nil || rep != want {
		t.Fatalf("report %+v, %v; want %+v", rep, err, want)
	}
	if !slices.Equal(got, []string{"waiting for replica a", "waiting for replica b", long[:MaxWaiting]}) {
		t.Fatalf("waiting lines %q", got)
	}

	w, r = pipeWriter(t)
	if err := w.Waiting("waiting for replica a"); err != nil {
		t.Fatal(err)
	}
	if err := w.Ready(want); err != nil {
		t.Fatal(err)
	}
	if rep, err := Read(r); err != nil || rep != want {
		t.Fatalf("Read: %+v, %v; want the report after the waiting line", rep, err)
	}
}

// TestReplicaReport: a replica's report, with both data addresses,
// reads back as written, and the second one's JSON name is localData.
func TestReplicaReport(t *testing.T) {
	w, r := pipeWriter(t)
	want := Report{Data: "10.0.0.7:10000", LocalData: "unix:/run/cairn/r-0123456789abcdef.sock", Control: "10.0.0.7:10001", Size: 1 << 30}
	if err := w.Ready(want); err != nil {
		t.Fatal(err)
	}
	if rep, err := Read(r); err != nil || rep != want {
		t.Fatalf("Read: %+v, %v; want %+v", rep, err, want)
	}
	rep, err := Read(strings.NewReader(`{"data":"10.0.0.7:10000","localData":"unix:/run/r.sock","size":4096}` + "\n"))
	if err != nil || rep.LocalData != "unix:/run/r.sock" {
		t.Fatalf("Read: %+v, %v; want localData unix:/run/r.sock", rep, err)
	}
}

// TestWaitingThenExit: a process that exits after waiting lines, without
// a report, is ErrNoReport.
func TestWaitingThenExit(t *testing.T) {
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if _, err := w.WriteString(`{"waiting":"waiting for replica a"}` + "\n"); err != nil {
		t.Fatal(err)
	}
	w.Close()
	n := 0
	if _, err := ReadProgress(r, func(string) { n++ }); !errors.Is(err, ErrNoReport) || n != 1 {
		t.Fatalf("ReadProgress: %v after %d waiting lines; want ErrNoReport after 1", err, n)
	}
}
