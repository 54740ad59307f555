//go:build !race

package uml

const raceEnabled = false
