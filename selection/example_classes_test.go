package selection_test

import (
	"context"
	"fmt"
	"time"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/selection"
)

// The class list the reference EPP and gateway read from
// DYN_EPP_POLICY_CLASSES: the first class is the default one.
func ExampleParseClasses() {
	classes, err := selection.ParseClasses("interactive:weight=3,tier=1,deadline=2s;batch:weight=1,queue=256,inflight=512")
	if err != nil {
		panic(err)
	}
	for _, c := range classes {
		fmt.Printf("%s: weight %v, tier %d, queue %d, in flight %d, deadline %v\n",
			c.Name, c.Weight, c.Tier, c.QueueLimit, c.InFlightLimit, c.Deadline)
	}
	cfg := selection.DefaultConfig(16)
	cfg.Classes = classes
	fmt.Println("valid:", cfg.Validate() == nil)
	// Output:
	// interactive: weight 3, tier 1, queue 0, in flight 0, deadline 2s
	// batch: weight 1, tier 0, queue 256, in flight 512, deadline 0s
	// valid: true
}

type sloKey struct{}

// An SLO-class classifier: requests the EPP marked interactive (here from
// a header, carried in ctx) are due within a time to first token that grows
// with their prompt; every other request is left to the default class,
// batch, without a deadline. The
// class's weight, tier and limits come from the configuration; the batch
// class holds at most one request in flight, so the second is refused with
// its class and limit named.
func ExampleAdmission_class() {
	cfg := selection.DefaultConfig(4)
	cfg.Classes = []selection.Class{
		{Name: "interactive", Weight: 3, Tier: 1},
		{Name: "batch", Weight: 1, InFlightLimit: 1},
	}
	cfg.DefaultClass = "batch" // a request the classifier leaves without a class
	now := func() time.Time { return time.Unix(1_700_000_000, 0) }
	slo := selection.ClassifierFunc(func(ctx context.Context, req *selection.Request) selection.Admission {
		adm := selection.Admission{Priority: req.Priority}
		if ctx.Value(sloKey{}) == "interactive" {
			budget := 500*time.Millisecond + time.Duration(req.ISL)*time.Millisecond/10
			adm.Class, adm.Deadline = "interactive", now().Add(budget)
		}
		return adm
	})
	svc, err := selection.NewSelectionServiceBuilder(cfg).ExternalEvents().Clock(now).Classifier(slo).Build(context.Background())
	if err != nil {
		panic(err)
	}
	defer svc.Close()
	if _, err := svc.Workers().Upsert(catalog.Worker{ID: "pod-a", Endpoint: "10.0.0.1:8000", DPSize: 1}); err != nil {
		panic(err)
	}

	interactive := context.WithValue(context.Background(), sloKey{}, "interactive")
	for _, ctx := range []context.Context{interactive, interactive, context.Background(), context.Background()} {
		if _, err := svc.Book(ctx, selection.Request{ISL: 2000}); err != nil {
			fmt.Println(selection.HTTPStatus(err), selection.RefusalReason(err))
			continue
		}
		fmt.Println("booked")
	}
	for _, name := range []string{"interactive", "batch"} {
		st := svc.Stats().Classes[name]
		fmt.Printf("%s: admitted %d, in flight %d, refused %v\n", name, st.Admitted, st.InFlight, st.Refused)
	}
	// Output:
	// booked
	// booked
	// booked
	// 429 class_inflight_full:batch
	// interactive: admitted 2, in flight 2, refused map[]
	// batch: admitted 1, in flight 1, refused map[class_inflight_full:1]
}
