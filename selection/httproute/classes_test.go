package httproute_test

import (
	"context"
	"io"
	"net/http"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/gaie"
	"github.com/kvselect/kvselect/selection"
	"github.com/kvselect/kvselect/selection/httproute"
)

// A request's policy class comes from its header; a class at its in-flight
// limit is refused with 429 (or Options.OverloadStatus), Retry-After and the
// reason in the drop-reason header, while another class is served.
func TestPolicyClassRefusalHeaders(t *testing.T) {
	ep := upstream(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"choices":[]}`)
	})
	classes := []selection.Class{{Name: "interactive", Weight: 3}, {Name: "batch", Weight: 1, InFlightLimit: 1}}
	for _, overload := range []int{0, gaie.StatusSiteOverloaded} {
		env := newEnv(t, envOptions{workers: []string{ep}, classes: classes, router: httproute.Options{OverloadStatus: overload}})
		ctx := context.Background()
		held, err := env.svc.Book(ctx, selection.Request{ISL: 8, Class: "batch"})
		require.NoError(t, err)
		want := http.StatusTooManyRequests
		if overload != 0 {
			want = overload
		}
		for _, h := range []string{gaie.HeaderPolicyClass, gaie.HeaderInferenceObjective} {
			resp, err := env.post(ctx, t, chatBody("", "hi"), h, "batch")
			require.NoError(t, err)
			require.Equal(t, want, resp.StatusCode)
			require.Equal(t, "1", resp.Header.Get("Retry-After"))
			require.Equal(t, "class_inflight_full:batch", resp.Header.Get(gaie.HeaderDroppedReason))
			e := readError(t, resp)
			require.Equal(t, "rate_limit_error", e.Error.Type)
			require.Contains(t, e.Error.Message, `class "batch" has 1 requests in flight`)
		}
		for _, hdr := range [][]string{{gaie.HeaderPolicyClass, "interactive"}, nil} {
			resp, err := env.post(ctx, t, chatBody("", "hi"), hdr...)
			require.NoError(t, err)
			_, _ = io.ReadAll(resp.Body)
			_ = resp.Body.Close()
			require.Equal(t, http.StatusOK, resp.StatusCode)
			require.Empty(t, resp.Header.Get(gaie.HeaderDroppedReason))
		}
		require.NoError(t, held.Done())
		st := env.svc.Stats().Classes
		require.Equal(t, map[string]uint64{selection.RefusedClassInFlightFull: 2}, st["batch"].Refused)
		require.EqualValues(t, 2, st["interactive"].Admitted)
	}
}

func TestOverloadStatusIsChecked(t *testing.T) {
	_, err := httproute.New(httproute.Options{Service: httproute.Single(nil), Tokenizer: byteTokens, OverloadStatus: http.StatusServiceUnavailable})
	require.ErrorIs(t, err, httproute.ErrInvalidOptions)
	require.ErrorContains(t, err, "OverloadStatus 503 is neither 429 nor 529")
}
