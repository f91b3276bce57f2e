package sidecar_test

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"

	"github.com/kvselect/kvselect/examples/pdsidecar/sidecar"
	"github.com/kvselect/kvselect/internal/fakeengine"
)

// A sidecar in front of a decode engine runs vLLM's NIXL hand-over with the
// prefill engine the EPP named in x-prefiller-host-port: the decode engine
// takes the prompt's KV over instead of computing it.
func ExampleSidecar() {
	newEngine := func(role fakeengine.PDRole) (*fakeengine.Engine, *httptest.Server) {
		e, err := fakeengine.New(fakeengine.Options{PDRole: role, BlockSize: 4})
		if err != nil {
			panic(err)
		}
		return e, httptest.NewServer(e.Handler())
	}
	prefill, prefillSrv := newEngine(fakeengine.PDRolePrefill)
	defer prefillSrv.Close()
	decode, decodeSrv := newEngine(fakeengine.PDRoleDecode)
	defer decodeSrv.Close()

	sc, err := sidecar.New(sidecar.Options{Protocol: sidecar.ProtocolVLLMNIXL, DecodeURL: decodeSrv.URL})
	if err != nil {
		panic(err)
	}
	defer sc.Close()
	front := httptest.NewServer(sc)
	defer front.Close()

	req, _ := http.NewRequest(http.MethodPost, front.URL+"/v1/completions",
		strings.NewReader(`{"model":"fake-model","prompt":"The quick brown fox jumps over the lazy dog","max_tokens":3}`))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set(sidecar.HeaderPrefiller, prefillSrv.Listener.Addr().String())
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		panic(err)
	}
	resp.Body.Close()
	http.DefaultClient.CloseIdleConnections()

	p, d := prefill.HTTPStats(), decode.HTTPStats()
	fmt.Println(resp.Status)
	fmt.Println("prefill legs", p.PrefillLegs, "pulls", p.Pulls)
	fmt.Println("decode legs", d.DecodeLegs, "transferred", d.TransferredTokens, "computed", d.ComputedTokens)
	// Output:
	// 200 OK
	// prefill legs 1 pulls 1
	// decode legs 1 transferred 10 computed 0
}
