package main

import (
	"net/http"
	"testing"

	"github.com/stretchr/testify/require"
)

// Tokenizer URLs where nothing listens (port 1 and 2 of loopback, never
// served here): each call to them is refused at once.
const (
	deadTokenizer1 = "http://127.0.0.1:1"
	deadTokenizer2 = "http://127.0.0.1:2"
)

// Two tokenizer URLs, the first one down: the pool fails over to the second
// (and, after 3 failures in a row, leaves the first out), so every request is
// tokenized and served, none routed without tokens; /metrics counts the
// failovers and the dead endpoint's failures.
func TestGatewayTokenizerFailsOver(t *testing.T) {
	var live string
	env := newE2EEnvWith(t, e2eOptions{tokenizers: func(l string) []string {
		live = l
		return []string{deadTokenizer1, l}
	}})
	plan := e2ePlan(200, 5, false)
	for i, r := range env.load(t, env.url, plan) {
		require.Equal(t, http.StatusOK, r.status, "request %d", i)
		require.True(t, r.done, "request %d", i)
	}
	m := scrape(t, env.metrics)
	dead := map[string]string{"endpoint": deadTokenizer1}
	require.GreaterOrEqual(t, mustValue(t, m, "kvselect_tokenizer_endpoint_failures_total", dead), 3.0)
	require.Equal(t, mustValue(t, m, "kvselect_tokenizer_endpoint_calls_total", dead),
		mustValue(t, m, "kvselect_tokenizer_endpoint_failures_total", dead), "every call to it failed")
	require.GreaterOrEqual(t, mustValue(t, m, "kvselect_tokenizer_endpoint_circuit_opened_total", dead), 1.0)
	require.Equal(t, 1.0, mustValue(t, m, "kvselect_tokenizer_endpoint_circuit_open", dead))
	require.GreaterOrEqual(t, mustValue(t, m, "kvselect_tokenizer_failovers_total", nil), 3.0)
	require.Zero(t, mustValue(t, m, "kvselect_tokenizer_endpoint_failures_total", map[string]string{"endpoint": live}))
	require.Positive(t, mustValue(t, m, "kvselect_tokenizer_endpoint_calls_total", map[string]string{"endpoint": live}))
	require.Zero(t, mustValue(t, m, "kvselect_tokenizer_exhausted_total", nil))
	require.Zero(t, mustValue(t, m, "kvselect_httproute_refusals_total", map[string]string{"reason": "tokenizer_degraded"}))
	require.EqualValues(t, len(plan), mustValue(t, m, "kvselect_httproute_done_total", map[string]string{"outcome": "ended"}))
}

// Every tokenizer down: requests are routed on load alone (the degraded
// mode), booked and served, none fails for want of tokens, and each is
// counted; with --tokenizer-no-degrade=true they are refused with 503.
func TestGatewayWithoutTokenizer(t *testing.T) {
	dead := func(string) []string { return []string{deadTokenizer1, deadTokenizer2} }
	plan := e2ePlan(64, 6, false)

	env := newE2EEnvWith(t, e2eOptions{tokenizers: dead})
	for i, r := range env.load(t, env.url, plan) {
		require.Equal(t, http.StatusOK, r.status, "request %d", i)
		require.True(t, r.done, "request %d", i)
	}
	m := scrape(t, env.metrics)
	require.EqualValues(t, len(plan), mustValue(t, m, "kvselect_httproute_refusals_total", map[string]string{"reason": "tokenizer_degraded"}))
	require.EqualValues(t, len(plan), mustValue(t, m, "kvselect_httproute_booked_total", nil))
	require.Zero(t, mustValue(t, m, "kvselect_httproute_rejected_total", nil))
	require.Positive(t, mustValue(t, m, "kvselect_tokenizer_exhausted_total", nil))
	require.EqualValues(t, len(plan), mustValue(t, m, "kvselect_bookings_total", map[string]string{"role": role}))
	env.close()

	env = newE2EEnvWith(t, e2eOptions{tokenizers: dead, noDegrade: true})
	for i, r := range env.load(t, env.url, plan) {
		require.Equal(t, http.StatusServiceUnavailable, r.status, "request %d", i)
	}
	m = scrape(t, env.metrics)
	require.Zero(t, mustValue(t, m, "kvselect_httproute_refusals_total", map[string]string{"reason": "tokenizer_degraded"}))
	require.EqualValues(t, len(plan), mustValue(t, m, "kvselect_httproute_rejected_total", nil))
	require.Zero(t, mustValue(t, m, "kvselect_httproute_booked_total", nil))
}

// No tokenizer URL: the workers file's workers are the tokenizers (each
// engine serves render), so every request is tokenized by an engine and
// routed on its tokens, none in the degraded mode.
func TestGatewayTokenizersAreTheWorkers(t *testing.T) {
	env := newE2EEnvWith(t, e2eOptions{tokenizers: func(string) []string { return nil }})
	plan := e2ePlan(100, 5, false)
	for i, r := range env.load(t, env.url, plan) {
		require.Equal(t, http.StatusOK, r.status, "request %d", i)
		require.True(t, r.done, "request %d", i)
	}
	var renders uint64
	for _, e := range env.engines {
		renders += e.HTTPStats().Renders
	}
	require.Positive(t, renders, "the engines tokenized")
	m := scrape(t, env.metrics)
	require.Zero(t, mustValue(t, m, "kvselect_httproute_refusals_total", map[string]string{"reason": "tokenizer_degraded"}))
	require.Zero(t, mustValue(t, m, "kvselect_tokenizer_exhausted_total", nil))
	require.EqualValues(t, len(plan), mustValue(t, m, "kvselect_httproute_booked_total", nil))
}
