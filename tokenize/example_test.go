package tokenize_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"

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
	cache, err := tokenize.NewCache(client, tokenize.CacheOptions{MaxBytes: 32 << 20})
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
