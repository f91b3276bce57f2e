package discovery_test

import (
	"context"
	"log/slog"
	"maps"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/watch"
	dynfake "k8s.io/client-go/dynamic/fake"
	kfake "k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/examples/epp/discovery"
)

const (
	testNS    = "serving"
	testPool  = "qwen"
	roleLabel = "nvidia.com/role"
	waitFor   = 10 * time.Second
)

var podsGVR = schema.GroupVersionResource{Version: "v1", Resource: "pods"}

// kubeEnv runs a Kubernetes source against fake clients and collects its
// snapshots.
type kubeEnv struct {
	cs    *kfake.Clientset
	dyn   *dynfake.FakeDynamicClient
	snaps chan discovery.Snapshot
	logs  *logBuf
	last  discovery.Snapshot
}

// watchStarted makes the fake client's watch for one resource signal once it
// is registered with the tracker. A change made after that is certain to
// reach the informer; one made between the informer's list and its watch
// could be lost by the fake (a delete in that gap is never replayed).
func watchStarted(f *k8stesting.Fake, tracker k8stesting.ObjectTracker, resource string) <-chan struct{} {
	started := make(chan struct{})
	var once sync.Once
	f.PrependWatchReactor(resource, func(action k8stesting.Action) (bool, watch.Interface, error) {
		var opts metav1.ListOptions
		if wa, ok := action.(k8stesting.WatchActionImpl); ok {
			opts = wa.ListOptions
		}
		w, err := tracker.Watch(action.GetResource(), action.GetNamespace(), opts)
		if err == nil {
			once.Do(func() { close(started) })
		}
		return true, w, err
	})
	return started
}

func startKube(t *testing.T, edit func(*discovery.KubeOptions), objs []runtime.Object, pods ...*corev1.Pod) *kubeEnv {
	t.Helper()
	podObjs := make([]runtime.Object, len(pods))
	for i, p := range pods {
		podObjs[i] = p
	}
	e := &kubeEnv{
		cs: kfake.NewClientset(podObjs...),
		dyn: dynfake.NewSimpleDynamicClientWithCustomListKinds(runtime.NewScheme(),
			map[schema.GroupVersionResource]string{discovery.InferencePoolGVR: discovery.InferencePoolListKind}, objs...),
		snaps: make(chan discovery.Snapshot, 64),
		logs:  &logBuf{},
	}
	podWatch := watchStarted(&e.cs.Fake, e.cs.Tracker(), "pods")
	poolWatch := watchStarted(&e.dyn.Fake, e.dyn.Tracker(), "inferencepools")
	o := discovery.KubeOptions{
		Dynamic:             e.dyn,
		Clientset:           e.cs,
		Namespace:           testNS,
		PoolName:            testPool,
		Model:               "qwen3",
		BlockSize:           16,
		TotalKVBlocks:       4096,
		MaxNumBatchedTokens: 8192,
		KVEventPort:         discovery.DefaultKVEventPort,
		ReplayPort:          5558,
		RoleLabel:           roleLabel,
		Logger:              slog.New(slog.NewJSONHandler(e.logs, nil)),
	}
	if edit != nil {
		edit(&o)
	}
	src, err := discovery.NewKubernetes(o)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- src.Run(ctx, func(s discovery.Snapshot) { e.snaps <- s }) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			require.ErrorIs(t, err, context.Canceled)
		case <-time.After(waitFor):
			t.Fatal("Run did not return after cancel")
		}
	})
	for _, ch := range []<-chan struct{}{podWatch, poolWatch} {
		select {
		case <-ch:
		case <-time.After(waitFor):
			t.Fatal("informer watch not started")
		}
	}
	return e
}

// next returns the next snapshot.
func (e *kubeEnv) next(t *testing.T) discovery.Snapshot {
	t.Helper()
	select {
	case s := <-e.snaps:
		e.last = s
		return s
	case <-time.After(waitFor):
		t.Fatal("no snapshot")
		return discovery.Snapshot{}
	}
}

// until reads snapshots until one satisfies ok, and returns it.
func (e *kubeEnv) until(t *testing.T, ok func(discovery.Snapshot) bool) discovery.Snapshot {
	t.Helper()
	deadline := time.After(waitFor)
	for {
		select {
		case s := <-e.snaps:
			e.last = s
			if ok(s) {
				return s
			}
		case <-deadline:
			t.Fatalf("no matching snapshot; last: %+v", e.last)
		}
	}
}

// untilIDs waits for a synced snapshot whose workers are exactly the pods named.
func (e *kubeEnv) untilIDs(t *testing.T, names ...string) discovery.Snapshot {
	t.Helper()
	return e.until(t, func(s discovery.Snapshot) bool { return s.Synced && equalIdentities(s, names) })
}

func equalIdentities(s discovery.Snapshot, names []string) bool {
	if len(s.Workers) != len(names) {
		return false
	}
	want := make(map[string]bool, len(names))
	for _, n := range names {
		want[testNS+"/"+n] = true
	}
	for _, w := range s.Workers {
		if !want[w.Identity] {
			return false
		}
	}
	return true
}

func (e *kubeEnv) createPod(t *testing.T, p *corev1.Pod) {
	t.Helper()
	_, err := e.cs.CoreV1().Pods(testNS).Create(context.Background(), p, metav1.CreateOptions{})
	require.NoError(t, err)
}

// editPod reads the pod, applies edit and writes it back.
func (e *kubeEnv) editPod(t *testing.T, name string, edit func(*corev1.Pod)) {
	t.Helper()
	pods := e.cs.CoreV1().Pods(testNS)
	p, err := pods.Get(context.Background(), name, metav1.GetOptions{})
	require.NoError(t, err)
	edit(p)
	_, err = pods.Update(context.Background(), p, metav1.UpdateOptions{})
	require.NoError(t, err)
}

func (e *kubeEnv) deletePod(t *testing.T, name string) {
	t.Helper()
	require.NoError(t, e.cs.CoreV1().Pods(testNS).Delete(context.Background(), name, metav1.DeleteOptions{}))
}

func (e *kubeEnv) createPool(t *testing.T, p *unstructured.Unstructured) {
	t.Helper()
	_, err := e.dyn.Resource(discovery.InferencePoolGVR).Namespace(testNS).Create(context.Background(), p, metav1.CreateOptions{})
	require.NoError(t, err)
}

func (e *kubeEnv) updatePool(t *testing.T, p *unstructured.Unstructured) {
	t.Helper()
	_, err := e.dyn.Resource(discovery.InferencePoolGVR).Namespace(testNS).Update(context.Background(), p, metav1.UpdateOptions{})
	require.NoError(t, err)
}

func (e *kubeEnv) deletePool(t *testing.T) {
	t.Helper()
	require.NoError(t, e.dyn.Resource(discovery.InferencePoolGVR).Namespace(testNS).Delete(context.Background(), testPool, metav1.DeleteOptions{}))
}

// pool builds a v1 InferencePool.
func pool(name string, matchLabels map[string]string, ports ...int64) *unstructured.Unstructured {
	sel := make(map[string]any, len(matchLabels))
	for k, v := range matchLabels {
		sel[k] = v
	}
	tps := make([]any, len(ports))
	for i, p := range ports {
		tps[i] = map[string]any{"number": p}
	}
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "inference.networking.k8s.io/v1",
		"kind":       "InferencePool",
		"metadata":   map[string]any{"name": name, "namespace": testNS},
		"spec": map[string]any{
			"selector":    map[string]any{"matchLabels": sel},
			"targetPorts": tps,
		},
	}}
}

var appLabels = map[string]string{"app": "qwen"}

// readyPod builds a Running, Ready pod with the pool's labels plus extra.
func readyPod(name, ip string, extra map[string]string) *corev1.Pod {
	labels := maps.Clone(appLabels)
	maps.Copy(labels, extra)
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: testNS, Labels: labels},
		Status: corev1.PodStatus{
			Phase: corev1.PodRunning,
			PodIP: ip,
			Conditions: []corev1.PodCondition{
				{Type: corev1.PodScheduled, Status: corev1.ConditionTrue},
				{Type: corev1.PodReady, Status: corev1.ConditionTrue},
			},
		},
	}
}

func setReady(status corev1.ConditionStatus) func(*corev1.Pod) {
	return func(p *corev1.Pod) {
		for i := range p.Status.Conditions {
			if p.Status.Conditions[i].Type == corev1.PodReady {
				p.Status.Conditions[i].Status = status
			}
		}
	}
}

func poolObjs() []runtime.Object { return []runtime.Object{pool(testPool, appLabels, 8000)} }

func TestKubeWorkerFields(t *testing.T) {
	e := startKube(t, nil, poolObjs(), readyPod("a", "10.0.0.1", map[string]string{roleLabel: "decode"}))
	s := e.next(t)
	require.True(t, s.Synced)
	require.Empty(t, s.Reason)
	require.Equal(t, []catalog.Worker{{
		ID:                  discovery.WorkerID(testNS, "a"),
		Model:               "qwen3",
		Endpoint:            "10.0.0.1:8000",
		DPStart:             0,
		DPSize:              1,
		KVEventEndpoints:    map[int]string{0: "tcp://10.0.0.1:5557"},
		ReplayEndpoint:      "tcp://10.0.0.1:5558",
		BlockSize:           16,
		TotalKVBlocks:       4096,
		MaxNumBatchedTokens: 8192,
		Labels:              map[string]string{"app": "qwen", roleLabel: "decode"},
		Identity:            testNS + "/a",
	}}, s.Workers)
	require.NoError(t, s.Workers[0].Validate())
}

func TestKubeEventsDisabledAndIPv6(t *testing.T) {
	e := startKube(t, func(o *discovery.KubeOptions) { o.KVEventPort, o.ReplayPort = 0, 0 },
		poolObjs(), readyPod("a", "fd00::7", nil))
	s := e.next(t)
	require.Len(t, s.Workers, 1)
	w := s.Workers[0]
	require.Equal(t, "[fd00::7]:8000", w.Endpoint)
	require.Empty(t, w.KVEventEndpoints)
	require.Empty(t, w.ReplayEndpoint)
	require.NoError(t, w.Validate())
}

func TestKubeEligibility(t *testing.T) {
	notReady := readyPod("not-ready", "10.0.0.2", nil)
	setReady(corev1.ConditionFalse)(notReady)
	noReadyCond := readyPod("no-ready-condition", "10.0.0.3", nil)
	noReadyCond.Status.Conditions = noReadyCond.Status.Conditions[:1]
	pending := readyPod("pending", "10.0.0.4", nil)
	pending.Status.Phase = corev1.PodPending
	noIP := readyPod("no-ip", "", nil)
	badIP := readyPod("bad-ip", "10.0.0", nil)
	otherApp := readyPod("other-app", "10.0.0.6", map[string]string{"app": "llama"})
	terminating := readyPod("terminating", "10.0.0.7", nil)
	terminating.DeletionTimestamp = &metav1.Time{Time: time.Unix(1, 0)}
	terminating.Finalizers = []string{"example.com/keep"}
	otherNS := readyPod("elsewhere", "10.0.0.8", nil)
	otherNS.Namespace = "other"

	e := startKube(t, nil, poolObjs(), readyPod("a", "10.0.0.1", nil), notReady, noReadyCond, pending,
		noIP, badIP, otherApp, terminating, otherNS)
	s := e.next(t)
	require.True(t, s.Synced)
	require.True(t, equalIdentities(s, []string{"a"}), "%+v", s.Workers)

	// Becoming Ready adds the pod; losing Ready removes another.
	e.editPod(t, "not-ready", setReady(corev1.ConditionTrue))
	e.untilIDs(t, "a", "not-ready")
	e.editPod(t, "a", setReady(corev1.ConditionFalse))
	e.untilIDs(t, "not-ready")

	// A pod that is created NotReady changes nothing: the next snapshot is the
	// one caused by the ready marker pod created after it.
	late := readyPod("late", "10.0.0.9", nil)
	setReady(corev1.ConditionFalse)(late)
	e.createPod(t, late)
	e.createPod(t, readyPod("marker", "10.0.0.10", nil))
	s = e.next(t)
	require.True(t, equalIdentities(s, []string{"not-ready", "marker"}), "%+v", s.Workers)
}

func TestKubeTerminatingAndDeleted(t *testing.T) {
	e := startKube(t, nil, poolObjs(), readyPod("a", "10.0.0.1", nil), readyPod("b", "10.0.0.2", nil))
	e.untilIDs(t, "a", "b")

	e.editPod(t, "a", func(p *corev1.Pod) { p.DeletionTimestamp = &metav1.Time{Time: time.Unix(5, 0)} })
	e.untilIDs(t, "b")

	e.deletePod(t, "b")
	s := e.next(t)
	require.True(t, s.Synced)
	require.Empty(t, s.Workers)

	e.createPod(t, readyPod("c", "10.0.0.3", nil))
	e.untilIDs(t, "c")
}

func TestKubePodIPChange(t *testing.T) {
	e := startKube(t, nil, poolObjs(), readyPod("a", "10.0.0.1", nil))
	before := e.next(t).Workers[0]

	e.editPod(t, "a", func(p *corev1.Pod) { p.Status.PodIP = "10.0.9.9" })
	s := e.until(t, func(s discovery.Snapshot) bool {
		return len(s.Workers) == 1 && s.Workers[0].Endpoint == "10.0.9.9:8000"
	})
	after := s.Workers[0]
	require.Equal(t, before.ID, after.ID, "the id does not depend on the IP")
	require.Equal(t, map[int]string{0: "tcp://10.0.9.9:5557"}, after.KVEventEndpoints)
	require.Equal(t, "tcp://10.0.9.9:5558", after.ReplayEndpoint)
}

func TestKubeLabelChangeAndRoleFlip(t *testing.T) {
	e := startKube(t, nil, poolObjs(),
		readyPod("a", "10.0.0.1", map[string]string{roleLabel: "prefill"}), readyPod("b", "10.0.0.2", nil))
	e.untilIDs(t, "a", "b")

	// b stops matching the selector, then matches again.
	e.editPod(t, "b", func(p *corev1.Pod) { p.Labels["app"] = "other" })
	e.untilIDs(t, "a")
	e.editPod(t, "b", func(p *corev1.Pod) { p.Labels["app"] = "qwen" })
	e.untilIDs(t, "a", "b")

	// A role flip keeps the worker and updates its labels.
	e.editPod(t, "a", func(p *corev1.Pod) { p.Labels[roleLabel] = "decode" })
	s := e.until(t, func(s discovery.Snapshot) bool {
		return len(s.Workers) == 2 && workerByName(s, "a").Labels[roleLabel] == "decode"
	})
	require.Equal(t, discovery.WorkerID(testNS, "a"), workerByName(s, "a").ID)
}

func workerByName(s discovery.Snapshot, name string) catalog.Worker {
	for _, w := range s.Workers {
		if w.Identity == testNS+"/"+name {
			return w
		}
	}
	return catalog.Worker{}
}

func TestKubePoolSelectorAndPortChange(t *testing.T) {
	e := startKube(t, nil, poolObjs(),
		readyPod("a", "10.0.0.1", map[string]string{"tier": "gold"}), readyPod("b", "10.0.0.2", nil))
	e.untilIDs(t, "a", "b")

	// A second selector label narrows the pool: every label must match.
	e.updatePool(t, pool(testPool, map[string]string{"app": "qwen", "tier": "gold"}, 8000))
	e.untilIDs(t, "a")

	// Only the first target port is used.
	e.updatePool(t, pool(testPool, map[string]string{"app": "qwen", "tier": "gold"}, 9000, 9001))
	s := e.until(t, func(s discovery.Snapshot) bool {
		return len(s.Workers) == 1 && s.Workers[0].Endpoint == "10.0.0.1:9000"
	})
	require.Equal(t, discovery.WorkerID(testNS, "a"), s.Workers[0].ID)

	// Back to the wide selector.
	e.updatePool(t, pool(testPool, appLabels, 9000))
	e.untilIDs(t, "a", "b")
	require.Equal(t, "10.0.0.2:9000", workerByName(e.last, "b").Endpoint)
}

func TestKubePoolMissingThenCreatedAndDeleted(t *testing.T) {
	e := startKube(t, nil, []runtime.Object{pool("another-pool", appLabels, 8000)}, readyPod("a", "10.0.0.1", nil))
	s := e.next(t)
	require.Equal(t, discovery.Snapshot{Reason: discovery.ReasonPoolNotFound}, s)

	e.createPool(t, pool(testPool, appLabels, 8000))
	s = e.next(t)
	require.True(t, s.Synced)
	require.True(t, equalIdentities(s, []string{"a"}))

	// An unusable spec is reported, with no workers.
	bad := pool(testPool, appLabels, 8000)
	bad.Object["spec"].(map[string]any)["targetPorts"] = []any{}
	e.updatePool(t, bad)
	s = e.next(t)
	require.False(t, s.Synced)
	require.Empty(t, s.Workers)
	require.Contains(t, s.Reason, discovery.ReasonPoolInvalid)
	require.Contains(t, s.Reason, "targetPorts")

	e.updatePool(t, pool(testPool, appLabels, 8000))
	e.untilIDs(t, "a")

	e.deletePool(t)
	s = e.next(t)
	require.Equal(t, discovery.Snapshot{Reason: discovery.ReasonPoolNotFound}, s)
}

func TestKubeCensus(t *testing.T) {
	e := startKube(t, nil, poolObjs(),
		readyPod("a", "10.0.0.1", map[string]string{roleLabel: "decode"}),
		readyPod("b", "10.0.0.2", map[string]string{roleLabel: "decode"}))
	e.untilIDs(t, "a", "b")
	recs := e.logs.records(t, "discovery census")
	require.Len(t, recs, 1)
	require.EqualValues(t, 2, recs[0]["workers"])
	require.Equal(t, map[string]any{"decode": float64(2)}, recs[0]["roles"])

	// No zero crossing: no new census line (the marker snapshot proves the
	// earlier change was processed).
	e.deletePod(t, "a")
	e.untilIDs(t, "b")
	require.Len(t, e.logs.records(t, "discovery census"), 1)

	// The prefill role appears: its count leaves zero.
	e.editPod(t, "b", func(p *corev1.Pod) { p.Labels[roleLabel] = "prefill" })
	e.until(t, func(s discovery.Snapshot) bool { return workerByName(s, "b").Labels[roleLabel] == "prefill" })
	recs = e.logs.records(t, "discovery census")
	require.Len(t, recs, 2)
	require.Equal(t, map[string]any{"decode": float64(0), "prefill": float64(1)}, recs[1]["roles"])

	// The total goes to zero.
	e.deletePod(t, "b")
	e.until(t, func(s discovery.Snapshot) bool { return len(s.Workers) == 0 })
	recs = e.logs.records(t, "discovery census")
	require.Len(t, recs, 3)
	require.EqualValues(t, 0, recs[2]["workers"])
}

func TestKubeRunTwiceAndNilSink(t *testing.T) {
	src, err := discovery.NewKubernetes(discovery.KubeOptions{
		Dynamic:   dynfake.NewSimpleDynamicClient(runtime.NewScheme()),
		Clientset: kfake.NewClientset(),
		Namespace: testNS,
		PoolName:  testPool,
	})
	require.NoError(t, err)
	require.ErrorIs(t, src.Run(context.Background(), nil), discovery.ErrInvalidOptions)

	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	require.ErrorIs(t, src.Run(ctx, func(discovery.Snapshot) {}), context.Canceled)
	require.ErrorIs(t, src.Run(ctx, func(discovery.Snapshot) {}), discovery.ErrAlreadyRun)
}

func TestNewKubernetesValidation(t *testing.T) {
	valid := func() discovery.KubeOptions {
		return discovery.KubeOptions{
			Dynamic:   dynfake.NewSimpleDynamicClient(runtime.NewScheme()),
			Clientset: kfake.NewClientset(),
			Namespace: testNS,
			PoolName:  testPool,
		}
	}
	_, err := discovery.NewKubernetes(valid())
	require.NoError(t, err)

	cases := []struct {
		name string
		edit func(*discovery.KubeOptions)
		want string
	}{
		{"no dynamic", func(o *discovery.KubeOptions) { o.Dynamic = nil }, "Dynamic is nil"},
		{"no clientset", func(o *discovery.KubeOptions) { o.Clientset = nil }, "Clientset is nil"},
		{"no namespace", func(o *discovery.KubeOptions) { o.Namespace = "" }, "Namespace is empty"},
		{"bad namespace", func(o *discovery.KubeOptions) { o.Namespace = "Bad_NS" }, `Namespace "Bad_NS"`},
		{"no pool", func(o *discovery.KubeOptions) { o.PoolName = "" }, "PoolName is empty"},
		{"bad pool", func(o *discovery.KubeOptions) { o.PoolName = "a/b" }, `PoolName "a/b"`},
		{"negative block size", func(o *discovery.KubeOptions) { o.BlockSize = -1 }, "BlockSize -1"},
		{"negative kv blocks", func(o *discovery.KubeOptions) { o.TotalKVBlocks = -1 }, "TotalKVBlocks -1"},
		{"negative batched", func(o *discovery.KubeOptions) { o.MaxNumBatchedTokens = -1 }, "MaxNumBatchedTokens -1"},
		{"event port", func(o *discovery.KubeOptions) { o.KVEventPort = 70000 }, "KVEventPort 70000"},
		{"replay port", func(o *discovery.KubeOptions) { o.ReplayPort = -2 }, "ReplayPort -2"},
		{"role label", func(o *discovery.KubeOptions) { o.RoleLabel = "bad label" }, `RoleLabel "bad label"`},
		{"resync", func(o *discovery.KubeOptions) { o.Resync = -time.Second }, "Resync -1s"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			o := valid()
			c.edit(&o)
			src, err := discovery.NewKubernetes(o)
			require.Nil(t, src)
			require.ErrorIs(t, err, discovery.ErrInvalidOptions)
			require.ErrorContains(t, err, c.want)
		})
	}

	// Every problem is reported at once.
	_, err = discovery.NewKubernetes(discovery.KubeOptions{BlockSize: -1})
	require.ErrorContains(t, err, "Dynamic is nil")
	require.ErrorContains(t, err, "PoolName is empty")
	require.ErrorContains(t, err, "BlockSize -1")
}

func TestWorkerID(t *testing.T) {
	id := discovery.WorkerID("ns", "pod-0")
	require.Len(t, id, 16)
	require.Equal(t, id, discovery.WorkerID("ns", "pod-0"), "stable")
	require.NotEqual(t, id, discovery.WorkerID("ns2", "pod-0"), "namespaced")
	require.NotEqual(t, id, discovery.WorkerID("ns", "pod-1"))
	// SHA-256("ns/pod-0"), first 8 bytes: pinned so the scheme cannot drift.
	require.Equal(t, "c750f45d3bb0ea88", id)
}
