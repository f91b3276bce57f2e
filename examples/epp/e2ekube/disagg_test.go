//go:build e2e

package e2ekube

import (
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/examples/epp/internal/eppproc"
	"github.com/kvselect/kvselect/examples/pdsidecar/sidecar"
)

// Pods of the role-split pool, by fleet index.
const (
	pf0 = iota // prefill
	pf1        // prefill
	dc0        // decode
	dc1        // decode
	unl        // no role label
	bad        // role label "both"
	nPods
)

var podNames = [nPods]string{"prefill-0", "prefill-1", "decode-0", "decode-1", "unlabelled", "both"}

// rolePool creates the pool of the disaggregated cases: two prefill pods, two
// decode pods (a decode sidecar in front of the engine), one without the role
// label and one with an invalid value, all Ready members of the pool.
func rolePool(t *testing.T, hh *harness) (*space, *fleet, string) {
	t.Helper()
	s := newSpace(t, hh)
	f := startPods(t, prefillPod, prefillPod, decodePod, decodePod, plainPod, plainPod)
	tok := startTokenizer(t)
	s.createPool("pool", map[string]string{"app": "llm"}, f.port)
	roles := [nPods]string{"prefill", "prefill", "decode", "decode", "", "both"}
	for i, name := range podNames {
		labels := map[string]string{"app": "llm"}
		if roles[i] != "" {
			labels[roleLabel] = roles[i]
		}
		s.runPod(name, f.ips[i], labels)
	}
	return s, f, tok
}

// ids returns the worker ids of pods, sorted.
func (s *space) ids(idx ...int) []string {
	out := make([]string, 0, len(idx))
	for _, i := range idx {
		out = append(out, s.workerID(podNames[i]))
	}
	slices.Sort(out)
	return out
}

func sorted(xs []string) []string { slices.Sort(xs); return xs }

// pair sends a request whose subset hint names the given pods and returns the
// decision's destination and prefill hint as fleet indexes (-1: none); status
// is the client's status.
func (p *eppProc) pair(f *fleet, idx ...int) (status, dest, prefill int) {
	p.t.Helper()
	subset := make([]string, 0, len(idx))
	for _, i := range idx {
		subset = append(subset, f.endpoint(i))
	}
	resp := p.send(request{prompt: fmt.Sprintf("pair probe %v", idx), subset: subset})
	dest, prefill = -1, -1
	if resp.StatusCode == http.StatusOK {
		dest, prefill = f.byEndpoint(resp.Served), f.byEndpoint(resp.Decision.Prefiller)
	}
	return resp.StatusCode, dest, prefill
}

// requireLegs checks what the pods' engines and sidecars counted from was to
// now against the legs the EPP's decisions asked for: prefills[i] prefill legs
// on pod i, decodes[i] requests with pod i as destination. A prefill leg runs
// on the pod the EPP named (on a decode pod, through its sidecar's
// pass-through) and its KV is pulled, once. A decode pod's sidecar takes each
// of its requests through a prefill leg and a decode leg, whose engine pulls
// the KV (transferred tokens) and computes none of the prompt itself; no
// fallback, no refusal, no other outcome. An engine runs nothing else.
func requireLegs(t *testing.T, f *fleet, was, now []podLegs, prefills, decodes map[int]int) {
	t.Helper()
	for i := range f.engines {
		name, e, e0 := podNames[i], now[i].engine, was[i].engine
		if f.kinds[i] != decodePod {
			require.Zero(t, decodes[i], "%s: no sidecar to run a decode leg", name)
		}
		require.EqualValues(t, prefills[i], e.PrefillLegs-e0.PrefillLegs, "%s: prefill legs, where the EPP named it", name)
		require.Equal(t, e.PrefillLegs-e0.PrefillLegs, e.Pulls-e0.Pulls, "%s: every prefill leg's KV pulled", name)
		require.Equal(t, e0.HoldsExpired, e.HoldsExpired, "%s: prefill legs nobody pulled", name)
		require.EqualValues(t, decodes[i], e.DecodeLegs-e0.DecodeLegs, "%s: decode legs", name)
		require.EqualValues(t, prefills[i]+decodes[i], e.Requests-e0.Requests, "%s: requests other than its legs", name)
		if decodes[i] > 0 {
			require.Greater(t, e.TransferredTokens, e0.TransferredTokens, "%s: the decode legs pulled their KV", name)
		}
		if prefills[i] == 0 {
			require.Equal(t, e0.ComputedTokens, e.ComputedTokens, "%s: prompt tokens computed by a decode engine", name)
		}
		if f.kinds[i] != decodePod {
			continue
		}
		sc, sc0 := now[i].sidecar, was[i].sidecar
		require.EqualValues(t, decodes[i], sc.Disaggregated-sc0.Disaggregated, "%s: hints the sidecar accepted", name)
		require.EqualValues(t, prefills[i], sc.Passthrough-sc0.Passthrough, "%s: requests the sidecar passed through", name)
		require.Equal(t, sc0.Fallbacks, sc.Fallbacks, "%s: local fallbacks", name)
		for k, n := range sc.Legs {
			want := sc0.Legs[k]
			switch {
			case k.Outcome != sidecar.OutcomeOK:
			case k.Leg == sidecar.LegPassthrough:
				want += uint64(prefills[i])
			default:
				want += uint64(decodes[i])
			}
			require.Equal(t, want, n, "%s: sidecar legs %s %s", name, k.Leg, k.Outcome)
		}
		for reason, n := range sc.BadHints {
			require.Equal(t, sc0.BadHints[reason], n, "%s: hints refused as %s", name, reason)
		}
		for reason, n := range sc.Refused {
			require.Equal(t, sc0.Refused[reason], n, "%s: requests refused as %s", name, reason)
		}
	}
}

// requireNoOrchestrationHeaders checks that no orchestration header reached
// the engine of any of pods.
func requireNoOrchestrationHeaders(t *testing.T, f *fleet, pods ...int) {
	t.Helper()
	for _, i := range pods {
		n, first := f.headers[i].seen()
		require.Zero(t, n, "%s: requests reached its engine with orchestration headers (the first: %s)", podNames[i], first)
	}
}

// excluded reports whether the EPP logged the worker of pod as excluded for
// reason (with value, when not empty).
func (p *eppProc) excluded(s *space, pod int, reason, value string) bool {
	return len(p.Logs().Find(func(r eppproc.Record) bool {
		return r.Msg() == "worker excluded" && r.Str("id") == s.workerID(podNames[pod]) &&
			r.Str("reason") == reason && (value == "" || r.Str("value") == value)
	})) > 0
}

// TestDisaggregated runs the role-split validation matrix against one pool of
// two prefill and two decode pods, each decode pod a sidecar in front of its
// engine (plus one unlabelled and one invalid): per-role catalogs, KV-event
// subscriptions to prefill pods only, 100 requests landing on decode pods with
// a prefill hint naming a prefill pod (forged routing headers included), each
// run by the sidecar as a prefill leg on that pod and a decode leg that pulls
// its KV, with no orchestration header reaching an engine; label flips in both
// directions, a removed and an invalid label, decode scaled to zero and back.
func TestDisaggregated(t *testing.T) {
	hh := need(t)
	s, f, tok := rolePool(t, hh)
	p := startEPP(t, hh, eppConfig{ns: s.ns, pool: "pool", fleet: f, tokenizer: tok, topology: "disaggregated"})
	require.EqualValues(t, nPods, p.waitServing().Num("workers"))

	// Startup census: the role counts as discovery sees them.
	census := p.waitLog(reconcileTimeout, "startup census", eppproc.MsgIs("discovery census"))
	require.Equal(t, roleLabel, census.Str("role_label"))
	for role, n := range map[string]float64{"prefill": 2, "decode": 2, "(none)": 1, "both": 1} {
		require.Equal(t, n, census.Num("roles", role), "census of %s: %s", role, census.Raw)
	}
	// Two catalogs; the unlabelled and the invalid pod are excluded with
	// their reasons.
	require.Equal(t, 2, p.workers("prefill", "schedulable"))
	require.Equal(t, 2, p.workers("decode", "schedulable"))
	require.Equal(t, -1, p.workers("aggregated", "schedulable"), "no aggregated catalog")
	require.True(t, p.excluded(s, unl, "role_label_missing", ""))
	require.True(t, p.excluded(s, bad, "role_label_invalid", "both"))

	// KV events: prefill pods only.
	for _, i := range []int{pf0, pf1} {
		require.Eventually(t, f.engines[i].Subscribed, reconcileTimeout, poll, "KV events of %s", podNames[i])
	}
	src := p.eventSources()
	require.Equal(t, s.ids(pf0, pf1), sorted(src["prefill"]))
	require.Empty(t, src["decode"], "decode workers have no KV-event source")
	for _, i := range []int{dc0, dc1, unl, bad} {
		require.False(t, f.engines[i].Subscribed(), "no subscription to %s", podNames[i])
	}

	// 100 requests: decode destination, prefill hint, whatever the client
	// claims. Every other request forges both routing headers, naming a
	// prefill pod as destination and a decode pod as prefiller.
	before := make([]uint64, nPods)
	for i := range before {
		before[i] = f.requests(i)
	}
	legsBefore := f.legs()
	prefills, decodes := map[int]int{}, map[int]int{}
	for i := range 100 {
		r := request{prompt: fmt.Sprintf("shared system prompt for family %d; question %d", i%10, i)}
		if i%2 == 1 {
			r.headers = http.Header{
				"X-Gateway-Destination-Endpoint": {f.endpoint(pf0 + i%4/2)},
				"X-Prefiller-Host-Port":          {f.endpoint(dc0)},
			}
		}
		resp := p.send(r)
		require.Equal(t, http.StatusOK, resp.StatusCode, "request %d: %s", i, resp.Body)
		d, pre := f.byEndpoint(resp.Served), f.byEndpoint(resp.Decision.Prefiller)
		require.Contains(t, []int{dc0, dc1}, d, "request %d served by %s", i, resp.Served)
		require.Contains(t, []int{pf0, pf1}, pre, "request %d prefill hint %q", i, resp.Decision.Prefiller)
		require.Equal(t, resp.Served, resp.Decision.Destination)
		require.Equal(t, []string{resp.Decision.Prefiller}, resp.Decision.Headers["x-prefiller-host-port"],
			"request %d: one prefill hint reaches the decode pod", i)
		require.Equal(t, []string{resp.Served}, resp.Decision.Headers["x-gateway-destination-endpoint"])
		prefills[pre]++
		decodes[d]++
	}
	var decodeServed uint64
	for i := range nPods {
		n := f.requests(i) - before[i]
		switch i {
		case dc0, dc1:
			decodeServed += n
		default:
			require.Zero(t, n, "%s served requests", podNames[i])
		}
	}
	require.EqualValues(t, 100, decodeServed)
	// The legs: each prefill leg on the prefill pod the EPP named, each
	// request decoded by its sidecar's engine with the KV pulled from there.
	legsAfter := f.legs()
	requireLegs(t, f, legsBefore, legsAfter, prefills, decodes)
	t.Logf("100 requests: prefill legs %d / %d (prefill-0 / prefill-1), decode legs %d / %d (decode-0 / decode-1), KV tokens pulled %d / %d",
		prefills[pf0], prefills[pf1], decodes[dc0], decodes[dc1],
		legsAfter[dc0].engine.TransferredTokens-legsBefore[dc0].engine.TransferredTokens,
		legsAfter[dc1].engine.TransferredTokens-legsBefore[dc1].engine.TransferredTokens)
	requireNoOrchestrationHeaders(t, f, pf0, pf1, dc0, dc1, unl, bad)

	// prefill -> decode: prefill-1 becomes a decode worker and a destination;
	// its KV-event source goes away.
	st, _, _ := p.pair(f, pf1, pf0)
	require.Equal(t, http.StatusServiceUnavailable, st, "no decode worker among two prefill pods")
	s.setLabel(podNames[pf1], roleLabel, "decode")
	p.eventually("prefill -> decode label flip", func() bool {
		return p.workers("prefill", "schedulable") == 1 && p.workers("decode", "schedulable") == 3
	})
	was := f.legs()
	st, d, pre := p.pair(f, pf1, pf0)
	require.Equal(t, http.StatusOK, st)
	require.Equal(t, []int{pf1, pf0}, []int{d, pre}, "the flipped pod is a destination now")
	// It has no sidecar: its engine gets the request as it came, hint
	// included (the header probe sees it), and prefills it itself; no leg
	// runs anywhere.
	now := f.legs()
	require.Equal(t, was[pf1].engine.Requests+1, now[pf1].engine.Requests, "served by the flipped pod's engine")
	for i := range nPods {
		require.Equal(t, was[i].engine.PrefillLegs, now[i].engine.PrefillLegs, "%s: a prefill leg ran", podNames[i])
		require.Equal(t, was[i].engine.DecodeLegs, now[i].engine.DecodeLegs, "%s: a decode leg ran", podNames[i])
	}
	n, _ := f.headers[pf1].seen()
	require.Positive(t, n, "the probe sees the EPP's headers reach an engine without a sidecar")
	require.Eventually(t, func() bool {
		return slices.Equal(s.ids(pf0), sorted(p.eventSources()["prefill"]))
	}, reconcileTimeout, poll, "the flipped pod's KV-event source is removed")

	// decode -> prefill: decode-0 becomes a prefill worker and a prefill hint;
	// its KV events are subscribed.
	s.setLabel(podNames[dc0], roleLabel, "prefill")
	p.eventually("decode -> prefill label flip", func() bool {
		return p.workers("prefill", "schedulable") == 2 && p.workers("decode", "schedulable") == 2
	})
	was = f.legs()
	st, d, pre = p.pair(f, dc0, dc1)
	require.Equal(t, http.StatusOK, st)
	require.Equal(t, []int{dc1, dc0}, []int{d, pre}, "the flipped pod is a prefill hint now")
	// Its prefill leg goes through its sidecar's pass-through to its engine.
	requireLegs(t, f, was, f.legs(), map[int]int{dc0: 1}, map[int]int{dc1: 1})
	require.Eventually(t, f.engines[dc0].Subscribed, reconcileTimeout, poll, "KV events of the new prefill pod")
	require.Eventually(t, func() bool {
		return slices.Equal(s.ids(pf0, dc0), sorted(p.eventSources()["prefill"]))
	}, reconcileTimeout, poll, "prefill KV-event sources follow the labels")

	// Label removed, label invalid: excluded with the reason.
	s.setLabel(podNames[dc1], roleLabel, "")
	p.eventually("role label removed", func() bool { return p.excluded(s, dc1, "role_label_missing", "") })
	require.Equal(t, 1, p.workers("decode", "schedulable"), "prefill-1 only")
	s.setLabel(podNames[pf0], roleLabel, "gpu")
	p.eventually("role label invalid", func() bool { return p.excluded(s, pf0, "role_label_invalid", "gpu") })
	require.Equal(t, 1, p.workers("prefill", "schedulable"), "decode-0 only")

	// Decode scaled to zero: 503, reported as an empty decode role.
	s.deletePod(podNames[pf1])
	p.eventually("decode scaled to zero", func() bool {
		return p.send(request{prompt: "anyone decoding?"}).StatusCode == http.StatusServiceUnavailable
	})
	resp := p.send(request{prompt: "still nobody decoding?"})
	require.Equal(t, http.StatusServiceUnavailable, resp.Decision.Status)
	require.Equal(t, "no endpoint available (no_schedulable_worker)\n", string(resp.Body),
		"the client gets the named reason (selection.RefusalReason), no details")
	require.NotEmpty(t, p.Logs().Find(eppproc.MsgIs("role has no ready workers", "role", "decode")))
	require.NotEmpty(t, p.Logs().Find(func(r eppproc.Record) bool {
		return r.Msg() == "request rejected" && r.Num("status") == 503 &&
			strings.Contains(r.Str("err"), "no ready workers") && strings.Contains(r.Str("err"), "decode")
	}), "the rejection names the empty decode role")
	zero := p.waitLog(reconcileTimeout, "census at decode zero", func(r eppproc.Record) bool {
		return r.Msg() == "discovery census" && r.Num("roles", "decode") == 0
	})
	require.Equal(t, float64(1), zero.Num("roles", "prefill"), zero.Raw)

	// Decode back: a relabelled pod serves again.
	s.setLabel(podNames[dc1], roleLabel, "decode")
	p.eventually("decode back from zero", func() bool {
		return p.send(request{prompt: "decode is back"}).StatusCode == http.StatusOK
	})
	require.NotEmpty(t, p.Logs().Find(eppproc.MsgIs("role has ready workers again", "role", "decode")))
	was = f.legs()
	st, d, pre = p.pair(f, dc1, dc0)
	require.Equal(t, http.StatusOK, st)
	require.Equal(t, []int{dc1, dc0}, []int{d, pre})
	requireLegs(t, f, was, f.legs(), map[int]int{dc0: 1}, map[int]int{dc1: 1})
	// Throughout, only the engine that served as a decode pod without a
	// sidecar saw an orchestration header.
	requireNoOrchestrationHeaders(t, f, pf0, dc0, dc1, unl, bad)
}

// TestDisaggregatedEmptyRoleAtStartup starts the EPP on a pool that has
// prefill pods only: the empty decode role is reported at startup, requests
// get 503, and the first decode pod makes it serve.
func TestDisaggregatedEmptyRoleAtStartup(t *testing.T) {
	hh := need(t)
	s := newSpace(t, hh)
	f := startPods(t, prefillPod, prefillPod, decodePod)
	tok := startTokenizer(t)
	s.createPool("pool", map[string]string{"app": "llm"}, f.port)
	s.runPod("prefill-0", f.ips[0], map[string]string{"app": "llm", roleLabel: "prefill"})
	s.runPod("prefill-1", f.ips[1], map[string]string{"app": "llm", roleLabel: "prefill"})

	p := startEPP(t, hh, eppConfig{ns: s.ns, pool: "pool", fleet: f, tokenizer: tok, topology: "disaggregated"})
	p.waitServing()
	p.waitLog(reconcileTimeout, "empty decode role reported at startup", eppproc.MsgIs("role has no ready workers", "role", "decode"))
	census := p.waitLog(reconcileTimeout, "startup census", eppproc.MsgIs("discovery census"))
	require.Equal(t, float64(2), census.Num("roles", "prefill"), census.Raw)
	require.Equal(t, float64(-1), census.Num("roles", "decode"), "no decode pod was ever seen: %s", census.Raw)
	require.Equal(t, 0, p.workers("decode", "schedulable"))
	resp := p.send(request{prompt: "is anyone decoding?"})
	require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)

	s.runPod("decode-0", f.ips[2], map[string]string{"app": "llm", roleLabel: "decode"})
	p.eventually("first decode pod", func() bool {
		return p.send(request{prompt: "decoding now"}).StatusCode == http.StatusOK
	})
	p.waitLog(reconcileTimeout, "decode role ready", eppproc.MsgIs("role has ready workers again", "role", "decode"))
}

// TestAggregatedParity runs the EPP with the topology unset over the same
// role-labelled pool: one catalog, labels ignored, every pod a destination,
// no prefill hint, KV events from every pod.
func TestAggregatedParity(t *testing.T) {
	hh := need(t)
	s, f, tok := rolePool(t, hh)
	p := startEPP(t, hh, eppConfig{ns: s.ns, pool: "pool", fleet: f, tokenizer: tok})
	require.EqualValues(t, nPods, p.waitServing().Num("workers"))
	require.Equal(t, nPods, p.workers("aggregated", "schedulable"))
	require.Equal(t, -1, p.workers("prefill", "schedulable"), "no role catalogs")
	require.Equal(t, -1, p.workers("decode", "schedulable"), "no role catalogs")
	for i := range nPods {
		require.True(t, p.servedBy(f.endpoint(i)), "%s serves", podNames[i])
		require.Eventually(t, f.engines[i].Subscribed, reconcileTimeout, poll, "KV events of %s", podNames[i])
	}
	resp := p.send(request{prompt: "who prefills?"})
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Empty(t, resp.Decision.Prefiller)
	require.Empty(t, resp.Decision.Headers["x-prefiller-host-port"])
	require.Equal(t, s.ids(pf0, pf1, dc0, dc1, unl, bad), sorted(p.eventSources()["aggregated"]))
	require.Empty(t, p.Logs().Find(eppproc.MsgIs("worker excluded")), "labels are not read")
}
