package eppserver

import (
	"context"
	"net"
	"net/http"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/examples/epp/discovery"
	"github.com/kvselect/kvselect/examples/internal/extproctest"
	"github.com/kvselect/kvselect/roles"
)

func TestLoRAConfig(t *testing.T) {
	c, err := load(t, nil)
	require.NoError(t, err)
	require.Equal(t, loraOff, c.LoRA)
	require.Equal(t, "lora.kvselect.io/", c.LoRALabelPrefix)
	l, err := newLoRA(c)
	require.NoError(t, err)
	require.Nil(t, l, "off: no policy")

	c, err = load(t, map[string]string{"DYN_EPP_LORA_AFFINITY": "require", "DYN_EPP_LORA_LABEL_PREFIX": "lora-"})
	require.NoError(t, err)
	require.Equal(t, loraRequire, c.LoRA)
	require.Equal(t, "lora-", c.LoRALabelPrefix)
	_, err = load(t, nil, "--lora-affinity=prefer")
	require.NoError(t, err)

	_, err = load(t, map[string]string{"DYN_EPP_LORA_AFFINITY": "always", "DYN_EPP_LORA_LABEL_PREFIX": "bad prefix/"})
	require.ErrorIs(t, err, ErrConfig)
	require.ErrorContains(t, err, "DYN_EPP_LORA_AFFINITY")
	require.ErrorContains(t, err, "DYN_EPP_LORA_LABEL_PREFIX")
}

func TestBodyModel(t *testing.T) {
	for body, want := range map[string]string{
		`{"model":"sql-lora","messages":[]}`:                          "sql-lora",
		`{"messages":[{"role":"user","content":"hi"}],"model":" m "}`: "m",
		`{"stream":true,"n":{"deep":[1,{"model":"inner"}]}}`:          "",
		`{"model":7}`:     "",
		`[{"model":"x"}]`: "",
		`not json`:        "",
		``:                "",
	} {
		require.Equal(t, want, bodyModel([]byte(body)), body)
	}
}

// With DYN_EPP_LORA_AFFINITY=require, a request naming an adapter goes only
// to the workers labelled with it loaded, one naming an adapter nobody has
// is refused (503, filtered:lora), and one naming the EPP's model goes
// anywhere; prefer sends it to them too here (both workers idle).
func TestLoRAAffinityRoutes(t *testing.T) {
	for _, mode := range []string{loraRequire, loraPrefer} {
		t.Run(mode, func(t *testing.T) {
			cfg, err := load(t, map[string]string{"DYN_EPP_LORA_AFFINITY": mode, "DYN_MODEL_NAME": "base",
				"DYN_EPP_TOKENIZER_SERVICE_URL": "http://127.0.0.1:1", "DYN_EPP_KV_EVENT_PORT": "0"})
			require.NoError(t, err)
			e, err := New(context.Background(), cfg, Options{})
			require.NoError(t, err)
			defer e.Close()
			e.Apply(discovery.Snapshot{Workers: []catalog.Worker{
				{ID: "a", Model: "base", Endpoint: "10.0.0.1:8000", DPSize: 1, Labels: map[string]string{"lora.kvselect.io/sql-lora": "true"}},
				{ID: "b", Model: "base", Endpoint: "10.0.0.2:8000", DPSize: 1},
			}, Synced: true})
			envoy := serveExtProc(t, e)
			do := func(model string) extproctest.Decision {
				d, err := envoy.Do(context.Background(), extproctest.HTTPRequest{Path: "/v1/chat/completions",
					Body: []byte(`{"model":"` + model + `","messages":[{"role":"user","content":"hello"}]}`)})
				require.NoError(t, err)
				return d
			}
			for range 8 {
				d := do("sql-lora")
				require.Equal(t, http.StatusOK, d.Status, "%s", d.ImmediateBody)
				require.Equal(t, "10.0.0.1:8000", d.Destination)
			}
			d := do("chat-lora")
			if mode == loraRequire {
				require.Equal(t, http.StatusServiceUnavailable, d.Status)
				require.Contains(t, string(d.ImmediateBody), "(filtered:lora)")
				require.EqualValues(t, 8+2, e.Service(roles.Aggregated).Stats().Filtered["lora"]) // b for each sql-lora request, both for chat-lora
			} else {
				require.Equal(t, http.StatusOK, d.Status)
			}
			require.Equal(t, http.StatusOK, do("base").Status)
		})
	}
}

// serveExtProc serves e's ext_proc server on loopback until the test ends
// and returns an Envoy for it.
func serveExtProc(t *testing.T, e *EPP) *extproctest.Client {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	gs := grpc.NewServer(e.ExtProc().GRPCServerOptions()...)
	e.ExtProc().Register(gs)
	served := make(chan struct{})
	go func() { defer close(served); _ = gs.Serve(lis) }()
	t.Cleanup(func() { gs.Stop(); <-served })
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	envoy, err := extproctest.NewClient(conn, extproctest.Options{})
	require.NoError(t, err)
	return envoy
}
