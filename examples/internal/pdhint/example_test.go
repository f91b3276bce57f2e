package pdhint_test

import (
	"bytes"
	"errors"
	"fmt"
	"time"

	"github.com/kvselect/kvselect/examples/internal/pdhint"
)

// The EPP signs the prefill endpoint it chose for a request, with the decode
// endpoint it routed the request to; that sidecar verifies it against the
// headers, path and body it receives, once. Another sidecar sharing the key
// refuses it.
func ExampleVerifier_Verify() {
	key := bytes.Repeat([]byte{0x5a}, pdhint.MinKeyLen) // shared by the EPP and the sidecars
	now := time.Unix(1_700_000_000, 0)
	claim := pdhint.Claim{
		Prefiller:    "10.0.0.7:8000",           // x-prefiller-host-port
		Destinations: []string{"10.0.0.2:8000"}, // x-gateway-destination-endpoint: the decode sidecar
		Path:         "/v1/chat/completions",
		Body:         []byte(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`),
	}

	// EPP: the signature goes next to the hint.
	sig, err := pdhint.Sign(key, claim, now, now.Add(30*time.Second), pdhint.NewNonce())
	if err != nil {
		panic(err)
	}

	// The sidecar at 10.0.0.2:8000, started a minute ago.
	v, err := pdhint.NewVerifier(pdhint.VerifierOptions{
		Key: key, Now: func() time.Time { return now }, NotBefore: now.Add(-time.Minute),
	})
	if err != nil {
		panic(err)
	}
	fmt.Println(v.Verify(sig, claim))
	fmt.Println(errors.Is(v.Verify(sig, claim), pdhint.ErrReplayed))

	retargeted := claim
	retargeted.Prefiller = "169.254.169.254:80"
	fmt.Println(errors.Is(v.Verify(sig, retargeted), pdhint.ErrForged))
	elsewhere := claim
	elsewhere.Destinations = []string{"10.0.0.3:8000"} // another sidecar with the same key
	fmt.Println(errors.Is(v.Verify(sig, elsewhere), pdhint.ErrForged))
	// Output:
	// <nil>
	// true
	// true
	// true
}
