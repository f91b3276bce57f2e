//go:build !race

package roles

const raceEnabled = false
