package process

import (
	"strings"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/types"
)

func TestPolicyDelay(t *testing.T) {
	p := Policy{Initial: time.Second, Max: 10 * time.Second, Stable: time.Minute}
	for _, tc := range []struct {
		failures int
		want     time.Duration
	}{
		{0, 0}, {1, 0}, {2, time.Second}, {3, 2 * time.Second}, {4, 4 * time.Second}, {5, 8 * time.Second},
		{6, 10 * time.Second}, {7, 10 * time.Second}, {1000, 10 * time.Second},
	} {
		if got := p.Delay(tc.failures); got != tc.want {
			t.Errorf("Delay(%d) = %s, want %s", tc.failures, got, tc.want)
		}
	}
	if got := (Policy{}).Delay(2); got != DefaultPolicy.Initial {
		t.Errorf("the zero policy is the default: Delay(2) = %s, want %s", got, DefaultPolicy.Initial)
	}
	if got := (Policy{Initial: time.Minute, Max: time.Second}).Delay(5); got != time.Minute {
		t.Errorf("a Max below Initial is Initial: Delay(5) = %s", got)
	}
}

// TestBackoff walks one process through failures, a repeat of the same
// failure, a wait, a short run and a long run.
func TestBackoff(t *testing.T) {
	now := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	b := NewBackoff(Policy{Initial: time.Second, Max: 4 * time.Second, Stable: time.Minute}, func() time.Time { return now })
	const key = types.UID("u1")
	// runFor: started after wait, seen running, and running for d.
	runFor := func(wait, d time.Duration) func() {
		return func() { now = now.Add(wait); b.Running(key); now = now.Add(d) }
	}
	type step struct {
		name string
		do   func()
		// wantCount and wantWait after the step.
		wantCount int
		wantWait  time.Duration
	}
	steps := []step{
		{"nothing failed", nil, 0, 0},
		{"first exit: started again at once", func() { b.Failed(key, "pid 1", "exit 1") }, 1, 0},
		{"the same exit seen again counts once", func() { b.Failed(key, "pid 1", "exit 1") }, 1, 0},
		{"second exit", func() { b.Failed(key, "pid 2", "exit 2") }, 2, time.Second},
		{"half the wait later", func() { now = now.Add(500 * time.Millisecond) }, 2, 500 * time.Millisecond},
		{"a refused create always counts", func() { b.Failed(key, "", "refused") }, 3, 2 * time.Second},
		{"again", func() { b.Failed(key, "", "refused") }, 4, 4 * time.Second},
		{"capped", func() { b.Failed(key, "", "refused") }, 5, 4 * time.Second},
		{"runs briefly", runFor(5*time.Second, 10*time.Second), 5, 0},
		{"fails after a short run: the count goes on", func() { b.Failed(key, "pid 3", "exit 3") }, 6, 4 * time.Second},
		{"runs a minute", runFor(5*time.Second, time.Minute), 6, 0},
		{"fails after a long run: a new count", func() { b.Failed(key, "pid 4", "exit 4") }, 1, 0},
		{"fails again", func() { b.Failed(key, "pid 5", "exit 5") }, 2, time.Second},
		{"stopped on purpose: forgotten", func() { b.Forget(key) }, 0, 0},
	}
	for _, s := range steps {
		if s.do != nil {
			s.do()
		}
		f, wait := b.Wait(key)
		if f.Count != s.wantCount || wait != s.wantWait {
			t.Fatalf("%s: count %d, wait %s; want %d, %s", s.name, f.Count, wait, s.wantCount, s.wantWait)
		}
	}
	// A record forgotten by a stable run: Running alone drops it.
	b.Failed(key, "pid 6", "exit 6")
	b.Running(key)
	now = now.Add(time.Minute)
	b.Running(key)
	if f, _ := b.Wait(key); f.Count != 0 {
		t.Fatalf("after a minute running, the count is %d, want 0", f.Count)
	}
	if f, _ := b.Wait("other"); f.Count != 0 {
		t.Fatalf("another object's count is %d, want 0", f.Count)
	}
}

func TestFailureMessage(t *testing.T) {
	f := Failure{Count: 3, Cause: "the engine process exited (code 1): boom", Next: time.Date(2030, 1, 1, 0, 0, 4, 0, time.UTC), Delay: 2 * time.Second}
	msg := f.Message("engine process")
	for _, want := range []string{"failed 3 times in a row", "exited (code 1): boom", "2030-01-01T00:00:04Z", "2s"} {
		if !strings.Contains(msg, want) {
			t.Errorf("message %q lacks %q", msg, want)
		}
	}
}
