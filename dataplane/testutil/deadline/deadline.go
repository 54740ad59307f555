// Package deadline scales the deadlines tests wait with by one factor read
// from the environment, so that a suite that passes on a quiet machine
// also passes on a loaded or slow one without any test asserting a speed.
//
// CAIRN_TEST_DEADLINE_SCALE is a number >= 1 (default 1); every deadline a
// test polls against (Eventually timeouts, time.Now().Add bounds, context
// timeouts of waits) goes through Scale. Timeouts that are the behaviour
// under test (a replica timeout that must fire, a back-off's length) are
// not scaled.
package deadline

import (
	"fmt"
	"os"
	"strconv"
	"sync"
	"time"
)

// Env is the environment variable that holds the factor.
const Env = "CAIRN_TEST_DEADLINE_SCALE"

// maxFactor bounds the factor: a typo such as 300 instead of 3 would
// otherwise turn a hung test into one that hangs for hours.
const maxFactor = 50

var factor = sync.OnceValue(func() float64 {
	f, err := parse(os.Getenv(Env))
	if err != nil {
		panic(err)
	}
	return f
})

// parse reads the factor: "" is 1; anything else must be a number from 1
// to maxFactor.
func parse(s string) (float64, error) {
	if s == "" {
		return 1, nil
	}
	f, err := strconv.ParseFloat(s, 64)
	if err != nil || !(f >= 1 && f <= maxFactor) {
		return 0, fmt.Errorf("%s=%q: give a number from 1 to %d (how many times longer the tests may wait than on a quiet machine)", Env, s, maxFactor)
	}
	return f, nil
}

// Factor is the factor deadlines are scaled by.
func Factor() float64 { return factor() }

// Scale returns d scaled by the factor.
func Scale(d time.Duration) time.Duration { return time.Duration(float64(d) * factor()) }

// After returns the time d (scaled) from now: a poll's deadline.
func After(d time.Duration) time.Time { return time.Now().Add(Scale(d)) }
