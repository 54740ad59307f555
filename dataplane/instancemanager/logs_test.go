package instancemanager

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// TestLogReopenFails: when the new file cannot be opened after a rotation,
// the log keeps the lines for the tail and tries again on the next write,
// instead of writing to the closed file for good.
func TestLogReopenFails(t *testing.T) {
	path := filepath.Join(t.TempDir(), "p.log")
	l, err := openLog(path, 16)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	fail := true
	l.open = func(p string) (*os.File, error) {
		if fail {
			return nil, errors.New("disk full")
		}
		return createLogFile(p)
	}
	if _, err := l.Write([]byte("first line 0123\n")); err != nil {
		t.Fatal(err)
	}
	if _, err := l.Write([]byte("while failing\n")); err != nil { // rotates; the reopen fails
		t.Fatalf("a failed reopen made the process's write fail: %v", err)
	}
	fail = false
	if _, err := l.Write([]byte("after\n")); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(path)
	if err != nil || string(b) != "after\n" {
		t.Fatalf("log file after the reopen failed once: %q %v", b, err)
	}
	if tail := strings.Join(l.Tail(), "|"); tail != "first line 0123|while failing|after" {
		t.Fatalf("tail %q", tail)
	}
}

// TestLogLinesDoesNotBlockWrites: reading a log (up to 20 MiB on disk)
// does not hold the lock the process's writes take. The rotated file here
// is a FIFO whose reader never sees its end: a reader that read it under
// the lock would block the writer for good.
func TestLogLinesDoesNotBlockWrites(t *testing.T) {
	path := filepath.Join(t.TempDir(), "p.log")
	l, err := openLog(path, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if err := syscall.Mkfifo(path+".1", 0o600); err != nil {
		t.Fatal(err)
	}
	w, err := os.OpenFile(path+".1", os.O_RDWR, 0) // keeps the FIFO open: no EOF
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.Write([]byte("partial line with no end")); err != nil {
		t.Fatal(err)
	}
	// The FIFO stays open for writing until the reader is done: opening
	// it for reading with no writer would block that reader (under the
	// log's lock) for ever, and the deferred Close with it.
	read := make(chan struct{})
	go func() {
		l.Lines(false)
		close(read)
	}()
	wrote := make(chan struct{})
	go func() {
		if _, err := l.Write([]byte("the process goes on\n")); err != nil {
			t.Error(err)
		}
		close(wrote)
	}()
	select {
	case <-wrote:
	case <-time.After(deadline.Scale(20 * time.Second)):
		w.Close() // unblock the reader so the test can end
		t.Fatal("a write waited for a reader of the log")
	}
	<-read
	w.Close()
}
