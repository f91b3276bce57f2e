package discovery

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	dynfake "k8s.io/client-go/dynamic/fake"
	kfake "k8s.io/client-go/kubernetes/fake"
)

func TestParsePoolSpec(t *testing.T) {
	good := map[string]any{
		"selector":          map[string]any{"matchLabels": map[string]any{"app": "qwen", "tier": "gold"}},
		"targetPorts":       []any{map[string]any{"number": int64(8000)}, map[string]any{"number": int64(8001)}},
		"endpointPickerRef": map[string]any{"name": "epp", "port": map[string]any{"number": int64(9002)}},
	}
	spec, err := parsePoolSpec(&unstructured.Unstructured{Object: map[string]any{"spec": good}})
	require.NoError(t, err)
	require.Equal(t, map[string]string{"app": "qwen", "tier": "gold"}, spec.Selector.MatchLabels)
	require.EqualValues(t, 8000, spec.TargetPorts[0].Number)

	cases := []struct {
		name string
		spec any
		want string
	}{
		{"no spec", nil, "spec is missing"},
		{"spec not an object", "x", "spec is missing"},
		{"no selector", map[string]any{"targetPorts": []any{map[string]any{"number": int64(1)}}}, "matchLabels is empty"},
		{"empty selector", map[string]any{"selector": map[string]any{"matchLabels": map[string]any{}},
			"targetPorts": []any{map[string]any{"number": int64(1)}}}, "matchLabels is empty"},
		{"no ports", map[string]any{"selector": map[string]any{"matchLabels": map[string]any{"a": "b"}}}, "targetPorts is empty"},
		{"port zero", map[string]any{"selector": map[string]any{"matchLabels": map[string]any{"a": "b"}},
			"targetPorts": []any{map[string]any{"number": int64(0)}}}, "number 0 is not in 1..65535"},
		{"port too big", map[string]any{"selector": map[string]any{"matchLabels": map[string]any{"a": "b"}},
			"targetPorts": []any{map[string]any{"number": int64(70000)}}}, "number 70000"},
		{"legacy shape", map[string]any{"selector": map[string]any{"a": "b"}, "targetPortNumber": int64(8000)}, "spec"},
		{"wrong types", map[string]any{"selector": map[string]any{"matchLabels": "a=b"},
			"targetPorts": []any{map[string]any{"number": int64(1)}}}, "spec"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			obj := map[string]any{}
			if c.spec != nil {
				obj["spec"] = c.spec
			}
			_, err := parsePoolSpec(&unstructured.Unstructured{Object: obj})
			require.ErrorContains(t, err, c.want)
		})
	}
}

func TestTrimPod(t *testing.T) {
	del := metav1.Now()
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Name: "p", Namespace: "ns", UID: "u", ResourceVersion: "7",
			Labels: map[string]string{"a": "b"}, Annotations: map[string]string{"big": "x"},
			DeletionTimestamp: &del, ManagedFields: []metav1.ManagedFieldsEntry{{Manager: "m"}},
		},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Image: "i"}}},
		Status: corev1.PodStatus{
			Phase: corev1.PodRunning, PodIP: "10.0.0.1", HostIP: "192.0.2.1",
			Conditions: []corev1.PodCondition{
				{Type: corev1.PodScheduled, Status: corev1.ConditionTrue},
				{Type: corev1.PodReady, Status: corev1.ConditionFalse, Reason: "r"},
			},
		},
	}
	got, err := trimPod(pod)
	require.NoError(t, err)
	want := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: "ns", UID: "u", ResourceVersion: "7",
			Labels: map[string]string{"a": "b"}, DeletionTimestamp: &del},
		Status: corev1.PodStatus{Phase: corev1.PodRunning, PodIP: "10.0.0.1",
			Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionFalse}}},
	}
	require.Equal(t, want, got)
	again, err := trimPod(got)
	require.NoError(t, err)
	require.Equal(t, want, again, "idempotent")
	require.Len(t, pod.Status.Conditions, 2, "input untouched")

	other := "not a pod"
	same, err := trimPod(other)
	require.NoError(t, err)
	require.Equal(t, other, same)
}

// BenchmarkDesired measures one recomputation over a namespace of 2,000 pods
// of which 500 are ready pool members: the work done per batch of changes.
func BenchmarkDesired(b *testing.B) {
	k, err := NewKubernetes(KubeOptions{
		Dynamic: dynfake.NewSimpleDynamicClient(runtime.NewScheme()), Clientset: kfake.NewClientset(),
		Namespace: "ns", PoolName: "pool", BlockSize: 16, KVEventPort: DefaultKVEventPort,
	})
	require.NoError(b, err)
	pool := poolState{matchLabels: map[string]string{"app": "qwen"}, port: 8000}
	objs := make([]any, 0, 2000)
	for i := range 2000 {
		app := "other"
		if i%4 == 0 {
			app = "qwen"
		}
		objs = append(objs, &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("pod-%d", i), Namespace: "ns",
				Labels: map[string]string{"app": app, "nvidia.com/role": "decode"}},
			Status: corev1.PodStatus{Phase: corev1.PodRunning, PodIP: fmt.Sprintf("10.0.%d.%d", i/256, i%256),
				Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}},
		})
	}
	b.ReportAllocs()
	for b.Loop() {
		if s := k.desired(pool, objs); len(s.Workers) != 500 {
			b.Fatal(len(s.Workers))
		}
	}
}
