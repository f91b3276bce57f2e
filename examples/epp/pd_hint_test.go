package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/examples/epp/extproc"
	"github.com/kvselect/kvselect/examples/internal/pdhint"
	"github.com/kvselect/kvselect/roles"
	"github.com/kvselect/kvselect/selection"
)

func TestConfigPDHintKey(t *testing.T) {
	c, err := load(t, nil)
	require.NoError(t, err)
	require.Nil(t, c.PDHintKey, "unset: hints are not signed")
	require.Equal(t, 30*time.Second, c.PDHintTTL)

	key := strings.Repeat("s", 40)
	path := filepath.Join(t.TempDir(), "key")
	require.NoError(t, os.WriteFile(path, []byte(key+"\n"), 0o600))
	for _, v := range []string{"file:" + path, path, key} {
		c, err := load(t, map[string]string{"DYN_EPP_PD_HINT_KEY": v})
		require.NoError(t, err, v)
		require.Equal(t, key, string(c.PDHintKey), v)
	}
	c, err = load(t, nil, "--pd-hint-key", key, "--pd-hint-ttl-ms", "1000")
	require.NoError(t, err)
	require.Equal(t, key, string(c.PDHintKey))
	require.Equal(t, time.Second, c.PDHintTTL)

	_, err = load(t, map[string]string{"DYN_EPP_PD_HINT_KEY": "short-secret", "DYN_EPP_PD_HINT_TTL_MS": "999"})
	require.ErrorIs(t, err, errConfig)
	require.ErrorContains(t, err, "DYN_EPP_PD_HINT_KEY")
	require.ErrorContains(t, err, "a key of 12 bytes; want at least 32")
	require.NotContains(t, err.Error(), "short-secret", "the key is never quoted")
	require.ErrorContains(t, err, "DYN_EPP_PD_HINT_TTL_MS")
	_, err = load(t, map[string]string{"DYN_EPP_PD_HINT_KEY": "file:" + filepath.Join(t.TempDir(), "missing")})
	require.ErrorContains(t, err, "DYN_EPP_PD_HINT_KEY")
}

// pairBooker books every request as a pair whose prefill worker is hint.
type pairBooker struct {
	progressless
	hint     string
	local    bool
	mu       sync.Mutex
	complete map[string]int
}

func (b *pairBooker) Book(context.Context, selection.Request) (roles.Plan, error) {
	p := roles.Plan{ID: "p1", Decode: selection.Result{ReservationID: "p1/decode", Endpoint: "10.0.0.1:8000"}, LocalPrefill: b.local}
	if !b.local {
		p.Prefill = selection.Result{ReservationID: "p1/prefill", Endpoint: b.hint}
	}
	return p, nil
}
func (b *pairBooker) Handoff(string) error { return nil }
func (b *pairBooker) Complete(id string) error {
	b.mu.Lock()
	b.complete[id]++
	b.mu.Unlock()
	return nil
}

// The router signs the hint exactly as the ext_proc server sends it
// (canonical), over the body it was given, until now + TTL; a plan without a
// hint is not signed, and a hint it cannot sign fails the pick with the plan
// released.
func TestRouterSignsPrefillHints(t *testing.T) {
	key := bytes.Repeat([]byte("k"), pdhint.MinKeyLen)
	now := time.Unix(1_700_000_000, 0)
	signer := &hintSigner{key: key, ttl: 30 * time.Second, now: func() time.Time { return now }}
	body := []byte(`{"model":"m","prompt":"hello"}`)
	pick := func(b *pairBooker, s *hintSigner) (extproc.Pick, error) {
		b.complete = map[string]int{}
		r := newRouter("m", fakeTok{}, b, &fakeSvc{})
		r.signer = s
		return r.Pick(context.Background(), extproc.PickRequest{Path: "/v1/completions", Body: body})
	}

	p, err := pick(&pairBooker{hint: "[FD00::0002]:8001"}, signer)
	require.NoError(t, err)
	require.Equal(t, "[fd00::2]:8001", p.Prefiller, "the canonical value, as it goes on the wire")
	sig, err := pdhint.Parse(p.PrefillerSignature)
	require.NoError(t, err)
	require.Equal(t, now.Add(30*time.Second), sig.Expiry)
	v, err := pdhint.NewVerifier(pdhint.VerifierOptions{Key: key, Now: func() time.Time { return now }})
	require.NoError(t, err)
	require.NoError(t, v.Verify(p.PrefillerSignature, "[fd00::2]:8001", body))
	p2, err := pick(&pairBooker{hint: "10.0.0.2:8001"}, signer)
	require.NoError(t, err)
	require.NotEqual(t, p.PrefillerSignature[:30], p2.PrefillerSignature[:30], "a fresh nonce each time")

	p, err = pick(&pairBooker{hint: "10.0.0.2:8001"}, nil)
	require.NoError(t, err)
	require.Equal(t, "10.0.0.2:8001", p.Prefiller)
	require.Empty(t, p.PrefillerSignature, "no key, no signature")

	p, err = pick(&pairBooker{local: true}, signer)
	require.NoError(t, err)
	require.Empty(t, p.Prefiller)
	require.Empty(t, p.PrefillerSignature, "no hint, nothing to sign")

	b := &pairBooker{hint: "prefill.example:8000"}
	_, err = pick(b, signer)
	require.ErrorIs(t, err, extproc.ErrInvalidEndpoint)
	require.Equal(t, map[string]int{"p1": 1}, b.complete, "the plan is released")
}
