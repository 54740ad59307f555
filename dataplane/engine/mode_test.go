package engine

import (
	"errors"
	"testing"
)

// TestModeTransitions walks every pair of modes.
func TestModeTransitions(t *testing.T) {
	legal := map[[2]Mode]bool{{modeNew, ModeRW}: true, {modeNew, ModeWO}: true, {modeNew, ModeERR}: true,
		{ModeWO, ModeRW}: true, {ModeWO, ModeERR}: true, {ModeRW, ModeERR}: true}
	all := []Mode{modeNew, ModeWO, ModeRW, ModeERR}
	for _, from := range all {
		for _, to := range all {
			err := transition(from, to)
			if legal[[2]Mode{from, to}] != (err == nil) {
				t.Errorf("%s → %s: %v", from, to, err)
			}
			if err != nil && !errors.Is(err, ErrIllegalTransition) {
				t.Errorf("%s → %s: error %v is not ErrIllegalTransition", from, to, err)
			}
		}
	}
	if ModeRW.String() != "RW" || ModeWO.String() != "WO" || ModeERR.String() != "ERR" || modeNew.String() != "new" || Mode(9).String() != "Mode(9)" {
		t.Error("String")
	}
}
