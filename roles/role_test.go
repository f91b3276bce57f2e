package roles

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/reservation"
	"github.com/kvselect/kvselect/selection"
)

func TestRoleStringParse(t *testing.T) {
	for _, r := range []Role{Aggregated, Prefill, Decode} {
		require.True(t, r.valid())
		got, err := parseRole(" " + strings.ToUpper(r.String()) + "\n")
		require.NoError(t, err)
		require.Equal(t, r, got)
	}
	require.Equal(t, Aggregated, Role(0), "the zero Role is Aggregated")
	require.False(t, Role(3).valid())
	require.Equal(t, "Role(3)", Role(3).String())
	for _, bad := range []string{"", "both", "pre-fill", "decoder", "\u212Aecode"} {
		_, err := parseRole(bad)
		require.ErrorIs(t, err, errInvalidRole, bad)
	}
}

func TestTopologyMode(t *testing.T) {
	m, err := ParseTopologyMode(" Disaggregated ")
	require.NoError(t, err)
	require.Equal(t, ModeDisaggregated, m)
	m, err = ParseTopologyMode("AGGREGATED")
	require.NoError(t, err)
	require.Equal(t, ModeAggregated, m)
	for _, bad := range []string{"", "disagg", "prefill_decode", "aggregated,disaggregated"} {
		_, err := ParseTopologyMode(bad)
		require.ErrorIs(t, err, ErrInvalidTopologyMode, bad)
		require.Equal(t, http.StatusBadRequest, HTTPStatus(err))
	}
	require.Equal(t, []Role{Aggregated}, ModeAggregated.Roles())
	require.Equal(t, []Role{Prefill, Decode}, ModeDisaggregated.Roles())
	require.Nil(t, TopologyMode(7).Roles())
	require.Equal(t, Decode, ModeDisaggregated.Destination())
	require.Equal(t, Aggregated, ModeAggregated.Destination())
	require.Equal(t, "TopologyMode(7)", TopologyMode(7).String())
}

func TestValidateLabelKey(t *testing.T) {
	long := func(n int, c string) string { return strings.Repeat(c, n) }
	valid := []string{
		DefaultRoleLabel, "nvidia.com/role", "role", "Role_Name.v-1", "a", "a/b", "x-1.y-2/z",
		long(63, "n"), long(253, "a") + "/n",
		strings.Repeat("abcdefghi.", 25) + "abc/n", // 253 characters
	}
	for _, k := range valid {
		require.NoError(t, validateLabelKey(k), "%q", k)
	}
	invalid := map[string]string{
		"":                            "name is empty",
		"/role":                       "prefix before '/' is empty",
		"nvidia.com/":                 "name is empty",
		"a/b/c":                       "character '/'",
		long(64, "n"):                 "64 characters",
		long(254, "a") + "/n":         "254 characters",
		"Nvidia.com/role":             "lower-case",
		"nvidia..com/role":            "empty DNS label",
		".nvidia.com/role":            "empty DNS label",
		"nvidia-.com/role":            "start and end",
		"nvi_dia.com/role":            "character '_'",
		"-role":                       "start and end",
		"role-":                       "start and end",
		"ro le":                       "character ' '",
		"rôle":                        "character",
		"nvidia.com/role\x00":         "start and end",
		"nvidia.com/" + long(64, "r"): "64 characters",
	}
	for k, want := range invalid {
		err := validateLabelKey(k)
		require.ErrorIs(t, err, ErrInvalidLabelKey, "%q", k)
		require.ErrorContains(t, err, want, "%q", k)
	}
}

func TestSplitAggregatedNeverReadsLabels(t *testing.T) {
	ws := []catalog.Worker{wk("a", "prefill"), wk("b", "garbage"), wk("c", noLabel)}
	// An invalid label key is not even looked at in aggregated mode.
	res, err := Split(ws, ModeAggregated, "not a key!")
	require.NoError(t, err)
	require.Equal(t, map[Role][]catalog.Worker{Aggregated: ws}, res.ByRole)
	require.Empty(t, res.Excluded)
}

func TestSplitDisaggregated(t *testing.T) {
	ws := []catalog.Worker{
		wk("p1", "prefill"), wk("d1", "decode"), wk("p2", "  PreFill\t"), wk("d2", "DECODE"),
		wk("m1", noLabel), wk("m2", ""), wk("m3", "   "),
		wk("i1", "aggregated"), wk("i2", "both"), wk("i3", "prefill,decode"), wk("i4", "pre fill"),
		wk("i5", "\u212Adecode"), wk("i6", "décode"), wk("i7", "prefill\x00"),
	}
	nilLabels := catalog.Worker{ID: "m4", Endpoint: "10.0.0.1:1", DPSize: 1, BlockSize: 4}
	otherKey := wk("m5", noLabel)
	otherKey.Labels["nvidia.com/role"] = "decode"
	ws = append(ws, nilLabels, otherKey)

	res, err := Split(ws, ModeDisaggregated, "")
	require.NoError(t, err)
	idsOf := func(ws []catalog.Worker) []string {
		var out []string
		for _, w := range ws {
			out = append(out, w.ID)
		}
		return out
	}
	require.Equal(t, []string{"p1", "p2"}, idsOf(res.ByRole[Prefill]))
	require.Equal(t, []string{"d1", "d2"}, idsOf(res.ByRole[Decode]))
	require.Len(t, res.ByRole, 2)
	reasons := map[string]string{}
	for _, e := range res.Excluded {
		reasons[e.ID] = e.Reason
	}
	require.Equal(t, map[string]string{
		"m1": ReasonRoleLabelMissing, "m2": ReasonRoleLabelMissing, "m3": ReasonRoleLabelMissing,
		"m4": ReasonRoleLabelMissing, "m5": ReasonRoleLabelMissing,
		"i1": ReasonRoleLabelInvalid, "i2": ReasonRoleLabelInvalid, "i3": ReasonRoleLabelInvalid,
		"i4": ReasonRoleLabelInvalid, "i5": ReasonRoleLabelInvalid, "i6": ReasonRoleLabelInvalid,
		"i7": ReasonRoleLabelInvalid,
	}, reasons)
	require.Equal(t, "both", res.Excluded[4].Value)

	// An overridden key reads that label instead.
	res, err = Split([]catalog.Worker{otherKey, wk("d", "decode")}, ModeDisaggregated, "nvidia.com/role")
	require.NoError(t, err)
	require.Equal(t, []string{"m5"}, idsOf(res.ByRole[Decode]))
	require.Equal(t, []Excluded{{ID: "d", Reason: ReasonRoleLabelMissing}}, res.Excluded)

	_, err = Split(ws, ModeDisaggregated, "bad key/")
	require.ErrorIs(t, err, ErrInvalidLabelKey)
	_, err = Split(ws, TopologyMode(9), "")
	require.ErrorIs(t, err, ErrInvalidTopologyMode)
}

// FuzzSplit: no key or value panics, and every worker lands in exactly one
// place, the one its trimmed, ASCII-folded value names.
func FuzzSplit(f *testing.F) {
	for _, s := range []struct{ key, value string }{
		{DefaultRoleLabel, "prefill"}, {DefaultRoleLabel, " DECODE "}, {"role", "both"},
		{"a/b/c", "decode"}, {"", ""}, {"", "decode"}, {"x", "\xff\xfe"}, {"nvidia.com/role", "\u212Aecode"},
	} {
		f.Add(s.key, s.value)
	}
	f.Fuzz(func(t *testing.T, key, value string) {
		_ = validateLabelKey(key)
		_, _ = parseRole(value)
		_, _ = ParseTopologyMode(value)
		w := catalog.Worker{ID: "w", Labels: map[string]string{key: value}}
		res, err := Split([]catalog.Worker{w}, ModeDisaggregated, key)
		if err != nil {
			require.ErrorIs(t, err, ErrInvalidLabelKey)
			require.Error(t, validateLabelKey(key))
			return
		}
		n := len(res.ByRole[Prefill]) + len(res.ByRole[Decode]) + len(res.Excluded)
		require.Equal(t, 1, n)
		// key "" reads DefaultRoleLabel, which this worker does not carry.
		v := strings.ToLower(strings.TrimSpace(value))
		switch {
		case len(res.ByRole[Prefill]) == 1:
			require.Equal(t, "prefill", v)
			require.NotEmpty(t, key)
		case len(res.ByRole[Decode]) == 1:
			require.Equal(t, "decode", v)
			require.NotEmpty(t, key)
		case key == "" || strings.TrimSpace(value) == "":
			require.Equal(t, ReasonRoleLabelMissing, res.Excluded[0].Reason)
		default:
			require.Equal(t, ReasonRoleLabelInvalid, res.Excluded[0].Reason)
		}
	})
}

func TestProfiles(t *testing.T) {
	base := selection.DefaultConfig(16)
	base.Temperature = 0.5
	base.OverlapScoreCredit = 2
	ps, err := deriveProfiles(base, ProfileOptions{PrefillMaxNumBatchedTokens: 8192})
	require.NoError(t, err)
	require.Len(t, ps, 3)
	require.Equal(t, base, ps[Aggregated].Config)
	require.Equal(t, base, ps[Prefill].Config)
	require.Nil(t, ps[Prefill].Override)
	require.Equal(t, 8192, ps[Prefill].MaxNumBatchedTokens)

	d := ps[Decode]
	require.False(t, d.Config.UseKVEvents)
	require.Zero(t, d.Config.OverlapScoreCredit)
	require.False(t, d.Config.AssumeKVReuse)
	require.False(t, d.Config.TrackPrefillTokens)
	require.Equal(t, 0.5, d.Config.Temperature, "other settings are the base's")
	require.NoError(t, d.Config.Validate())
	require.Equal(t, 0.0, *d.Override.OverlapScoreCredit)
	require.False(t, *d.Override.AssumeKVReuse)
	require.False(t, *d.Override.TrackPrefillTokens)
	require.Nil(t, d.Override.Temperature)
	require.Equal(t, 2.0, *d.LocalPrefillOverride.OverlapScoreCredit)
	require.True(t, *d.LocalPrefillOverride.AssumeKVReuse)
	require.True(t, *d.LocalPrefillOverride.TrackPrefillTokens)
	require.Zero(t, d.MaxNumBatchedTokens, "no decode value: the worker's (shared) value stays")

	// A base credit of 0 is the local-prefill credit too.
	base.OverlapScoreCredit = 0
	ps, err = deriveProfiles(base, ProfileOptions{})
	require.NoError(t, err)
	require.Equal(t, 0.0, *ps[Decode].LocalPrefillOverride.OverlapScoreCredit)

	_, err = deriveProfiles(selection.DefaultConfig(0), ProfileOptions{PrefillMaxNumBatchedTokens: -1, DecodeMaxNumBatchedTokens: -2})
	require.ErrorIs(t, err, selection.ErrInvalidConfig)
	require.ErrorIs(t, err, ErrInvalidOptions)
	require.ErrorContains(t, err, "PrefillMaxNumBatchedTokens")
	require.ErrorContains(t, err, "DecodeMaxNumBatchedTokens")
}

func TestProfileWorker(t *testing.T) {
	ps, err := deriveProfiles(selection.DefaultConfig(4), ProfileOptions{DecodeMaxNumBatchedTokens: 512})
	require.NoError(t, err)
	w := wk("w", "decode")
	d := ps[Decode].worker(w)
	require.Nil(t, d.KVEventEndpoints)
	require.Empty(t, d.ReplayEndpoint)
	require.Equal(t, 512, d.MaxNumBatchedTokens)
	require.NotNil(t, w.KVEventEndpoints, "the caller's worker is untouched")
	require.Equal(t, 100, w.MaxNumBatchedTokens)

	p := ps[Prefill].worker(w)
	require.Equal(t, w.KVEventEndpoints, p.KVEventEndpoints)
	require.Equal(t, w.ReplayEndpoint, p.ReplayEndpoint)
	require.Equal(t, 100, p.MaxNumBatchedTokens, "falls back to the worker's value")
}

func TestMergeOverride(t *testing.T) {
	forced := &selection.Override{OverlapScoreCredit: ptr(0.0), TrackPrefillTokens: ptr(false)}
	require.Same(t, forced, mergeOverride(nil, forced))
	caller := &selection.Override{Temperature: ptr(0.3), TrackPrefillTokens: ptr(true), OverlapScoreCredit: ptr(4.0)}
	require.Same(t, caller, mergeOverride(caller, nil))
	m := mergeOverride(caller, forced)
	require.Equal(t, 0.3, *m.Temperature)
	require.False(t, *m.TrackPrefillTokens)
	require.Equal(t, 0.0, *m.OverlapScoreCredit)
	require.True(t, *caller.TrackPrefillTokens, "the caller's override is not modified")
	require.Equal(t, 4.0, *caller.OverlapScoreCredit)
}

func TestHTTPStatus(t *testing.T) {
	wrap := func(err error) error { return fmt.Errorf("ctx: %w", err) }
	empty := roleError(Decode, fmt.Errorf("%w: model %q has no schedulable worker", selection.ErrNotReady, "m"))
	for err, want := range map[error]int{
		nil:                                  http.StatusOK,
		empty:                                http.StatusServiceUnavailable,
		wrap(ErrClosed):                      http.StatusServiceUnavailable,
		wrap(ErrInvalidOptions):              http.StatusBadRequest,
		wrap(ErrDuplicateID):                 http.StatusConflict,
		wrap(ErrUnknownPlan):                 http.StatusNotFound,
		wrap(selection.ErrOverloaded):        http.StatusTooManyRequests,
		wrap(reservation.ErrConflict):        http.StatusConflict,
		wrap(context.DeadlineExceeded):       http.StatusGatewayTimeout,
		wrap(errors.New("something broken")): http.StatusInternalServerError,
	} {
		require.Equal(t, want, HTTPStatus(err), "%v", err)
	}
	require.ErrorIs(t, empty, ErrRoleCatalogEmpty)
	require.ErrorIs(t, empty, selection.ErrNotReady)
	require.Equal(t, http.StatusServiceUnavailable, selection.HTTPStatus(empty), "selection maps it to 503 as well")
}
