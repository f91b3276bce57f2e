//go:build e2e

package e2ekube

import (
	"fmt"
	"net/http"
	"testing"

	"github.com/stretchr/testify/require"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/kvselect/kvselect/examples/epp/internal/eppproc"
)

const holdFinalizer = "e2e.kvselect.test/hold"

// TestLeastPrivilege checks the identity the EPP runs as: it can read pods and
// pools in its namespace and nothing else.
func TestLeastPrivilege(t *testing.T) {
	hh := need(t)
	s := newSpace(t, hh)
	cs, dyn := s.eppClients()
	ctx := s.ctx()
	_, err := cs.CoreV1().Pods(s.ns).List(ctx, metav1.ListOptions{})
	require.NoError(t, err)
	_, err = dyn.Resource(poolGVR).Namespace(s.ns).List(ctx, metav1.ListOptions{})
	require.NoError(t, err)
	_, err = cs.CoreV1().Secrets(s.ns).List(ctx, metav1.ListOptions{})
	require.True(t, apierrors.IsForbidden(err), "secrets: %v", err)
	_, err = cs.CoreV1().Pods("default").List(ctx, metav1.ListOptions{})
	require.True(t, apierrors.IsForbidden(err), "pods of another namespace: %v", err)
	s.createPod("p", map[string]string{"app": "x"})
	err = cs.CoreV1().Pods(s.ns).Delete(ctx, "p", metav1.DeleteOptions{})
	require.True(t, apierrors.IsForbidden(err), "delete a pod: %v", err)
}

// TestAggregatedPoolLifecycle runs the EPP in aggregated mode over one pool and
// walks a pod through every change discovery must follow: Ready pods serve;
// NotReady, terminating and deleted pods stop receiving requests; a pod IP
// change moves the endpoint; a selector change swaps the members. Each change
// must reach routing within reconcileTimeout.
func TestAggregatedPoolLifecycle(t *testing.T) {
	hh := need(t)
	s := newSpace(t, hh)
	f := startFleet(t, 6) // 0-3: pool pods; 4: llm-3's next IP; 5: a pod of another app
	tok := startTokenizer(t)
	s.createPool("pool", map[string]string{"app": "llm"}, f.port)
	s.runPod("llm-0", f.ips[0], map[string]string{"app": "llm", "tier": "gold"})
	s.runPod("llm-1", f.ips[1], map[string]string{"app": "llm"}, holdFinalizer)
	s.runPod("llm-2", f.ips[2], map[string]string{"app": "llm"})
	s.runPod("llm-3", f.ips[3], map[string]string{"app": "llm"})
	s.runPod("other", f.ips[5], map[string]string{"app": "other", "tier": "gold"})
	s.createPod("pending", map[string]string{"app": "llm"}) // no status yet: not a worker

	p := startEPP(t, hh, eppConfig{ns: s.ns, pool: "pool", fleet: f, tokenizer: tok})
	serving := p.waitServing()
	require.EqualValues(t, 4, serving.Num("workers"))

	// Startup census and pool resolution are logged.
	census := p.waitLog(reconcileTimeout, "startup census", eppproc.MsgIs("discovery census"))
	require.Equal(t, "kubernetes", census.Str("source"))
	require.EqualValues(t, 4, census.Num("workers"))
	require.Equal(t, true, census.M["synced"])
	pool := p.waitLog(reconcileTimeout, "pool resolved", eppproc.MsgIs("inference pool resolved"))
	require.EqualValues(t, f.port, pool.Num("target_port"))
	require.Equal(t, s.ns+"/pool", pool.Str("pool"))

	// Every Ready member serves; a Ready pod of another app does not.
	require.Equal(t, 4, p.workers("aggregated", "schedulable"))
	for i := range 4 {
		require.True(t, p.servedBy(f.endpoint(i)), "member %d", i)
	}
	require.False(t, p.servedBy(f.endpoint(5)), "a pod the selector does not match")
	// Unhinted requests land on members only, and every member's KV events
	// are subscribed.
	for i := range 20 {
		resp := p.send(request{prompt: fmt.Sprintf("question number %d about the weather", i)})
		require.Equal(t, http.StatusOK, resp.StatusCode, "%s", resp.Body)
		idx := f.byEndpoint(resp.Served)
		require.True(t, idx >= 0 && idx < 4, "served by %s", resp.Served)
		require.Empty(t, resp.Decision.Prefiller, "aggregated mode sets no prefill hint")
	}
	for i := range 4 {
		require.Eventually(t, f.engines[i].Subscribed, reconcileTimeout, poll, "KV events of member %d", i)
	}
	require.False(t, f.engines[5].Subscribed(), "no subscription to a non-member")

	// NotReady leaves, Ready again returns.
	s.setStatus("llm-0", f.ips[0], false)
	p.eventually("NotReady pod leaves", func() bool { return !p.servedBy(f.endpoint(0)) })
	require.Equal(t, 3, p.workers("aggregated", "schedulable"))
	s.setStatus("llm-0", f.ips[0], true)
	p.eventually("Ready again pod returns", func() bool { return p.servedBy(f.endpoint(0)) })

	// Terminating: the finalizer keeps the pod, with a deletionTimestamp.
	s.deletePod("llm-1")
	require.NotNil(t, s.pod("llm-1").DeletionTimestamp)
	p.eventually("terminating pod leaves", func() bool { return !p.servedBy(f.endpoint(1)) })

	// Deleted.
	s.deletePod("llm-2")
	_, err := hh.admin.CoreV1().Pods(s.ns).Get(s.ctx(), "llm-2", metav1.GetOptions{})
	require.True(t, apierrors.IsNotFound(err))
	p.eventually("deleted pod leaves", func() bool { return !p.servedBy(f.endpoint(2)) })

	// IP change: the same pod (same worker id) moves to another address.
	s.setStatus("llm-3", f.ips[4], true)
	p.eventually("pod IP change", func() bool { return p.servedBy(f.endpoint(4)) && !p.servedBy(f.endpoint(3)) })
	require.Equal(t, 2, p.workers("aggregated", "schedulable"), "llm-0 and llm-3")
	require.Eventually(t, f.engines[4].Subscribed, reconcileTimeout, poll, "KV events follow the new IP")

	// Selector change: {app: llm} -> {tier: gold}. llm-0 stays, llm-3 leaves,
	// the other app's pod joins.
	s.setPoolSelector("pool", map[string]string{"tier": "gold"})
	p.eventually("selector change", func() bool { return p.servedBy(f.endpoint(5)) && !p.servedBy(f.endpoint(4)) })
	require.True(t, p.servedBy(f.endpoint(0)))
	require.Equal(t, 2, p.workers("aggregated", "schedulable"), "llm-0 and other")
	require.NotEmpty(t, p.Logs().Find(func(r eppproc.Record) bool {
		m, _ := r.M["match_labels"].(map[string]any)
		return r.Msg() == "inference pool resolved" && m["tier"] == "gold" && len(m) == 1
	}), "the new selector is logged")
}
