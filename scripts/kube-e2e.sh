#!/usr/bin/env bash
# End-to-end tests of examples/epp against a real Kubernetes control plane:
# etcd plus kube-apiserver on loopback, the InferencePool CRD from the Gateway
# API Inference Extension module (and the HTTPRoute and ServiceMonitor CRDs the
# deploy/ manifests use), fake engines standing in for pods.
#
#   scripts/kube-e2e.sh [go test flags...]     e.g. scripts/kube-e2e.sh -run Disaggregated
#   scripts/kube-e2e.sh --prepare              only install etcd, build the API server and fetch the CRDs
#
# It builds kube-apiserver once per version into the user cache (outside the
# repository) and reuses it, installs etcd with apt when it is missing, starts
# both on free loopback ports with temporary directories, runs the e2e tests
# and always stops what it started.
#
# Environment:
#   KUBE_VERSION          kube-apiserver version to build (default v1.34.4)
#   GAIE_VERSION          Gateway API Inference Extension module version whose
#                         InferencePool CRD is applied (default v1.2.0)
#   GATEWAY_API_VERSION   Gateway API module version whose HTTPRoute CRD the
#                         deploy/ manifests are applied against (default v1.4.1)
#   PROM_OPERATOR_VERSION Prometheus Operator module version whose ServiceMonitor
#                         CRD they are applied against (default v0.85.0); when
#                         either cannot be fetched, the tests skip that kind and say so
#   KVSELECT_E2E_KEEP=1   keep the temporary directory (logs, kubeconfigs)
#   KVSELECT_E2E_RACE=1   build the EPP with the race detector; a reported race fails the test
#   READY_TIMEOUT         seconds to wait for etcd and the API server (default 90)
set -euo pipefail

KUBE_VERSION="${KUBE_VERSION:-v1.34.4}"
GAIE_VERSION="${GAIE_VERSION:-v1.2.0}"
GATEWAY_API_VERSION="${GATEWAY_API_VERSION:-v1.4.1}"
PROM_OPERATOR_VERSION="${PROM_OPERATOR_VERSION:-v0.85.0}"
READY_TIMEOUT="${READY_TIMEOUT:-90}"
repo="$(cd "$(dirname "$0")/.." && pwd)"
cache="${XDG_CACHE_HOME:-$HOME/.cache}/kvselect"
apiserver_dir="$cache/kube-apiserver-$KUBE_VERSION"
apiserver="$apiserver_dir/kube-apiserver"

t_start=$EPOCHREALTIME
t_phase=$EPOCHREALTIME
# phase NAME: report how long the phase that just ended took.
phase() {
	local now=$EPOCHREALTIME
	awk -v n="$1" -v a="$t_phase" -v b="$now" -v s="$t_start" \
		'BEGIN { printf "== %-28s %6.1fs (total %6.1fs)\n", n, b - a, b - s }'
	t_phase=$now
}
log() { echo "kube-e2e: $*" >&2; }
die() { log "$*"; exit 1; }

as_root() {
	if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

# --- binaries ----------------------------------------------------------------

ensure_etcd() {
	if command -v etcd >/dev/null 2>&1; then
		return
	fi
	log "etcd not on PATH: installing etcd-server with apt"
	command -v apt-get >/dev/null 2>&1 || die "no etcd and no apt-get: install etcd (3.4 or later) and retry"
	if ! as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y etcd-server; then
		as_root apt-get update
		as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y etcd-server
	fi
	command -v etcd >/dev/null 2>&1 || die "etcd-server installed but etcd is not on PATH"
}

# ensure_apiserver builds k8s.io/kubernetes/cmd/kube-apiserver in a throwaway
# module: k8s.io/kubernetes cannot be required as is because its go.mod
# replaces its staging modules with ./staging paths, so the same replaces are
# redone against the published staging modules (v0.X.Y for v1.X.Y).
ensure_apiserver() {
	if [ -x "$apiserver" ]; then
		log "reusing $apiserver"
		return
	fi
	log "building kube-apiserver $KUBE_VERSION (a few minutes; cached afterwards)"
	local mod staging gomod repl
	mod="$(mktemp -d "${TMPDIR:-/tmp}/kvselect-kbuild.XXXXXX")"
	# Subshell: its own directory, module mode and cleanup.
	(
		trap 'rm -rf "$mod"' EXIT
		cd "$mod"
		export GOFLAGS=-mod=mod GOWORK=off GO111MODULE=on
		staging="v0.${KUBE_VERSION#v1.}"
		go mod init kubeapiserverbuild >/dev/null 2>&1
		gomod="$(go list -m -json "k8s.io/kubernetes@$KUBE_VERSION" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",*$/\1/p')"
		[ -f "$gomod" ] || die "could not fetch the go.mod of k8s.io/kubernetes@$KUBE_VERSION"
		repl=()
		while read -r path; do
			repl+=("-replace=$path=$path@$staging")
		done < <(sed -n 's#^[[:space:]]*\(k8s\.io/[^[:space:]]*\)[[:space:]]*=>[[:space:]]*\./staging/.*#\1#p' "$gomod")
		[ "${#repl[@]}" -gt 0 ] || die "no ./staging replaces found in $gomod"
		log "replacing ${#repl[@]} staging modules with $staging"
		go mod edit -require="k8s.io/kubernetes@$KUBE_VERSION" "${repl[@]}"
		printf '//go:build tools\n\npackage main\n\nimport _ "k8s.io/kubernetes/cmd/kube-apiserver"\n' >tools.go
		go mod tidy >tidy.log 2>&1 || { cat tidy.log >&2; exit 1; }
		mkdir -p "$apiserver_dir"
		go build -trimpath -o "$apiserver.tmp" k8s.io/kubernetes/cmd/kube-apiserver
		mv "$apiserver.tmp" "$apiserver"
	)
	"$apiserver" --version
}

# module_file MODULE@VERSION PATH downloads a Go module through the module
# proxy (into the module cache, never the repository) and prints the path of
# one of its files; nothing when the module or the file is not there.
module_file() {
	local mod dir
	mod="$(mktemp -d "${TMPDIR:-/tmp}/kvselect-mod.XXXXXX")"
	dir="$(cd "$mod" && GOFLAGS=-mod=mod GOWORK=off go mod init crds >/dev/null 2>&1 &&
		GOFLAGS=-mod=mod GOWORK=off go mod download -json "$1" 2>/dev/null |
		sed -n 's/^[[:space:]]*"Dir": "\(.*\)",*$/\1/p' || true)"
	rm -rf "$mod"
	if [ -n "$dir" ] && [ -f "$dir/$2" ]; then echo "$dir/$2"; fi
}

# crd_path prints the path of the GAIE module's InferencePool CRD
# (inference.networking.k8s.io, served as v1).
crd_path() {
	local f
	f="$(module_file "sigs.k8s.io/gateway-api-inference-extension@$GAIE_VERSION" \
		config/crd/bases/inference.networking.k8s.io_inferencepools.yaml)"
	[ -n "$f" ] || die "InferencePool CRD not found in sigs.k8s.io/gateway-api-inference-extension@$GAIE_VERSION"
	echo "$f"
}

# optional_crds sets gateway_crd and servicemonitor_crd: the HTTPRoute and
# ServiceMonitor CRDs the deploy/ manifests are applied against, each empty
# (with a note) when it cannot be fetched.
optional_crds() {
	gateway_crd="$(module_file "sigs.k8s.io/gateway-api@$GATEWAY_API_VERSION" \
		config/crd/standard/gateway.networking.k8s.io_httproutes.yaml)"
	[ -n "$gateway_crd" ] || log "HTTPRoute CRD not fetched (sigs.k8s.io/gateway-api@$GATEWAY_API_VERSION): HTTPRoutes are skipped"
	servicemonitor_crd="$(module_file "github.com/prometheus-operator/prometheus-operator@$PROM_OPERATOR_VERSION" \
		example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml)"
	[ -n "$servicemonitor_crd" ] || log "ServiceMonitor CRD not fetched (prometheus-operator@$PROM_OPERATOR_VERSION): ServiceMonitors are skipped"
}

# --- ports -------------------------------------------------------------------

# listening_ports prints every local TCP port in LISTEN state (IPv4 and IPv6).
listening_ports() {
	local hex
	cat /proc/net/tcp /proc/net/tcp6 2>/dev/null |
		awk '$4 == "0A" { n = split($2, a, ":"); print a[n] }' |
		while read -r hex; do echo $((16#$hex)); done | sort -un
}

# free_port VAR sets VAR to a port below the ephemeral range (so outgoing
# connections do not take it meanwhile) that nothing listens on and that this
# run has not handed out yet. It runs in this shell (no command substitution)
# so that it remembers what it handed out.
taken=" "
free_port() {
	local used p i
	used=" $(listening_ports | tr '\n' ' ')"
	for i in $(seq 1 200); do
		p=$((20000 + RANDOM % 12000))
		case "$used$taken" in *" $p "*) continue ;; esac
		taken+="$p "
		printf -v "$1" '%s' "$p"
		return
	done
	die "no free port found"
}

# --- control plane -----------------------------------------------------------

work=""
etcd_pid=""
apiserver_pid=""
test_pid=""

stop_all() {
	local rc=$?
	set +e
	if [ -n "$test_pid" ]; then # interrupted while the tests ran
		kill -TERM -- "-$test_pid" 2>/dev/null
		wait "$test_pid" 2>/dev/null
		phase "go test (interrupted)"
	fi
	for pid in "$apiserver_pid" "$etcd_pid"; do
		[ -n "$pid" ] || continue
		kill "$pid" 2>/dev/null
		for _ in $(seq 1 100); do
			kill -0 "$pid" 2>/dev/null || break
			sleep 0.1
		done
		kill -9 "$pid" 2>/dev/null
		wait "$pid" 2>/dev/null
	done
	if [ -n "$work" ]; then
		if [ "$rc" -ne 0 ] && [ -f "$work/kube-apiserver.log" ]; then
			log "last lines of the kube-apiserver log:"
			tail -n 20 "$work/kube-apiserver.log" >&2
		fi
		if [ "${KVSELECT_E2E_KEEP:-}" = 1 ]; then
			log "kept $work"
		else
			rm -rf "$work"
		fi
	fi
	phase "stop"
	exit "$rc"
}

# wait_for NAME CMD...: run CMD until it succeeds, for at most READY_TIMEOUT
# seconds; fail early when the process behind it died.
wait_for() {
	local name=$1 pid=$2
	shift 2
	local deadline=$((SECONDS + READY_TIMEOUT))
	until "$@" >/dev/null 2>&1; do
		kill -0 "$pid" 2>/dev/null || die "$name exited; see $work/$name.log"
		[ "$SECONDS" -lt "$deadline" ] || die "$name not ready after ${READY_TIMEOUT}s; see $work/$name.log"
		sleep 0.2
	done
}

write_kubeconfig() { # file user token
	cat >"$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: e2e
  cluster:
    server: https://127.0.0.1:$api_port
    certificate-authority: $work/certs/apiserver.crt
contexts:
- name: $2
  context: {cluster: e2e, user: $2}
current-context: $2
users:
- name: $2
  user: {token: $3}
EOF
}

random_token() { od -An -N16 -tx1 /dev/urandom | tr -d ' \n'; }

main() {
	cd "$repo"
	command -v go >/dev/null 2>&1 || die "go is not on PATH"
	command -v openssl >/dev/null 2>&1 || die "openssl is needed to generate the service-account key"
	command -v curl >/dev/null 2>&1 || die "curl is needed to probe readiness"

	ensure_etcd
	phase "etcd binary"
	ensure_apiserver
	phase "kube-apiserver binary"
	local crd
	crd="$(crd_path)"
	local gateway_crd servicemonitor_crd
	optional_crds
	phase "CRDs"
	if [ "${1:-}" = --prepare ]; then
		log "prerequisites ready"
		return 0
	fi

	work="$(mktemp -d "${TMPDIR:-/tmp}/kvselect-kube-e2e.XXXXXX")"
	trap stop_all EXIT
	trap 'exit 130' INT TERM
	mkdir -p "$work/etcd" "$work/certs"
	openssl genrsa -out "$work/sa.key" 2048 2>/dev/null
	local admin_token epp_token
	admin_token="$(random_token)"
	epp_token="$(random_token)"
	# token,user,uid,"groups": the admin is in system:masters; epp gets only
	# what the tests' Role grants it.
	printf '%s,e2e-admin,e2e-admin,"system:masters"\n%s,epp,epp\n' "$admin_token" "$epp_token" >"$work/tokens.csv"

	local etcd_port peer_port
	free_port etcd_port
	free_port peer_port
	free_port api_port
	etcd --name e2e --data-dir "$work/etcd" \
		--listen-client-urls "http://127.0.0.1:$etcd_port" --advertise-client-urls "http://127.0.0.1:$etcd_port" \
		--listen-peer-urls "http://127.0.0.1:$peer_port" --initial-advertise-peer-urls "http://127.0.0.1:$peer_port" \
		--initial-cluster "e2e=http://127.0.0.1:$peer_port" \
		>"$work/etcd.log" 2>&1 &
	etcd_pid=$!
	wait_for etcd "$etcd_pid" curl -fsS "http://127.0.0.1:$etcd_port/health"
	phase "etcd ready"

	"$apiserver" \
		--etcd-servers "http://127.0.0.1:$etcd_port" \
		--bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$api_port" \
		--cert-dir "$work/certs" \
		--token-auth-file "$work/tokens.csv" \
		--authorization-mode RBAC \
		--service-account-issuer https://kubernetes.default.svc \
		--service-account-key-file "$work/sa.key" \
		--service-account-signing-key-file "$work/sa.key" \
		--service-cluster-ip-range 10.96.0.0/24 \
		--disable-admission-plugins ServiceAccount \
		>"$work/kube-apiserver.log" 2>&1 &
	apiserver_pid=$!
	wait_for kube-apiserver "$apiserver_pid" \
		curl -fsS --cacert "$work/certs/apiserver.crt" -H "Authorization: Bearer $admin_token" \
		"https://127.0.0.1:$api_port/readyz"
	phase "kube-apiserver ready"

	write_kubeconfig "$work/admin.kubeconfig" e2e-admin "$admin_token"
	write_kubeconfig "$work/epp.kubeconfig" epp "$epp_token"
	export KVSELECT_E2E_ADMIN_KUBECONFIG="$work/admin.kubeconfig"
	export KVSELECT_E2E_EPP_KUBECONFIG="$work/epp.kubeconfig"
	export KVSELECT_E2E_EPP_USER=epp
	export KVSELECT_E2E_CRD="$crd"
	export KVSELECT_E2E_GATEWAY_CRD="$gateway_crd"
	export KVSELECT_E2E_SERVICEMONITOR_CRD="$servicemonitor_crd"

	# go test runs in a session of its own, in the background: a signal to
	# this script interrupts the wait at once, and stop_all can end go test,
	# the test binary and the EPP processes it started as one process group.
	local rc=0
	mkdir -p "$work/tmp"
	TMPDIR="$work/tmp" setsid go test -tags e2e -count=1 -timeout 10m "$@" ./examples/epp/e2ekube/ &
	test_pid=$!
	wait "$test_pid" || rc=$?
	test_pid=""
	phase "go test"
	return "$rc"
}

main "$@"
