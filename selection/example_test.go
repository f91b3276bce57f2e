package selection_test

import (
	"context"
	"fmt"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/kvindex"
	"github.com/kvselect/kvselect/selection"
)

// A full request lifecycle: register workers, feed one worker's cached prefix,
// route a request to it, and settle the booking.
func ExampleSelectionServiceBuilder() {
	cfg := selection.DefaultConfig(4)
	// This example feeds KV events by hand; a real deployment lets the service
	// subscribe to each engine's ZeroMQ publisher (catalog.Worker.KVEventEndpoints).
	svc, err := selection.NewSelectionServiceBuilder(cfg).ExternalEvents().Build(context.Background())
	if err != nil {
		panic(err)
	}
	defer svc.Close()

	for i, id := range []string{"pod-a", "pod-b"} {
		ep := fmt.Sprintf("10.0.0.%d:8000", i+1) // pod IPs: endpoints are IP literals
		rec, err := svc.Workers().Upsert(catalog.Worker{ID: id, Endpoint: ep, DPSize: 1, BlockSize: 4})
		if err != nil {
			panic(err)
		}
		fmt.Println(id, rec.Lifecycle)
	}
	prompt := []uint32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}
	// pod-b's engine reports it cached the first two blocks of the prompt.
	_ = svc.Events().Apply(catalog.WorkerRank{WorkerID: "pod-b"}, kvindex.Event{
		Kind: kvindex.EventStored, BlockHashes: []uint64{901, 902}, Tokens: prompt[:8],
	})

	res, err := svc.SelectAndReserve(context.Background(), selection.Request{ReservationID: "req-1", Tokens: prompt})
	if err != nil {
		panic(err)
	}
	fmt.Println(res.Endpoint, "cached blocks:", res.Overlap.Device, "to prefill:", res.EffectivePrefillTokens)

	_ = svc.Reservations().PrefillComplete("req-1") // first response bytes
	_ = svc.Reservations().Free("req-1")            // end of stream
	fmt.Println(svc.Reservations().Free("req-1") != nil, selection.HTTPStatus(svc.Reservations().Free("req-1")))
	// Output:
	// pod-a schedulable
	// pod-b schedulable
	// 10.0.0.2:8000 cached blocks: 2 to prefill: 4
	// true 404
}

// Book returns a handle that settles the booking: PrefillComplete at the first
// response byte, Done on every way the request ends, Renew while a long stream
// makes progress. Each call is idempotent, so a gateway can call Done from a
// deferred function and from its error path alike.
func ExampleSelectionService_Book() {
	svc, err := selection.NewSelectionServiceBuilder(selection.DefaultConfig(16)).ExternalEvents().Build(context.Background())
	if err != nil {
		panic(err)
	}
	defer svc.Close()
	_, _ = svc.Workers().Upsert(catalog.Worker{ID: "pod-a", Endpoint: "10.0.0.1:8000", DPSize: 1})

	b, err := svc.Book(context.Background(), selection.Request{Tokens: make([]uint32, 64)})
	if err != nil {
		panic(err)
	}
	defer b.Done() // every path frees the booking
	fmt.Println("send to", b.Endpoint, "active:", svc.Loads("")[0].ActiveRequests)

	_ = b.PrefillComplete() // the first response byte arrived
	_ = b.Renew()           // still streaming
	_ = b.Done()            // the end of the stream; the deferred Done does nothing
	fmt.Println("active:", svc.Loads("")[0].ActiveRequests)
	// Output:
	// send to 10.0.0.1:8000 active: 1
	// active: 0
}
