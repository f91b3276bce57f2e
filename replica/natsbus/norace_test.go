//go:build !race

package natsbus_test

const raceEnabled = false
