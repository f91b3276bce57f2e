package main

import (
	"fmt"
	"io"
	"maps"
	"slices"
	"strconv"
	"strings"

	"github.com/kvselect/kvselect/examples/pdsidecar/sidecar"
)

// writeMetrics writes st in the Prometheus text exposition format (0.0.4),
// every sample labelled with the protocol. Every leg, outcome and reason is
// written, counted or not, so rates start at zero.
func writeMetrics(w io.Writer, st sidecar.Stats) error {
	var b strings.Builder
	proto := `protocol="` + string(st.Protocol) + `"`
	family := func(name, typ, help string) {
		fmt.Fprintf(&b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, typ)
	}
	sample := func(name, labels string, v uint64) {
		fmt.Fprintf(&b, "%s{%s} %d\n", name, labels, v)
	}

	family("kvselect_pd_requests_total", "counter", "Requests by path: disaggregated (the hint was accepted) or passthrough.")
	sample("kvselect_pd_requests_total", proto+`,path="disaggregated"`, st.Disaggregated)
	sample("kvselect_pd_requests_total", proto+`,path="passthrough"`, st.Passthrough)

	family("kvselect_pd_legs_total", "counter", "Upstream calls by leg and outcome.")
	for _, l := range sidecar.AllLegs {
		for _, o := range sidecar.AllOutcomes {
			sample("kvselect_pd_legs_total", fmt.Sprintf(`%s,leg="%s",outcome="%s"`, proto, l, o), st.Legs[sidecar.LegKey{Leg: l, Outcome: o}])
		}
	}

	family("kvselect_pd_bad_hints_total", "counter", "Prefill hints refused (502 invalid_epp_metadata), by reason.")
	for _, r := range slices.Sorted(maps.Keys(st.BadHints)) {
		sample("kvselect_pd_bad_hints_total", proto+`,reason="`+r+`"`, st.BadHints[r])
	}
	family("kvselect_pd_refused_total", "counter", "Requests refused before any leg, by reason.")
	for _, r := range slices.Sorted(maps.Keys(st.Refused)) {
		sample("kvselect_pd_refused_total", proto+`,reason="`+r+`"`, st.Refused[r])
	}
	family("kvselect_pd_fallbacks_total", "counter", "P/D requests prefilled on the decode engine after their prefill leg failed.")
	sample("kvselect_pd_fallbacks_total", proto, st.Fallbacks)

	family("kvselect_pd_handoff_seconds", "histogram", "Latency of successful prefill legs (the hand-off).")
	for i, le := range st.Handoff.Bounds {
		sample("kvselect_pd_handoff_seconds_bucket", proto+`,le="`+strconv.FormatFloat(le, 'g', -1, 64)+`"`, st.Handoff.Cumulative[i])
	}
	sample("kvselect_pd_handoff_seconds_bucket", proto+`,le="+Inf"`, st.Handoff.Count)
	fmt.Fprintf(&b, "kvselect_pd_handoff_seconds_sum{%s} %s\n", proto, strconv.FormatFloat(st.Handoff.Sum.Seconds(), 'g', -1, 64))
	sample("kvselect_pd_handoff_seconds_count", proto, st.Handoff.Count)

	_, err := io.WriteString(w, b.String())
	return err
}
