package eppserver

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/examples/epp/extproc"
	"github.com/kvselect/kvselect/tokenize"
)

// A tokenizer failure that is the tokenizers' (unreachable, timed out, an
// upstream error, closed) routes the request on load alone: a load-only
// booking (ISL from the body, no tokens), counted. The request's own faults,
// a client that left, and DYN_EPP_TOKENIZER_NO_DEGRADE refuse it with the
// error's status, booking nothing.
func TestRouterDegradedMode(t *testing.T) {
	body := []byte(strings.Repeat("b", 400))
	canceled, cancel := context.WithCancel(context.Background())
	cancel()
	cases := []struct {
		name      string
		err       error
		ctx       context.Context
		noDegrade bool
		status    int // 0: routed degraded
	}{
		{name: "unavailable", err: tokenize.ErrUnavailable},
		{name: "timeout", err: tokenize.ErrTimeout},
		{name: "upstream", err: tokenize.ErrUpstream},
		{name: "closed", err: tokenize.ErrClosed},
		{name: "bad request", err: tokenize.ErrBadRequest, status: 400},
		{name: "prompt too long", err: tokenize.ErrPromptTooLong, status: 413},
		{name: "canceled", err: tokenize.ErrCanceled, status: 499},
		{name: "timeout, the client gone", err: tokenize.ErrTimeout, ctx: canceled, status: 504},
		{name: "no degrade", err: tokenize.ErrUnavailable, noDegrade: true, status: 503},
		{name: "no degrade, timeout", err: tokenize.ErrTimeout, noDegrade: true, status: 504},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			svc := &fakeSvc{endpoint: "10.0.0.1:8000", prefill: map[string]int{}, freed: map[string]int{}}
			r := newTestRouter(svc, fakeTok{err: fmt.Errorf("tokenize: every tokenizer failed (3 tried): %w", c.err)})
			r.noDegrade = c.noDegrade
			ctx := c.ctx
			if ctx == nil {
				ctx = context.Background()
			}
			p, err := r.Pick(ctx, extproc.PickRequest{Path: "/v1/chat/completions", Body: body})
			if c.status != 0 {
				require.ErrorIs(t, err, c.err)
				require.Equal(t, c.status, statusOf(err))
				require.Zero(t, svc.last.ISL, "nothing booked")
				require.Zero(t, r.degraded.Load())
				return
			}
			require.NoError(t, err)
			require.Equal(t, "10.0.0.1:8000", p.Destination)
			require.Nil(t, svc.last.Tokens)
			require.Equal(t, len(body)/tokenize.BytesPerToken, svc.last.ISL, "a load-only decision for the body's estimated length")
			require.EqualValues(t, 1, r.degraded.Load())
			p.Settle.Done()
			require.Equal(t, 1, svc.freed["r1"], "settled as any booking")
		})
	}
}

// The degraded mode logs a WARN at once, then at most once every 10 s with
// the requests since the last line.
func TestDegradationLogsAtMostEveryTenSeconds(t *testing.T) {
	var logs syncBuffer
	log := slog.New(slog.NewTextHandler(&logs, nil))
	var d degradation
	t0 := time.Unix(1_000_000, 0)
	err := errors.New("tokenize: every tokenizer failed")
	d.note(log, err, t0)
	for i := range 5 {
		d.note(log, err, t0.Add(time.Duration(i+1)*time.Second))
	}
	require.Equal(t, 1, strings.Count(logs.String(), "level=WARN"))
	d.note(log, err, t0.Add(degradedLogEvery))
	require.Equal(t, 2, strings.Count(logs.String(), "level=WARN"))
	require.Contains(t, logs.String(), "count_since_last_line=6")
	require.EqualValues(t, 7, d.Load())
	require.Equal(t, 1, tokenize.EstimateTokens(nil), "an empty body still books a token")
}
