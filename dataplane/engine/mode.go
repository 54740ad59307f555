package engine

import "fmt"

// Mode is the role the engine gives a replica.
type Mode uint8

const (
	// ModeWO: the replica takes writes but serves no reads (being rebuilt).
	ModeWO Mode = iota + 1
	// ModeRW: the replica holds every acknowledged write; reads may use it.
	ModeRW
	// ModeERR: the replica failed. It is never read again and never becomes
	// RW without a fresh rebuild (as a new member).
	ModeERR
)

func (m Mode) String() string {
	switch m {
	case ModeWO:
		return "WO"
	case ModeRW:
		return "RW"
	case ModeERR:
		return "ERR"
	}
	return fmt.Sprintf("Mode(%d)", uint8(m))
}

// ErrIllegalTransition is returned for a mode change the state machine
// does not allow.
var ErrIllegalTransition = fmt.Errorf("illegal replica mode transition")

// transition checks a mode change. The legal ones: WO→RW (rebuild done),
// WO→ERR and RW→ERR (failure). ERR is final; RW never goes back to WO.
func transition(from, to Mode) error {
	switch {
	case from == ModeWO && to == ModeRW, from == ModeWO && to == ModeERR, from == ModeRW && to == ModeERR:
		return nil
	}
	return fmt.Errorf("%w: %s → %s", ErrIllegalTransition, from, to)
}
