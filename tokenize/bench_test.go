package tokenize_test

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/kvselect/kvselect/tokenize"
)

// benchBody is a chat body of about size bytes.
func benchBody(size int) []byte {
	return chatBody(strings.Repeat("lorem ipsum ", size/12))
}

// BenchmarkCachedTokenize measures the hit path: xxhash over the key material,
// the ristretto lookup, the byte comparison with the entry's request and, unless
// results are shared, the copy of the ids.
func BenchmarkCachedTokenize(b *testing.B) {
	for _, tc := range []struct {
		tokens, body int
		share        bool
	}{{256, 1 << 10, false}, {2048, 8 << 10, false}, {8192, 32 << 10, false}, {256, 1 << 10, true}, {2048, 8 << 10, true}, {8192, 32 << 10, true}} {
		mode := "copy"
		if tc.share {
			mode = "shared"
		}
		b.Run(fmt.Sprintf("%s/tokens=%d/body=%dKiB", mode, tc.tokens, tc.body>>10), func(b *testing.B) {
			c, err := tokenize.NewCache(&fakeTokenizer{n: tc.tokens, noFeatures: true}, tokenize.CacheOptions{ShareResults: tc.share})
			if err != nil {
				b.Fatal(err)
			}
			defer c.Close()
			req := tokenize.Request{Path: tokenize.PathChatCompletions, Body: benchBody(tc.body), Model: "m"}
			ctx := context.Background()
			for c.Stats().Hits == 0 {
				if _, err := c.Tokenize(ctx, req); err != nil {
					b.Fatal(err)
				}
				c.Wait()
			}
			b.ReportAllocs()
			b.SetBytes(int64(len(req.Body)))
			b.ResetTimer()
			for b.Loop() {
				res, err := c.Tokenize(ctx, req)
				if err != nil || len(res.Tokens) != tc.tokens {
					b.Fatal(err)
				}
			}
			b.StopTimer()
			if s := c.Stats(); s.Misses > 2 {
				b.Fatalf("hit path missed: %+v", s)
			}
		})
	}
}

// BenchmarkCachedTokenizeParallel is the copying hit path from every P.
func BenchmarkCachedTokenizeParallel(b *testing.B) {
	c, err := tokenize.NewCache(&fakeTokenizer{n: 2048, noFeatures: true}, tokenize.CacheOptions{})
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	req := tokenize.Request{Path: tokenize.PathChatCompletions, Body: benchBody(8 << 10), Model: "m"}
	for c.Stats().Hits == 0 {
		_, _ = c.Tokenize(context.Background(), req)
		c.Wait()
	}
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if _, err := c.Tokenize(context.Background(), req); err != nil {
				b.Error(err)
				return
			}
		}
	})
}

// BenchmarkTokenizeMiss is one uncached vllm-render call over loopback HTTP to an
// httptest server answering 2048 ids: request, keep-alive connection, reading
// and parsing the answer.
func BenchmarkTokenizeMiss(b *testing.B) {
	answer := renderAnswer(seq(2048, 100000))
	srv := newBenchServer(b, answer)
	c, err := tokenize.New(tokenize.Options{Protocol: tokenize.ProtocolVLLMRender, BaseURL: srv})
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	req := tokenize.Request{Path: tokenize.PathChatCompletions, Body: benchBody(8 << 10)}
	b.ReportAllocs()
	for b.Loop() {
		res, err := c.Tokenize(context.Background(), req)
		if err != nil || len(res.Tokens) != 2048 {
			b.Fatal(err)
		}
	}
}

// BenchmarkParseRender is the parsing share of a miss: a 2048-id render answer.
func BenchmarkParseRender(b *testing.B) {
	answer := []byte(renderAnswer(seq(2048, 100000)))
	b.ReportAllocs()
	b.SetBytes(int64(len(answer)))
	for b.Loop() {
		if _, err := tokenize.ParseResponse(tokenize.ProtocolVLLMRender, answer); err != nil {
			b.Fatal(err)
		}
	}
}

func newBenchServer(b *testing.B, answer string) string {
	b.Helper()
	srv := newTestServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		reply(200, answer)(w, r)
	}))
	b.Cleanup(srv.Close)
	return srv.URL
}
