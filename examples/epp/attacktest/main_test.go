package attacktest

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/kvselect/kvselect/examples/epp/internal/eppproc"
)

// buildTimeout bounds the one build of the EPP binary (a cold build cache on a
// loaded machine takes a few minutes; a warm one, seconds).
const buildTimeout = 5 * time.Minute

// eppBinary is the path of the EPP binary TestMain built (with -race when
// the tests run with it).
var eppBinary string

func TestMain(m *testing.M) {
	os.Exit(run(m))
}

func run(m *testing.M) int {
	dir, err := os.MkdirTemp("", "kvselect-attacktest-")
	if err != nil {
		fmt.Fprintln(os.Stderr, "attacktest:", err)
		return 1
	}
	defer os.RemoveAll(dir)
	ctx, cancel := context.WithTimeout(context.Background(), buildTimeout)
	defer cancel()
	start := time.Now()
	eppBinary, err = eppproc.Build(ctx, dir, raceBuild)
	if err != nil {
		fmt.Fprintf(os.Stderr, "attacktest: FAIL: cannot build the EPP binary (after %v): %v\n", time.Since(start).Round(time.Millisecond), err)
		return 1
	}
	return m.Run()
}
