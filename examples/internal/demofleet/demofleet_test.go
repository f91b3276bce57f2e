package demofleet

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// A workload is a function of its options and run: the same seed, the same
// requests; another run, other system prompts; every ShortEvery-th request
// a short question of its own.
func TestWorkload(t *testing.T) {
	o := WorkloadOptions{Requests: 40, Groups: 3, ShortEvery: 4, Seed: 5}
	a, err := Workload(o, 0)
	require.NoError(t, err)
	b, err := Workload(o, 0)
	require.NoError(t, err)
	c, err := Workload(o, 1)
	require.NoError(t, err)
	require.Equal(t, a, b)
	require.Len(t, a, 40)
	systems := map[string]bool{}
	for i, r := range a {
		require.Equal(t, i%4 == 3, r.Short, "request %d", i)
		var body struct {
			Model     string              `json:"model"`
			MaxTokens int                 `json:"max_tokens"`
			Stream    bool                `json:"stream"`
			Messages  []map[string]string `json:"messages"`
		}
		require.NoError(t, json.Unmarshal(r.Body, &body))
		require.Equal(t, Model, body.Model)
		require.Equal(t, 8, body.MaxTokens)
		require.True(t, body.Stream)
		if r.Short {
			require.Len(t, body.Messages, 1)
			continue
		}
		require.Equal(t, "system", body.Messages[0]["role"])
		systems[body.Messages[0]["content"]] = true
		require.NotEqual(t, r.Body, c[i].Body, "run 1 does not repeat run 0's prompts")
	}
	require.Len(t, systems, 3, "the groups share their system prompts")

	for _, bad := range []WorkloadOptions{{Requests: -1, Groups: 1}, {Requests: 1}, {Requests: 1, Groups: 1, MaxTokens: -1}} {
		_, err := Workload(bad, 0)
		require.Error(t, err, "%+v", bad)
	}
}

// The driver's clock notes the first byte and each token event of a
// stream, and the usage block gives the prompt and cached tokens, streamed
// or not.
func TestStreamClockAndUsage(t *testing.T) {
	stream := "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\n\n" +
		"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n" +
		"data: {\"choices\":[{\"text\":\"b\"}]}\n\n" +
		"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":40,\"prompt_tokens_details\":{\"cached_tokens\":32}}}\n\n" +
		"data: [DONE]\n\n"
	sc := &streamClock{ReadCloser: io.NopCloser(trickle{strings.NewReader(stream)})}
	got, err := io.ReadAll(sc)
	require.NoError(t, err)
	require.Equal(t, stream, string(got))
	require.False(t, sc.first.IsZero())
	require.Len(t, sc.tokens, 2, "the role chunk, the usage chunk and [DONE] are no tokens")
	p, c := usageOf(got)
	require.Equal(t, 40, p)
	require.Equal(t, 32, c)
	p, c = usageOf([]byte(`{"usage":{"prompt_tokens":7,"prompt_tokens_details":{"cached_tokens":0}}}`))
	require.Equal(t, 7, p)
	require.Zero(t, c)
	require.Equal(t, 2.0, Percentile([]float64{3, 1, 2}, 0.5))
	require.Zero(t, Percentile(nil, 0.5))
	require.Equal(t, 0.75, Result{PromptTokens: 4, CachedTokens: 3}.HitRate())
	require.Equal(t, 3, Result{PerUnpaired: map[string]int{"a": 1, "b": 2}}.Unpaired())
	require.Equal(t, 500.0, ms(500*time.Millisecond))
}

// trickle hands its reader's bytes out a few at a time, as a network does.
type trickle struct{ r io.Reader }

func (s trickle) Read(p []byte) (int, error) { return s.r.Read(p[:min(len(p), 7)]) }

func ExampleWorkload() {
	reqs, err := Workload(WorkloadOptions{Requests: 8, Groups: 2, ShortEvery: 4, Seed: 7}, 0)
	if err != nil {
		fmt.Println(err)
		return
	}
	short := 0
	for _, r := range reqs {
		if r.Short {
			short++
		}
	}
	fmt.Println(len(reqs), "requests,", short, "short;", bytes.Contains(reqs[0].Body, []byte(`"stream":true`)))
	// Output: 8 requests, 2 short; true
}
