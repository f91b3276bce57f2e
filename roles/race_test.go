//go:build race

package roles

const raceEnabled = true
