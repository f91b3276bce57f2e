package eppserver

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/examples/internal/demofleet"
	"github.com/kvselect/kvselect/examples/internal/extproctest"
	"github.com/kvselect/kvselect/gaie"
	"github.com/kvselect/kvselect/selection"
)

// DYN_EPP_POLICY_CLASSES sets fair admission's classes (checked with the
// rest of the selection configuration); DYN_EPP_OVERLOAD_STATUS the status
// of their refusals.
func TestConfigPolicyClasses(t *testing.T) {
	c, err := load(t, nil)
	require.NoError(t, err)
	require.Nil(t, c.Router.Classes)
	require.Equal(t, http.StatusTooManyRequests, c.OverloadStatus)

	c, err = load(t, map[string]string{
		"DYN_EPP_POLICY_CLASSES":  "interactive:weight=3,tier=1,deadline=2s;batch:queue=8,inflight=16",
		"DYN_EPP_OVERLOAD_STATUS": "529",
	})
	require.NoError(t, err)
	require.Equal(t, []selection.Class{
		{Name: "interactive", Weight: 3, Tier: 1, Deadline: 2 * time.Second},
		{Name: "batch", Weight: 1, QueueLimit: 8, InFlightLimit: 16},
	}, c.Router.Classes)
	require.Equal(t, gaie.StatusSiteOverloaded, c.OverloadStatus)

	_, err = load(t, map[string]string{"DYN_EPP_POLICY_CLASSES": "a:speed=1", "DYN_EPP_OVERLOAD_STATUS": "503"})
	require.ErrorContains(t, err, "DYN_EPP_POLICY_CLASSES")
	require.ErrorContains(t, err, "DYN_EPP_OVERLOAD_STATUS")
	_, err = load(t, map[string]string{"DYN_EPP_POLICY_CLASSES": "Batch:weight=0"})
	require.ErrorContains(t, err, `Classes[0].Name "Batch" is not a token`)
	require.ErrorContains(t, err, "Weight is 0")
}

func TestPolicyClassHeaders(t *testing.T) {
	require.Equal(t, "", policyClass(map[string]string{}))
	require.Equal(t, "batch", policyClass(map[string]string{headerObjective: " batch "}))
	require.Equal(t, "interactive", policyClass(map[string]string{headerPolicyClass: "interactive", headerObjective: "batch"}))
	require.Equal(t, "batch", policyClass(map[string]string{headerPolicyClass: " ", headerObjective: "batch"}))
}

func TestOverloadAs(t *testing.T) {
	errFull := fmt.Errorf("full: %w", selection.ErrAdmission)
	require.Equal(t, http.StatusTooManyRequests, overloadAs(statusOf, 0)(errFull))
	require.Equal(t, http.StatusTooManyRequests, overloadAs(statusOf, http.StatusTooManyRequests)(errFull))
	as529 := overloadAs(statusOf, gaie.StatusSiteOverloaded)
	require.Equal(t, gaie.StatusSiteOverloaded, as529(errFull))
	require.Equal(t, gaie.StatusSiteOverloaded, as529(selection.ErrOverloaded))
	require.Equal(t, http.StatusServiceUnavailable, as529(selection.ErrNoEndpoints))
	require.Equal(t, http.StatusInternalServerError, as529(errors.New("other")))
}

// End to end through ext_proc: a request's class comes from its header; a
// class at its in-flight limit is refused with 529 (configured), Retry-After
// and its reason in the drop-reason header and the body, while another class
// is routed; the figures reach /metrics' source, the service's Stats.
func TestPolicyClassLimitThroughExtProc(t *testing.T) {
	env := newLoadEnvWith(t, "aggregated", map[string]string{
		"DYN_EPP_POLICY_CLASSES":  "interactive:weight=3;batch:inflight=1",
		"DYN_EPP_OVERLOAD_STATUS": "529",
	})
	defer env.close()
	require.Len(t, env.services, 1)
	var svc *selection.SelectionService
	for _, s := range env.services {
		svc = s
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// One batch request in flight takes the class's only slot.
	held, err := svc.Book(ctx, selection.Request{Model: demofleet.Model, ISL: 64, Class: "batch"})
	require.NoError(t, err)
	defer func() { _ = held.Done() }()

	body, err := json.Marshal(map[string]any{"model": demofleet.Model, "max_tokens": 4,
		"messages": []map[string]string{{"role": "user", "content": "which class am I in?"}}})
	require.NoError(t, err)
	send := func(headers http.Header) (int, extproctest.Decision) {
		headers.Set("Content-Type", "application/json")
		res, err := env.client.Do(ctx, extproctest.HTTPRequest{Path: "/v1/chat/completions", Body: body, Headers: headers})
		require.NoError(t, err)
		return res.Status, res
	}
	for _, h := range []http.Header{{"X-Dynamo-Meta-Policy-Class": {"batch"}}, {"X-Gateway-Inference-Objective": {"batch"}}} {
		st, res := send(h)
		require.Equal(t, gaie.StatusSiteOverloaded, st)
		require.Equal(t, "1", res.ImmediateHeaders["retry-after"])
		require.Equal(t, "class_inflight_full:batch", res.ImmediateHeaders[gaie.HeaderDroppedReason])
		require.Equal(t, "overloaded, retry later (class_inflight_full:batch)\n", string(res.ImmediateBody))
	}
	// Another class, and no class at all (the first class's), are routed.
	for _, h := range []http.Header{{"X-Dynamo-Meta-Policy-Class": {"interactive"}}, {}} {
		_, res := send(h)
		require.NotEmpty(t, res.Destination)
		require.Nil(t, res.ImmediateBody)
	}
	st := svc.Stats().Classes
	require.Equal(t, map[string]uint64{selection.RefusedClassInFlightFull: 2}, st["batch"].Refused)
	require.EqualValues(t, 2, st["interactive"].Admitted)
}
