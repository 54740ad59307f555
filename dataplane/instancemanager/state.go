package instancemanager

import "fmt"

// State is a process's state.
type State string

// States.
const (
	StateStarting State = "starting"
	StateRunning  State = "running"
	StateStopping State = "stopping"
	StateStopped  State = "stopped"
	StateError    State = "error"
)

func (s State) String() string { return string(s) }

// transitions lists every legal change of state:
//
//	starting ──ready──▶ running ──exits on its own──▶ error
//	   │  └──exits, or not ready in time──▶ error
//	   └──────────┬── delete or shutdown ──▶ stopping ──exits──▶ stopped
//	running ──────┘
//
// stopped and error are final: a process there is only forgotten.
var transitions = map[State][]State{
	StateStarting: {StateRunning, StateError, StateStopping},
	StateRunning:  {StateError, StateStopping},
	StateStopping: {StateStopped},
	StateStopped:  nil,
	StateError:    nil,
}

// canTransition reports whether from → to is legal.
func canTransition(from, to State) bool {
	for _, s := range transitions[from] {
		if s == to {
			return true
		}
	}
	return false
}

// errTransition is the error of an illegal change of state.
func errTransition(name string, from, to State) error {
	return fmt.Errorf("process %s: illegal state change %s → %s", name, from, to)
}
