//go:build e2e

package e2ekube

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io/fs"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/restmapper"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
	"sigs.k8s.io/yaml"

	"github.com/kvselect/kvselect/examples/epp/internal/eppproc"
	"github.com/kvselect/kvselect/examples/internal/extproctest"
	"github.com/kvselect/kvselect/examples/internal/imagebuild"
	"github.com/kvselect/kvselect/tokenize"
)

// More CRDs scripts/kube-e2e.sh fetches through the module proxy; unset
// when it could not, and the kinds they define are then skipped, with the
// reason logged.
const (
	envGatewayCRD        = "KVSELECT_E2E_GATEWAY_CRD"        // Gateway API's HTTPRoute (standard channel)
	envServiceMonitorCRD = "KVSELECT_E2E_SERVICEMONITOR_CRD" // Prometheus Operator's ServiceMonitor
)

// repoRoot is the repository root, seen from this package.
const repoRoot = "../../.."

// fieldManager owns what the test applies.
const fieldManager = "kvselect-e2e"

// overlay is one kustomization the test renders: an overlay of deploy/, or a
// test kustomization over one (the optional components).
type overlay struct {
	name       string
	resources  []string // paths under deploy/
	components []string
}

var overlays = []overlay{
	{name: "aggregated", resources: []string{"overlays/aggregated"}},
	{name: "disaggregated", resources: []string{"overlays/disaggregated"}},
	{name: "replicas", resources: []string{"overlays/replicas"}},
	{name: "aggregated-servicemonitor", resources: []string{"overlays/aggregated"}, components: []string{"components/servicemonitor"}},
	{name: "aggregated-render", resources: []string{"overlays/aggregated"}, components: []string{"components/render"}},
}

// TestDeployManifests renders every overlay of deploy/ with kustomize's Go
// API, checks that its pieces agree (the pool's ports, the engines' flags,
// the EPP's environment, probes and Service), applies each object to the API
// server with server-side apply and strict field validation, and then runs
// the EPP as the image builds it (examples/epp/Dockerfile's go build) with
// the environment of the rendered Deployment, under the rendered Roles only:
// it must report itself ready on the probes' health services and route a
// request to a pod of the rendered model-server Deployments.
func TestDeployManifests(t *testing.T) {
	hh := need(t)
	bins := buildImageBinaries(t)
	eppVars := envTableNames(t, bins["epp"])
	sidecarVars := envTableNames(t, bins["pdsidecar"])
	mapper := installDeployCRDs(t, hh)
	secret := randomHex(t, 24)

	for _, o := range overlays {
		t.Run(o.name, func(t *testing.T) {
			objs := render(t, o, secret)
			m := indexObjects(t, objs)
			checkAgreement(t, m, eppVars, sidecarVars)

			s := newNamespace(t, hh)
			applied := s.apply(mapper, objs)
			t.Logf("%s: applied %d objects: %s", o.name, len(applied), strings.Join(applied, ", "))
			if strings.HasSuffix(o.name, "-servicemonitor") {
				return // the same EPP as aggregated; the component is the ServiceMonitor
			}
			if strings.HasSuffix(o.name, "-render") {
				requireRenderTokenizers(t, m)
			}
			s.grantRendered(m)
			p := s.startRenderedEPP(bins["epp"], m)
			p.waitHealth(deref(m.eppContainer().ReadinessProbe.GRPC.Service), deref(m.eppContainer().LivenessProbe.GRPC.Service))
			s.routeThroughRendered(p, m)
		})
	}
}

// buildImageBinaries builds the EPP and the sidecar with their Dockerfiles'
// go build (the image's binaries).
func buildImageBinaries(t *testing.T) map[string]string {
	t.Helper()
	out := t.TempDir()
	bins := map[string]string{}
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Minute)
	defer cancel()
	for _, name := range []string{"epp", "pdsidecar"} {
		r, err := imagebuild.Read(filepath.Join(repoRoot, "examples", name, "Dockerfile"))
		require.NoError(t, err)
		start := time.Now()
		bins[name], err = r.Build(ctx, repoRoot, out)
		require.NoError(t, err)
		t.Logf("built %s as its Dockerfile does in %v", name, time.Since(start).Round(time.Millisecond))
	}
	return bins
}

// envTableNames runs bin --print-env-table and returns every variable name
// in it (aliases and Dynamo's names included).
func envTableNames(t *testing.T, bin string) map[string]bool {
	t.Helper()
	out, err := exec.CommandContext(t.Context(), bin, "--print-env-table").Output()
	require.NoError(t, err)
	names := map[string]bool{}
	for _, m := range regexp.MustCompile("`([A-Z][A-Z0-9_]+)`").FindAllStringSubmatch(string(out), -1) {
		names[m[1]] = true
	}
	require.NotEmpty(t, names)
	return names
}

// installDeployCRDs installs the HTTPRoute and ServiceMonitor CRDs when the
// script fetched them, and returns a REST mapper that knows them.
func installDeployCRDs(t *testing.T, hh *harness) meta.ResettableRESTMapper {
	t.Helper()
	for _, env := range []string{envGatewayCRD, envServiceMonitorCRD} {
		path := os.Getenv(env)
		if path == "" {
			t.Logf("%s is not set (scripts/kube-e2e.sh could not fetch it): the kinds it defines are skipped", env)
			continue
		}
		ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
		err := installCRD(ctx, hh.dyn, path)
		cancel()
		require.NoError(t, err, env)
	}
	return restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(hh.admin.Discovery()))
}

// installCRD creates the CRD of a YAML file (or keeps the one there) and
// waits until it is Established.
func installCRD(ctx context.Context, dyn dynamic.Interface, path string) error {
	raw, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	js, err := yaml.YAMLToJSON(raw)
	if err != nil {
		return err
	}
	obj := &unstructured.Unstructured{}
	if err := obj.UnmarshalJSON(js); err != nil {
		return err
	}
	if _, err := dyn.Resource(crdGVR).Create(ctx, obj, metav1.CreateOptions{}); err != nil && !strings.Contains(err.Error(), "already exists") {
		return err
	}
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		got, err := dyn.Resource(crdGVR).Get(ctx, obj.GetName(), metav1.GetOptions{})
		if err == nil && established(got) {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("the CRD %s is not established: %w", obj.GetName(), ctx.Err())
		case <-tick.C:
		}
	}
}

// render builds o with kustomize over an in-memory copy of deploy/, the
// replicas' sync secret written into it as the overlay's instructions say.
func render(t *testing.T, o overlay, secret string) []*unstructured.Unstructured {
	t.Helper()
	mem := filesys.MakeFsInMemory()
	src := filepath.Join(repoRoot, "deploy")
	err := filepath.WalkDir(src, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		rel, err := filepath.Rel(src, path)
		if err != nil {
			return err
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		return mem.WriteFile(filepath.Join("/deploy", rel), b)
	})
	require.NoError(t, err)
	require.NoError(t, mem.WriteFile("/deploy/overlays/replicas/sync-secret.env", []byte("secret="+secret+"\n")))
	k := "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n"
	for _, r := range o.resources {
		k += "  - ../deploy/" + r + "\n"
	}
	if len(o.components) > 0 {
		k += "components:\n"
		for _, c := range o.components {
			k += "  - ../deploy/" + c + "\n"
		}
	}
	require.NoError(t, mem.WriteFile("/test/kustomization.yaml", []byte(k)))
	rm, err := krusty.MakeKustomizer(krusty.MakeDefaultOptions()).Run(mem, "/test")
	require.NoError(t, err, "kustomize build of %s", o.name)
	var objs []*unstructured.Unstructured
	for _, r := range rm.Resources() {
		js, err := r.MarshalJSON() // JSON types (int64, float64), as unstructured wants
		require.NoError(t, err)
		o := &unstructured.Unstructured{}
		require.NoError(t, o.UnmarshalJSON(js))
		objs = append(objs, o)
	}
	require.NotEmpty(t, objs)
	return objs
}

// rendered indexes an overlay's objects by kind and name.
type rendered struct {
	t    *testing.T
	objs map[string]*unstructured.Unstructured // "Kind/name"
}

func indexObjects(t *testing.T, objs []*unstructured.Unstructured) *rendered {
	m := &rendered{t: t, objs: map[string]*unstructured.Unstructured{}}
	for _, o := range objs {
		m.objs[o.GetKind()+"/"+o.GetName()] = o
	}
	return m
}

// get returns the object Kind/name; it must be there.
func (m *rendered) get(kind, name string) *unstructured.Unstructured {
	o := m.objs[kind+"/"+name]
	require.NotNil(m.t, o, "%s/%s not rendered", kind, name)
	return o
}

// ofKind lists the objects of kind.
func (m *rendered) ofKind(kind string) []*unstructured.Unstructured {
	var out []*unstructured.Unstructured
	for _, o := range m.objs {
		if o.GetKind() == kind {
			out = append(out, o)
		}
	}
	slices.SortFunc(out, func(a, b *unstructured.Unstructured) int { return strings.Compare(a.GetName(), b.GetName()) })
	return out
}

// into converts o into a typed object.
func into[T any](t *testing.T, o *unstructured.Unstructured) *T {
	t.Helper()
	v := new(T)
	require.NoError(t, runtime.DefaultUnstructuredConverter.FromUnstructured(o.Object, v))
	return v
}

// eppDeployment is the EPP's Deployment.
func (m *rendered) eppDeployment() *appsv1.Deployment {
	return into[appsv1.Deployment](m.t, m.get("Deployment", "kvselect-epp"))
}

// eppContainer is the EPP's container.
func (m *rendered) eppContainer() corev1.Container {
	for _, c := range m.eppDeployment().Spec.Template.Spec.Containers {
		if c.Name == "epp" {
			return c
		}
	}
	require.FailNow(m.t, "no epp container")
	return corev1.Container{}
}

// eppEnv is the EPP container's literal env values (valueFrom left out).
func (m *rendered) eppEnv() map[string]string {
	out := map[string]string{}
	for _, e := range m.eppContainer().Env {
		if e.ValueFrom == nil {
			out[e.Name] = e.Value
		}
	}
	return out
}

// engineDeployments are the model servers: the Deployments whose pods the
// pool selects.
func (m *rendered) engineDeployments() []*appsv1.Deployment {
	pool := m.pool()
	var out []*appsv1.Deployment
	for _, o := range m.ofKind("Deployment") {
		d := into[appsv1.Deployment](m.t, o)
		if selects(pool.selector, d.Spec.Template.Labels) {
			out = append(out, d)
		}
	}
	require.NotEmpty(m.t, out, "no Deployment's pods match the pool's selector %v", pool.selector)
	return out
}

func selects(sel, labels map[string]string) bool {
	for k, v := range sel {
		if labels[k] != v {
			return false
		}
	}
	return true
}

// poolView is what the test reads of the InferencePool.
type poolView struct {
	name       string
	selector   map[string]string
	targetPort int
	eppName    string
	eppPort    int
}

func (m *rendered) pool() poolView {
	pools := m.ofKind("InferencePool")
	require.Len(m.t, pools, 1)
	p := pools[0]
	sel, _, _ := unstructured.NestedStringMap(p.Object, "spec", "selector", "matchLabels")
	ports, _, _ := unstructured.NestedSlice(p.Object, "spec", "targetPorts")
	require.Len(m.t, ports, 1)
	target, _, _ := unstructured.NestedInt64(ports[0].(map[string]any), "number")
	name, _, _ := unstructured.NestedString(p.Object, "spec", "endpointPickerRef", "name")
	port, _, _ := unstructured.NestedInt64(p.Object, "spec", "endpointPickerRef", "port", "number")
	return poolView{name: p.GetName(), selector: sel, targetPort: int(target), eppName: name, eppPort: int(port)}
}

// vllmArg returns the value of an engine flag (--name=value), "" when absent.
func vllmArg(c corev1.Container, name string) string {
	for _, a := range c.Args {
		if v, ok := strings.CutPrefix(a, "--"+name+"="); ok {
			return v
		}
	}
	return ""
}

func container(t *testing.T, d *appsv1.Deployment, name string) corev1.Container {
	t.Helper()
	for _, c := range d.Spec.Template.Spec.Containers {
		if c.Name == name {
			return c
		}
	}
	require.FailNow(t, "no container", "%s in %s", name, d.Name)
	return corev1.Container{}
}

func envOf(c corev1.Container, name string) string {
	for _, e := range c.Env {
		if e.Name == name {
			return e.Value
		}
	}
	return ""
}

// portOf is the port of a listen address (":9002" -> 9002).
func portOf(t *testing.T, addr string) int {
	t.Helper()
	_, p, err := net.SplitHostPort(addr)
	require.NoError(t, err, addr)
	n, err := strconv.Atoi(p)
	require.NoError(t, err, addr)
	return n
}

// checkAgreement checks that the overlay's pieces fit together: the names
// the EPP's environment and the sidecar's use exist in the binaries, the
// pool points at the EPP's Service and ext_proc port, the probes at its
// health port, and the engines' flags match what the EPP expects of them.
func checkAgreement(t *testing.T, m *rendered, eppVars, sidecarVars map[string]bool) {
	t.Helper()
	epp := m.eppContainer()
	for _, e := range epp.Env {
		require.True(t, eppVars[e.Name], "the EPP's Deployment sets %s, which the EPP does not read", e.Name)
	}
	env := m.eppEnv()
	pool := m.pool()
	require.Equal(t, env["DYN_EPP_INFERENCE_POOL_NAME"], pool.name)
	svc := into[corev1.Service](t, m.get("Service", pool.eppName))
	var extproc *corev1.ServicePort
	for i := range svc.Spec.Ports {
		if int(svc.Spec.Ports[i].Port) == pool.eppPort {
			extproc = &svc.Spec.Ports[i]
		}
	}
	require.NotNil(t, extproc, "the EPP Service has no port %d", pool.eppPort)
	require.Equal(t, "http2", deref(extproc.AppProtocol))
	require.True(t, selects(svc.Spec.Selector, m.eppDeployment().Spec.Template.Labels), "the Service selects the EPP pods")
	containerPort := func(name string) int {
		for _, p := range epp.Ports {
			if p.Name == name {
				return int(p.ContainerPort)
			}
		}
		require.FailNow(t, "no container port", name)
		return 0
	}
	require.Equal(t, portOf(t, env["DYN_EPP_EXTPROC_ADDR"]), containerPort(extproc.TargetPort.StrVal))
	health := portOf(t, env["DYN_EPP_HEALTH_ADDR"])
	for _, probe := range []*corev1.Probe{epp.ReadinessProbe, epp.LivenessProbe} {
		require.True(t, probe != nil && probe.GRPC != nil, "gRPC readiness and liveness probes")
		require.Equal(t, health, int(probe.GRPC.Port))
		require.NotEmpty(t, deref(probe.GRPC.Service), "a probe names its health service")
	}
	require.Equal(t, portOf(t, env["DYN_EPP_METRICS_ADDR"]), containerPort("metrics"))
	sc := epp.SecurityContext
	require.NotNil(t, sc)
	require.True(t, deref(sc.ReadOnlyRootFilesystem))
	require.True(t, sc.AllowPrivilegeEscalation != nil && !*sc.AllowPrivilegeEscalation)
	require.True(t, sc.Capabilities != nil && slices.Equal([]corev1.Capability{"ALL"}, sc.Capabilities.Drop))
	podSC := m.eppDeployment().Spec.Template.Spec.SecurityContext
	require.True(t, podSC != nil && deref(podSC.RunAsNonRoot))
	require.Len(t, m.ofKind("PodDisruptionBudget"), 1)

	roleLabel := env["DYN_EPP_WORKER_ROLE_LABEL"]
	disagg := env["DYN_EPP_TOPOLOGY_MODE"] == "disaggregated"
	for _, d := range m.engineDeployments() {
		role := d.Spec.Template.Labels[roleLabel]
		vllm := container(t, d, "vllm")
		require.Equal(t, env["DYN_MODEL_NAME"], vllm.Args[0], "%s serves the EPP's model", d.Name)
		require.Equal(t, env["DYN_KV_CACHE_BLOCK_SIZE"], vllmArg(vllm, "block-size"), d.Name)
		if disagg {
			require.Contains(t, []string{"prefill", "decode"}, role, "%s: role label %s", d.Name, roleLabel)
		}
		if role == "decode" {
			// The pool's port is the sidecar's, in front of the engine.
			side := container(t, d, "pdsidecar")
			for _, e := range side.Env {
				require.True(t, sidecarVars[e.Name], "the sidecar's container sets %s, which the sidecar does not read", e.Name)
			}
			require.Equal(t, strconv.Itoa(pool.targetPort), envOf(side, "DYN_SIDECAR_PORT"))
			require.Equal(t, envOf(side, "DYN_DECODE_ENGINE_PORT"), vllmArg(vllm, "port"))
			continue
		}
		require.Equal(t, strconv.Itoa(pool.targetPort), vllmArg(vllm, "port"), d.Name)
		var kv struct {
			Enable   bool   `json:"enable_kv_cache_events"`
			Endpoint string `json:"endpoint"`
			Replay   string `json:"replay_endpoint"`
		}
		require.NoError(t, json.Unmarshal([]byte(vllmArg(vllm, "kv-events-config")), &kv), d.Name)
		require.True(t, kv.Enable)
		require.Equal(t, "tcp://*:"+env["DYN_EPP_KV_EVENT_PORT"], kv.Endpoint, d.Name)
		require.Equal(t, "tcp://*:"+env["DYN_EPP_KV_EVENT_REPLAY_PORT"], kv.Replay, d.Name)
	}
}

// apply applies every object server-side (strict field validation) into the
// space's namespace and returns what it applied; kinds the API server does
// not serve are skipped with the reason logged.
func (s *space) apply(mapper meta.ResettableRESTMapper, objs []*unstructured.Unstructured) []string {
	s.t.Helper()
	mapper.Reset()
	var applied []string
	for _, o := range objs {
		gvk := o.GroupVersionKind()
		mapping, err := mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
		if meta.IsNoMatchError(err) {
			s.t.Logf("skipped %s %s: the API server does not serve %s (its CRD is not installed)", gvk.Kind, o.GetName(), gvk.GroupVersion())
			continue
		}
		require.NoError(s.t, err)
		var ri dynamic.ResourceInterface = s.h.dyn.Resource(mapping.Resource)
		if mapping.Scope.Name() == meta.RESTScopeNameNamespace {
			o = o.DeepCopy()
			o.SetNamespace(s.ns)
			ri = s.h.dyn.Resource(mapping.Resource).Namespace(s.ns)
		}
		body, err := json.Marshal(o.Object)
		require.NoError(s.t, err)
		force := true
		_, err = ri.Patch(s.ctx(), o.GetName(), types.ApplyPatchType, body,
			metav1.PatchOptions{FieldManager: fieldManager, Force: &force, FieldValidation: "Strict"})
		require.NoError(s.t, err, "server-side apply of %s %s", gvk.Kind, o.GetName())
		applied = append(applied, gvk.Kind+"/"+o.GetName())
	}
	return applied
}

// grantRendered binds every rendered Role to the EPP identity as well (the
// rendered RoleBindings name the ServiceAccount, which the test's EPP does
// not run as), and waits until the authorizer applies them: the EPP then
// runs with exactly the manifests' rules.
func (s *space) grantRendered(m *rendered) {
	s.t.Helper()
	for _, o := range m.ofKind("Role") {
		role := into[rbacv1.Role](s.t, o)
		name := role.Name + "-e2e-user"
		_, err := s.h.admin.RbacV1().RoleBindings(s.ns).Create(s.ctx(), &rbacv1.RoleBinding{
			ObjectMeta: metav1.ObjectMeta{Name: name},
			Subjects:   []rbacv1.Subject{{Kind: rbacv1.UserKind, APIGroup: rbacv1.GroupName, Name: s.h.eppUser}},
			RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: role.Name},
		}, metav1.CreateOptions{})
		require.NoError(s.t, err)
	}
	cs, dyn := s.eppClients()
	require.Eventually(s.t, func() bool {
		ctx := s.ctx()
		_, errPods := cs.CoreV1().Pods(s.ns).List(ctx, metav1.ListOptions{})
		_, errPools := dyn.Resource(poolGVR).Namespace(s.ns).List(ctx, metav1.ListOptions{})
		return errPods == nil && errPools == nil
	}, 20*time.Second, 50*time.Millisecond, "the epp identity never got the rendered Roles in %s", s.ns)
}

// renderedRun is an EPP started from a rendered Deployment, and the engines
// behind its pool.
type renderedRun struct {
	*eppProc
	healthAddr string
	fleet      *fleet
	roles      []string // by pod: the role label value ("" aggregated)
}

// startRenderedEPP starts fake engines behind the rendered pool (one pod per
// pod template of the model-server Deployments, two of each), then the EPP
// binary with the rendered container's environment: valueFrom resolved as
// the kubelet would (the pod's namespace, name and IP, the Secret's key),
// and only testOnlyEnv changed.
func (s *space) startRenderedEPP(bin string, m *rendered) *renderedRun {
	s.t.Helper()
	var kinds []podKind
	var templates []*appsv1.Deployment
	roleLabel := m.eppEnv()["DYN_EPP_WORKER_ROLE_LABEL"]
	for _, d := range m.engineDeployments() {
		kind := plainPod
		switch d.Spec.Template.Labels[roleLabel] {
		case "prefill":
			kind = prefillPod
		case "decode":
			kind = decodePod
		}
		kinds = append(kinds, kind, kind)
		templates = append(templates, d, d)
	}
	f := startPods(s.t, kinds...)
	run := &renderedRun{fleet: f}
	pool := m.pool()
	// The fleet's ports are free ones, not the manifests' (checked to agree
	// with each other): the pool is applied again with the fleet's port.
	s.setPoolTargetPort(pool.name, f.port)
	for i, d := range templates {
		name := fmt.Sprintf("%s-%d", d.Name, i)
		s.runPod(name, f.ips[i], d.Spec.Template.Labels)
		run.roles = append(run.roles, d.Spec.Template.Labels[roleLabel])
	}

	env := map[string]string{"PATH": os.Getenv("PATH"), "HOME": os.Getenv("HOME"), "KUBECONFIG": s.h.eppKubeconfig}
	podIP := nextIP(s.t)
	for _, e := range m.eppContainer().Env {
		switch {
		case e.ValueFrom == nil:
			env[e.Name] = e.Value
		case e.ValueFrom.FieldRef != nil:
			switch e.ValueFrom.FieldRef.FieldPath {
			case "metadata.namespace":
				env[e.Name] = s.ns
			case "metadata.name":
				env[e.Name] = "kvselect-epp-0"
			case "status.podIP":
				env[e.Name] = podIP
			default:
				require.FailNow(s.t, "unresolved fieldRef", "%s: %s", e.Name, e.ValueFrom.FieldRef.FieldPath)
			}
		case e.ValueFrom.SecretKeyRef != nil:
			ref := e.ValueFrom.SecretKeyRef
			sec := m.get("Secret", ref.Name)
			data, _, _ := unstructured.NestedStringMap(sec.Object, "data")
			v, err := base64.StdEncoding.DecodeString(data[ref.Key])
			require.NoError(s.t, err)
			require.NotEmpty(s.t, v, "Secret %s has no key %s", ref.Name, ref.Key)
			env[e.Name] = string(v)
		default:
			require.FailNow(s.t, "unresolved valueFrom", e.Name)
		}
	}
	// The test's changes, all of them: the EPP runs as a process on loopback,
	// not in a pod, in front of fake engines.
	changed := map[string]string{
		// Free ports; the test reads the bound addresses from the log.
		"DYN_EPP_EXTPROC_ADDR": "127.0.0.1:0", "DYN_EPP_HEALTH_ADDR": "127.0.0.1:0", "DYN_EPP_METRICS_ADDR": "127.0.0.1:0",
		// The fake engines' (checkAgreement held the rendered ones against
		// the vLLM flags).
		"DYN_MODEL_NAME": model, "DYN_EPP_KV_EVENT_PORT": strconv.Itoa(f.pubPort), "DYN_EPP_KV_EVENT_REPLAY_PORT": strconv.Itoa(f.replayPort),
		// The test's tokenizer engine instead of the in-cluster Service.
		"DYN_EPP_TOKENIZER_SERVICE_URL": startTokenizer(s.t),
	}
	if _, ok := env["DYN_EPP_REPLICA_SYNC_PORT"]; ok {
		// A free port (peer discovery takes no port 0), on POD_IP, a fresh
		// loopback address.
		ports, err := freePorts(1)
		require.NoError(s.t, err)
		changed["DYN_EPP_REPLICA_SYNC_PORT"] = strconv.Itoa(ports[0])
	}
	for k, v := range changed {
		_, ok := env[k]
		require.True(s.t, ok, "the rendered EPP has no %s", k)
		env[k] = v
	}
	tlsOn := env["DYN_SECURE_SERVING"] != "false"

	proc, err := eppproc.Start(context.Background(), bin, env)
	require.NoError(s.t, err)
	p := &eppProc{Process: proc, t: s.t, httpc: &http.Client{Timeout: requestTimeout}}
	s.t.Cleanup(func() {
		p.stop()
		p.Report(s.t)
	})
	rec := p.waitLog(startTimeout, "the EPP never listened", eppproc.MsgIs("epp listening"))
	p.extproc, p.metricsAddr = rec.Str("extproc"), rec.Str("metrics")
	health := rec.Str("health")
	require.NotEmpty(s.t, health)
	creds := insecure.NewCredentials()
	if tlsOn {
		// As the gateways are told to: TLS, the self-signed certificate not
		// verified (docs/DEPLOY.md).
		creds = credentials.NewTLS(&tls.Config{InsecureSkipVerify: true, MinVersion: tls.VersionTLS12}) //nolint:gosec // the EPP's certificate is self-signed by design
	}
	conn, err := grpc.NewClient(p.extproc, grpc.WithTransportCredentials(creds))
	require.NoError(s.t, err)
	p.conn = conn
	p.client, err = extproctest.NewClient(conn, extproctest.Options{})
	require.NoError(s.t, err)
	run.eppProc, run.healthAddr = p, health
	return run
}

// setPoolTargetPort points the pool at the fake engines' port, applied by a
// field manager of its own, which takes that field only.
func (s *space) setPoolTargetPort(name string, port int) {
	s.t.Helper()
	patch, err := json.Marshal(map[string]any{
		"apiVersion": poolGVR.Group + "/" + poolGVR.Version, "kind": "InferencePool",
		"metadata": map[string]any{"name": name},
		"spec":     map[string]any{"targetPorts": []any{map[string]any{"number": port}}},
	})
	require.NoError(s.t, err)
	force := true
	_, err = s.h.dyn.Resource(poolGVR).Namespace(s.ns).Patch(s.ctx(), name, types.ApplyPatchType, patch,
		metav1.PatchOptions{FieldManager: fieldManager + "-ports", Force: &force, FieldValidation: "Strict"})
	require.NoError(s.t, err)
}

// waitHealth waits until the health port answers SERVING for every service
// the rendered probes ask about, as the kubelet's gRPC probes would.
func (r *renderedRun) waitHealth(services ...string) {
	t := r.t
	t.Helper()
	conn, err := grpc.NewClient(r.healthAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	defer conn.Close()
	hc := healthpb.NewHealthClient(conn)
	for _, name := range services {
		start := time.Now()
		require.Eventually(t, func() bool {
			ctx, cancel := context.WithTimeout(t.Context(), time.Second)
			defer cancel()
			resp, err := hc.Check(ctx, &healthpb.HealthCheckRequest{Service: name})
			return !r.Exited() && err == nil && resp.GetStatus() == healthpb.HealthCheckResponse_SERVING
		}, startTimeout, poll, "health service %q never SERVING", name)
		t.Logf("health service %q SERVING after %v", name, time.Since(start).Round(time.Millisecond))
	}
}

// routeThroughRendered sends requests through the EPP and checks they reach
// the rendered pods: any pod in aggregated mode; a decode pod, with a prefill
// pod's hint, in disaggregated mode.
func (s *space) routeThroughRendered(r *renderedRun, m *rendered) {
	s.t.Helper()
	disagg := m.eppEnv()["DYN_EPP_TOPOLOGY_MODE"] == "disaggregated"
	r.eventually("every rendered pod is a worker", func() bool {
		n := 0
		for _, role := range []string{"aggregated", "prefill", "decode"} {
			if w := r.workers(role, "schedulable"); w > 0 {
				n += w
			}
		}
		return n == len(r.fleet.ips)
	})
	for i := range 4 {
		resp := r.send(request{prompt: fmt.Sprintf("deploy check %d: a request through the rendered manifests", i)})
		require.Equal(s.t, http.StatusOK, resp.StatusCode, "%s", resp.Body)
		dest := r.fleet.byEndpoint(resp.Served)
		require.GreaterOrEqual(s.t, dest, 0, "served by %s, no rendered pod", resp.Served)
		if !disagg {
			require.Empty(s.t, resp.Decision.Prefiller)
			continue
		}
		require.Equal(s.t, "decode", r.roles[dest])
		pre := r.fleet.byEndpoint(resp.Decision.Prefiller)
		require.GreaterOrEqual(s.t, pre, 0, "prefill hint %q", resp.Decision.Prefiller)
		require.Equal(s.t, "prefill", r.roles[pre])
	}
}

// deref is *p, or T's zero value for nil.
func deref[T any](p *T) T {
	var zero T
	if p == nil {
		return zero
	}
	return *p
}

func randomHex(t *testing.T, n int) string {
	t.Helper()
	b := make([]byte, n)
	_, err := rand.Read(b)
	require.NoError(t, err)
	return hex.EncodeToString(b)
}

// requireRenderTokenizers checks the render component: the EPP's tokenizer
// URLs name every replica of the rendered renderer StatefulSet, through its
// headless Service, on its container port, and parse as the EPP parses them.
func requireRenderTokenizers(t *testing.T, m *rendered) {
	t.Helper()
	var env string
	for _, e := range m.eppContainer().Env {
		if e.Name == "DYN_EPP_TOKENIZER_SERVICE_URL" {
			env = e.Value
		}
	}
	urls, err := tokenize.ParseBaseURLs(env, 64)
	require.NoError(t, err)
	require.Len(t, urls, 2, "both renderer replicas, for failover")
	for i, u := range urls {
		require.Equal(t, fmt.Sprintf("http://qwen3-render-%d.qwen3-render:8000", i), u)
	}
}
