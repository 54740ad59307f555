package instancemanager

import (
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cairn-io/cairn/dataplane/internal/ready"
)

// waitingLine is what an engine writes while it waits (ready.Writer.Waiting).
const waitingLine = `{"waiting":"waiting for replica 10.0.0.5:10000,10.0.0.5:10001 (no answer yet): connecting for 3s"}` + "\n"

// TestSupervisorShowsWhatAProcessWaitsFor: what a starting process says
// it waits for is in its record (an event each time it changes); if it
// does not report ready in time, the error it is killed with ends with
// that; once it runs, nothing is shown as waited for.
func TestSupervisorShowsWhatAProcessWaitsFor(t *testing.T) {
	const msg = "waiting for replica 10.0.0.5:10000,10.0.0.5:10001 (no answer yet): connecting for 3s"
	r := newRig(t, func(o *Options) { o.StartTimeout = 2 * time.Second })
	_, c := r.create("e1", r.replica("e1"))
	r.expect("e1", StateStarting, false)
	if _, err := c.readyW.WriteString(waitingLine); err != nil {
		t.Fatal(err)
	}
	if p := r.expect("e1", StateStarting, false); p.Waiting != msg {
		t.Fatalf("waiting %q, want %q", p.Waiting, msg)
	}
	if s := c.signal(t); s != syscall.SIGKILL {
		t.Fatalf("a process that never reported ready got %s", s)
	}
	if p := r.expect("e1", StateError, false); !strings.Contains(p.Error, "did not report ready within 2s") || !strings.HasSuffix(p.Error, msg) {
		t.Fatalf("error %q: want the timeout and what it waited for", p.Error)
	}

	r2 := newRig(t, nil)
	_, c2 := r2.create("e2", r2.replica("e2"))
	r2.expect("e2", StateStarting, false)
	if _, err := c2.readyW.WriteString(waitingLine); err != nil {
		t.Fatal(err)
	}
	r2.expect("e2", StateStarting, false)
	c2.report(t, ready.Report{Control: "127.0.0.1:2", Size: 1 << 20})
	if p := r2.expect("e2", StateRunning, false); p.Waiting != "" || p.ControlAddress != "127.0.0.1:2" {
		t.Fatalf("running: %+v", p)
	}
}
