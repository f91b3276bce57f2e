package roles_test

import (
	"context"
	"fmt"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/roles"
	"github.com/kvselect/kvselect/selection"
)

// One pool split by the role label: a request is booked on a prefill worker
// (the hint) and a decode worker (the destination), handed off at the first
// response byte and completed at the end of the stream.
func ExamplePairBooker() {
	rs, err := roles.New(context.Background(), roles.RoleOptions{
		Mode: roles.ModeDisaggregated,
		Base: selection.DefaultConfig(4),
		Configure: func(_ roles.Role, b *selection.SelectionServiceBuilder) {
			// This example feeds no KV events; a deployment lets the prefill
			// service subscribe to each engine (catalog.Worker.KVEventEndpoints).
			b.ExternalEvents()
		},
	})
	if err != nil {
		panic(err)
	}
	defer rs.Close()

	pod := func(name, ip, role string) catalog.Worker {
		return catalog.Worker{
			ID: name, Endpoint: ip + ":8000", DPSize: 1, BlockSize: 4,
			Labels: map[string]string{roles.DefaultRoleLabel: role},
		}
	}
	res, err := rs.Reconcile([]catalog.Worker{
		pod("prefill-0", "10.0.0.1", "prefill"),
		pod("decode-0", "10.0.0.2", " Decode "),
		pod("other-0", "10.0.0.3", "both"),
	})
	if err != nil {
		panic(err)
	}
	fmt.Println("excluded:", res.Excluded[0].ID, res.Excluded[0].Reason)
	for _, c := range rs.Census().Roles {
		fmt.Println(c.Role, "ready workers:", c.Schedulable)
	}

	booker, err := roles.NewPairBooker(rs, roles.BookerOptions{})
	if err != nil {
		panic(err)
	}
	defer booker.Close()
	prompt := []uint32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}
	plan, err := booker.Book(context.Background(), selection.Request{ReservationID: "req-1", Tokens: prompt})
	if err != nil {
		panic(err)
	}
	hint, _ := plan.PrefillHint()
	fmt.Println("destination:", plan.Destination(), "prefiller:", hint)

	show := func(step string) {
		p := rs.Service(roles.Prefill).Loads("")[0]
		d := rs.Service(roles.Decode).Loads("")[0]
		fmt.Printf("%-9s prefill: %d requests, %d tokens; decode: %d requests, %d tokens\n",
			step, p.ActiveRequests, p.ActivePrefillTokens, d.ActiveRequests, d.ActivePrefillTokens)
	}
	show("booked")
	_ = plan.PrefillComplete() // first response byte
	show("handoff")
	_ = plan.Done() // end of stream
	show("complete")
	fmt.Println(plan.Done())
	// Output:
	// excluded: other-0 role_label_invalid
	// prefill ready workers: 1
	// decode ready workers: 1
	// destination: 10.0.0.2:8000 prefiller: 10.0.0.1:8000
	// booked    prefill: 1 requests, 12 tokens; decode: 1 requests, 0 tokens
	// handoff   prefill: 0 requests, 0 tokens; decode: 1 requests, 0 tokens
	// complete  prefill: 0 requests, 0 tokens; decode: 0 requests, 0 tokens
	// <nil>
}

// Split is a pure function: one desired set in, disjoint role sets out.
func ExampleSplit() {
	ws := []catalog.Worker{
		{ID: "a", Labels: map[string]string{roles.DefaultRoleLabel: "prefill"}},
		{ID: "b", Labels: map[string]string{roles.DefaultRoleLabel: "DECODE"}},
		{ID: "c"},
	}
	res, err := roles.Split(ws, roles.ModeDisaggregated, roles.DefaultRoleLabel)
	if err != nil {
		panic(err)
	}
	fmt.Println(len(res.ByRole[roles.Prefill]), len(res.ByRole[roles.Decode]), res.Excluded)
	// Output:
	// 1 1 [{c role_label_missing }]
}
