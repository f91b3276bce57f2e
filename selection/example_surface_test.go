package selection_test

import (
	"context"
	"fmt"
	"time"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/kvindex"
	"github.com/kvselect/kvselect/selection"
)

// exampleService builds a service fed by hand with two workers, pod-a and
// pod-b, where pod-b's engine holds the first two blocks of prompt.
func exampleService(prompt []uint32) *selection.SelectionService {
	svc, err := selection.NewSelectionServiceBuilder(selection.DefaultConfig(4)).ExternalEvents().Build(context.Background())
	if err != nil {
		panic(err)
	}
	for i, id := range []string{"pod-a", "pod-b"} {
		if _, err := svc.Workers().Upsert(catalog.Worker{ID: id, Endpoint: fmt.Sprintf("10.0.0.%d:8000", i+1), DPSize: 1}); err != nil {
			panic(err)
		}
	}
	_ = svc.Events().Apply(catalog.WorkerRank{WorkerID: "pod-b"}, kvindex.Event{
		Kind: kvindex.EventStored, BlockHashes: []uint64{901, 902}, Tokens: prompt[:8],
	})
	return svc
}

var examplePrompt = []uint32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}

// Select answers where a request would go, without booking it.
func ExampleSelectionService_Select() {
	svc := exampleService(examplePrompt)
	defer svc.Close()
	res, _ := svc.Select(context.Background(), selection.Request{Tokens: examplePrompt})
	fmt.Println(res.WorkerID, res.Overlap.Device, "booked:", res.ReservationID != "")
	fmt.Println("active requests:", svc.Loads("")[1].ActiveRequests)
	// Output:
	// pod-b 2 booked: false
	// active requests: 0
}

// SelectAndReserve books by id; the caller settles the id (Book returns a
// handle that does it instead).
func ExampleSelectionService_SelectAndReserve() {
	svc := exampleService(examplePrompt)
	defer svc.Close()
	id := selection.NewReservationID()
	res, _ := svc.SelectAndReserve(context.Background(), selection.Request{ReservationID: id, Tokens: examplePrompt})
	fmt.Println(res.WorkerID, "prefill load:", svc.Loads("")[1].ActivePrefillTokens) // the 4 uncached tokens
	_ = svc.Reservations().PrefillComplete(id)                                       // first response byte
	fmt.Println("after first byte:", svc.Loads("")[1].ActivePrefillTokens, "requests:", svc.Loads("")[1].ActiveRequests)
	_ = svc.Reservations().Free(id) // end of stream, cancel or error
	fmt.Println("after free:", svc.Loads("")[1].ActiveRequests, len(id))
	// Output:
	// pod-b prefill load: 4
	// after first byte: 0 requests: 1
	// after free: 0 32
}

// Loads and PotentialLoads show what the cost function sees: every rank's
// load now, and with the request added. The default cost on a small model is
// the predicted time to first token, here in milliseconds: 1.5 x the tokens
// to prefill (the request's own prefill counts once more for the requests it
// delays) plus 0.125 x the decode blocks' tokens, at 10,000 tokens a second.
func ExampleSelectionService_PotentialLoads() {
	svc := exampleService(examplePrompt)
	defer svc.Close()
	scored, _ := svc.PotentialLoads(context.Background(), selection.Request{Tokens: examplePrompt})
	for _, s := range scored {
		fmt.Printf("%s overlap=%d to-prefill=%d decode-blocks=%d cost=%.2fms\n",
			s.WorkerID, s.Overlap.Device, s.EffectivePrefillTokens, s.PotentialDecodeBlock, 1000*s.Cost)
	}
	for _, l := range svc.Loads("") {
		fmt.Println(l.WorkerID, "active:", l.ActiveRequests)
	}
	// Output:
	// pod-a overlap=0 to-prefill=12 decode-blocks=3 cost=1.95ms
	// pod-b overlap=2 to-prefill=4 decode-blocks=3 cost=0.75ms
	// pod-a active: 0
	// pod-b active: 0
}

// Workers().Upsert's record says whether the worker can be routed, and why not;
// Ready and Workers report the catalog; Workers().Delete removes a worker.
func ExampleWorkers_Upsert() {
	svc, _ := selection.NewSelectionServiceBuilder(selection.DefaultConfig(16)).Build(context.Background())
	defer svc.Close()
	// With KV events on (the default), every rank needs an event endpoint.
	rec, _ := svc.Workers().Upsert(catalog.Worker{ID: "pod-a", Endpoint: "10.0.0.1:8000", DPSize: 1})
	fmt.Println(rec.Lifecycle, rec.Reasons, svc.Ready().Ready)
	rec, _ = svc.Workers().Upsert(catalog.Worker{ID: "pod-a", Endpoint: "10.0.0.1:8000", DPSize: 1,
		KVEventEndpoints: map[int]string{0: "tcp://10.0.0.1:5557"}})
	fmt.Println(rec.Lifecycle, rec.Worker.BlockSize, svc.Ready().Ready, len(svc.Workers().List()))
	rec, _ = svc.Workers().Delete("pod-a")
	fmt.Printf("%v %+v\n", rec.Lifecycle, svc.Ready())
	// Output:
	// incomplete [kv_event_endpoint_missing:rank=0] false
	// schedulable 16 true 1
	// unschedulable {Ready:false Schedulable:0 Workers:0}
}

// A gateway drains a worker before it stops it (a pod being deleted): the
// worker leaves the picks at once, its bookings in flight run to their end,
// and undraining judges it afresh.
func ExampleWorkers_SetDraining() {
	cfg := selection.DefaultConfig(16)
	cfg.UseKVEvents = false
	svc, _ := selection.NewSelectionServiceBuilder(cfg).Build(context.Background())
	defer svc.Close()
	for i, id := range []string{"pod-a", "pod-b"} {
		_, _ = svc.Workers().Upsert(catalog.Worker{ID: id, Endpoint: fmt.Sprintf("10.0.0.%d:8000", i+1), DPSize: 1})
	}
	b, _ := svc.Book(context.Background(), selection.Request{Tokens: make([]uint32, 32), Allowed: []string{"pod-a"}})
	rec, _ := svc.Workers().SetDraining("pod-a", true)
	fmt.Println(rec.Lifecycle, rec.Reasons)
	for range 3 {
		res, _ := svc.Select(context.Background(), selection.Request{Tokens: make([]uint32, 32)})
		fmt.Println("picked", res.WorkerID)
	}
	fmt.Println("done:", b.Done())
	rec, _ = svc.Workers().SetDraining("pod-a", false)
	fmt.Println(rec.Lifecycle)
	// Output:
	// draining [draining]
	// picked pod-b
	// picked pod-b
	// picked pod-b
	// done: <nil>
	// schedulable
}

// Without KV events the service remembers the prefixes it routed (for
// Config.RouterTTL), so requests sharing a prefix still meet their cache.
func ExampleSelectionService_approximate() {
	cfg := selection.DefaultConfig(4)
	cfg.UseKVEvents = false
	svc, _ := selection.NewSelectionServiceBuilder(cfg).Build(context.Background())
	defer svc.Close()
	for i, id := range []string{"pod-a", "pod-b", "pod-c"} {
		_, _ = svc.Workers().Upsert(catalog.Worker{ID: id, Endpoint: fmt.Sprintf("10.0.0.%d:8000", i+1), DPSize: 1})
	}
	system := []uint32{7, 7, 7, 7, 8, 8, 8, 8, 9, 9, 9, 9}
	first, _ := svc.Book(context.Background(), selection.Request{Tokens: append(system, 1, 2, 3, 4)})
	_ = first.Done()
	next, _ := svc.Book(context.Background(), selection.Request{Tokens: append(system, 5, 6, 7, 8)})
	_ = next.Done()
	fmt.Println(next.WorkerID == first.WorkerID, "cached blocks:", next.Overlap.Device)
	// Output:
	// true cached blocks: 3
}

// A gateway that saw a worker fail tells the service; a worker about to stop
// is drained first.
func ExampleWorkers_MarkFailed() {
	svc := exampleService(examplePrompt)
	defer svc.Close()
	_ = svc.Workers().MarkFailed("pod-b") // connection refused: out of the picks for FailureEjection
	res, _ := svc.Select(context.Background(), selection.Request{Tokens: examplePrompt})
	fmt.Println(res.WorkerID)
	rec, _ := svc.Workers().SetDraining("pod-a", true)
	fmt.Println(rec.Lifecycle, svc.Ready().Schedulable)
	// Output:
	// pod-a
	// draining 1
}

// With the sweeper off (SweepInterval(-1)) and a clock of its own, a caller
// expires orphaned bookings itself, at the time it chooses.
func ExampleReservations_Expire() {
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	cfg := selection.DefaultConfig(16)
	cfg.ActiveRequestExpiry = time.Minute
	svc, _ := selection.NewSelectionServiceBuilder(cfg).ExternalEvents().Clock(func() time.Time { return now }).
		SweepInterval(-1).Build(context.Background())
	defer svc.Close()
	_, _ = svc.Workers().Upsert(catalog.Worker{ID: "pod-a", Endpoint: "10.0.0.1:8000", DPSize: 1})
	_, _ = svc.Book(context.Background(), selection.Request{Tokens: make([]uint32, 32)}) // never settled
	fmt.Println("expired at once:", svc.Reservations().Expire())
	now = now.Add(time.Minute)
	fmt.Println("expired after the lease:", svc.Reservations().Expire(), "active:", svc.Loads("")[0].ActiveRequests)
	// Output:
	// expired at once: 0
	// expired after the lease: 1 active: 0
}

// A session's requests follow its first booking: with hard pins, a turn whose
// prompt shares nothing with the cache still goes to the session's worker.
func ExampleSessionConfig() {
	cfg := selection.DefaultConfig(4)
	cfg.UseKVEvents = false
	cfg.Sessions.Mode = selection.SessionHard
	svc, err := selection.NewSelectionServiceBuilder(cfg).Build(context.Background())
	if err != nil {
		panic(err)
	}
	defer svc.Close()
	for i, id := range []string{"pod-a", "pod-b"} {
		_, _ = svc.Workers().Upsert(catalog.Worker{ID: id, Endpoint: fmt.Sprintf("10.0.0.%d:8000", i+1), DPSize: 1})
	}
	first, _ := svc.Book(context.Background(), selection.Request{Tokens: examplePrompt, SessionID: "conv-42"})
	defer first.Done()
	other := []uint32{90, 91, 92, 93, 94, 95, 96, 97}
	next, _ := svc.Book(context.Background(), selection.Request{Tokens: other, SessionID: "conv-42"})
	defer next.Done()
	fmt.Println(next.WorkerID == first.WorkerID, svc.Stats().SessionHits)
	// Output:
	// true 1
}

// A gateway that retries elsewhere asks for fallbacks, and when the request
// was served on one of them moves the booking there; a long answer grows the
// booking as it is generated.
func ExampleBooking_Move() {
	svc := exampleService(examplePrompt)
	defer svc.Close()
	b, _ := svc.Book(context.Background(), selection.Request{Tokens: examplePrompt, Fallbacks: 1})
	fmt.Println("picked", b.WorkerID, "fallback", b.Fallbacks[0].WorkerID, b.Fallbacks[0].Endpoint)

	// pod-b refused the connection; the gateway's retry reached pod-a.
	_ = b.Move(b.Fallbacks[0].WorkerRank)
	fmt.Println("booked on", b.WorkerID, b.Endpoint, "requests:", svc.Loads("")[0].ActiveRequests, svc.Loads("")[1].ActiveRequests)

	before := svc.Loads("")[0].ActiveBlocks
	_ = b.Generated(8) // 8 tokens generated so far: two more blocks of 4
	fmt.Println("active blocks", before, "->", svc.Loads("")[0].ActiveBlocks)
	_ = b.Done()
	fmt.Println("after done:", svc.Loads("")[0].ActiveRequests)
	// Output:
	// picked pod-b fallback pod-a 10.0.0.1:8000
	// booked on pod-a 10.0.0.1:8000 requests: 1 0
	// active blocks 3 -> 5
	// after done: 0
}

// printTracer is a Tracer that prints each decision's span when it ends: an
// adapter to OpenTelemetry does the same with a real span.
type printTracer struct{}

type printSpan struct{ name string }

func (printTracer) StartDecision(_ context.Context, model string, reserve bool) selection.DecisionSpan {
	name := "select"
	if reserve {
		name = "book"
	}
	return printSpan{name: name + " " + model}
}

func (s printSpan) End(d *selection.Decision, err error) {
	if err != nil {
		fmt.Println(s.name, "error:", err)
		return
	}
	fmt.Printf("%s -> %s (overlap %d of %d blocks, %d candidates)\n", s.name, d.WorkerID, d.ChosenOverlapBlocks, d.RequestBlocks, d.Candidates)
}

// A Tracer sees every decision call as a span; the library imports no tracing
// package.
func ExampleTracer() {
	cfg := selection.DefaultConfig(4)
	svc, _ := selection.NewSelectionServiceBuilder(cfg).ExternalEvents().Tracer(printTracer{}).Build(context.Background())
	defer svc.Close()
	for i, id := range []string{"pod-a", "pod-b"} {
		_, _ = svc.Workers().Upsert(catalog.Worker{ID: id, Endpoint: fmt.Sprintf("10.0.0.%d:8000", i+1), DPSize: 1})
	}
	_ = svc.Events().Apply(catalog.WorkerRank{WorkerID: "pod-b"}, kvindex.Event{Kind: kvindex.EventStored, BlockHashes: []uint64{1, 2}, Tokens: examplePrompt[:8]})
	b, _ := svc.Book(context.Background(), selection.Request{Tokens: examplePrompt})
	_ = b.Done()
	_, _ = svc.Select(context.Background(), selection.Request{Tokens: examplePrompt, Model: "other"})
	// Output:
	// book default -> pod-b (overlap 2 of 3 blocks, 2 candidates)
	// select other error: selection: not ready: no worker serves model "other"
}
