package engine

import "fmt"

// Mode is the role the engine gives a replica.
type Mode uint8

const (
	// modeNew: a member being set up (at open, or being added). It takes
	// no I/O and is not listed; its first transition gives it its role.
	modeNew Mode = iota
	// ModeWO: the replica takes writes but serves no reads (being rebuilt).
	ModeWO
	// ModeRW: the replica holds every acknowledged write; reads may use it.
	ModeRW
	// ModeERR: the replica failed. It is never read again and never becomes
	// RW without a fresh rebuild (as a new member).
	ModeERR
)

func (m Mode) String() string {
	switch m {
	case modeNew:
		return "new"
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

// transition checks a mode change. The legal ones: new→RW (usable at
// open), new→WO (added, to be rebuilt), new→ERR (unusable at open, or
// failed while joining), WO→RW (rebuild done), WO→ERR and RW→ERR
// (failure). ERR is final; RW never goes back to WO; nothing goes back to
// new.
func transition(from, to Mode) error {
	switch {
	case from == modeNew && to != modeNew,
		from == ModeWO && to == ModeRW, from == ModeWO && to == ModeERR, from == ModeRW && to == ModeERR:
		return nil
	}
	return fmt.Errorf("%w: %s → %s", ErrIllegalTransition, from, to)
}
