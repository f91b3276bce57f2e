package enginemodel_test

import (
	"fmt"
	"time"

	"github.com/kvselect/kvselect/internal/enginemodel"
)

// Two requests on one engine: the second arrives while the first decodes,
// prefills in the same steps and slows it down.
func ExampleEngine() {
	e, err := enginemodel.New(enginemodel.Params{
		RequestOverhead: time.Millisecond,
		StepBase:        time.Millisecond,
		PrefillToken:    10 * time.Microsecond,
		DecodeSeq:       100 * time.Microsecond,
	})
	if err != nil {
		panic(err)
	}
	_ = e.Add(1, 200, 3, 0)                     // 200 uncached prompt tokens, 3 output tokens
	_ = e.Add(2, 500, 1, 3500*time.Microsecond) // arrives during request 1's first decode step
	var events []enginemodel.Event
	for {
		t, ok := e.Next()
		if !ok {
			break
		}
		events = e.Advance(t, events)
	}
	for _, ev := range events {
		fmt.Printf("%-7v request %d: %s (%d)\n", ev.At, ev.ID, ev.Kind, ev.Tokens)
	}
	// Output:
	// 4ms     request 1: first-token (1)
	// 5.1ms   request 1: token (2)
	// 11.2ms  request 1: token (3)
	// 11.2ms  request 1: finished (3)
	// 11.2ms  request 2: first-token (1)
	// 11.2ms  request 2: finished (1)
}
