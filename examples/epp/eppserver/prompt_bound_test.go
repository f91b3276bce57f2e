package eppserver

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/examples/epp/discovery"
	"github.com/kvselect/kvselect/examples/epp/extproc"
	"github.com/kvselect/kvselect/tokenize"
)

// DYN_EPP_MAX_PROMPT_TOKENS bounds the ids the tokenizer may answer with: one
// more is refused, 413, as the answer is parsed; at the bound the request is
// routed.
func TestEPPMaxPromptTokens(t *testing.T) {
	cfg, err := load(t, map[string]string{"DYN_EPP_TOKENIZER_SERVICE_URL": "http://127.0.0.1:1"})
	require.NoError(t, err)
	require.Equal(t, tokenize.DefaultMaxPromptTokens, cfg.MaxPromptTokens)

	var ids atomic.Int64 // the ids the tokenizer answers with
	ids.Store(8)
	tok := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		_, _ = fmt.Fprintf(w, `{"token_ids":[%s]}`, strings.TrimSuffix(strings.Repeat("7,", int(ids.Load())), ","))
	}))
	defer tok.Close()
	cfg, err = load(t, map[string]string{"DYN_EPP_TOKENIZER_SERVICE_URL": tok.URL, "DYN_EPP_KV_EVENT_PORT": "0",
		"DYN_EPP_MAX_PROMPT_TOKENS": "8"})
	require.NoError(t, err)
	e, err := New(context.Background(), cfg, Options{})
	require.NoError(t, err)
	defer e.Close()
	e.Apply(discovery.Snapshot{Workers: []catalog.Worker{{ID: "a", Endpoint: "10.0.0.1:8000", DPSize: 1}}, Synced: true})

	pick := func(prompt string) error {
		p, err := e.router.Pick(context.Background(), extproc.PickRequest{Path: "/v1/chat/completions",
			Body: []byte(`{"model":"default","messages":[{"role":"user","content":"` + prompt + `"}]}`)})
		if err == nil {
			p.Settle.Done()
		}
		return err
	}
	require.NoError(t, pick("at the bound"))
	ids.Store(9)
	err = pick("one past it") // another body: not a cache hit
	require.ErrorIs(t, err, tokenize.ErrPromptTooLong)
	require.Equal(t, http.StatusRequestEntityTooLarge, statusOf(err))

	_, err = load(t, map[string]string{"DYN_EPP_MAX_PROMPT_TOKENS": "0"})
	require.ErrorContains(t, err, "DYN_EPP_MAX_PROMPT_TOKENS")
}
