package discovery

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/dynamic/dynamicinformer"
	coreinformers "k8s.io/client-go/informers/core/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	"github.com/kvselect/kvselect/catalog"
)

// DefaultKVEventPort is the port vLLM publishes KV events on unless told
// otherwise, and the default of DYN_EPP_KV_EVENT_PORT. KubeOptions does not
// apply it by itself (there, 0 disables events): pass it explicitly.
const DefaultKVEventPort = 5557

// InferencePoolGVR is the resource the Kubernetes source watches: the Gateway
// API Inference Extension's InferencePool, API version v1.
var InferencePoolGVR = schema.GroupVersionResource{
	Group:    "inference.networking.k8s.io",
	Version:  "v1",
	Resource: "inferencepools",
}

// InferencePoolListKind is the list kind of InferencePoolGVR, needed by fake
// dynamic clients (k8s.io/client-go/dynamic/fake) in tests.
const InferencePoolListKind = "InferencePoolList"

// KubeOptions configures NewKubernetes. Every field is validated; the zero
// value is not usable (the clients, Namespace and PoolName are required).
type KubeOptions struct {
	// Dynamic reads the InferencePool. Required.
	Dynamic dynamic.Interface
	// Clientset reads Pods. Required.
	Clientset kubernetes.Interface
	// Namespace holds the pool and its pods (POD_NAMESPACE). Required; a DNS
	// label.
	Namespace string
	// PoolName names the InferencePool (DYN_EPP_INFERENCE_POOL_NAME). Required;
	// a DNS subdomain.
	PoolName string
	// Model is copied into every worker (DYN_MODEL_NAME). Empty means
	// catalog.DefaultModel.
	Model string
	// BlockSize, TotalKVBlocks and MaxNumBatchedTokens are copied into every
	// worker (DYN_KV_CACHE_BLOCK_SIZE, DYN_EPP_TOTAL_KV_BLOCKS,
	// DYN_EPP_MAX_NUM_BATCHED_TOKENS). 0 means not known (the catalog then
	// decides whether the worker is routable); negative is invalid.
	BlockSize, TotalKVBlocks, MaxNumBatchedTokens int
	// KVEventPort is the port each pod publishes KV events on; the worker gets
	// the event endpoint tcp://podIP:KVEventPort for rank 0. 0 disables events
	// (no event endpoints); it is not defaulted, so pass DefaultKVEventPort for
	// vLLM's default. 0..65535.
	KVEventPort int
	// ReplayPort is the port of each pod's replay (ROUTER) socket; the worker
	// gets tcp://podIP:ReplayPort as its replay endpoint. 0 means none.
	// 0..65535.
	ReplayPort int
	// RoleLabel is the pod label that names a worker's role. Discovery copies
	// every pod label into Worker.Labels anyway; RoleLabel only groups the
	// census log line. Empty means no grouping; otherwise a qualified label key.
	RoleLabel string
	// Resync is the informers' periodic resync interval. 0 disables it;
	// negative is invalid. Resync is not needed for correctness: every watch
	// event triggers a recomputation.
	Resync time.Duration
	// Logger receives the census and pool lines. Nil discards them.
	Logger *slog.Logger
}

func (o KubeOptions) validate() error {
	var problems []string
	add := func(format string, args ...any) { problems = append(problems, fmt.Sprintf(format, args...)) }
	if o.Dynamic == nil {
		add("Dynamic is nil")
	}
	if o.Clientset == nil {
		add("Clientset is nil")
	}
	if o.Namespace == "" {
		add("Namespace is empty")
	} else if errs := validation.IsDNS1123Label(o.Namespace); len(errs) > 0 {
		add("Namespace %q: %s", o.Namespace, strings.Join(errs, ", "))
	}
	if o.PoolName == "" {
		add("PoolName is empty")
	} else if errs := validation.IsDNS1123Subdomain(o.PoolName); len(errs) > 0 {
		add("PoolName %q: %s", o.PoolName, strings.Join(errs, ", "))
	}
	for _, f := range []struct {
		name string
		v    int
	}{{"BlockSize", o.BlockSize}, {"TotalKVBlocks", o.TotalKVBlocks}, {"MaxNumBatchedTokens", o.MaxNumBatchedTokens}} {
		if f.v < 0 {
			add("%s %d is negative", f.name, f.v)
		}
	}
	for _, f := range []struct {
		name string
		v    int
	}{{"KVEventPort", o.KVEventPort}, {"ReplayPort", o.ReplayPort}} {
		if f.v < 0 || f.v > 65535 {
			add("%s %d is not in 0..65535", f.name, f.v)
		}
	}
	if o.RoleLabel != "" {
		if errs := validation.IsQualifiedName(o.RoleLabel); len(errs) > 0 {
			add("RoleLabel %q: %s", o.RoleLabel, strings.Join(errs, ", "))
		}
	}
	if o.Resync < 0 {
		add("Resync %v is negative", o.Resync)
	}
	if len(problems) == 0 {
		return nil
	}
	return fmt.Errorf("%w: %s", ErrInvalidOptions, strings.Join(problems, "; "))
}

// Kubernetes is a Source that watches one InferencePool and the pods of its
// namespace and turns the pool's ready pods into workers. See the package
// documentation for the eligibility rules and the worker fields.
//
// Kubernetes is safe to share between goroutines; Run may be called once.
type Kubernetes struct {
	o    KubeOptions
	log  *slog.Logger
	once onceGuard
}

var _ Source = (*Kubernetes)(nil)

// NewKubernetes validates o and returns a source. It starts nothing and does
// not contact the API server. Errors: ErrInvalidOptions (wrapped, listing
// every problem).
func NewKubernetes(o KubeOptions) (*Kubernetes, error) {
	if err := o.validate(); err != nil {
		return nil, err
	}
	log := o.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Kubernetes{o: o, log: log}, nil
}

// Run starts an informer on the InferencePool and one on the namespace's pods,
// waits until both caches have synced, and from then on calls sink with the
// recomputed Snapshot whenever the pool or a pod changes in a way that alters
// it (equal snapshots are not repeated). The first Snapshot is Synced when the
// pool exists and has a usable spec; otherwise it carries Reason and no
// workers, and a Synced one follows once the pool appears or is fixed. A pool
// that later disappears yields a Snapshot with Synced false, no workers and
// ReasonPoolNotFound.
//
// Run returns ctx.Err() after both informers and the loop calling sink have
// stopped, ErrAlreadyRun on a second call, or an error wrapping
// ErrInvalidOptions when sink is nil. API errors (a missing CRD, forbidden
// list) do not end Run: the informers retry with back-off, and until their
// caches sync no Snapshot is emitted.
func (k *Kubernetes) Run(ctx context.Context, sink func(Snapshot)) error {
	if sink == nil {
		return fmt.Errorf("%w: sink is nil", ErrInvalidOptions)
	}
	if !k.once.start() {
		return ErrAlreadyRun
	}
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()

	nameSelector := fields.OneTermEqualSelector("metadata.name", k.o.PoolName).String()
	pools := dynamicinformer.NewFilteredDynamicInformer(k.o.Dynamic, InferencePoolGVR, k.o.Namespace, k.o.Resync,
		cache.Indexers{}, func(lo *metav1.ListOptions) { lo.FieldSelector = nameSelector }).Informer()
	pods := coreinformers.NewFilteredPodInformer(k.o.Clientset, k.o.Namespace, k.o.Resync, cache.Indexers{}, nil)
	if err := pods.SetTransform(trimPod); err != nil {
		return fmt.Errorf("discovery: pod informer: %w", err)
	}

	// Handlers only mark the state dirty: the loop recomputes from the stores,
	// which the informer updates before it calls the handlers, so coalesced
	// marks lose nothing.
	dirty := make(chan struct{}, 1)
	mark := func() {
		select {
		case dirty <- struct{}{}:
		default:
		}
	}
	handler := cache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { mark() },
		UpdateFunc: func(any, any) { mark() },
		DeleteFunc: func(any) { mark() },
	}
	for _, inf := range []cache.SharedIndexInformer{pools, pods} {
		if _, err := inf.AddEventHandler(handler); err != nil {
			return fmt.Errorf("discovery: informer handler: %w", err)
		}
	}

	var wg sync.WaitGroup
	wg.Go(func() { pools.RunWithContext(runCtx) })
	wg.Go(func() { pods.RunWithContext(runCtx) })
	k.loop(runCtx, pools, pods, dirty, sink)
	cancel()
	wg.Wait()
	return ctx.Err()
}

// loop waits for both caches, then recomputes and emits on every mark until
// ctx is done.
func (k *Kubernetes) loop(ctx context.Context, pools, pods cache.SharedIndexInformer, dirty <-chan struct{}, sink func(Snapshot)) {
	poolsSynced, podsSynced := pools.HasSyncedChecker().Done(), pods.HasSyncedChecker().Done()
	cen := census{log: k.log, roleLabel: k.o.RoleLabel, source: "kubernetes"}
	var (
		last     Snapshot
		emitted  bool
		lastPool poolState
	)
	for {
		select {
		case <-ctx.Done():
			return
		case <-dirty:
		case <-poolsSynced:
			poolsSynced = nil
		case <-podsSynced:
			podsSynced = nil
		}
		if poolsSynced != nil || podsSynced != nil {
			continue // a nil channel means that cache has synced
		}
		pool := k.resolvePool(pools.GetStore())
		if !pool.equal(lastPool) {
			k.logPool(pool)
			lastPool = pool
		}
		s := k.desired(pool, pods.GetStore().List())
		if emitted && s.Equal(last) {
			continue
		}
		if ctx.Err() != nil {
			return
		}
		last, emitted = s, true
		cen.observe(s)
		sink(s.clone())
	}
}

// poolState is what discovery needs from the InferencePool.
type poolState struct {
	matchLabels map[string]string
	port        int
	reason      string // non-empty: the pool cannot drive discovery
}

func (p poolState) equal(o poolState) bool {
	return p.port == o.port && p.reason == o.reason && maps.Equal(p.matchLabels, o.matchLabels)
}

func (k *Kubernetes) logPool(p poolState) {
	if p.reason != "" {
		k.log.Warn("inference pool unusable", slog.String("pool", k.o.Namespace+"/"+k.o.PoolName), slog.String("reason", p.reason))
		return
	}
	k.log.Info("inference pool resolved", slog.String("pool", k.o.Namespace+"/"+k.o.PoolName),
		slog.Any("match_labels", p.matchLabels), slog.Int("target_port", p.port))
}

// poolSpec is the part of the v1 InferencePool spec discovery reads.
type poolSpec struct {
	Selector struct {
		MatchLabels map[string]string `json:"matchLabels"`
	} `json:"selector"`
	TargetPorts []struct {
		Number int64 `json:"number"`
	} `json:"targetPorts"`
}

// resolvePool finds the pool in the store and extracts its selector and first
// target port.
func (k *Kubernetes) resolvePool(store cache.Store) poolState {
	obj, ok, err := store.GetByKey(k.o.Namespace + "/" + k.o.PoolName)
	if err != nil || !ok {
		return poolState{reason: ReasonPoolNotFound}
	}
	u, ok := obj.(*unstructured.Unstructured)
	if !ok {
		return poolState{reason: fmt.Sprintf("%s: unexpected object %T", ReasonPoolInvalid, obj)}
	}
	spec, err := parsePoolSpec(u)
	if err != nil {
		return poolState{reason: fmt.Sprintf("%s: %v", ReasonPoolInvalid, err)}
	}
	return poolState{matchLabels: spec.Selector.MatchLabels, port: int(spec.TargetPorts[0].Number)}
}

func parsePoolSpec(u *unstructured.Unstructured) (poolSpec, error) {
	var spec poolSpec
	raw, ok := u.Object["spec"].(map[string]any)
	if !ok {
		return spec, errors.New("spec is missing")
	}
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(raw, &spec); err != nil {
		return spec, fmt.Errorf("spec: %w", err)
	}
	if len(spec.Selector.MatchLabels) == 0 {
		return spec, errors.New("spec.selector.matchLabels is empty")
	}
	if len(spec.TargetPorts) == 0 {
		return spec, errors.New("spec.targetPorts is empty")
	}
	if n := spec.TargetPorts[0].Number; n < 1 || n > 65535 {
		return spec, fmt.Errorf("spec.targetPorts[0].number %d is not in 1..65535", n)
	}
	return spec, nil
}

// desired computes the snapshot for a resolved pool and the pods in the cache.
func (k *Kubernetes) desired(pool poolState, objs []any) Snapshot {
	if pool.reason != "" {
		return Snapshot{Reason: pool.reason}
	}
	ws := make([]catalog.Worker, 0, len(objs))
	ids := make(map[string]string, len(objs))
	for _, obj := range objs {
		pod, ok := obj.(*corev1.Pod)
		if !ok || !eligible(pod, pool.matchLabels) {
			continue
		}
		w := k.worker(pod, pool.port)
		if err := w.Validate(); err != nil { // not expected: the IP and ports were checked
			k.log.Error("pod skipped", slog.String("pod", w.Identity), slog.String("error", err.Error()))
			continue
		}
		if other, dup := ids[w.ID]; dup { // a 64-bit hash collision: keep the first, say so
			k.log.Error("worker id collision; pod skipped", slog.String("id", w.ID),
				slog.String("pod", w.Identity), slog.String("other", other))
			continue
		}
		ids[w.ID] = w.Identity
		ws = append(ws, w)
	}
	sortWorkers(ws)
	return Snapshot{Workers: ws, Synced: true}
}

// eligible reports whether pod is a ready member of the pool.
func eligible(pod *corev1.Pod, matchLabels map[string]string) bool {
	if pod.Name == "" || pod.DeletionTimestamp != nil || pod.Status.Phase != corev1.PodRunning {
		return false
	}
	if _, err := netip.ParseAddr(pod.Status.PodIP); err != nil {
		return false
	}
	for key, want := range matchLabels {
		if got, ok := pod.Labels[key]; !ok || got != want {
			return false
		}
	}
	for _, c := range pod.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// WorkerID returns the worker id discovery gives the pod namespace/name: the
// first 16 hex digits (64 bits) of the SHA-256 of "namespace/name". It is
// stable across restarts and EPP replicas, and independent of the pod's IP.
func WorkerID(namespace, name string) string {
	sum := sha256.Sum256([]byte(namespace + "/" + name))
	return hex.EncodeToString(sum[:8])
}

func (k *Kubernetes) worker(pod *corev1.Pod, port int) catalog.Worker {
	ip := pod.Status.PodIP
	w := catalog.Worker{
		ID:                  WorkerID(pod.Namespace, pod.Name),
		Model:               k.o.Model,
		Endpoint:            net.JoinHostPort(ip, strconv.Itoa(port)),
		DPStart:             0,
		DPSize:              1,
		BlockSize:           k.o.BlockSize,
		TotalKVBlocks:       k.o.TotalKVBlocks,
		MaxNumBatchedTokens: k.o.MaxNumBatchedTokens,
		Labels:              maps.Clone(pod.Labels),
		Identity:            pod.Namespace + "/" + pod.Name,
	}
	if k.o.KVEventPort > 0 {
		w.KVEventEndpoints = map[int]string{0: "tcp://" + net.JoinHostPort(ip, strconv.Itoa(k.o.KVEventPort))}
	}
	if k.o.ReplayPort > 0 {
		w.ReplayEndpoint = "tcp://" + net.JoinHostPort(ip, strconv.Itoa(k.o.ReplayPort))
	}
	return w
}

// trimPod keeps only the fields discovery reads, so the cache of a large
// namespace stays small. It is idempotent and leaves its input alone.
func trimPod(obj any) (any, error) {
	pod, ok := obj.(*corev1.Pod)
	if !ok {
		return obj, nil
	}
	t := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Name:              pod.Name,
			Namespace:         pod.Namespace,
			UID:               pod.UID,
			ResourceVersion:   pod.ResourceVersion,
			Labels:            pod.Labels,
			DeletionTimestamp: pod.DeletionTimestamp,
		},
		Status: corev1.PodStatus{Phase: pod.Status.Phase, PodIP: pod.Status.PodIP},
	}
	for _, c := range pod.Status.Conditions {
		if c.Type == corev1.PodReady {
			t.Status.Conditions = []corev1.PodCondition{{Type: c.Type, Status: c.Status}}
			break
		}
	}
	return t, nil
}
