package natsbus_test

import (
	"testing"

	"go.uber.org/goleak"

	"github.com/kvselect/kvselect/internal/fakeengine"
	"github.com/kvselect/kvselect/replica/natsbus"
)

type natsBus = natsbus.Bus

// TestMain fails the package's tests if any goroutine (a replica's, the
// client's, the embedded server's, the test proxy's) outlives them: every
// test shuts its server down and waits for it.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction(fakeengine.LeakyZMQFunction))
}
