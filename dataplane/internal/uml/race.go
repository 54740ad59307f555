//go:build race

package uml

// raceEnabled: the race detector's shadow memory cannot be mapped inside
// UML, so Run builds a copy of the test binary without it.
const raceEnabled = true
