package kvevents

import (
	"testing"

	"go.uber.org/goleak"
)

// zmqPubLeak is the one goroutine go-zeromq v0.17.0 leaves behind for every PUB
// socket after Close. Only test publishers (the fake engine, the tests' own PUBs)
// create PUB sockets; the feed itself never does, so ignoring this function hides
// nothing of ours.
const zmqPubLeak = "github.com/go-zeromq/zmq4.(*pubMWriter).run"

// TestMain fails the package's tests if any goroutine (a feed's, a socket's, a test
// publisher's) is still running when they end.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction(zmqPubLeak))
}
