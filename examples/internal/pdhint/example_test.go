package pdhint_test

import (
	"bytes"
	"errors"
	"fmt"
	"time"

	"github.com/kvselect/kvselect/examples/internal/pdhint"
)

// The EPP signs the prefill endpoint it chose for a request; the sidecar
// verifies it against the header and body it receives, once.
func ExampleVerifier_Verify() {
	key := bytes.Repeat([]byte{0x5a}, pdhint.MinKeyLen) // shared by the EPP and the sidecars
	now := time.Unix(1_700_000_000, 0)
	body := []byte(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`)

	// EPP: x-prefiller-host-port: 10.0.0.7:8000, and the signature next to it.
	sig, err := pdhint.Sign(key, "10.0.0.7:8000", body, now.Add(30*time.Second), pdhint.NewNonce())
	if err != nil {
		panic(err)
	}

	// Sidecar.
	v, err := pdhint.NewVerifier(pdhint.VerifierOptions{Key: key, Now: func() time.Time { return now }})
	if err != nil {
		panic(err)
	}
	fmt.Println(v.Verify(sig, "10.0.0.7:8000", body))
	fmt.Println(errors.Is(v.Verify(sig, "10.0.0.7:8000", body), pdhint.ErrReplayed))
	fmt.Println(errors.Is(v.Verify(sig, "169.254.169.254:80", body), pdhint.ErrForged))
	// Output:
	// <nil>
	// true
	// true
}
