package engine

import (
	"errors"
	"testing"
)

// TestModeTransitions walks every pair of modes.
func TestModeTransitions(t *testing.T) {
	legal := map[[2]Mode]bool{{ModeWO, ModeRW}: true, {ModeWO, ModeERR}: true, {ModeRW, ModeERR}: true}
	for _, from := range []Mode{ModeWO, ModeRW, ModeERR} {
		for _, to := range []Mode{ModeWO, ModeRW, ModeERR} {
			err := transition(from, to)
			if legal[[2]Mode{from, to}] != (err == nil) {
				t.Errorf("%s → %s: %v", from, to, err)
			}
			if err != nil && !errors.Is(err, ErrIllegalTransition) {
				t.Errorf("%s → %s: error %v is not ErrIllegalTransition", from, to, err)
			}
		}
	}
	if ModeRW.String() != "RW" || ModeWO.String() != "WO" || ModeERR.String() != "ERR" || Mode(9).String() != "Mode(9)" {
		t.Error("String")
	}
}
