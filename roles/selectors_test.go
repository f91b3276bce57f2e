package roles

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/selection"
)

func TestNewValidates(t *testing.T) {
	_, err := New(context.Background(), RoleOptions{
		Mode: TopologyMode(5), LabelKey: "bad key", Base: selection.DefaultConfig(0),
		Profile: ProfileOptions{DecodeMaxNumBatchedTokens: -1},
	})
	require.ErrorIs(t, err, ErrInvalidOptions)
	require.ErrorIs(t, err, ErrInvalidTopologyMode)
	require.ErrorIs(t, err, ErrInvalidLabelKey)
	require.ErrorIs(t, err, selection.ErrInvalidConfig)
	require.ErrorContains(t, err, "DecodeMaxNumBatchedTokens")

	// A failing build leaves nothing running (goleak checks at exit).
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	opts := testOptions(ModeDisaggregated, newFakeClock())
	_, err = New(ctx, opts)
	require.ErrorIs(t, err, context.Canceled)
}

func TestServicesPerMode(t *testing.T) {
	clk := newFakeClock()
	agg := newRoles(t, testOptions(ModeAggregated, clk))
	require.NotNil(t, agg.Service(Aggregated))
	require.Nil(t, agg.Service(Prefill))
	require.Nil(t, agg.Service(Decode))
	require.Nil(t, agg.Service(Role(9)))
	require.Equal(t, DefaultRoleLabel, agg.labelKey)

	opts := testOptions(ModeDisaggregated, clk)
	opts.LabelKey = "example.com/role"
	dis := newRoles(t, opts)
	require.Nil(t, dis.Service(Aggregated))
	require.NotNil(t, dis.Service(Prefill))
	require.NotNil(t, dis.Service(Decode))
	require.Equal(t, "example.com/role", dis.labelKey)
	require.False(t, dis.profiles[Decode].Config.UseKVEvents)
	require.True(t, dis.profiles[Prefill].Config.UseKVEvents)
}

// labelCase is a label value and the role it must give, or the exclusion
// reason.
type labelCase struct {
	value  string
	role   Role // meaningful when reason is ""
	reason string
}

var labelCases = []labelCase{
	{"prefill", Prefill, ""}, {"decode", Decode, ""}, {" Prefill ", Prefill, ""}, {"DECODE\t", Decode, ""},
	{"pReFiLl", Prefill, ""}, {"\nDecode", Decode, ""},
	{noLabel, 0, ReasonRoleLabelMissing}, {"", 0, ReasonRoleLabelMissing}, {"  ", 0, ReasonRoleLabelMissing},
	{"aggregated", 0, ReasonRoleLabelInvalid}, {"both", 0, ReasonRoleLabelInvalid},
	{"prefill,decode", 0, ReasonRoleLabelInvalid}, {"decoder", 0, ReasonRoleLabelInvalid},
	{"\u212Adecode", 0, ReasonRoleLabelInvalid}, {"décode", 0, ReasonRoleLabelInvalid},
	{"prefill\x00", 0, ReasonRoleLabelInvalid}, {"\xff", 0, ReasonRoleLabelInvalid},
}

// routingPool is a pool with the expected role of every worker.
type routingPool struct {
	name    string
	workers []catalog.Worker
	prefill map[string]bool
	decode  map[string]bool
	reasons map[string]string
}

func makePool(name string, values []labelCase) routingPool {
	p := routingPool{name: name, prefill: map[string]bool{}, decode: map[string]bool{}, reasons: map[string]string{}}
	for i, c := range values {
		id := fmt.Sprintf("w%02d", i)
		w := wk(id, c.value)
		w.Endpoint = fmt.Sprintf("10.0.%d.%d:8000", i/200, i%200+1)
		p.workers = append(p.workers, w)
		switch {
		case c.reason != "":
			p.reasons[id] = c.reason
		case c.role == Prefill:
			p.prefill[id] = true
		default:
			p.decode[id] = true
		}
	}
	return p
}

func routingPools() []routingPool {
	pd := labelCases[0]
	dd := labelCases[1]
	pools := []routingPool{
		makePool("one each", []labelCase{pd, dd}),
		makePool("balanced", []labelCase{pd, pd, pd, dd, dd, dd}),
		makePool("decode heavy", []labelCase{pd, dd, dd, dd, dd, dd, dd, dd}),
		makePool("decode only", []labelCase{dd, dd, dd}),
		makePool("prefill only", []labelCase{pd, pd, pd}),
		makePool("empty", nil),
		makePool("all excluded", labelCases[6:]),
		makePool("every label state", labelCases),
		makePool("case and spaces", labelCases[2:6]),
		makePool("one decode among invalid", append(slices.Clone(labelCases[6:]), dd)),
	}
	r := rand.New(rand.NewPCG(7, 7))
	for i := range 30 {
		n := 1 + r.IntN(12)
		vals := make([]labelCase, n)
		for j := range vals {
			vals[j] = labelCases[r.IntN(len(labelCases))]
		}
		pools = append(pools, makePool(fmt.Sprintf("random %d", i), vals))
	}
	return pools
}

// TestRoutingInvariant: over many pools and label states, and both prefill
// fallbacks, the destination is always a decode worker, the prefill hint is
// always a prefill worker, an empty decode role is ErrRoleCatalogEmpty, and
// nothing stays booked.
func TestRoutingInvariant(t *testing.T) {
	ctx := context.Background()
	var pairs, local, failures int
	defer func() {
		// The table must exercise every outcome.
		require.Positive(t, pairs)
		require.Positive(t, local)
		require.Positive(t, failures)
		t.Logf("pair plans %d, local-prefill plans %d, refusals %d", pairs, local, failures)
	}()
	for _, p := range routingPools() {
		for _, fb := range []PrefillFallback{PrefillFail, PrefillDecodeOnly} {
			t.Run(p.name+"/"+fb.String(), func(t *testing.T) {
				clk := newFakeClock()
				rs := newRoles(t, testOptions(ModeDisaggregated, clk))
				res, err := rs.Reconcile(p.workers)
				require.NoError(t, err)
				got := map[string]string{}
				for _, e := range res.Excluded {
					got[e.ID] = e.Reason
				}
				require.Equal(t, p.reasons, got)
				require.Equal(t, sortedKeys(p.prefill), ids(rs, Prefill))
				require.Equal(t, sortedKeys(p.decode), ids(rs, Decode))

				b := newBooker(t, rs, BookerOptions{PrefillFallback: fb, Now: clk.Now})
				require.Equal(t, len(p.decode) > 0 && (len(p.prefill) > 0 || fb == PrefillDecodeOnly), b.Ready())
				r := rand.New(rand.NewPCG(1, uint64(len(p.workers))))
				var plans []Plan
				for i := range 12 {
					req := selection.Request{Tokens: toks(8+r.IntN(40), i)}
					if i%3 == 2 && len(p.workers) > 0 {
						// A subset hint naming some of the pool, any role.
						for _, w := range p.workers {
							if r.IntN(2) == 0 {
								req.Allowed = append(req.Allowed, w.ID)
							}
						}
					}
					plan, err := b.Book(ctx, req)
					allowed := func(id string) bool { return req.Allowed == nil || slices.Contains(req.Allowed, id) }
					decodeOK, prefillOK := anyOf(p.decode, allowed), anyOf(p.prefill, allowed)
					if err != nil {
						failures++
					}
					switch {
					case len(p.decode) == 0:
						require.ErrorIs(t, err, ErrRoleCatalogEmpty)
						require.ErrorContains(t, err, "decode")
						require.Equal(t, http.StatusServiceUnavailable, HTTPStatus(err))
					case !decodeOK:
						require.ErrorIs(t, err, selection.ErrNoEndpoints)
						require.Equal(t, http.StatusServiceUnavailable, HTTPStatus(err))
					case !prefillOK && fb == PrefillFail:
						require.Error(t, err)
						require.Equal(t, http.StatusServiceUnavailable, HTTPStatus(err))
						if len(p.prefill) == 0 {
							require.ErrorIs(t, err, ErrRoleCatalogEmpty)
							require.ErrorContains(t, err, "prefill")
						}
					default:
						require.NoError(t, err)
						require.True(t, p.decode[plan.Decode.WorkerID], "destination %q is not a decode worker", plan.Decode.WorkerID)
						require.True(t, allowed(plan.Decode.WorkerID))
						require.Equal(t, plan.Decode.Endpoint, plan.Destination())
						if prefillOK {
							require.False(t, plan.LocalPrefill)
							require.True(t, p.prefill[plan.Prefill.WorkerID], "prefill hint %q is not a prefill worker", plan.Prefill.WorkerID)
							require.True(t, allowed(plan.Prefill.WorkerID))
							hint, ok := plan.PrefillHint()
							require.True(t, ok)
							require.Equal(t, plan.Prefill.Endpoint, hint)
							require.Equal(t, plan.ID+suffixPrefill, plan.Prefill.ReservationID)
							require.Equal(t, plan.ID+suffixDecode, plan.Decode.ReservationID)
							pairs++
						} else {
							local++
							require.True(t, plan.LocalPrefill)
							_, ok := plan.PrefillHint()
							require.False(t, ok)
							require.Equal(t, plan.ID+suffixAggregated, plan.Decode.ReservationID)
						}
						plans = append(plans, plan)
					}
				}
				require.Equal(t, len(plans), b.plans.Len())
				for i, plan := range plans {
					if i%2 == 0 {
						require.NoError(t, plan.PrefillComplete())
					}
					require.NoError(t, plan.Done())
				}
				require.Zero(t, b.plans.Len())
				requireIdle(t, rs)
			})
		}
	}
}

func anyOf(set map[string]bool, allowed func(string) bool) bool {
	for id := range set {
		if allowed(id) {
			return true
		}
	}
	return false
}

func sortedKeys(m map[string]bool) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

// requireRoles checks the exact membership of both role catalogs, and that
// no worker is in both.
func requireRoles(t *testing.T, rs *RoleSelectors, prefill, decode []string) {
	t.Helper()
	require.Equal(t, prefill, ids(rs, Prefill), "prefill catalog")
	require.Equal(t, decode, ids(rs, Decode), "decode catalog")
	for _, id := range prefill {
		require.NotContains(t, decode, id)
	}
}

func TestLabelFlipsRemovalAndInvalidValues(t *testing.T) {
	clk := newFakeClock()
	rs := newRoles(t, testOptions(ModeDisaggregated, clk))
	b := newBooker(t, rs, BookerOptions{Now: clk.Now})
	ctx := context.Background()

	a, bw, c := wk("a", "prefill"), wk("b", "decode"), wk("c", "decode")
	res, err := rs.Reconcile([]catalog.Worker{a, bw, c})
	require.NoError(t, err)
	require.Len(t, res.Plans[Prefill].Upserts, 1)
	require.Len(t, res.Plans[Decode].Upserts, 2)
	requireRoles(t, rs, []string{"a"}, []string{"b", "c"})

	// A plan whose prefill leg sits on a.
	plan, err := b.Book(ctx, selection.Request{Tokens: toks(40, 1), Allowed: []string{"a", "b"}})
	require.NoError(t, err)
	require.Equal(t, "a", plan.Prefill.WorkerID)
	require.Equal(t, "b", plan.Decode.WorkerID)
	require.Equal(t, int64(40), load(t, rs, Prefill, "a").ActivePrefillTokens)

	// Flip a to decode and c to prefill: each moves on this reconcile.
	a.Labels[DefaultRoleLabel] = "decode"
	c = wk("c", " PREFILL")
	res, err = rs.Reconcile([]catalog.Worker{a, bw, c})
	require.NoError(t, err)
	require.Equal(t, []string{"a"}, res.Plans[Prefill].Deletes)
	require.Equal(t, []string{"c"}, res.Plans[Decode].Deletes)
	requireRoles(t, rs, []string{"c"}, []string{"a", "b"})
	require.Nil(t, rs.Service(Decode).Workers().List()[0].Worker.KVEventEndpoints, "a decode worker has no event endpoints")
	rec := rs.Service(Decode).Workers().List()[0]
	require.Equal(t, catalog.Schedulable, rec.Lifecycle, rec.Reasons)
	// Leaving the prefill catalog dropped a's prefill booking; the plan
	// settles without error and nothing is left.
	require.Zero(t, load(t, rs, Decode, "a").ActiveRequests)
	require.NoError(t, plan.PrefillComplete())
	require.NoError(t, plan.Done())
	requireIdle(t, rs)

	// Another label changes: the worker is updated in place.
	bw.Labels["app"] = "sglang"
	res, err = rs.Reconcile([]catalog.Worker{a, bw, c})
	require.NoError(t, err)
	require.Empty(t, res.Plans[Prefill].Deletes)
	require.Empty(t, res.Plans[Decode].Deletes)
	require.Len(t, res.Plans[Decode].Upserts, 1)
	requireRoles(t, rs, []string{"c"}, []string{"a", "b"})

	// An invalid value or a missing label takes the worker out of every
	// catalog; there is no fallback role.
	a.Labels[DefaultRoleLabel] = "both"
	delete(c.Labels, DefaultRoleLabel)
	res, err = rs.Reconcile([]catalog.Worker{a, bw, c})
	require.NoError(t, err)
	require.Equal(t, []Excluded{
		{ID: "a", Reason: ReasonRoleLabelInvalid, Value: "both"},
		{ID: "c", Reason: ReasonRoleLabelMissing},
	}, res.Excluded)
	requireRoles(t, rs, nil, []string{"b"})
	census := rs.Census()
	require.Equal(t, res.Excluded, census.Excluded)
	require.Equal(t, []Role{Prefill}, census.empty())

	// Removal.
	res, err = rs.Reconcile([]catalog.Worker{a})
	require.NoError(t, err)
	require.Equal(t, []string{"b"}, res.Plans[Decode].Deletes)
	requireRoles(t, rs, nil, nil)

	// Duplicates are refused before anything changes, across roles too.
	_, err = rs.Reconcile([]catalog.Worker{wk("x", "prefill"), wk("y", "decode"), wk("x", "decode")})
	require.ErrorIs(t, err, ErrDuplicateID)
	require.ErrorIs(t, err, catalog.ErrDuplicateID)
	require.Equal(t, http.StatusConflict, HTTPStatus(err))
	requireRoles(t, rs, nil, nil)

	// A worker the catalog rejects is reported in its role's plan.
	bad := wk("z", "decode")
	bad.DPSize = -1
	res, err = rs.Reconcile([]catalog.Worker{bad, wk("y", "decode")})
	require.NoError(t, err)
	require.Len(t, res.Plans[Decode].Invalid, 1)
	requireRoles(t, rs, nil, []string{"y"})

	// A worker the service refuses is reported in the error; the rest applies.
	odd := wk("o", "prefill")
	odd.BlockSize = 6 // not a multiple of the router's 4
	_, err = rs.Reconcile([]catalog.Worker{odd, wk("y", "decode"), wk("p", "prefill")})
	require.ErrorIs(t, err, selection.ErrBadRequest)
	require.ErrorContains(t, err, `"o"`)
	requireRoles(t, rs, []string{"p"}, []string{"y"})
}

func TestEmptyRolesFromStart(t *testing.T) {
	clk := newFakeClock()
	var logs bytes.Buffer
	opts := testOptions(ModeDisaggregated, clk)
	opts.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	rs := newRoles(t, opts)
	b := newBooker(t, rs, BookerOptions{Now: clk.Now, PrefillFallback: PrefillDecodeOnly})

	// Nothing reconciled yet: both roles are reported, not silent.
	c := rs.Census()
	require.Equal(t, ModeDisaggregated, c.Mode)
	require.Equal(t, []RoleCensus{{Role: Prefill}, {Role: Decode}}, c.Roles)
	require.Equal(t, []Role{Prefill, Decode}, c.empty())
	st := rs.ready()
	require.False(t, st.Ready)
	require.Equal(t, []Role{Prefill, Decode}, st.Empty)
	require.False(t, b.Ready())
	_, err := b.Book(context.Background(), selection.Request{Tokens: toks(16, 1)})
	require.ErrorIs(t, err, ErrRoleCatalogEmpty)
	require.Equal(t, http.StatusServiceUnavailable, HTTPStatus(err))

	// Decode workers only: the prefill role stays empty and is logged once.
	_, err = rs.Reconcile(pool("d", 2, "decode"))
	require.NoError(t, err)
	_, err = rs.Reconcile(pool("d", 2, "decode"))
	require.NoError(t, err)
	require.Equal(t, 1, bytes.Count(logs.Bytes(), []byte("role has no ready workers")), logs.String())
	require.Contains(t, logs.String(), "role=prefill")
	c = rs.Census()
	require.Equal(t, []RoleCensus{{Role: Prefill}, {Role: Decode, Workers: 2, Schedulable: 2}}, c.Roles)
	require.Equal(t, []Role{Prefill}, c.empty())
	require.Equal(t, []Role{Prefill}, rs.ready().Empty)
	require.True(t, b.Ready(), "the decode-only fallback can route")
	plan, err := b.Book(context.Background(), selection.Request{Tokens: toks(16, 1)})
	require.NoError(t, err)
	require.True(t, plan.LocalPrefill)
	require.NoError(t, plan.Done())

	// The prefill role fills: logged as recovered; every role ready.
	_, err = rs.Reconcile(append(pool("d", 2, "decode"), wk("p", "prefill")))
	require.NoError(t, err)
	require.Contains(t, logs.String(), "role has ready workers again")
	require.True(t, rs.ready().Ready)
	requireIdle(t, rs)

	require.NoError(t, rs.Close())
	require.NoError(t, rs.Close())
	require.False(t, rs.ready().Ready)
	require.False(t, b.Ready())
	_, err = rs.Reconcile(nil)
	require.ErrorIs(t, err, ErrClosed)
}

// TestAggregatedParity: in aggregated mode labels are ignored, every worker is
// in the one catalog, and a booking picks exactly what a plain service with the
// same configuration and seed picks.
func TestAggregatedParity(t *testing.T) {
	clk := newFakeClock()
	p := makePool("every label state", labelCases)
	rs := newRoles(t, testOptions(ModeAggregated, clk))
	res, err := rs.Reconcile(p.workers)
	require.NoError(t, err)
	require.Empty(t, res.Excluded)
	require.Len(t, ids(rs, Aggregated), len(p.workers))
	require.Equal(t, []RoleCensus{{Role: Aggregated, Workers: len(p.workers), Schedulable: len(p.workers)}}, rs.Census().Roles)
	require.True(t, rs.ready().Ready)

	plain, err := selection.NewSelectionServiceBuilder(selection.DefaultConfig(4)).
		Clock(clk.Now).Rand(rand.NewPCG(1, uint64(Aggregated)+2)).SweepInterval(-1).ExternalEvents().Build(context.Background())
	require.NoError(t, err)
	defer plain.Close()
	for _, w := range p.workers {
		_, err := plain.Workers().Upsert(w)
		require.NoError(t, err)
	}

	b := newBooker(t, rs, BookerOptions{Now: clk.Now})
	require.True(t, b.Ready())
	ctx := context.Background()
	r := rand.New(rand.NewPCG(9, 9))
	var plans []Plan
	for i := range 60 {
		req := selection.Request{Tokens: toks(4+r.IntN(60), r.IntN(5))}
		plan, err := b.Book(ctx, req)
		require.NoError(t, err)
		want, err := plain.SelectAndReserve(ctx, req)
		require.NoError(t, err)
		require.Equal(t, want.WorkerID, plan.Decode.WorkerID, "request %d", i)
		require.Equal(t, want.Cost, plan.Decode.Cost)
		require.True(t, plan.LocalPrefill)
		require.Equal(t, plan.ID+suffixAggregated, plan.Decode.ReservationID)
		plans = append(plans, plan)
	}
	require.Equal(t, plain.Loads(""), rs.Service(Aggregated).Loads(""))
	for _, plan := range plans {
		require.NoError(t, plan.PrefillComplete())
		require.NoError(t, plan.Done())
	}
	requireIdle(t, rs)
}
