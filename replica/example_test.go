package replica_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/replica"
	"github.com/kvselect/kvselect/selection"
)

// localBus is the smallest Bus: every replica of one process shares it, and
// it delivers inline. Real replicas use replica/natsbus.
type localBus struct {
	mu    sync.Mutex
	subs  map[string][]func(string, []byte)
	resps map[string]func([]byte) []byte
}

func (b *localBus) Publish(subject string, data []byte) error {
	b.mu.Lock()
	fns := b.subs[subject[:strings.LastIndexByte(subject, '.')]+".*"]
	b.mu.Unlock()
	for _, fn := range fns {
		fn(subject, data)
	}
	return nil
}

// Subscribe takes the subjects a Replicator subscribes to, which end in
// ".*".
func (b *localBus) Subscribe(subject string, fn func(string, []byte)) (func(), error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.subs[subject] = append(b.subs[subject], fn)
	return func() {}, nil
}

func (b *localBus) Request(_ context.Context, subject string, data []byte) ([]byte, error) {
	b.mu.Lock()
	fn := b.resps[subject]
	b.mu.Unlock()
	if fn == nil {
		return nil, errors.New("no responder")
	}
	return fn(data), nil
}

func (b *localBus) Respond(subject string, fn func([]byte) []byte) (func(), error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.resps[subject] = fn
	return func() {}, nil
}

// Two replicas of one router: what one books, the other counts as load.
func Example() {
	bus := &localBus{subs: map[string][]func(string, []byte){}, resps: map[string]func([]byte) []byte{}}
	replicaOf := func(id string) (*selection.SelectionService, *replica.Replicator) {
		r, err := replica.New(replica.Options{Bus: bus, ID: id})
		if err != nil {
			panic(err)
		}
		// The observer exists before the service, the service before Start.
		svc, err := selection.NewSelectionServiceBuilder(selection.DefaultConfig(16)).ExternalEvents().Observe(r).Build(context.Background())
		if err != nil {
			panic(err)
		}
		_, _ = svc.Workers().Upsert(catalog.Worker{ID: "pod-a", Endpoint: "10.0.0.1:8000", DPSize: 1})
		if err := r.Start(svc); err != nil {
			panic(err)
		}
		return svc, r
	}
	a, ra := replicaOf("epp-0")
	b, rb := replicaOf("epp-1")
	defer a.Close()
	defer b.Close()
	defer ra.Close()
	defer rb.Close()

	res, _ := a.SelectAndReserve(context.Background(), selection.Request{Tokens: make([]uint32, 64)})
	_ = ra.Flush() // publish now rather than within BatchInterval
	fmt.Println("epp-1 sees active requests:", b.Loads("")[0].ActiveRequests, rb.RemoteIDs("epp-0")[0] == res.ReservationID)
	for _, p := range rb.Peers() {
		if p.ID == "epp-0" {
			fmt.Println("epp-1 holds", p.Bookings, "booking of epp-0, which holds", len(ra.LocalIDs()), "of its own")
		}
	}

	_ = a.Reservations().Free(res.ReservationID)
	_ = ra.Flush()
	fmt.Println("epp-1 sees active requests:", b.Loads("")[0].ActiveRequests)
	// Output:
	// epp-1 sees active requests: 1 true
	// epp-1 holds 1 booking of epp-0, which holds 1 of its own
	// epp-1 sees active requests: 0
}
