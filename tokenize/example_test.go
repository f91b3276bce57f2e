package tokenize_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"time"

	"github.com/kvselect/kvselect/tokenize"
)

// Example asks a vLLM render endpoint (here a loopback stand-in) for the token
// ids of a chat request, through a cache, and maps a failure to an HTTP status.
func Example() {
	renderer := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/v1/chat/completions/render" {
			http.Error(w, `{"error":{"message":"no such route"}}`, http.StatusNotFound)
			return
		}
		_, _ = io.WriteString(w, `{"request_id":"chatcmpl-1","token_ids":[151644,872,198,9707,151645],"features":null}`)
	}))
	defer renderer.Close()

	client, err := tokenize.New(tokenize.Options{Protocol: tokenize.ProtocolVLLMRender, BaseURL: renderer.URL})
	if err != nil {
		panic(err)
	}
	defer client.Close()
	// 32 MiB of entries, each kept at most an hour (a new tokenizer revision
	// behind the same URL is then picked up within the hour).
	cache, err := tokenize.NewCache(client, tokenize.CacheOptions{MaxBytes: 32 << 20, TTL: time.Hour})
	if err != nil {
		panic(err)
	}
	defer cache.Close()

	res, err := cache.Tokenize(context.Background(), tokenize.Request{
		Path: tokenize.PathChatCompletions,
		Body: []byte(`{"model":"qwen","messages":[{"role":"user","content":"Hello"}]}`),
	})
	fmt.Println(res.Tokens, err)

	_, err = cache.Tokenize(context.Background(), tokenize.Request{Path: "/v1/embeddings", Body: []byte(`{}`)})
	fmt.Println(tokenize.HTTPStatus(err), err)
	// Output:
	// [151644 872 198 9707 151645] <nil>
	// 400 tokenize: bad request: unsupported path "/v1/embeddings" (want /v1/chat/completions or /v1/completions)
}

// ExampleNew reaches a tokenizer served over TLS through the caller's own HTTP
// client (here one that trusts the test server's certificate), and bounds the
// request bodies it forwards: a larger one fails before anything is sent.
func ExampleNew() {
	var calls atomic.Int32
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		_, _ = io.WriteString(w, `{"count":3,"max_model_len":4096,"tokens":[1,2,3]}`)
	}))
	defer srv.Close()

	client, err := tokenize.New(tokenize.Options{
		Protocol:        tokenize.ProtocolVLLMTokenize,
		BaseURL:         srv.URL,
		HTTPClient:      srv.Client(),
		MaxRequestBytes: 1 << 10,
	})
	if err != nil {
		panic(err)
	}
	defer client.Close()

	res, err := client.Tokenize(context.Background(), tokenize.Request{
		Path: tokenize.PathCompletions, Body: []byte(`{"model":"m","prompt":"Hello there"}`),
	})
	fmt.Println(res.Tokens, res.MaxModelLen, err)

	big := `{"model":"m","prompt":"` + strings.Repeat("x", 2<<10) + `"}`
	_, err = client.Tokenize(context.Background(), tokenize.Request{Path: tokenize.PathCompletions, Body: []byte(big)})
	fmt.Println(tokenize.HTTPStatus(err), err)
	fmt.Println("calls:", calls.Load())
	// Output:
	// [1 2 3] 4096 <nil>
	// 400 tokenize: bad request: body of 2073 bytes exceeds the limit of 1024
	// calls: 1
}

// A pool of two engines' render endpoints: the first is down, so its calls
// fail over to the second, and after three failures in a row its circuit
// opens and it is left out.
func ExampleNewPool() {
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_, _ = io.WriteString(w, `{"request_id":"chatcmpl-1","token_ids":[1,2,3],"features":null}`)
	}))
	defer up.Close()
	down := httptest.NewServer(http.NotFoundHandler())
	down.Close() // connection refused from now on

	var eps []tokenize.Endpoint
	for _, base := range []string{down.URL, up.URL} {
		c, err := tokenize.New(tokenize.Options{Protocol: tokenize.ProtocolVLLMRender, BaseURL: base})
		if err != nil {
			panic(err)
		}
		defer c.Close()
		eps = append(eps, tokenize.Endpoint{Name: base, Tokenizer: c})
	}
	pool, err := tokenize.NewPool(tokenize.PoolOptions{Endpoints: eps})
	if err != nil {
		panic(err)
	}
	req := tokenize.Request{Path: tokenize.PathChatCompletions, Body: []byte(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`)}
	for range 8 {
		res, err := pool.Tokenize(context.Background(), req)
		if err != nil {
			panic(err)
		}
		_ = res
	}
	st := pool.Stats()
	fmt.Println("failovers:", st.Failovers, "first endpoint open:", st.Endpoints[0].Open, "calls:", st.Endpoints[0].Calls, st.Endpoints[1].Calls)
	// Output:
	// failovers: 3 first endpoint open: true calls: 3 8
}

// A pool that follows the engines a discovery finds: it starts empty (its
// calls fail with ErrUnavailable, which a gateway's degraded mode acts on),
// and SetBaseURLs gives it each new set of URLs.
func ExamplePool_SetBaseURLs() {
	engine := func(id int) *httptest.Server {
		return httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			_, _ = fmt.Fprintf(w, `{"request_id":"chatcmpl-1","token_ids":[%d]}`, id)
		}))
	}
	a, b := engine(1), engine(2)
	defer a.Close()
	defer b.Close()
	pool, err := tokenize.NewClientPool(tokenize.Options{Protocol: tokenize.ProtocolVLLMRender}, nil, tokenize.PoolOptions{})
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	ctx := context.Background()
	req := tokenize.Request{Path: tokenize.PathChatCompletions, Body: []byte(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`)}

	_, err = pool.Tokenize(ctx, req)
	fmt.Println("no engine yet, unavailable:", errors.Is(err, tokenize.ErrUnavailable))
	if err := pool.SetBaseURLs([]string{a.URL}); err != nil {
		panic(err)
	}
	res, err := pool.Tokenize(ctx, req)
	fmt.Println("engine a:", res.Tokens, err)
	if err := pool.SetBaseURLs([]string{b.URL}); err != nil { // a left, b came
		panic(err)
	}
	res, err = pool.Tokenize(ctx, req)
	fmt.Println("engine b:", res.Tokens, err, "endpoints:", len(pool.Stats().Endpoints))
	// Output:
	// no engine yet, unavailable: true
	// engine a: [1] <nil>
	// engine b: [2] <nil> endpoints: 1
}
