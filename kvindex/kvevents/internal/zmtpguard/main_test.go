package zmtpguard

import (
	"testing"

	"go.uber.org/goleak"
)

// zmqPubLeak is the one goroutine go-zeromq v0.17.0 leaves behind for every PUB
// socket after Close. Only the tests' own publishers create PUB sockets; the guard
// starts no goroutine there, so ignoring this function hides nothing of ours.
const zmqPubLeak = "github.com/go-zeromq/zmq4.(*pubMWriter).run"

// TestMain fails the package's tests if any goroutine (a listener's, a handshake's,
// a socket's) is still running when they end.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction(zmqPubLeak))
}
