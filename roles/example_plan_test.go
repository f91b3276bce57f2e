package roles_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/roles"
	"github.com/kvselect/kvselect/selection"
)

// disaggregated returns role selectors for one pool split by the role label,
// fed no KV events, on the clock now, holding the given pods (name, role).
func disaggregated(now func() time.Time, pods ...[2]string) *roles.RoleSelectors {
	rs, err := roles.New(context.Background(), roles.RoleOptions{
		Mode: roles.ModeDisaggregated,
		Base: selection.DefaultConfig(4),
		Configure: func(_ roles.Role, b *selection.SelectionServiceBuilder) {
			b.ExternalEvents().Clock(now).SweepInterval(-1)
		},
	})
	if err != nil {
		panic(err)
	}
	var ws []catalog.Worker
	for i, p := range pods {
		ws = append(ws, catalog.Worker{
			ID: p[0], Endpoint: fmt.Sprintf("10.0.0.%d:8000", i+1), DPSize: 1, BlockSize: 4,
			Labels: map[string]string{roles.DefaultRoleLabel: p[1]},
		})
	}
	if _, err := rs.Reconcile(ws); err != nil {
		panic(err)
	}
	return rs
}

// A Plan is its request's handle: whoever streams the response settles the
// request through it, on every path, without knowing the booker.
func ExamplePlan() {
	rs := disaggregated(time.Now, [2]string{"prefill-0", "prefill"}, [2]string{"decode-0", "decode"})
	defer rs.Close()
	booker, err := roles.NewPairBooker(rs, roles.BookerOptions{})
	if err != nil {
		panic(err)
	}
	defer booker.Close()
	plan, err := booker.Book(context.Background(), selection.Request{ReservationID: "req-7", Tokens: []uint32{1, 2, 3, 4, 5, 6, 7, 8}})
	if err != nil {
		panic(err)
	}
	fmt.Println(plan.ID, "to", plan.Destination())
	fmt.Println("first response byte:", plan.PrefillComplete()) // frees the prefill worker
	fmt.Println("still streaming:", plan.Renew())               // a long stream keeps its leases
	fmt.Println("end of stream:", plan.Done())
	fmt.Println("again:", plan.Done())
	// Output:
	// req-7 to 10.0.0.2:8000
	// first response byte: <nil>
	// still streaming: <nil>
	// end of stream: <nil>
	// again: <nil>
}

// With no prefill worker ready, a booker fails the request by default; with
// the decode-only fallback the decode worker prefills the prompt itself. A
// plan whose owner never settles it is expired once its lease has passed.
func ExampleBookerOptions() {
	now := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	clock := func() time.Time { return now }
	rs := disaggregated(clock, [2]string{"decode-0", "decode"})
	defer rs.Close()
	req := selection.Request{Tokens: []uint32{1, 2, 3, 4, 5, 6, 7, 8}}

	strict, err := roles.NewPairBooker(rs, roles.BookerOptions{})
	if err != nil {
		panic(err)
	}
	defer strict.Close()
	_, err = strict.Book(context.Background(), req)
	fmt.Println("fail: ready", strict.Ready(), "status", roles.HTTPStatus(err), errors.Is(err, roles.ErrRoleCatalogEmpty))

	lenient, err := roles.NewPairBooker(rs, roles.BookerOptions{
		PrefillFallback: roles.PrefillDecodeOnly,
		Now:             clock,
		PlanLease:       time.Minute,
	})
	if err != nil {
		panic(err)
	}
	defer lenient.Close()
	plan, err := lenient.Book(context.Background(), req)
	if err != nil {
		panic(err)
	}
	_, hinted := plan.PrefillHint()
	fmt.Println("decode-only: ready", lenient.Ready(), "local prefill", plan.LocalPrefill, "hint", hinted, "to", plan.Destination())

	// Nobody settles the plan; a minute later the owner's periodic Expire does.
	fmt.Println("expired at once:", lenient.Expire())
	now = now.Add(time.Minute)
	fmt.Println("expired a minute later:", lenient.Expire())
	// Output:
	// fail: ready false status 503 true
	// decode-only: ready true local prefill true hint false to 10.0.0.1:8000
	// expired at once: 0
	// expired a minute later: 1
}

// Conditional disaggregation: with LocalPrefillBelow a request the decode
// worker would prefill little of is booked on it alone; a long uncached one
// gets a prefill worker. Timeout bounds a Book whose legs wait in admission
// queues (services with Config.QueueThreshold); DecodePrefixHashes, which
// LocalPrefillBelow turns on, lets the decode service learn the prefixes its
// workers received.
func ExampleBookerOptions_localPrefillBelow() {
	rs := disaggregated(time.Now, [2]string{"prefill-0", "prefill"}, [2]string{"decode-0", "decode"})
	defer rs.Close()
	b, err := roles.NewPairBooker(rs, roles.BookerOptions{LocalPrefillBelow: 16, DecodePrefixHashes: true, Timeout: 5 * time.Second})
	if err != nil {
		panic(err)
	}
	defer b.Close()
	for _, n := range []int{8, 64} {
		plan, err := b.Book(context.Background(), selection.Request{Tokens: make([]uint32, n)})
		if err != nil {
			panic(err)
		}
		hint, _ := plan.PrefillHint()
		fmt.Printf("%d tokens: local prefill %v, prefiller %q, to %s\n", n, plan.LocalPrefill, hint, plan.Destination())
		_ = plan.Done()
	}
	fmt.Println("skipped the prefill leg:", b.Stats().Conditional)
	// Output:
	// 8 tokens: local prefill true, prefiller "", to 10.0.0.2:8000
	// 64 tokens: local prefill false, prefiller "10.0.0.1:8000", to 10.0.0.2:8000
	// skipped the prefill leg: 1
}
