package eppserver

import (
	"bytes"
	"context"
	"fmt"
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
	require.ErrorIs(t, err, ErrConfig)
	require.ErrorContains(t, err, "DYN_EPP_PD_HINT_KEY")
	require.ErrorContains(t, err, "a key of 12 bytes; want at least 32")
	require.NotContains(t, err.Error(), "short-secret", "the key is never quoted")
	require.ErrorContains(t, err, "DYN_EPP_PD_HINT_TTL_MS")
	_, err = load(t, map[string]string{"DYN_EPP_PD_HINT_KEY": "file:" + filepath.Join(t.TempDir(), "missing")})
	require.ErrorContains(t, err, "DYN_EPP_PD_HINT_KEY")
	require.ErrorIs(t, err, pdhint.ErrKeyFile)
}

// A key path naming an endless file (/dev/zero), a directory or a large file
// is a named configuration error at once, never a read without end.
func TestConfigPDHintKeyFileBounded(t *testing.T) {
	dir := t.TempDir()
	big := filepath.Join(dir, "big")
	require.NoError(t, os.WriteFile(big, bytes.Repeat([]byte("k"), pdhint.MaxKeyFileBytes+1), 0o600))
	for _, v := range []string{"/dev/zero", "file:/dev/zero", dir, big} {
		if _, err := os.Stat(strings.TrimPrefix(v, "file:")); err != nil {
			continue // no /dev/zero here
		}
		_, err := load(t, map[string]string{"DYN_EPP_PD_HINT_KEY": v})
		require.ErrorIs(t, err, ErrConfig, v)
		require.ErrorIs(t, err, pdhint.ErrKeyFile, v)
		require.ErrorContains(t, err, "DYN_EPP_PD_HINT_KEY", v)
	}
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
// (canonical), for the destination it routes to, over the path and body it was
// given, from now until now + TTL; a plan without a hint is not signed, and a
// hint it cannot sign fails the pick with the plan released.
func TestRouterSignsPrefillHints(t *testing.T) {
	key := bytes.Repeat([]byte("k"), pdhint.MinKeyLen)
	now := time.Unix(1_700_000_000, 0)
	signer := &hintSigner{key: key, ttl: 30 * time.Second, now: func() time.Time { return now }}
	body := []byte(`{"model":"m","prompt":"hello"}`)
	pick := func(b *pairBooker, s *hintSigner) (extproc.Pick, error) {
		b.complete = map[string]int{}
		r := newRouter("m", fakeTok{}, b, &fakeSvc{})
		r.handleOf = handlesOf(b)
		r.signer = s
		return r.Pick(context.Background(), extproc.PickRequest{Path: "/v1/completions?trace=1", Body: body})
	}
	claim := func(prefiller string) pdhint.Claim {
		return pdhint.Claim{Prefiller: prefiller, Destinations: []string{"10.0.0.1:8000"}, Path: "/v1/completions", Body: body}
	}

	p, err := pick(&pairBooker{hint: "[FD00::0002]:8001"}, signer)
	require.NoError(t, err)
	require.Equal(t, "[fd00::2]:8001", p.Prefiller, "the canonical value, as it goes on the wire")
	sig, err := pdhint.Parse(p.PrefillerSignature)
	require.NoError(t, err)
	require.Equal(t, now, sig.Issued)
	require.Equal(t, now.Add(30*time.Second), sig.Expiry)
	v, err := pdhint.NewVerifier(pdhint.VerifierOptions{Key: key, Now: func() time.Time { return now }})
	require.NoError(t, err)
	require.NoError(t, v.Verify(p.PrefillerSignature, claim("[fd00::2]:8001")))
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

// The signed destinations are the list the ext_proc server sends: the
// canonical destination, then each valid fallback once, at most
// extproc.MaxFallbacks; the signed path has no query.
func TestSignedDestinationsAndPath(t *testing.T) {
	fallbacks := []string{"10.0.0.2:8000", "10.0.0.1:8000", "decode.example:8000", "[FD00::3]:80", "10.0.0.2:8000"}
	for i := range extproc.MaxFallbacks + 2 {
		fallbacks = append(fallbacks, fmt.Sprintf("10.1.0.%d:8000", i+1))
	}
	list, err := destinationList("10.0.0.1:08000", fallbacks)
	require.NoError(t, err)
	require.Equal(t, []string{"10.0.0.1:8000", "10.0.0.2:8000", "[fd00::3]:80"}, list[:3])
	require.Len(t, list, 1+extproc.MaxFallbacks)
	_, err = destinationList("decode.example:8000", nil)
	require.ErrorIs(t, err, extproc.ErrInvalidEndpoint)

	for in, want := range map[string]string{
		"/v1/completions": "/v1/completions", "/v1/chat/completions?x=1&y=2": "/v1/chat/completions",
		"/v1/%63ompletions": "/v1/completions", "/v1/completions%": "/v1/completions%",
	} {
		require.Equal(t, want, requestPath(in), in)
	}
}
