package logtest_test

import (
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"

	"github.com/kvselect/kvselect/internal/logtest"
)

// Concurrent loggers and a reader: every line arrives whole.
func TestBuffer(t *testing.T) {
	var b logtest.Buffer
	log := slog.New(slog.NewTextHandler(&b, nil))
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Go(func() {
			log.Info("line", "i", i)
			_ = b.String()
		})
	}
	wg.Wait()
	if n := strings.Count(b.String(), "msg=line"); n != 8 {
		t.Fatalf("%d lines, want 8:\n%s", n, b.String())
	}
}

func ExampleBuffer() {
	var b logtest.Buffer
	fmt.Fprint(&b, "hello")
	fmt.Println(b.String())
	// Output: hello
}
