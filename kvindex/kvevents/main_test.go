package kvevents

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the package's tests if any goroutine (a feed's, a socket's, a test
// publisher's) is still running when they end.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}
