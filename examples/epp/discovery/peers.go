package discovery

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/validation"
	discoveryinformers "k8s.io/client-go/informers/discovery/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
)

// DefaultMaxPeers bounds the peer set of PeerOptions.MaxPeers.
const DefaultMaxPeers = 256

// Errors of Peers.Run about the peer Service.
var (
	// ErrPeerServiceNotFound: the namespace has no Service of that name.
	ErrPeerServiceNotFound = errors.New("discovery: peer service not found")
	// ErrPeerForbidden: the API server refused to read the Service (the
	// EPP's Role lacks services get).
	ErrPeerForbidden = errors.New("discovery: reading the peer service is forbidden")
)

// PeerOptions configure NewPeers. Every field is validated; the zero value
// is not usable.
type PeerOptions struct {
	// Clientset reads the Service and its EndpointSlices. Required.
	Clientset kubernetes.Interface
	// Namespace holds the Service (POD_NAMESPACE). Required; a DNS label.
	Namespace string
	// Service names the peers' Service (DYN_EPP_PEER_SERVICE), usually
	// headless. Required; a DNS-1035 label.
	Service string
	// PodIP is this replica's own IP (POD_IP): its address is never a peer,
	// and only endpoints of its address family are. Required.
	PodIP string
	// Port is the port of every peer address (DYN_EPP_REPLICA_SYNC_PORT):
	// peers are ip:Port. 1..65535.
	Port int
	// MaxPeers bounds the peer set: beyond it, the first MaxPeers addresses
	// in order are kept and a WARN says so. Default DefaultMaxPeers.
	MaxPeers int
	// Resync is the informer's periodic resync; 0 disables it, negative is
	// invalid.
	Resync time.Duration
	// Logger receives the census lines (the peers changed) and the
	// Service's problems. Default: discard.
	Logger *slog.Logger
}

func (o *PeerOptions) validate() error {
	var problems []string
	add := func(format string, args ...any) { problems = append(problems, fmt.Sprintf(format, args...)) }
	if o.Clientset == nil {
		add("Clientset is nil")
	}
	if errs := validation.IsDNS1123Label(o.Namespace); len(errs) > 0 {
		add("Namespace %q: %s", o.Namespace, strings.Join(errs, ", "))
	}
	if errs := validation.IsDNS1035Label(o.Service); len(errs) > 0 {
		add("Service %q: %s", o.Service, strings.Join(errs, ", "))
	}
	if _, err := netip.ParseAddr(o.PodIP); err != nil {
		add("PodIP %q is not an IP address", o.PodIP)
	}
	if o.Port < 1 || o.Port > 65535 {
		add("Port %d is not in 1..65535", o.Port)
	}
	switch {
	case o.MaxPeers < 0:
		add("MaxPeers %d is negative", o.MaxPeers)
	case o.MaxPeers == 0:
		o.MaxPeers = DefaultMaxPeers
	}
	if o.Resync < 0 {
		add("Resync %v is negative", o.Resync)
	}
	if len(problems) == 0 {
		return nil
	}
	return fmt.Errorf("%w: %s", ErrInvalidOptions, strings.Join(problems, "; "))
}

// Peers finds the other replicas of this EPP: the ready endpoints of one
// Service, read from its EndpointSlices (label kubernetes.io/service-name),
// as ip:port addresses of the embedded NATS servers to route to.
//
// Peers is safe to share between goroutines; Run may be called once.
type Peers struct {
	o    PeerOptions
	self netip.Addr
	log  *slog.Logger
	once onceGuard
}

// NewPeers validates o and returns a peer source. It starts nothing and does
// not contact the API server. Errors: ErrInvalidOptions (wrapped, listing
// every problem).
func NewPeers(o PeerOptions) (*Peers, error) {
	if err := o.validate(); err != nil {
		return nil, err
	}
	log := o.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	self := netip.MustParseAddr(o.PodIP).Unmap()
	return &Peers{o: o, self: self, log: log.With("peer_service", o.Namespace+"/"+o.Service)}, nil
}

// Run checks that the Service exists, then watches its EndpointSlices and,
// once the informer's cache has synced, calls sink with the peer set (sorted
// ip:port, never this replica's own address, only addresses of PodIP's
// family, endpoints that are ready and not terminating, at most MaxPeers)
// and again every time it changes. sink is called from one goroutine, one
// call at a time.
//
// Errors: a missing Service (ErrPeerServiceNotFound) or one the Role may
// not read (ErrPeerForbidden) end Run at once; other API errors on that
// first read are retried with back-off until ctx ends. Later API errors (a
// forbidden list or watch) do not end Run: the informer retries and the
// last set stays. Otherwise Run returns ctx.Err() once the informer and the
// loop have stopped; ErrAlreadyRun on a second call.
func (p *Peers) Run(ctx context.Context, sink func([]string)) error {
	if sink == nil {
		return fmt.Errorf("%w: sink is nil", ErrInvalidOptions)
	}
	if !p.once.start() {
		return ErrAlreadyRun
	}
	if err := p.checkService(ctx); err != nil {
		return err
	}
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	selector := labels.SelectorFromSet(labels.Set{discoveryv1.LabelServiceName: p.o.Service}).String()
	inf := discoveryinformers.NewFilteredEndpointSliceInformer(p.o.Clientset, p.o.Namespace, p.o.Resync, cache.Indexers{},
		func(lo *metav1.ListOptions) { lo.LabelSelector = selector })
	dirty := make(chan struct{}, 1)
	mark := func() {
		select {
		case dirty <- struct{}{}:
		default:
		}
	}
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: func(any) { mark() }, UpdateFunc: func(any, any) { mark() }, DeleteFunc: func(any) { mark() },
	}); err != nil {
		return fmt.Errorf("discovery: endpointslice informer: %w", err)
	}
	var wg sync.WaitGroup
	wg.Go(func() { inf.RunWithContext(runCtx) })
	p.loop(runCtx, inf, dirty, sink)
	cancel()
	wg.Wait()
	return ctx.Err()
}

// checkService reads the Service once, retrying errors that may pass.
func (p *Peers) checkService(ctx context.Context) error {
	wait := 200 * time.Millisecond
	for {
		_, err := p.o.Clientset.CoreV1().Services(p.o.Namespace).Get(ctx, p.o.Service, metav1.GetOptions{})
		switch {
		case err == nil:
			return nil
		case apierrors.IsNotFound(err):
			return fmt.Errorf("%w: %s/%s (DYN_EPP_PEER_SERVICE): %v", ErrPeerServiceNotFound, p.o.Namespace, p.o.Service, err)
		case apierrors.IsForbidden(err), apierrors.IsUnauthorized(err):
			return fmt.Errorf("%w: %s/%s: %v (grant services get, endpointslices list and watch)", ErrPeerForbidden, p.o.Namespace, p.o.Service, err)
		}
		p.log.Warn("reading the peer service failed; retrying", "err", err, "in", wait)
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		}
		wait = min(2*wait, 5*time.Second)
	}
}

func (p *Peers) loop(ctx context.Context, inf cache.SharedIndexInformer, dirty <-chan struct{}, sink func([]string)) {
	synced := inf.HasSyncedChecker().Done()
	var (
		last    []string
		emitted bool
	)
	for {
		select {
		case <-ctx.Done():
			return
		case <-dirty:
		case <-synced:
			synced = nil
		}
		if synced != nil {
			continue
		}
		set := p.peerSet(inf.GetStore().List())
		if emitted && slices.Equal(set, last) {
			continue
		}
		if ctx.Err() != nil {
			return
		}
		p.census(last, set, emitted)
		last, emitted = set, true
		sink(slices.Clone(set))
	}
}

// peerSet computes the peer addresses from the Service's EndpointSlices.
func (p *Peers) peerSet(objs []any) []string {
	want := discoveryv1.AddressTypeIPv4
	if p.self.Is6() {
		want = discoveryv1.AddressTypeIPv6
	}
	port := strconv.Itoa(p.o.Port)
	var set []string
	for _, obj := range objs {
		es, ok := obj.(*discoveryv1.EndpointSlice)
		if !ok || es.AddressType != want || es.Labels[discoveryv1.LabelServiceName] != p.o.Service {
			continue
		}
		for _, ep := range es.Endpoints {
			// Ready unset means ready (the API's rule); a terminating
			// endpoint is on its way out.
			if (ep.Conditions.Ready != nil && !*ep.Conditions.Ready) || (ep.Conditions.Terminating != nil && *ep.Conditions.Terminating) {
				continue
			}
			for _, a := range ep.Addresses {
				ip, err := netip.ParseAddr(a)
				if err != nil {
					continue
				}
				ip = ip.Unmap()
				if ip == p.self || ip.Is6() != p.self.Is6() {
					continue
				}
				set = append(set, net.JoinHostPort(ip.String(), port))
			}
		}
	}
	slices.Sort(set)
	set = slices.Compact(set)
	if len(set) > p.o.MaxPeers {
		p.log.Warn("too many peers; routing to the first ones only", "peers", len(set), "max", p.o.MaxPeers)
		set = set[:p.o.MaxPeers]
	}
	return set
}

// census logs a changed peer set: its size, and up to 16 addresses that
// came and went.
func (p *Peers) census(old, now []string, emitted bool) {
	added, removed := diffSorted(old, now), diffSorted(now, old)
	const show = 16
	p.log.Info("replica peers", "peers", len(now), "first", !emitted,
		"added", added[:min(len(added), show)], "removed", removed[:min(len(removed), show)])
}

// diffSorted returns the elements of b missing from a (both sorted).
func diffSorted(a, b []string) []string {
	out := []string{}
	for _, s := range b {
		if _, found := slices.BinarySearch(a, s); !found {
			out = append(out, s)
		}
	}
	return out
}
