package eppserver

import (
	"testing"

	"go.uber.org/goleak"

	"github.com/kvselect/kvselect/internal/fakeengine"
)

// TestMain fails the package when a test leaves a goroutine behind (the fake
// engines' ZMQ library leaves one by design).
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction(fakeengine.LeakyZMQFunction))
}
