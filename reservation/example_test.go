package reservation_test

import (
	"fmt"
	"time"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/reservation"
)

// stepClock is a fixed clock, so the example's output does not depend on the time.
type stepClock struct{ now time.Time }

func (c *stepClock) Now() time.Time { return c.now }

func Example() {
	clock := &stepClock{now: time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)}
	ledger, err := reservation.New(reservation.Options{
		Now: clock.Now,
		OnChange: func(w catalog.WorkerRank) {
			fmt.Println("load went down on", w)
		},
	})
	if err != nil {
		panic(err)
	}
	pod := catalog.WorkerRank{WorkerID: "pod-a"}
	show := func(step string) {
		ld := ledger.Load(pod)
		fmt.Printf("%-16s prefill=%d blocks=%d requests=%d\n", step, ld.ActivePrefillTokens, ld.ActiveBlocks, ld.ActiveRequests)
	}

	// A 64-token prompt (four blocks of 16) of which the worker had one block
	// cached: 48 tokens left to prefill.
	err = ledger.Book(reservation.Booking{
		ID:            "req-1",
		Worker:        pod,
		SeqHashes:     []uint64{0xa1, 0xa2, 0xa3, 0xa4},
		PrefillTokens: 48,
	})
	if err != nil {
		panic(err)
	}
	show("booked")
	// A second request sharing the first two blocks adds only its own blocks.
	sibling := ledger.AppendLoads(nil, []catalog.WorkerRank{pod}, []uint64{0xa1, 0xa2, 0xb3})
	fmt.Println("new blocks for a sibling:", sibling[0].NewBlocks)

	_ = ledger.PrefillComplete("req-1") // first response byte
	show("prefill complete")
	_ = ledger.Free("req-1") // response finished
	show("freed")

	fmt.Println("free again:", ledger.Free("req-1"))
	// Output:
	// booked           prefill=48 blocks=4 requests=1
	// new blocks for a sibling: 1
	// load went down on pod-a/0
	// prefill complete prefill=0 blocks=4 requests=1
	// load went down on pod-a/0
	// freed            prefill=0 blocks=0 requests=0
	// free again: reservation: unknown reservation id: free "req-1"
}

func ExampleLedger_Expire() {
	clock := &stepClock{now: time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)}
	ledger, _ := reservation.New(reservation.Options{Now: clock.Now, DefaultLease: time.Minute})
	pod := catalog.WorkerRank{WorkerID: "pod-a"}
	_ = ledger.Book(reservation.Booking{ID: "orphan", Worker: pod, PrefillTokens: 100})
	_ = ledger.Book(reservation.Booking{ID: "long", Worker: pod, Lease: time.Hour})

	// An owner's sweeper calls Expire every so often (the selection service:
	// every second); a minute later the orphan's lease has passed.
	fmt.Println("expired:", ledger.Expire(clock.now.Add(time.Minute)))
	fmt.Printf("%+v\n", ledger.Load(pod))
	// Output:
	// expired: 1
	// {ActivePrefillTokens:0 ActiveBlocks:0 ActiveRequests:1}
}
