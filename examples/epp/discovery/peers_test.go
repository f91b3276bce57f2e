package discovery_test

import (
	"context"
	"errors"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	kfake "k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/kvselect/kvselect/examples/epp/discovery"
)

const peerSvc = "epp-peers"

func peerService() *corev1.Service {
	return &corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: testNS, Name: peerSvc}}
}

type ep struct {
	addr               string
	ready, terminating *bool
}

func yes() *bool { b := true; return &b }
func no() *bool  { b := false; return &b }

func slice(name, service string, family discoveryv1.AddressType, eps ...ep) *discoveryv1.EndpointSlice {
	es := &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Namespace: testNS, Name: name, Labels: map[string]string{discoveryv1.LabelServiceName: service}},
		AddressType: family,
	}
	for _, e := range eps {
		es.Endpoints = append(es.Endpoints, discoveryv1.Endpoint{Addresses: []string{e.addr},
			Conditions: discoveryv1.EndpointConditions{Ready: e.ready, Terminating: e.terminating}})
	}
	return es
}

// peersEnv runs a peer source against a fake clientset and collects its
// sets.
type peersEnv struct {
	cs   *kfake.Clientset
	sets chan []string
	done chan error
	logs *logBuf
}

func startPeers(t *testing.T, podIP string, maxPeers int, objs ...runtime.Object) *peersEnv {
	t.Helper()
	e := &peersEnv{cs: kfake.NewClientset(objs...), sets: make(chan []string, 64), done: make(chan error, 1), logs: &logBuf{}}
	watching := watchStarted(&e.cs.Fake, e.cs.Tracker(), "endpointslices")
	p, err := discovery.NewPeers(discovery.PeerOptions{Clientset: e.cs, Namespace: testNS, Service: peerSvc, PodIP: podIP,
		Port: 9092, MaxPeers: maxPeers, Logger: slog.New(slog.NewJSONHandler(e.logs, nil))})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	go func() { e.done <- p.Run(ctx, func(s []string) { e.sets <- s }) }()
	t.Cleanup(func() {
		cancel()
		require.ErrorIs(t, <-e.done, context.Canceled)
	})
	select {
	case <-watching:
	case err := <-e.done:
		t.Fatalf("Run ended: %v", err)
	case <-time.After(waitFor):
		t.Fatal("the endpointslice watch never started")
	}
	return e
}

func (e *peersEnv) next(t *testing.T) []string {
	t.Helper()
	select {
	case s := <-e.sets:
		return s
	case err := <-e.done:
		t.Fatalf("Run ended: %v", err)
	case <-time.After(waitFor):
		t.Fatal("no peer set")
	}
	return nil
}

// The peer set follows the Service's EndpointSlices: ready endpoints of
// this pod's address family, on the sync port, self excluded, other
// Services' slices ignored; it changes as endpoints come, turn unready or
// terminating, and go; each change is logged.
func TestPeersFollowEndpointSlices(t *testing.T) {
	e := startPeers(t, "10.0.0.1", 0, peerService(),
		slice("a", peerSvc, discoveryv1.AddressTypeIPv4, ep{addr: "10.0.0.1", ready: yes()}, ep{addr: "10.0.0.2", ready: yes()}, ep{addr: "10.0.0.3"}),
		slice("a6", peerSvc, discoveryv1.AddressTypeIPv6, ep{addr: "fd00::2", ready: yes()}),
		slice("other", "another", discoveryv1.AddressTypeIPv4, ep{addr: "10.0.0.9", ready: yes()}),
	)
	require.Equal(t, []string{"10.0.0.2:9092", "10.0.0.3:9092"}, e.next(t), "self excluded, unset Ready is ready, IPv6 and other services ignored")

	ctx := context.Background()
	slices := e.cs.DiscoveryV1().EndpointSlices(testNS)
	_, err := slices.Create(ctx, slice("b", peerSvc, discoveryv1.AddressTypeIPv4, ep{addr: "10.0.0.4", ready: yes()}, ep{addr: "10.0.0.5", ready: no()}), metav1.CreateOptions{})
	require.NoError(t, err)
	require.Equal(t, []string{"10.0.0.2:9092", "10.0.0.3:9092", "10.0.0.4:9092"}, e.next(t), "an unready endpoint is no peer")

	_, err = slices.Update(ctx, slice("a", peerSvc, discoveryv1.AddressTypeIPv4, ep{addr: "10.0.0.1", ready: yes()}, ep{addr: "10.0.0.2", ready: yes(), terminating: yes()}), metav1.UpdateOptions{})
	require.NoError(t, err)
	require.Equal(t, []string{"10.0.0.4:9092"}, e.next(t), "a terminating endpoint and a removed one are gone")

	require.NoError(t, slices.Delete(ctx, "b", metav1.DeleteOptions{}))
	require.Empty(t, e.next(t))

	recs := e.logs.records(t, "replica peers")
	require.Len(t, recs, 4)
	require.EqualValues(t, 2, recs[0]["peers"])
	require.Equal(t, []any{"10.0.0.4:9092"}, recs[1]["added"])
	require.Equal(t, []any{"10.0.0.4:9092"}, recs[3]["removed"])
}

// An IPv6 pod routes to the IPv6 endpoints only, in brackets.
func TestPeersIPv6(t *testing.T) {
	e := startPeers(t, "fd00::1", 0, peerService(),
		slice("a", peerSvc, discoveryv1.AddressTypeIPv4, ep{addr: "10.0.0.2", ready: yes()}),
		slice("a6", peerSvc, discoveryv1.AddressTypeIPv6, ep{addr: "fd00::1", ready: yes()}, ep{addr: "fd00::2", ready: yes()}),
	)
	require.Equal(t, []string{"[fd00::2]:9092"}, e.next(t))
}

// The set is bounded: past MaxPeers, the first addresses are kept, with a
// WARN.
func TestPeersBounded(t *testing.T) {
	var eps []ep
	for _, a := range []string{"10.0.0.5", "10.0.0.2", "10.0.0.4", "10.0.0.3"} {
		eps = append(eps, ep{addr: a})
	}
	e := startPeers(t, "10.0.0.1", 2, peerService(), slice("a", peerSvc, discoveryv1.AddressTypeIPv4, eps...))
	require.Equal(t, []string{"10.0.0.2:9092", "10.0.0.3:9092"}, e.next(t))
	require.NotEmpty(t, e.logs.records(t, "too many peers; routing to the first ones only"))
}

// A missing Service, or one the Role may not read, ends Run at once with a
// clear error; a transient error is retried.
func TestPeersServiceChecked(t *testing.T) {
	run := func(cs *kfake.Clientset) error {
		p, err := discovery.NewPeers(discovery.PeerOptions{Clientset: cs, Namespace: testNS, Service: peerSvc, PodIP: "10.0.0.1", Port: 9092})
		require.NoError(t, err)
		ctx, cancel := context.WithTimeout(context.Background(), waitFor)
		defer cancel()
		return p.Run(ctx, func([]string) { cancel() })
	}
	err := run(kfake.NewClientset())
	require.ErrorIs(t, err, discovery.ErrPeerServiceNotFound)
	require.ErrorContains(t, err, "DYN_EPP_PEER_SERVICE")

	cs := kfake.NewClientset(peerService())
	cs.PrependReactor("get", "services", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, apierrors.NewForbidden(schema.GroupResource{Resource: "services"}, peerSvc, errors.New("no"))
	})
	require.ErrorIs(t, run(cs), discovery.ErrPeerForbidden)

	cs = kfake.NewClientset(peerService())
	fails := 2
	cs.PrependReactor("get", "services", func(k8stesting.Action) (bool, runtime.Object, error) {
		if fails > 0 {
			fails--
			return true, nil, apierrors.NewServiceUnavailable("busy")
		}
		return false, nil, nil
	})
	require.ErrorIs(t, run(cs), context.Canceled, "retried until the Service was read, then synced (the sink cancels)")
	require.Zero(t, fails)
}

func TestNewPeersInvalid(t *testing.T) {
	cs := kfake.NewClientset()
	ok := discovery.PeerOptions{Clientset: cs, Namespace: testNS, Service: peerSvc, PodIP: "10.0.0.1", Port: 9092}
	_, err := discovery.NewPeers(ok)
	require.NoError(t, err)
	for name, edit := range map[string]func(*discovery.PeerOptions){
		"clientset": func(o *discovery.PeerOptions) { o.Clientset = nil },
		"namespace": func(o *discovery.PeerOptions) { o.Namespace = "Bad_NS" },
		"service":   func(o *discovery.PeerOptions) { o.Service = "1peers" },
		"pod ip":    func(o *discovery.PeerOptions) { o.PodIP = "pod" },
		"port":      func(o *discovery.PeerOptions) { o.Port = 0 },
		"max peers": func(o *discovery.PeerOptions) { o.MaxPeers = -1 },
		"resync":    func(o *discovery.PeerOptions) { o.Resync = -1 },
	} {
		o := ok
		edit(&o)
		_, err := discovery.NewPeers(o)
		require.ErrorIs(t, err, discovery.ErrInvalidOptions, name)
	}
	p, err := discovery.NewPeers(ok)
	require.NoError(t, err)
	require.ErrorIs(t, p.Run(context.Background(), nil), discovery.ErrInvalidOptions)
}
