//go:build race

package natsbus_test

const raceEnabled = true
