//go:build e2e

package e2ekube

import (
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/examples/epp/internal/eppproc"
)

// longPrompt is a prompt of many complete KV blocks.
func longPrompt() string {
	var b strings.Builder
	for i := range 240 {
		fmt.Fprintf(&b, "word%d ", i%37)
	}
	return b.String()
}

// cachedTokens reads the engine's report of prompt tokens served from its
// prefix cache.
func cachedTokens(t *testing.T, h http.Header) int {
	t.Helper()
	vs := h["x-fake-cached-tokens"]
	require.Len(t, vs, 1, "engine header %v", h)
	n, err := strconv.Atoi(vs[0])
	require.NoError(t, err)
	return n
}

// TestRestartRecovers kills the EPP mid-run (SIGKILL), changes the pool while
// it is down, and starts a new one with the same configuration: the new EPP
// rebuilds its catalog from the API server (the change included) and its KV
// index from the engines' replay buffers, which each event source reads when it
// starts, so a prompt whose prefix one (now idle) engine holds goes back to that
// engine without any engine publishing anything new.
func TestRestartRecovers(t *testing.T) {
	hh := need(t)
	s := newSpace(t, hh)
	f := startFleet(t, 4) // llm-0..2 at first; llm-3 joins while the EPP is down
	tok := startTokenizer(t)
	s.createPool("pool", map[string]string{"app": "llm"}, f.port)
	for i := range 3 {
		s.runPod(fmt.Sprintf("llm-%d", i), f.ips[i], map[string]string{"app": "llm"})
	}
	cfg := eppConfig{ns: s.ns, pool: "pool", fleet: f, tokenizer: tok}
	p := startEPP(t, hh, cfg)
	require.EqualValues(t, 3, p.waitServing().Num("workers"))
	for i := range 3 {
		require.Eventually(t, f.engines[i].Subscribed, reconcileTimeout, poll, "KV events of llm-%d", i)
	}

	// llm-1 caches the long prompt; the index learns it from its KV events and
	// the unhinted prompt goes back there.
	long := longPrompt()
	first := p.send(request{prompt: long, subset: []string{f.endpoint(1)}})
	require.Equal(t, http.StatusOK, first.StatusCode, "%s", first.Body)
	require.Equal(t, f.endpoint(1), first.Served)
	id1 := s.workerID("llm-1")
	p.eventually("llm-1's blocks indexed", func() bool {
		return p.counter("kvselect_kv_events_applied_total", map[string]string{"worker": id1}) > 0
	})
	again := p.send(request{prompt: long})
	require.Equal(t, f.endpoint(1), again.Served, "the prefix holder is chosen")
	require.Positive(t, cachedTokens(t, again.Header))
	require.Positive(t, p.counter("kvselect_overlap_chosen_blocks_total", nil))

	// Crash, and change the pool meanwhile.
	p.kill()
	s.deletePod("llm-2")
	s.runPod("llm-3", f.ips[3], map[string]string{"app": "llm"})

	q := startEPP(t, hh, cfg)
	require.EqualValues(t, 3, q.waitServing().Num("workers"), "llm-0, llm-1, llm-3")
	census := q.waitLog(reconcileTimeout, "startup census", eppproc.MsgIs("discovery census"))
	require.EqualValues(t, 3, census.Num("workers"))
	require.False(t, q.servedBy(f.endpoint(2)), "the pod deleted while the EPP was down")
	require.Zero(t, q.counter("kvselect_overlap_chosen_blocks_total", nil), "a new process has made no decision yet")

	// No engine publishes anything new: the new EPP's start-up replay alone
	// rebuilds what llm-1 holds.
	q.eventually("llm-1's history replayed", func() bool {
		return q.counter("kvselect_kv_event_replays_total", map[string]string{"worker": id1, "result": "ok"}) >= 1
	})
	back := q.send(request{prompt: long})
	require.Equal(t, http.StatusOK, back.StatusCode, "%s", back.Body)
	require.Equal(t, f.endpoint(1), back.Served, "the prefix goes back to the engine holding it")
	require.Equal(t, cachedTokens(t, again.Header), cachedTokens(t, back.Header))
	require.Positive(t, q.counter("kvselect_overlap_chosen_blocks_total", nil), "chosen for its overlap, not by chance")
}
