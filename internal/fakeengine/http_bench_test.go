package fakeengine

import (
	"io"
	"net/http"
	"strings"
	"testing"
)

func BenchmarkApplyChatTemplate(b *testing.B) {
	msgs := []Message{{"system", sysPrompt}, {"user", "What is the boiling point of water at sea level?"}}
	b.ReportAllocs()
	for b.Loop() {
		_ = ApplyChatTemplate(msgs)
	}
}

// BenchmarkHTTPChatCompletion is one non-streaming chat request over loopback,
// the prompt a cache hit after the first iteration.
func BenchmarkHTTPChatCompletion(b *testing.B) {
	e, err := New(Options{EnableHTTP: true})
	if err != nil {
		b.Fatal(err)
	}
	if err := e.Start(b.Context()); err != nil {
		b.Fatal(err)
	}
	defer e.Close()
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	c := &http.Client{Transport: tr}
	url := "http://" + e.HTTPEndpoint() + "/v1/chat/completions"
	body := `{"model":"fake-model","max_tokens":16,"messages":[{"role":"system","content":"` + sysPrompt +
		`"},{"role":"user","content":"What is the boiling point of water at sea level?"}]}`
	b.ReportAllocs()
	for b.Loop() {
		resp, err := c.Post(url, "application/json", strings.NewReader(body))
		if err != nil {
			b.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			b.Fatal(resp.Status)
		}
	}
}
