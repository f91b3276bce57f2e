//go:build e2e

package e2ekube

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/util/retry"

	"github.com/kvselect/kvselect/examples/epp/discovery"
)

// apiTimeout bounds every single API call of the tests (rest.Config.Timeout).
const apiTimeout = 15 * time.Second

var poolGVR = discovery.InferencePoolGVR

// space is one test's namespace, with the EPP identity's Role in it.
type space struct {
	t  *testing.T
	h  *harness
	ns string
}

var nonDNS = regexp.MustCompile(`[^a-z0-9-]+`)

// newSpace creates a namespace named after the test, grants the EPP user
// get/list/watch on pods and inferencepools there (nothing else), and waits
// until the API server's authorizer applies the grant.
func newSpace(t *testing.T, hh *harness) *space {
	t.Helper()
	s := newNamespace(t, hh)
	verbs := []string{"get", "list", "watch"}
	s.grant("epp-discovery", []rbacv1.PolicyRule{
		{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: verbs},
		{APIGroups: []string{poolGVR.Group}, Resources: []string{poolGVR.Resource}, Verbs: verbs},
	}, func(ctx context.Context, cs kubernetes.Interface, dyn dynamic.Interface) bool {
		_, errPods := cs.CoreV1().Pods(s.ns).List(ctx, metav1.ListOptions{})
		_, errPools := dyn.Resource(poolGVR).Namespace(s.ns).List(ctx, metav1.ListOptions{})
		return errPods == nil && errPools == nil
	})
	return s
}

// newNamespace creates a namespace named after the test, where the EPP user
// has no rights yet.
func newNamespace(t *testing.T, hh *harness) *space {
	t.Helper()
	slug := strings.Trim(nonDNS.ReplaceAllString(strings.ToLower(t.Name()), "-"), "-")
	if len(slug) > 40 {
		slug = slug[:40]
	}
	var b [3]byte
	_, _ = rand.Read(b[:])
	s := &space{t: t, h: hh, ns: strings.TrimRight(slug, "-") + "-" + hex.EncodeToString(b[:])}
	_, err := hh.admin.CoreV1().Namespaces().Create(s.ctx(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: s.ns}}, metav1.CreateOptions{})
	require.NoError(t, err)
	// Without a controller manager a deleted namespace stays Terminating; the
	// whole store goes away with the run, so this only tidies a kept cluster.
	t.Cleanup(func() { _ = hh.admin.CoreV1().Namespaces().Delete(context.Background(), s.ns, metav1.DeleteOptions{}) })
	return s
}

// grant binds a Role named name, of rules, to the EPP user in the space, and
// waits until applied (the EPP identity's clients) reports the authorizer
// applies it.
func (s *space) grant(name string, rules []rbacv1.PolicyRule, applied func(context.Context, kubernetes.Interface, dynamic.Interface) bool) {
	s.t.Helper()
	ctx := s.ctx()
	_, err := s.h.admin.RbacV1().Roles(s.ns).Create(ctx, &rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Name: name}, Rules: rules}, metav1.CreateOptions{})
	require.NoError(s.t, err)
	_, err = s.h.admin.RbacV1().RoleBindings(s.ns).Create(ctx, &rbacv1.RoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Subjects:   []rbacv1.Subject{{Kind: rbacv1.UserKind, APIGroup: rbacv1.GroupName, Name: s.h.eppUser}},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: name},
	}, metav1.CreateOptions{})
	require.NoError(s.t, err)
	cs, dyn := s.eppClients()
	require.Eventually(s.t, func() bool { return applied(ctx, cs, dyn) }, 20*time.Second, 50*time.Millisecond,
		"the epp identity never got its Role %s in %s", name, s.ns)
}

// ctx is the context of the space's API calls: the test's own, done when
// the test ends. Each call is also bounded by the clients' apiTimeout.
func (s *space) ctx() context.Context { return s.t.Context() }

// eppClients returns clients acting as the EPP's identity.
func (s *space) eppClients() (kubernetes.Interface, dynamic.Interface) {
	rc, err := clientcmd.BuildConfigFromFlags("", s.h.eppKubeconfig)
	require.NoError(s.t, err)
	rc.Timeout = apiTimeout
	cs, err := kubernetes.NewForConfig(rc)
	require.NoError(s.t, err)
	dyn, err := dynamic.NewForConfig(rc)
	require.NoError(s.t, err)
	return cs, dyn
}

// createPool creates an InferencePool selecting match on port.
func (s *space) createPool(name string, match map[string]string, port int) {
	s.t.Helper()
	sel := map[string]any{}
	for k, v := range match {
		sel[k] = v
	}
	pool := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": poolGVR.Group + "/" + poolGVR.Version,
		"kind":       "InferencePool",
		"metadata":   map[string]any{"name": name, "namespace": s.ns},
		"spec": map[string]any{
			"selector":          map[string]any{"matchLabels": sel},
			"targetPorts":       []any{map[string]any{"number": int64(port)}},
			"endpointPickerRef": map[string]any{"name": "kvselect-epp", "port": map[string]any{"number": int64(9002)}},
		},
	}}
	_, err := s.h.dyn.Resource(poolGVR).Namespace(s.ns).Create(s.ctx(), pool, metav1.CreateOptions{})
	require.NoError(s.t, err)
}

// setPoolSelector replaces the pool's matchLabels.
func (s *space) setPoolSelector(name string, match map[string]string) {
	s.t.Helper()
	// A JSON patch replaces the map wholesale (a merge patch would keep the
	// keys it does not name).
	ops, err := json.Marshal([]map[string]any{{"op": "replace", "path": "/spec/selector/matchLabels", "value": match}})
	require.NoError(s.t, err)
	_, err = s.h.dyn.Resource(poolGVR).Namespace(s.ns).Patch(s.ctx(), name, types.JSONPatchType, ops, metav1.PatchOptions{})
	require.NoError(s.t, err)
}

// createPod creates a pod (Pending, no IP) with labels and finalizers.
func (s *space) createPod(name string, labels map[string]string, finalizers ...string) {
	s.t.Helper()
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels, Finalizers: finalizers},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "engine", Image: "kvselect.invalid/fake-engine:e2e"}}},
	}
	_, err := s.h.admin.CoreV1().Pods(s.ns).Create(s.ctx(), pod, metav1.CreateOptions{})
	require.NoError(s.t, err)
}

// setStatus plays the kubelet: phase Running, the Ready condition and the pod
// IP, written through the status subresource.
func (s *space) setStatus(name, ip string, ready bool) {
	s.t.Helper()
	cond := corev1.ConditionFalse
	if ready {
		cond = corev1.ConditionTrue
	}
	pods := s.h.admin.CoreV1().Pods(s.ns)
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		pod, err := pods.Get(s.ctx(), name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		now := metav1.Now()
		pod.Status.Phase = corev1.PodRunning
		pod.Status.PodIP = ip
		pod.Status.PodIPs = []corev1.PodIP{{IP: ip}}
		pod.Status.HostIP = "127.0.0.1"
		pod.Status.HostIPs = []corev1.HostIP{{IP: "127.0.0.1"}}
		if pod.Status.StartTime == nil {
			pod.Status.StartTime = &now
		}
		pod.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: cond, LastTransitionTime: now}}
		_, err = pods.UpdateStatus(s.ctx(), pod, metav1.UpdateOptions{})
		return err
	})
	require.NoError(s.t, err)
}

// runPod creates a pod and makes it Running and Ready at ip.
func (s *space) runPod(name, ip string, labels map[string]string, finalizers ...string) {
	s.t.Helper()
	s.createPod(name, labels, finalizers...)
	s.setStatus(name, ip, true)
}

// setLabel sets one pod label; an empty value removes it.
func (s *space) setLabel(name, key, value string) {
	s.t.Helper()
	var v any = value
	if value == "" {
		v = nil
	}
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{"labels": map[string]any{key: v}}})
	require.NoError(s.t, err)
	_, err = s.h.admin.CoreV1().Pods(s.ns).Patch(s.ctx(), name, types.MergePatchType, patch, metav1.PatchOptions{})
	require.NoError(s.t, err)
}

// deletePod deletes a pod at once (a pod with finalizers only gets its
// deletionTimestamp and stays, terminating).
func (s *space) deletePod(name string) {
	s.t.Helper()
	zero := int64(0)
	err := s.h.admin.CoreV1().Pods(s.ns).Delete(s.ctx(), name, metav1.DeleteOptions{GracePeriodSeconds: &zero})
	require.NoError(s.t, err)
}

// pod returns the current pod.
func (s *space) pod(name string) *corev1.Pod {
	s.t.Helper()
	p, err := s.h.admin.CoreV1().Pods(s.ns).Get(s.ctx(), name, metav1.GetOptions{})
	require.NoError(s.t, err)
	return p
}

// workerID is the id discovery gives a pod of this namespace.
func (s *space) workerID(pod string) string { return discovery.WorkerID(s.ns, pod) }
