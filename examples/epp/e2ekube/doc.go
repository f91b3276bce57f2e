// Package e2ekube holds the end-to-end tests of the Endpoint Picker
// (examples/epp) against a real Kubernetes API server: a real etcd, a real
// kube-apiserver, the real InferencePool CRD, and fake engines
// (internal/fakeengine) standing in for the pods' model servers.
//
// It has no code outside its tests, which carry the build tag e2e. Run them
// with `make e2e-kube` (scripts/kube-e2e.sh), which builds or reuses the API
// server, starts the control plane on loopback ports, exports
//
//	KVSELECT_E2E_ADMIN_KUBECONFIG  kubeconfig of an administrator (system:masters)
//	KVSELECT_E2E_EPP_KUBECONFIG    kubeconfig of the EPP's identity, which has no rights until a test grants them
//	KVSELECT_E2E_EPP_USER          that identity's user name
//	KVSELECT_E2E_CRD               path of the InferencePool CRD (from the Gateway API Inference Extension module)
//	KVSELECT_E2E_GATEWAY_CRD       path of the HTTPRoute CRD (Gateway API module); empty: HTTPRoutes skipped
//	KVSELECT_E2E_SERVICEMONITOR_CRD  path of the ServiceMonitor CRD (Prometheus Operator module); empty: skipped
//
// and runs `go test -tags e2e ./examples/epp/e2ekube/`. Without these
// variables every test skips and says so.
//
// The harness has no kubelet, scheduler or controller manager: a test creates
// Pods and then writes their status (phase, Ready condition, pod IP) through
// the status subresource. Every pod IP is a distinct loopback address
// (127.0.0.2, 127.0.0.3, ...) where a fake engine serves HTTP, KV events and
// replay on the pool's shared port numbers; in the role-labelled pools a
// decode pod's HTTP port is a real decode sidecar (examples/pdsidecar/sidecar)
// in front of its engine, and the tests check each prefill and decode leg on
// the engines' counters. The EPP runs as a subprocess with
// the least-privilege identity (a Role that can only get, list and watch pods
// and inferencepools in the test's namespace); the tests play Envoy with
// internal/extproctest against its ext_proc port and read its JSON logs and
// Prometheus metrics. TestDeployManifests applies the deploy/ overlays and
// runs the EPP, built as its Dockerfile builds it, from the rendered
// Deployment under the rendered Roles. docs/E2E.md lists the cases and what
// each one shows.
package e2ekube
