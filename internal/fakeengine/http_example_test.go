package fakeengine_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/kvselect/kvselect/internal/fakeengine"
)

// With EnableHTTP the engine serves an OpenAI-compatible API; a repeated prompt
// is served from the prefix cache, which lowers the simulated TTFT.
func ExampleEngine_Handler() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	e, err := fakeengine.New(fakeengine.Options{EnableHTTP: true, BlockSize: 4})
	if err != nil {
		panic(err)
	}
	if err := e.Start(ctx); err != nil {
		panic(err)
	}
	defer e.Close()
	client := &http.Client{Transport: &http.Transport{}}
	defer client.CloseIdleConnections()

	body := `{"model": "fake-model", "max_tokens": 4,
	  "messages": [{"role": "system", "content": "You are terse."},
	               {"role": "user", "content": "Name three primary colours."}]}`
	for range 2 {
		resp, err := client.Post("http://"+e.HTTPEndpoint()+"/v1/chat/completions", "application/json", strings.NewReader(body))
		if err != nil {
			panic(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		fmt.Println(resp.Status, "prompt", resp.Header.Get(fakeengine.HeaderPromptTokens),
			"cached", resp.Header.Get(fakeengine.HeaderCachedTokens), "ttft_ms", resp.Header.Get(fakeengine.HeaderTTFT))
	}
	msgs := []fakeengine.Message{{Role: "system", Content: "You are terse."}, {Role: "user", Content: "Name three primary colours."}}
	fmt.Println(fakeengine.ApplyChatTemplate(msgs)[:3], e.HTTPStats().HitRate())
	// Output:
	// 200 OK prompt 15 cached 0 ttft_ms 1.300
	// 200 OK prompt 15 cached 12 ttft_ms 1.060
	// [1 3 31657] 0.4
}
