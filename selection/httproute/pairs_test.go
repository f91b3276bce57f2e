package httproute_test

import (
	"context"
	"io"
	"net/http"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/gaie"
	"github.com/kvselect/kvselect/roles"
	"github.com/kvselect/kvselect/selection"
	"github.com/kvselect/kvselect/selection/httproute"
)

// A prefill/decode request through the Router: the pair booker books a
// prefill worker and a decode worker; the request goes to the decode worker
// with the prefill worker as x-prefiller-host-port (a client's own value
// removed); the first body byte frees the prefill leg, the end the decode
// leg. A 503 from the decode worker marks it failed, once.
func TestRouterPairs(t *testing.T) {
	type seen struct{ prefiller []string }
	got := make(chan seen, 4)
	var status atomic.Int32
	var prefillFailed atomic.Bool
	decode := upstream(t, func(w http.ResponseWriter, r *http.Request) {
		got <- seen{prefiller: r.Header.Values("x-prefiller-host-port")}
		if prefillFailed.Load() { // as the decode sidecar answers a failed prefill leg
			w.Header().Set(gaie.HeaderFailedLeg, gaie.FailedLegPrefill)
		}
		if st := int(status.Load()); st != 0 {
			w.WriteHeader(st)
			return
		}
		sseHeaders(w)
		sse(w, `{"choices":[{"delta":{"content":"hi"}}]}`)
		sse(w, "[DONE]")
	})
	const prefill = "10.0.0.9:8000" // never dialled: the decode worker's sidecar would

	rs, err := roles.New(context.Background(), roles.RoleOptions{
		Mode: roles.ModeDisaggregated, Base: selection.DefaultConfig(4),
		Configure: func(_ roles.Role, b *selection.SelectionServiceBuilder) { b.ExternalEvents() },
	})
	require.NoError(t, err)
	defer rs.Close()
	label := func(role string) map[string]string { return map[string]string{roles.DefaultRoleLabel: role} }
	_, err = rs.Reconcile([]catalog.Worker{
		{ID: "p", Endpoint: prefill, DPSize: 1, BlockSize: 4, Labels: label("prefill")},
		{ID: "d", Endpoint: decode, DPSize: 1, BlockSize: 4, Labels: label("decode")},
	})
	require.NoError(t, err)
	pb, err := roles.NewPairBooker(rs, roles.BookerOptions{})
	require.NoError(t, err)
	defer pb.Close()
	env := newEnv(t, envOptions{router: httproute.Options{Service: httproute.Pairs(pb)}})

	active := func(r roles.Role) (n int) {
		for _, l := range rs.Service(r).Loads("") {
			n += l.ActiveRequests
		}
		return n
	}
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	resp, err := env.post(ctx, t, chatBody("", "a prompt of some blocks"), "x-prefiller-host-port", "10.6.6.6:8000")
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Equal(t, []string{prefill}, (<-got).prefiller, "the plan's prefill worker, not the client's")
	_, err = io.ReadAll(resp.Body)
	require.NoError(t, err)
	require.NoError(t, resp.Body.Close())
	env.waitServed(t, 1)
	require.Zero(t, active(roles.Prefill))
	require.Zero(t, active(roles.Decode))
	st := pb.Stats()
	require.EqualValues(t, 1, st.Plans.HandedOff)
	require.EqualValues(t, 1, st.Plans.Completed)
	require.Zero(t, st.Plans.Active)

	status.Store(http.StatusServiceUnavailable)
	resp, err = env.post(ctx, t, chatBody("", "another prompt"))
	require.NoError(t, err)
	require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
	<-got
	_, _ = io.Copy(io.Discard, resp.Body)
	require.NoError(t, resp.Body.Close())
	env.waitServed(t, 1)
	require.EqualValues(t, 1, rs.Service(roles.Decode).Stats().Failures, "the decode worker marked failed")
	require.EqualValues(t, 1, env.router.Stats().MarkedFailed)
	require.EqualValues(t, 1, pb.Stats().Plans.HandedOff, "an error answer hands nothing off")
	require.EqualValues(t, 2, pb.Stats().Plans.Completed)
	require.Zero(t, active(roles.Prefill)+active(roles.Decode))

	// The sidecar's prefill leg failed: the prefill worker is marked, not
	// the decode worker, and the client never sees the report.
	prefillFailed.Store(true)
	status.Store(http.StatusBadGateway)
	resp, err = env.post(ctx, t, chatBody("", "a third prompt"))
	require.NoError(t, err)
	require.Equal(t, http.StatusBadGateway, resp.StatusCode)
	require.Empty(t, resp.Header.Values(gaie.HeaderFailedLeg))
	<-got
	_, _ = io.Copy(io.Discard, resp.Body)
	require.NoError(t, resp.Body.Close())
	env.waitServed(t, 1)
	require.EqualValues(t, 1, rs.Service(roles.Prefill).Stats().Failures, "the prefill worker marked failed")
	require.EqualValues(t, 1, rs.Service(roles.Decode).Stats().Failures, "the decode worker not again")
	require.EqualValues(t, 3, pb.Stats().Plans.Completed)
	require.Zero(t, active(roles.Prefill)+active(roles.Decode))
}
