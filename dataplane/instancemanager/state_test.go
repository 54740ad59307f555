package instancemanager

import (
	"testing"

	"github.com/go-logr/logr"
)

// TestTransitions walks every pair of states: setState makes exactly the
// changes the table allows, emits an event for each, and refuses the rest
// without touching the process.
func TestTransitions(t *testing.T) {
	all := []State{StateStarting, StateRunning, StateStopping, StateStopped, StateError}
	legal := map[[2]State]bool{
		{StateStarting, StateRunning}:  true,
		{StateStarting, StateError}:    true,
		{StateStarting, StateStopping}: true,
		{StateRunning, StateError}:     true,
		{StateRunning, StateStopping}:  true,
		{StateStopping, StateStopped}:  true,
	}
	for _, from := range all {
		for _, to := range all {
			s := &Supervisor{log: logr.Discard(), watchers: map[chan Event]struct{}{}}
			ch := make(chan Event, 1)
			s.watchers[ch] = struct{}{}
			p := &proc{Process: Process{Name: "p", State: from}}
			mutated := false
			err := s.setState(p, to, func(*proc) { mutated = true })
			if want := legal[[2]State{from, to}]; want != (err == nil) {
				t.Errorf("%s → %s: err %v, legal %v", from, to, err, want)
				continue
			}
			if err != nil {
				if p.State != from || mutated || len(ch) != 0 {
					t.Errorf("%s → %s refused but changed the process (state %s, mutated %v, %d events)", from, to, p.State, mutated, len(ch))
				}
				continue
			}
			if p.State != to || !mutated || len(ch) != 1 || (<-ch).Process.State != to {
				t.Errorf("%s → %s: state %s, mutated %v", from, to, p.State, mutated)
			}
		}
	}
}
