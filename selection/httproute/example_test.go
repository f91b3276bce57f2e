package httproute_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/roles"
	"github.com/kvselect/kvselect/selection"
	"github.com/kvselect/kvselect/selection/httproute"
	"github.com/kvselect/kvselect/tokenize"
)

// promptBytes stands in for the engine's tokenizer (tokenize.New with the
// engine's protocol, wrapped in tokenize.NewCache): one id per body byte.
type promptBytes struct{}

func (promptBytes) Tokenize(_ context.Context, req tokenize.Request) (tokenize.Result, error) {
	ids := make([]uint32, len(req.Body))
	for i, c := range req.Body {
		ids[i] = uint32(c)
	}
	return tokenize.Result{Tokens: ids, PromptCount: 1}, nil
}

// A gateway in two lines: a Router over the selection service, served by
// net/http. The second request for the same prompt goes back to the engine
// that computed it, although the other engine is idle, and once each answer
// has been read its booking is settled.
func Example() {
	ctx := context.Background()
	engine := func(name string) *httptest.Server { // an engine answering with its name
		return httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			_, _ = io.Copy(io.Discard, r.Body)
			w.Header().Set("Content-Type", "application/json")
			_, _ = fmt.Fprintf(w, `{"served_by":%q}`, name)
		}))
	}
	a, b := engine("engine-a"), engine("engine-b")
	defer a.Close()
	defer b.Close()

	cfg := selection.DefaultConfig(4)
	cfg.UseKVEvents = false // approximate mode: the service remembers where it sent each prefix
	svc, err := selection.NewSelectionServiceBuilder(cfg).Build(ctx)
	if err != nil {
		panic(err)
	}
	defer svc.Close()

	router, err := httproute.New(httproute.Options{Service: httproute.Single(svc), Tokenizer: promptBytes{}})
	if err != nil {
		panic(err)
	}
	defer router.CloseIdleConnections()
	gateway := httptest.NewServer(router)
	defer gateway.Close()
	client := &http.Client{Transport: &http.Transport{}}
	defer client.CloseIdleConnections()

	body := `{"model":"default","messages":[{"role":"system","content":"You are a terse assistant."},` +
		`{"role":"user","content":"Name three primary colours."}]}`
	ask := func() {
		resp, err := client.Post(gateway.URL+"/v1/chat/completions", "application/json", strings.NewReader(body))
		if err != nil {
			panic(err)
		}
		answer, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		fmt.Println(resp.Status, string(answer))
	}
	_, _ = svc.Workers().Upsert(catalog.Worker{ID: "engine-a", Endpoint: a.Listener.Addr().String(), DPSize: 1})
	ask()
	_, _ = svc.Workers().Upsert(catalog.Worker{ID: "engine-b", Endpoint: b.Listener.Addr().String(), DPSize: 1})
	ask()
	for _, l := range svc.Loads("") {
		fmt.Println(l.WorkerID, "active requests:", l.ActiveRequests)
	}
	fmt.Println("bookings:", svc.Stats().Bookings, "freed:", svc.Stats().Frees)
	// Output:
	// 200 OK {"served_by":"engine-a"}
	// 200 OK {"served_by":"engine-a"}
	// engine-a active requests: 0
	// engine-b active requests: 0
	// bookings: 2 freed: 2
}

// Prefill/decode serving: Pairs books each request on a prefill worker and
// a decode worker of a roles.PairBooker. The request goes to the decode
// worker, whose sidecar (examples/pdsidecar) reads the prefill worker from
// x-prefiller-host-port and runs the prefill leg there; the end of the
// answer settles both legs.
func ExamplePairs() {
	ctx := context.Background()
	decode := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		_, _ = fmt.Fprintf(w, `{"prefilled_on":%q}`, r.Header.Get("x-prefiller-host-port"))
	}))
	defer decode.Close()

	rs, err := roles.New(ctx, roles.RoleOptions{
		Mode: roles.ModeDisaggregated, Base: selection.DefaultConfig(4),
		Configure: func(_ roles.Role, b *selection.SelectionServiceBuilder) { b.ExternalEvents() },
	})
	if err != nil {
		panic(err)
	}
	defer rs.Close()
	role := func(r string) map[string]string { return map[string]string{roles.DefaultRoleLabel: r} }
	if _, err := rs.Reconcile([]catalog.Worker{
		{ID: "prefill-0", Endpoint: "10.0.0.1:8000", DPSize: 1, BlockSize: 4, Labels: role("prefill")},
		{ID: "decode-0", Endpoint: decode.Listener.Addr().String(), DPSize: 1, BlockSize: 4, Labels: role("decode")},
	}); err != nil {
		panic(err)
	}
	pairs, err := roles.NewPairBooker(rs, roles.BookerOptions{})
	if err != nil {
		panic(err)
	}
	defer pairs.Close()

	router, err := httproute.New(httproute.Options{Service: httproute.Pairs(pairs), Tokenizer: promptBytes{}})
	if err != nil {
		panic(err)
	}
	defer router.CloseIdleConnections()
	gateway := httptest.NewServer(router)
	defer gateway.Close()
	client := &http.Client{Transport: &http.Transport{}}
	defer client.CloseIdleConnections()

	resp, err := client.Post(gateway.URL+"/v1/completions", "application/json", strings.NewReader(`{"model":"default","prompt":"Hello there"}`))
	if err != nil {
		panic(err)
	}
	answer, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	fmt.Println(resp.Status, string(answer))
	st := pairs.Stats().Plans
	fmt.Println("plans completed:", st.Completed, "active:", st.Active)
	// Output:
	// 200 OK {"prefilled_on":"10.0.0.1:8000"}
	// plans completed: 1 active: 0
}

// ParseRequest reads only the fields that decide where a request may go; a
// field it does not know is no error, a field of the wrong type is.
func ExampleParseRequest() {
	info, err := httproute.ParseRequest([]byte(`{"model":"llama","lora_path":["sql-adapter"],"cache_salt":"tenant-7",
		"prompt_cache_key":"conv-42","messages":[{"role":"user","content":"hi"}],"stream":true}`))
	fmt.Printf("%+v %v\n", info, err)
	_, err = httproute.ParseRequest([]byte(`{"model":7}`))
	fmt.Println(errors.Is(err, httproute.ErrBadRequest))
	// Output:
	// {Model:llama LoRA:sql-adapter CacheSalt:tenant-7 SessionID:conv-42} <nil>
	// true
}
