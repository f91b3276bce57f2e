//go:build e2e

package e2ekube

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"

	"github.com/kvselect/kvselect/examples/epp/internal/eppproc"
)

const peerService = "epp-peers"

// peerRules is the least privilege of peer discovery (docs/REPLICAS.md):
// read the peer Service, list and watch EndpointSlices.
var peerRules = []rbacv1.PolicyRule{
	{APIGroups: []string{""}, Resources: []string{"services"}, Verbs: []string{"get"}},
	{APIGroups: []string{discoveryv1.GroupName}, Resources: []string{"endpointslices"}, Verbs: []string{"list", "watch"}},
}

// peerEnv is the environment of an EPP replica at ip (a loopback address):
// static workers (one, approximate index: no engine is needed), the peers
// from the Service's EndpointSlices, its embedded NATS server on ip:port.
func peerEnv(s *space, ip string, port int, workersFile string) map[string]string {
	return map[string]string{
		"PATH": os.Getenv("PATH"), "HOME": os.Getenv("HOME"),
		"KUBECONFIG":                    s.h.eppKubeconfig,
		"POD_NAMESPACE":                 s.ns,
		"POD_NAME":                      "epp-" + strings.ReplaceAll(ip, ".", "-"),
		"POD_IP":                        ip,
		"DYN_EPP_PEER_SERVICE":          peerService,
		"DYN_EPP_REPLICA_SYNC_PORT":     strconv.Itoa(port),
		"DYN_EPP_WORKERS_FILE":          workersFile,
		"DYN_EPP_TOKENIZER_SERVICE_URL": "http://127.0.0.1:9",
		"DYN_ROUTER_USE_KV_EVENTS":      "false",
		"DYN_EPP_KV_EVENT_PORT":         "0",
		"DYN_SECURE_SERVING":            "false",
		"DYN_EPP_EXTPROC_ADDR":          "127.0.0.1:0",
		"DYN_EPP_HEALTH_ADDR":           "127.0.0.1:0",
		"DYN_EPP_METRICS_ADDR":          "127.0.0.1:0",
	}
}

type peerEndpoint struct {
	ip    string
	ready bool
}

// putSlice creates or replaces the EndpointSlice name of service, as the
// EndpointSlice controller would for the EPP pods.
func (s *space) putSlice(name string, family discoveryv1.AddressType, service string, eps ...peerEndpoint) {
	s.t.Helper()
	es := &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Name: name, Labels: map[string]string{discoveryv1.LabelServiceName: service}},
		AddressType: family,
		Ports:       []discoveryv1.EndpointPort{{Name: new("replica-sync"), Port: new(int32(9092))}},
	}
	for _, e := range eps {
		es.Endpoints = append(es.Endpoints, discoveryv1.Endpoint{Addresses: []string{e.ip},
			Conditions: discoveryv1.EndpointConditions{Ready: new(e.ready)}})
	}
	slices := s.h.admin.DiscoveryV1().EndpointSlices(s.ns)
	cur, err := slices.Get(s.ctx(), name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		_, err = slices.Create(s.ctx(), es, metav1.CreateOptions{})
	} else if err == nil {
		es.ResourceVersion = cur.ResourceVersion
		_, err = slices.Update(s.ctx(), es, metav1.UpdateOptions{})
	}
	require.NoError(s.t, err)
}

// census matches the peer discovery's census line of a set of n peers that
// added and removed (ip:port lists) changed; nil lists are not checked.
func census(n int, added, removed []string) func(eppproc.Record) bool {
	same := func(got any, want []string) bool {
		if want == nil {
			return true
		}
		w := make([]any, len(want))
		for i, v := range want {
			w[i] = v
		}
		return fmt.Sprint(got) == fmt.Sprint(w)
	}
	return func(r eppproc.Record) bool {
		return r.Msg() == "replica peers" && int(r.Num("peers")) == n && same(r.M["added"], added) && same(r.M["removed"], removed)
	}
}

// TestPeerDiscovery runs an EPP replica with DYN_EPP_PEER_SERVICE against
// the real API server, with only the peer discovery's Role (services get,
// endpointslices list and watch): the identity is refused everything else
// (listing services, writing EndpointSlices, pods, secrets, another
// namespace); a replica whose Service is missing stops with a clear error;
// the replica's peer set, and the routes of its embedded NATS server, follow
// the Service's EndpointSlices as EPP "pods" come, turn ready and unready,
// and go with their slice; other Services' slices and IPv6 slices are
// ignored.
//
// The API server refuses loopback addresses in EndpointSlices, so the peer
// "pods" here are addresses of TEST-NET-2 (198.51.100.0/24), where nothing
// answers: the routes are configured and never connect. Traffic between
// replicas over routes is TestThreeEPPProcesses' (package main), on
// loopback.
func TestPeerDiscovery(t *testing.T) {
	hh := need(t)
	s := newNamespace(t, hh)
	s.grant("epp-peers", peerRules, func(ctx context.Context, cs kubernetes.Interface, _ dynamic.Interface) bool {
		_, err := cs.DiscoveryV1().EndpointSlices(s.ns).List(ctx, metav1.ListOptions{})
		return err == nil
	})
	ctx := s.ctx()

	// Least privilege: exactly the rules, nothing else.
	cs, _ := s.eppClients()
	forbidden := map[string]error{}
	_, forbidden["list services"] = cs.CoreV1().Services(s.ns).List(ctx, metav1.ListOptions{})
	_, forbidden["create endpointslices"] = cs.DiscoveryV1().EndpointSlices(s.ns).Create(ctx, &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{Name: "forged"}, AddressType: discoveryv1.AddressTypeIPv4}, metav1.CreateOptions{})
	_, forbidden["list pods"] = cs.CoreV1().Pods(s.ns).List(ctx, metav1.ListOptions{})
	_, forbidden["get secrets"] = cs.CoreV1().Secrets(s.ns).Get(ctx, "any", metav1.GetOptions{})
	_, forbidden["list endpointslices elsewhere"] = cs.DiscoveryV1().EndpointSlices("default").List(ctx, metav1.ListOptions{})
	for call, err := range forbidden {
		require.True(t, apierrors.IsForbidden(err), "%s: want forbidden, got %v", call, err)
	}

	raw, err := json.Marshal(map[string]any{"workers": []map[string]any{{"id": "w0", "endpoint": "127.0.0.1:8000"}}})
	require.NoError(t, err)
	workers := filepath.Join(t.TempDir(), "workers.json")
	require.NoError(t, os.WriteFile(workers, raw, 0o600))
	ports, err := freePorts(1)
	require.NoError(t, err)
	port := ports[0]
	route := func(ip string) string { return net.JoinHostPort(ip, strconv.Itoa(port)) }

	// No Service yet: the replica stops and says why.
	missing := startEPPEnv(t, hh, peerEnv(s, nextIP(t), port, workers))
	rec := missing.waitLog(startTimeout, "a missing peer Service must stop the EPP", eppproc.MsgIs("epp stopped"))
	require.Contains(t, rec.Str("err"), "peer service not found")
	<-missing.Done()
	missing.stop()

	_, err = hh.admin.CoreV1().Services(s.ns).Create(ctx, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: peerService},
		Spec: corev1.ServiceSpec{ClusterIP: corev1.ClusterIPNone, PublishNotReadyAddresses: true,
			Selector: map[string]string{"app": "kvselect-epp"},
			Ports:    []corev1.ServicePort{{Name: "replica-sync", Port: 9092}}},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	const b, c, d = "198.51.100.2", "198.51.100.3", "198.51.100.4"
	s.putSlice("epp-peers-1", discoveryv1.AddressTypeIPv4, peerService, peerEndpoint{b, true}, peerEndpoint{c, false})
	s.putSlice("epp-peers-v6", discoveryv1.AddressTypeIPv6, peerService, peerEndpoint{"2001:db8::5", true})
	s.putSlice("other-1", discoveryv1.AddressTypeIPv4, "other", peerEndpoint{"198.51.100.9", true})

	a := startEPPEnv(t, hh, peerEnv(s, nextIP(t), port, workers))
	a.waitServing()
	a.waitLog(reconcileTimeout, "the first census: B (C is not ready; IPv6 and another Service's slices ignored)",
		census(1, []string{route(b)}, []string{}))
	configured := func(n int) func() bool {
		return func() bool { return a.counter("kvselect_replica_nats_routes_configured", nil) == float64(n) }
	}
	a.eventually("one route configured", configured(1))

	s.putSlice("epp-peers-1", discoveryv1.AddressTypeIPv4, peerService, peerEndpoint{b, true}, peerEndpoint{c, true})
	a.waitLog(reconcileTimeout, "C turned ready", census(2, []string{route(c)}, []string{}))
	s.putSlice("epp-peers-2", discoveryv1.AddressTypeIPv4, peerService, peerEndpoint{d, true})
	a.waitLog(reconcileTimeout, "D came in a slice of its own", census(3, []string{route(d)}, []string{}))
	a.eventually("three routes configured", configured(3))

	s.putSlice("epp-peers-1", discoveryv1.AddressTypeIPv4, peerService, peerEndpoint{b, false}, peerEndpoint{c, true})
	a.waitLog(reconcileTimeout, "B turned unready", census(2, []string{}, []string{route(b)}))
	require.NoError(t, hh.admin.DiscoveryV1().EndpointSlices(s.ns).Delete(ctx, "epp-peers-1", metav1.DeleteOptions{}))
	a.waitLog(reconcileTimeout, "C went with its slice", census(1, []string{}, []string{route(c)}))
	require.NoError(t, hh.admin.DiscoveryV1().EndpointSlices(s.ns).Delete(ctx, "epp-peers-2", metav1.DeleteOptions{}))
	a.waitLog(reconcileTimeout, "no peer left", census(0, []string{}, []string{route(d)}))
	a.eventually("no route configured", configured(0))
	require.Zero(t, a.counter("kvselect_replica_nats_routes", nil), "no route ever connected to an address where nothing answers")
	require.False(t, a.Exited(), "the replica still runs")
}
