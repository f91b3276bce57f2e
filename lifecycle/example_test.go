package lifecycle_test

import (
	"context"
	"fmt"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/lifecycle"
	"github.com/kvselect/kvselect/selection"
)

// A gateway books a request and hands the booking to a follower, which
// settles it as the response passes: the first chunk of a 2xx answer is the
// first output, its data lines grow the booking, and Done ends it on every
// path (here, deferred as well as at the end of the stream).
func ExampleFollower() {
	svc, err := selection.NewSelectionServiceBuilder(selection.DefaultConfig(4)).ExternalEvents().Build(context.Background())
	if err != nil {
		panic(err)
	}
	defer svc.Close()
	if _, err := svc.Workers().Upsert(catalog.Worker{ID: "pod-a", Endpoint: "10.0.0.1:8000", DPSize: 1, BlockSize: 4}); err != nil {
		panic(err)
	}
	b, err := svc.Book(context.Background(), selection.Request{Tokens: []uint32{1, 2, 3, 4, 5, 6, 7, 8}})
	if err != nil {
		panic(err)
	}
	f, err := lifecycle.NewFollower(b, lifecycle.Options{
		OutputGrowth: true,
		Marked:       func(c lifecycle.Cause, err error) { fmt.Println("marked failed:", c, err) },
	})
	if err != nil {
		panic(err)
	}
	defer f.Done()

	load := func() selection.WorkerLoad { return svc.Loads("")[0] }
	fmt.Println("booked on", b.WorkerID, "blocks", load().ActiveBlocks)
	f.Response(200, "text/event-stream")
	fmt.Println("first output:", f.Body([]byte("data: {\"choices\":[]}\n\n")))
	f.Body([]byte("data: a\n\ndata: b\n\ndata: c\n\n")) // four tokens so far: one block
	fmt.Println("blocks", load().ActiveBlocks)
	fmt.Println("end:", f.Done(), "requests", load().ActiveRequests)
	// Output:
	// booked on pod-a blocks 2
	// first output: true
	// blocks 3
	// end: <nil> requests 0
}
