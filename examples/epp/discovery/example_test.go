package discovery_test

import (
	"context"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	dynfake "k8s.io/client-go/dynamic/fake"
	kfake "k8s.io/client-go/kubernetes/fake"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/examples/epp/discovery"
)

// A Kubernetes source, here on fake clients: one InferencePool selecting
// app=qwen on port 8000, and one ready pod.
func ExampleNewKubernetes() {
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "qwen-0", Namespace: "serving",
			Labels: map[string]string{"app": "qwen", "nvidia.com/role": "decode"}},
		Status: corev1.PodStatus{Phase: corev1.PodRunning, PodIP: "10.1.2.3",
			Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}},
	}
	dyn := dynfake.NewSimpleDynamicClientWithCustomListKinds(runtime.NewScheme(),
		map[schema.GroupVersionResource]string{discovery.InferencePoolGVR: discovery.InferencePoolListKind},
		pool("qwen", map[string]string{"app": "qwen"}, 8000))

	src, err := discovery.NewKubernetes(discovery.KubeOptions{
		Dynamic:     dyn,
		Clientset:   kfake.NewClientset(pod),
		Namespace:   "serving",
		PoolName:    "qwen",
		Model:       "qwen3",
		BlockSize:   16,
		KVEventPort: discovery.DefaultKVEventPort,
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	ctx, cancel := context.WithCancel(context.Background())
	err = src.Run(ctx, func(s discovery.Snapshot) {
		fmt.Println("synced:", s.Synced)
		for _, w := range s.Workers {
			fmt.Println(w.ID, w.Identity, w.Endpoint, w.KVEventEndpoints[0], w.Labels["nvidia.com/role"])
		}
		cancel() // a real consumer keeps running and reconciles every snapshot
	})
	fmt.Println(err)
	// Output:
	// synced: true
	// a1812f7d18f45b92 serving/qwen-0 10.1.2.3:8000 tcp://10.1.2.3:5557 decode
	// context canceled
}

func ExampleStaticWorkers() {
	src := discovery.StaticWorkers([]catalog.Worker{
		{ID: "engine-b", Endpoint: "127.0.0.1:8002", DPSize: 1},
		{ID: "engine-a", Endpoint: "127.0.0.1:8001", DPSize: 1},
	})
	ctx, cancel := context.WithCancel(context.Background())
	err := src.Run(ctx, func(s discovery.Snapshot) {
		for _, w := range s.Workers {
			fmt.Println(w.ID, w.Endpoint)
		}
		cancel()
	})
	fmt.Println(err)
	// Output:
	// engine-a 127.0.0.1:8001
	// engine-b 127.0.0.1:8002
	// context canceled
}

func ExampleParseWorkers() {
	file := []byte(`
workers:
  - id: engine-a
    endpoint: 127.0.0.1:8001
    kv_events_endpoint: tcp://127.0.0.1:5557
    labels: {nvidia.com/role: prefill}
`)
	ws, err := discovery.ParseWorkers(file, discovery.Defaults{Model: "qwen3", BlockSize: 16})
	if err != nil {
		fmt.Println(err)
		return
	}
	w := ws[0]
	fmt.Println(w.ID, w.Model, w.BlockSize, w.DPStart, w.DPSize, w.KVEventEndpoints, w.Labels)
	// Output: engine-a qwen3 16 0 1 map[0:tcp://127.0.0.1:5557] map[nvidia.com/role:prefill]
}
