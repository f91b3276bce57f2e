//go:build e2e

package e2ekube

import (
	"context"
	"errors"
	"fmt"
	"os"
	"testing"
	"time"

	"go.uber.org/goleak"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/yaml"

	"github.com/kvselect/kvselect/examples/epp/internal/eppproc"
	"github.com/kvselect/kvselect/internal/fakeengine"
)

// Environment set by scripts/kube-e2e.sh.
const (
	envAdminKubeconfig = "KVSELECT_E2E_ADMIN_KUBECONFIG"
	envEPPKubeconfig   = "KVSELECT_E2E_EPP_KUBECONFIG"
	envEPPUser         = "KVSELECT_E2E_EPP_USER"
	envCRD             = "KVSELECT_E2E_CRD"
	// envRace=1 builds the EPP with the race detector; a test fails when an
	// EPP it started reports a data race.
	envRace = "KVSELECT_E2E_RACE"
)

// harness is what every test shares: the admin clients, the EPP identity and
// the EPP binary. nil when the environment is absent (skip is the reason).
type harness struct {
	admin         kubernetes.Interface
	dyn           dynamic.Interface
	eppKubeconfig string
	eppUser       string
	eppBinary     string
}

var (
	h    *harness
	skip string
)

var crdGVR = schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}

func TestMain(m *testing.M) {
	code, err := run(m)
	if err != nil {
		fmt.Fprintln(os.Stderr, "e2ekube:", err)
		os.Exit(1)
	}
	os.Exit(code)
}

func run(m *testing.M) (int, error) {
	admin, eppKC, crd := os.Getenv(envAdminKubeconfig), os.Getenv(envEPPKubeconfig), os.Getenv(envCRD)
	if admin == "" || eppKC == "" || crd == "" {
		skip = fmt.Sprintf("%s, %s and %s are not set: run `make e2e-kube` (scripts/kube-e2e.sh), which starts a real API server",
			envAdminKubeconfig, envEPPKubeconfig, envCRD)
		return m.Run(), nil
	}
	bin, err := os.MkdirTemp("", "kvselect-e2ekube-")
	if err != nil {
		return 0, err
	}
	defer os.RemoveAll(bin)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	hh, err := setUp(ctx, admin, eppKC, crd, bin)
	if err != nil {
		return 0, err
	}
	h = hh
	code := m.Run()
	if code == 0 {
		// client-go caches its transports process-wide, so the idle HTTP/2
		// connections to the API server stay; the fake engines leave
		// go-zeromq's per-socket goroutine. Everything else must be gone.
		if err := goleak.Find(goleak.IgnoreAnyFunction(fakeengine.LeakyZMQFunction),
			goleak.IgnoreAnyFunction("golang.org/x/net/http2.(*ClientConn).readLoop"),
			goleak.IgnoreAnyFunction("net/http.(*persistConn).readLoop"),
			goleak.IgnoreAnyFunction("net/http.(*persistConn).writeLoop"),
			goleak.IgnoreTopFunction("k8s.io/klog/v2.(*flushDaemon).run.func1"),
		); err != nil {
			fmt.Fprintln(os.Stderr, "e2ekube: goroutine leak:", err)
			return 1, nil
		}
	}
	return code, nil
}

// setUp connects as the admin, installs the InferencePool CRD and builds the
// EPP binary.
func setUp(ctx context.Context, adminKC, eppKC, crdPath, binDir string) (*harness, error) {
	rc, err := clientcmd.BuildConfigFromFlags("", adminKC)
	if err != nil {
		return nil, fmt.Errorf("admin kubeconfig: %w", err)
	}
	rc.QPS, rc.Burst, rc.Timeout = 200, 400, apiTimeout
	cs, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return nil, err
	}
	dyn, err := dynamic.NewForConfig(rc)
	if err != nil {
		return nil, err
	}
	user := os.Getenv(envEPPUser)
	if user == "" {
		user = "epp"
	}
	hh := &harness{admin: cs, dyn: dyn, eppKubeconfig: eppKC, eppUser: user}
	start := time.Now()
	if err := applyCRD(ctx, dyn, crdPath); err != nil {
		return nil, err
	}
	fmt.Fprintf(os.Stderr, "e2ekube: InferencePool CRD established in %v\n", time.Since(start).Round(time.Millisecond))
	start = time.Now()
	hh.eppBinary, err = eppproc.Build(ctx, binDir, os.Getenv(envRace) == "1")
	if err != nil {
		return nil, fmt.Errorf("build the EPP: %w", err)
	}
	fmt.Fprintf(os.Stderr, "e2ekube: EPP built in %v\n", time.Since(start).Round(time.Millisecond))
	return hh, nil
}

// applyCRD creates the CRD from its YAML file (or keeps an existing one) and
// waits until the API server reports it Established and serves the pool
// resource.
func applyCRD(ctx context.Context, dyn dynamic.Interface, path string) error {
	raw, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("read the CRD: %w", err)
	}
	js, err := yaml.YAMLToJSON(raw)
	if err != nil {
		return fmt.Errorf("parse the CRD: %w", err)
	}
	obj := &unstructured.Unstructured{}
	if err := obj.UnmarshalJSON(js); err != nil {
		return fmt.Errorf("decode the CRD: %w", err)
	}
	if _, err := dyn.Resource(crdGVR).Create(ctx, obj, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create the CRD: %w", err)
	}
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		got, err := dyn.Resource(crdGVR).Get(ctx, obj.GetName(), metav1.GetOptions{})
		if err == nil && established(got) {
			if _, err := dyn.Resource(poolGVR).Namespace("default").List(ctx, metav1.ListOptions{}); err == nil {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return errors.Join(fmt.Errorf("the CRD %s is not established", obj.GetName()), ctx.Err())
		case <-tick.C:
		}
	}
}

func established(crd *unstructured.Unstructured) bool {
	conds, _, _ := unstructured.NestedSlice(crd.Object, "status", "conditions")
	for _, c := range conds {
		m, ok := c.(map[string]any)
		if ok && m["type"] == "Established" && m["status"] == "True" {
			return true
		}
	}
	return false
}

// need returns the harness or skips the test with the reason.
func need(t *testing.T) *harness {
	t.Helper()
	if h == nil {
		t.Skip(skip)
	}
	return h
}
