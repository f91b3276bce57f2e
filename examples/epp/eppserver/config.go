package eppserver

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"math"
	"net"
	"net/netip"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/net/http/httpguts"
	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/kvselect/kvselect/examples/epp/discovery"
	"github.com/kvselect/kvselect/examples/epp/oteltracing"
	"github.com/kvselect/kvselect/examples/internal/envconf"
	"github.com/kvselect/kvselect/examples/internal/pdhint"
	"github.com/kvselect/kvselect/examples/policies"
	"github.com/kvselect/kvselect/gaie"
	"github.com/kvselect/kvselect/replica"
	"github.com/kvselect/kvselect/replica/natsbus"
	"github.com/kvselect/kvselect/roles"
	"github.com/kvselect/kvselect/selection"
	"github.com/kvselect/kvselect/tokenize"
)

// Config is the EPP's whole configuration, read from the environment contract
// of Dynamo's standalone EPP (so its users can switch) and overridable by flags.
// LoadConfig builds and checks it; a caller that runs the EPP in process (the
// demo, tests) may adjust a loaded value before New, never after.
type Config struct {
	Mode          string
	SessionHeader string // read before x-dynamo-session-id; "" for none
	Topology      string // aggregated | disaggregated
	RoleLabel     string
	PDHintKey     []byte        // signs prefill hints; nil: unsigned
	PDHintTTL     time.Duration // lifetime of a hint's signature
	PoolName      string
	Namespace     string
	PodIP         string
	Model         string
	// TokenizerURLs are the tokenizer endpoints (one or more base URLs of
	// the same protocol): a tokenize.Pool of one Client each, inside the
	// cache. Empty: the pool follows discovery, the workers' own endpoints
	// its URLs (discovery.Tokenizers).
	TokenizerURLs     []string
	TokenizerProtocol string
	TokenizerTimeout  time.Duration
	TokenizerMaxResp  int
	// TokenizerNoDegrade refuses a request whose tokenization failed on
	// the tokenizers' side (the error's status) instead of routing it on
	// load alone (the degraded mode).
	TokenizerNoDegrade bool
	BlockSize          int
	KVEventPort        int
	KVReplayPort       int
	KVEventBind        string
	KVEventBindAny     bool
	TotalKVBlocks      int
	MaxBatched         int
	PrefillMaxBatched  int
	LocalPrefillBelow  int // conditional disaggregation threshold in tokens (0: off)
	DecodeMaxBatched   int
	MaxInflight        int
	IndexerThreads     int
	SecureServing      bool
	ExtProcAddr        string
	HealthAddr         string
	MetricsAddr        string
	WorkersFile        string
	Kubeconfig         string
	MaxBodyBytes       int
	MaxPromptTokens    int
	// Replicas (docs/REPLICAS.md): at most one of PeerService, Peers (an
	// embedded NATS server routed to the peers) and NATSURL (an existing
	// NATS cluster); none means no replication.
	PodName     string
	PeerService string
	Peers       []string // host:port of the peers' route listeners
	SyncPort    int      // the embedded server's route listener port
	SyncSecret  string   // the routes' shared secret; "" for none
	NATSURL     string
	ReplicaID   string // explicit; see replicaID for the default
	HoldBursts  bool   // a burst's requests wait for the peers ahead (selection.Peers.Hold)
	// Long requests and observability (docs/OBSERVABILITY.md).
	RenewInterval time.Duration // lease renewal while a response flows; 0: off
	OutputGrowth  bool          // SSE events grow the decode booking
	growthAuto    bool          // DYN_EPP_OUTPUT_GROWTH=auto: OutputGrowth follows the cost
	Fallbacks     int           // fallback endpoints per pick, 0..16
	OTLPEndpoint  string        // "" : tracing off
	DebugHeader   bool          // x-kvselect-debug on every routed response
	// LoRA is LoRA-adapter affinity (DYN_EPP_LORA_AFFINITY): off, prefer
	// or require; LoRALabelPrefix begins the worker labels that name the
	// adapters loaded (package policies).
	LoRA, LoRALabelPrefix string
	// ConformanceTestHooks turns on GAIE's conformance-suite hooks
	// (extproc.Options.ConformanceTestHooks).
	ConformanceTestHooks bool
	// OverloadStatus answers an overload or an admission refusal (429 by
	// selection.HTTPStatus): 429 or 529 (DYN_EPP_OVERLOAD_STATUS).
	OverloadStatus int
	Router         selection.Config
}

// secondsIn sets *dst to a whole number of seconds in [lo, hi].
func secondsIn(dst *time.Duration, lo, hi int) func(string) error {
	return func(v string) error {
		var n int
		if err := intIn(&n, lo, hi)(v); err != nil {
			return err
		}
		*dst = time.Duration(n) * time.Second
		return nil
	}
}

func intIn(dst *int, lo, hi int) func(string) error {
	return func(v string) error {
		n, err := strconv.Atoi(strings.TrimSpace(v))
		if err != nil {
			return fmt.Errorf("%q is not an integer", v)
		}
		if n < lo || n > hi {
			return fmt.Errorf("%d is out of range [%d, %d]", n, lo, hi)
		}
		*dst = n
		return nil
	}
}

func floatMin(dst *float64, lo float64) func(string) error {
	return floatIn(dst, lo, math.MaxFloat64)
}

// floatIn reads a finite number in [lo, hi].
func floatIn(dst *float64, lo, hi float64) func(string) error {
	return func(v string) error {
		f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
		if err != nil || math.IsNaN(f) || math.IsInf(f, 0) {
			return fmt.Errorf("%q is not a finite number", v)
		}
		if f < lo || f > hi {
			return fmt.Errorf("%v is out of range [%v, %v]", f, lo, hi)
		}
		*dst = f
		return nil
	}
}

func boolean(dst *bool) func(string) error {
	return func(v string) error {
		b, err := strconv.ParseBool(strings.TrimSpace(v))
		if err != nil {
			return fmt.Errorf("%q is not a boolean (true/false)", v)
		}
		*dst = b
		return nil
	}
}

func str(dst *string) func(string) error {
	return func(v string) error { *dst = strings.TrimSpace(v); return nil }
}

func listenAddr(dst *string) func(string) error {
	return func(v string) error {
		if _, _, err := net.SplitHostPort(v); err != nil {
			return fmt.Errorf("%q is not host:port", v)
		}
		*dst = v
		return nil
	}
}

const maxPort = 65535

// maxPeers bounds DYN_EPP_PEERS (and the peers discovery routes to).
const maxPeers = 256

// tokenizerProtocols are DYN_EPP_TOKENIZER_PROTOCOL's values.
var tokenizerProtocols = tokenize.Protocols()

// settings returns the contract bound to c. The order is the README table's.
func (c *Config) settings() []envconf.Var {
	r := &c.Router
	return []envconf.Var{
		{Env: "DYN_EPP_MODE", Flag: "mode", Default: "standalone", Help: "EPP mode; only `standalone` (the embedded kvselect service) exists here",
			Set: func(v string) error {
				if strings.TrimSpace(v) != "standalone" {
					return fmt.Errorf("%q: only standalone is supported", v)
				}
				c.Mode = "standalone"
				return nil
			}},
		{Env: "DYN_EPP_TOPOLOGY_MODE", Flag: "topology", Default: "aggregated", Help: "`aggregated` or `disaggregated` (prefill/decode split by the role label)",
			Set: func(v string) error {
				m, err := roles.ParseTopologyMode(v)
				if err != nil {
					return fmt.Errorf("%q: want aggregated or disaggregated", v)
				}
				c.Topology = m.String()
				return nil
			}},
		{Env: "DYN_EPP_WORKER_ROLE_LABEL", Flag: "role-label", Default: roles.DefaultRoleLabel, Help: "pod label that carries `prefill` or `decode` (disaggregated mode)", Set: str(&c.RoleLabel)},
		{Env: "DYN_EPP_PD_HINT_KEY", Flag: "pd-hint-key", Help: "signs each prefill hint (x-kvselect-prefiller-signature) with the key the decode sidecars check (their DYN_PD_HINT_KEY): `file:<path>` or an absolute path is read, anything else is the key itself; at least 32 bytes (unset: hints are not signed)",
			Set: func(v string) error {
				key, err := pdhint.LoadKey(strings.TrimSpace(v))
				if err != nil {
					return err
				}
				if len(key) < pdhint.MinKeyLen { // never quote the key
					return fmt.Errorf("a key of %d bytes; want at least %d", len(key), pdhint.MinKeyLen)
				}
				c.PDHintKey = key
				return nil
			}},
		{Env: "DYN_EPP_PD_HINT_TTL_MS", Flag: "pd-hint-ttl-ms", Default: "30000", Help: "how long a hint's signature is valid, in ms (>= 1000; at most the sidecars' DYN_PD_HINT_MAX_LIFETIME_MS, 300000 by default)",
			Set: func(v string) error {
				var ms int
				if err := intIn(&ms, 1000, 86_400_000)(v); err != nil {
					return err
				}
				c.PDHintTTL = time.Duration(ms) * time.Millisecond
				return nil
			}},
		{Env: "DYN_EPP_INFERENCE_POOL_NAME", Flag: "inference-pool", Required: "with Kubernetes discovery", Help: "the InferencePool this EPP serves", Set: str(&c.PoolName)},
		{Env: "POD_NAMESPACE", Flag: "namespace", Required: "with Kubernetes discovery", Help: "namespace of the pool and its pods (downward API)", Set: str(&c.Namespace)},
		{Env: "POD_IP", Flag: "pod-ip", Help: "this EPP's own IP (downward API status.podIP): required with DYN_EPP_PEER_SERVICE (self is no peer); the replica sync listener binds it", Set: str(&c.PodIP)},
		{Env: "DYN_MODEL_NAME", Flag: "model", Default: "default", Help: "model name: the selection partition of every worker and request", Set: str(&c.Model)},
		{Env: "DYN_EPP_LORA_AFFINITY", Flag: "lora-affinity", Default: loraOff, Help: fmt.Sprintf("LoRA adapters: a request whose body `model` is not DYN_MODEL_NAME names an adapter (as vLLM and SGLang read it), and goes preferably (`prefer`: such a worker costs %d blocks, or %v s with the predictive cost, less) or only (`require`: none, 503 with reason filtered:lora) to the workers labelled with it loaded (`<DYN_EPP_LORA_LABEL_PREFIX><adapter>=true`); `off` reads no adapter", policies.DefaultAffinityBlocks, policies.DefaultAffinitySeconds),
			Set: func(v string) error {
				v = strings.TrimSpace(v)
				if v != loraOff && v != loraPrefer && v != loraRequire {
					return fmt.Errorf("%q: want off, prefer or require", v)
				}
				c.LoRA = v
				return nil
			}},
		{Env: "DYN_EPP_LORA_LABEL_PREFIX", Flag: "lora-label-prefix", Default: policies.DefaultLabelPrefix, Help: "prefix of the pod labels that name a worker's loaded LoRA adapters, `<prefix><adapter>=true` (a DNS subdomain and /, or the start of a label name)",
			Set: func(v string) error {
				v = strings.TrimSpace(v)
				if _, err := policies.NewAdapters(v); err != nil {
					return err
				}
				c.LoRALabelPrefix = v
				return nil
			}},
		{Env: "DYN_EPP_TOKENIZER_SERVICE_URL", Flag: "tokenizer-url", Help: fmt.Sprintf("absolute http(s) base URL of the engines' tokenizer/render service, or several, comma-separated (at most %d); a list set here wins. Unset: the discovered workers of DYN_MODEL_NAME (the first %[1]d by worker id) are the tokenizers, each at `http://<endpoint>` (every vLLM and SGLang pod serves render/tokenize), following discovery as workers come and go, except those whose `%s` label names another engine than the protocol's (`vllm` or `sglang`; label TensorRT-LLM pods `trtllm`: they serve no tokenizer, so give such a pool a render service here). Calls go round robin, fail over to the next URL on an error or timeout, are hedged on a second URL past the recent calls' p95 (at least 50 ms), and skip a URL for 5 s after 3 failures in a row", discovery.MaxTokenizers, discovery.EngineLabel),
			Set: func(v string) error {
				urls, err := tokenize.ParseBaseURLs(v, discovery.MaxTokenizers)
				c.TokenizerURLs = urls
				return err
			}},
		{Env: "DYN_EPP_TOKENIZER_PROTOCOL", Flag: "tokenizer-protocol", Default: "vllm-render", Help: "`vllm-render`, `vllm-tokenize`, `sglang` (SGLang's /tokenize) or `sglang-renderer` (the render routes of SGLang's CPU-only renderer, as Dynamo's EPP speaks them)",
			Set: func(v string) error {
				v = strings.TrimSpace(v)
				if !slices.Contains(tokenizerProtocols, v) {
					return fmt.Errorf("%q is not one of %s", v, strings.Join(tokenizerProtocols, ", "))
				}
				c.TokenizerProtocol = v
				return nil
			}},
		{Env: "DYN_EPP_TOKENIZATION_TIMEOUT_MS", Flag: "tokenization-timeout-ms", Default: "5000", Help: "per-call tokenizer timeout in ms (>= 1), for each tokenizer URL a call tries; with several URLs one request's tokenization may take up to three of them (failover)",
			Set: func(v string) error {
				var ms int
				if err := intIn(&ms, 1, 600_000)(v); err != nil {
					return err
				}
				c.TokenizerTimeout = time.Duration(ms) * time.Millisecond
				return nil
			}},
		{Env: "DYN_EPP_TOKENIZER_MAX_RESPONSE_BYTES", Flag: "tokenizer-max-response-bytes", Default: "16777216", Help: "largest tokenizer response accepted", Set: intIn(&c.TokenizerMaxResp, 1024, 1<<30)},
		{Env: "DYN_EPP_TOKENIZER_NO_DEGRADE", Flag: "tokenizer-no-degrade", Default: "false", Help: "when no tokenizer URL answers (unreachable, timed out, an upstream error), refuse the request with that error's status (503, 504 or 502) instead of routing it on load alone, without prefix reuse (the degraded mode, counted in kvselect_epp_degraded_requests_total)", Set: boolean(&c.TokenizerNoDegrade)},
		{Env: "DYN_KV_CACHE_BLOCK_SIZE", Flag: "block-size", Default: "16", Help: "KV block size in tokens; must equal the engines' block size", Set: intIn(&c.BlockSize, 1, 1<<16)},
		{Env: "DYN_EPP_KV_EVENT_PORT", Flag: "kv-event-port", Default: "5557", Help: "engines' ZMQ PUB port (0: no KV events, approximate mode)", Set: intIn(&c.KVEventPort, 0, maxPort)},
		{Env: "DYN_EPP_KV_EVENT_REPLAY_PORT", Flag: "kv-event-replay-port", Default: "0", Help: "engines' ZMQ replay ROUTER port (0: none)", Set: intIn(&c.KVReplayPort, 0, maxPort)},
		{Env: "DYN_EPP_KV_EVENT_BIND", Flag: "kv-event-bind", Help: "bind a SUB here (tcp://host:port) for engines that dial in, instead of dialing each engine; only workers' addresses may connect, each publishing its own topic", Set: str(&c.KVEventBind)},
		{Env: "DYN_EPP_KV_EVENT_BIND_ANY_PEER", Flag: "kv-event-bind-any-peer", Default: "false", Help: "let any address publish on the bind port (engines behind NAT); anyone reaching the port can then publish as any worker", Set: boolean(&c.KVEventBindAny)},
		{Env: "DYN_EPP_TOTAL_KV_BLOCKS", Flag: "total-kv-blocks", Default: "0", Help: "per-worker KV capacity in blocks (0: unknown)", Set: intIn(&c.TotalKVBlocks, 0, math.MaxInt32)},
		{Env: "DYN_EPP_MAX_NUM_BATCHED_TOKENS", Flag: "max-num-batched-tokens", Default: "0", Required: "when DYN_ROUTER_QUEUE_THRESHOLD is set", Help: "engines' max_num_batched_tokens, the busy base of queueing", Set: intIn(&c.MaxBatched, 0, math.MaxInt32)},
		{Env: "DYN_EPP_PREFILL_MAX_NUM_BATCHED_TOKENS", Flag: "prefill-max-num-batched-tokens", Default: "0", Help: "prefill workers' value (0: the shared one)", Set: intIn(&c.PrefillMaxBatched, 0, math.MaxInt32)},
		{Env: "DYN_EPP_DECODE_MAX_NUM_BATCHED_TOKENS", Flag: "decode-max-num-batched-tokens", Default: "0", Help: "decode workers' value (0: the shared one)", Set: intIn(&c.DecodeMaxBatched, 0, math.MaxInt32)},
		{Env: "DYN_EPP_LOCAL_PREFILL_BELOW", Flag: "local-prefill-below", Default: "0", Help: "conditional disaggregation (disaggregated mode): a request whose uncached prompt on its decode worker is at most this many tokens, or that meets a busy prefill pool, skips the prefill leg (0: off)", Set: intIn(&c.LocalPrefillBelow, 0, math.MaxInt32)},
		{Env: "DYN_EPP_MAX_INFLIGHT_REQUESTS", Flag: "max-inflight", Default: "1024", Help: "concurrent picks; more are shed with 503", Set: intIn(&c.MaxInflight, 1, 1<<20)},
		{Env: "DYN_EPP_SELECTION_INDEXER_THREADS", Flag: "indexer-threads", Default: "4", Help: "accepted for compatibility (each event source applies on its own goroutine)", Set: intIn(&c.IndexerThreads, 1, 1024)},
		{Env: "DYN_SECURE_SERVING", Flag: "secure-serving", Default: "true", Help: "TLS with a self-signed certificate on the ext_proc port (false: plaintext h2c)", Set: boolean(&c.SecureServing)},
		{Env: "DYN_EPP_EXTPROC_ADDR", Flag: "extproc-addr", Default: ":9002", Help: "ext_proc gRPC listen address", Set: listenAddr(&c.ExtProcAddr)},
		{Env: "DYN_EPP_HEALTH_ADDR", Flag: "health-addr", Default: ":9003", Help: "gRPC health listen address", Set: listenAddr(&c.HealthAddr)},
		{Env: "DYN_EPP_METRICS_ADDR", Flag: "metrics-addr", Default: ":9090", Help: "Prometheus /metrics listen address", Set: listenAddr(&c.MetricsAddr)},
		{Env: "DYN_EPP_WORKERS_FILE", Flag: "workers-file", Help: "static discovery: a JSON/YAML file of workers, watched (no Kubernetes)", Set: str(&c.WorkersFile)},
		{Env: "KUBECONFIG", Flag: "kubeconfig", Help: "kubeconfig path (default: in-cluster config)", Set: str(&c.Kubeconfig)},
		{Env: "DYN_EPP_MAX_BODY_BYTES", Flag: "max-body-bytes", Default: "8388608", Help: "largest request body buffered (excess: 413)", Set: intIn(&c.MaxBodyBytes, 1024, 1<<30)},
		{Env: "DYN_EPP_MAX_PROMPT_TOKENS", Flag: "max-prompt-tokens", Default: "1048576", Help: "most token ids one request's prompt may have, refused as the tokenizer's answer is parsed (excess: 413)", Set: intIn(&c.MaxPromptTokens, 1, 1<<26)},
		// Replicas (docs/REPLICAS.md).
		{Env: "POD_NAME", Flag: "pod-name", Help: "this EPP's pod name (downward API): the default replica ID", Set: str(&c.PodName)},
		{Env: "DYN_EPP_SELECTION_HTTP_PORT", Flag: "selection-http-port", Help: "Dynamo's peer index dump over HTTP for a starting replica: not served; set, it is a configuration error. kvselect's replicas warm from a peer's index over NATS instead (DYN_EPP_PEER_SERVICE, docs/REPLICAS.md)",
			Set: func(v string) error {
				return fmt.Errorf("not served: a starting replica warms from a peer's index over NATS (DYN_EPP_PEER_SERVICE, DYN_EPP_PEERS or DYN_EPP_NATS_URL; docs/REPLICAS.md), got %q", v)
			}},
		{Env: "DYN_EPP_PEER_SERVICE", Flag: "peer-service", Help: "replicas, embedded NATS: the headless Service (in POD_NAMESPACE) whose ready endpoints are this EPP's peers; their servers are routed to at `<ip>:DYN_EPP_REPLICA_SYNC_PORT` (needs POD_IP; RBAC services get, endpointslices list and watch)",
			Set: func(v string) error {
				v = strings.TrimSpace(v)
				if errs := validation.IsDNS1035Label(v); len(errs) > 0 {
					return fmt.Errorf("%q is not a Service name: %s", v, strings.Join(errs, "; "))
				}
				c.PeerService = v
				return nil
			}},
		{Env: "DYN_EPP_PEERS", Flag: "peers", Help: "replicas, embedded NATS, without Kubernetes: comma-separated host:port of the peers' sync listeners (static routes)",
			Set: func(v string) error {
				var out []string
				for _, f := range strings.Split(v, ",") {
					if f = strings.TrimSpace(f); f == "" {
						continue
					}
					host, port, err := net.SplitHostPort(f)
					if n, perr := strconv.Atoi(port); err != nil || perr != nil || host == "" || n < 1 || n > maxPort {
						return fmt.Errorf("%q is not host:port", f)
					}
					out = append(out, f)
				}
				if len(out) == 0 {
					// Set but empty would run unreplicated without a word.
					return fmt.Errorf("%q names no peer (unset it to run one replica)", v)
				}
				if len(out) > maxPeers {
					return fmt.Errorf("%d peers, at most %d", len(out), maxPeers)
				}
				c.Peers = out
				return nil
			}},
		{Env: "DYN_EPP_REPLICA_SYNC_SECRET", Flag: "replica-sync-secret", Help: "replicas, embedded NATS: a secret every peer's route must present (at least 16 printable ASCII characters, from a Kubernetes Secret); unset, any host that reaches the sync port may join, so keep it behind a NetworkPolicy",
			Set: func(v string) error {
				v = strings.TrimSpace(v)
				if len(v) < natsbus.MinRouteSecret || strings.IndexFunc(v, func(r rune) bool { return r <= ' ' || r > '~' }) >= 0 {
					return fmt.Errorf("want at least %d printable ASCII characters without spaces", natsbus.MinRouteSecret)
				}
				c.SyncSecret = v
				return nil
			}},
		{Env: "DYN_EPP_REPLICA_SYNC_PORT", Flag: "replica-sync-port", Default: "9092", Help: "the embedded NATS server's route (cluster) port, on POD_IP when set, else every interface (0: a free port, logged; for tests)", Set: intIn(&c.SyncPort, 0, maxPort)},
		{Env: "DYN_EPP_NATS_URL", Flag: "nats-url", Help: "replicas over an existing NATS cluster: comma-separated nats:// or tls:// URLs (credentials in the URL); not with DYN_EPP_PEER_SERVICE or DYN_EPP_PEERS",
			Set: func(v string) error {
				v = strings.TrimSpace(v)
				for _, f := range strings.Split(v, ",") {
					u, err := url.Parse(strings.TrimSpace(f))
					if err != nil || u.Host == "" || (u.Scheme != "nats" && u.Scheme != "tls" && u.Scheme != "ws" && u.Scheme != "wss") {
						return fmt.Errorf("%q is not a NATS URL (nats://host:4222)", f)
					}
				}
				c.NATSURL = v
				return nil
			}},
		{Env: "DYN_EPP_REPLICA_ID", Flag: "replica-id", Help: "this replica's ID among its peers, 1 to 64 of [A-Za-z0-9_-] (default: POD_NAME, else the host name, other characters as `-`)",
			Set: func(v string) error {
				v = strings.TrimSpace(v)
				if sanitizeReplicaID(v) != v {
					return fmt.Errorf("%q: want 1 to %d characters of [A-Za-z0-9_-]", v, replica.MaxIDLen)
				}
				c.ReplicaID = v
				return nil
			}},
		{Env: "DYN_EPP_REPLICA_HOLD_BURSTS", Flag: "replica-hold-bursts", Default: "true", Help: "replicas: a request of a burst (requests the gateway spread over the replicas in the same instant) waits until the bookings of the replicas ahead of this one (by replica ID) have arrived, 4 ms per replica ahead, at most 64 ms, so that the replicas decide a burst in turn as one EPP would (false: each prices the bookings its peers are likely making, without waiting; docs/REPLICAS.md)", Set: boolean(&c.HoldBursts)},
		// Long requests and observability (docs/OBSERVABILITY.md).
		{Env: "DYN_EPP_RENEW_INTERVAL_MS", Flag: "renew-interval-ms", Default: "10000", Help: "renew a request's leases this often while its response is starting or flowing (a stream silent for one interval is not renewed, so it expires at its lease); must be shorter than DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS (0: off)",
			Set: func(v string) error {
				var ms int
				if err := intIn(&ms, 0, 86_400_000)(v); err != nil {
					return err
				}
				c.RenewInterval = time.Duration(ms) * time.Millisecond
				return nil
			}},
		{Env: "DYN_EPP_OUTPUT_GROWTH", Flag: "output-growth", Default: "auto", Help: "grow a request's decode booking by one block per block-size SSE `data:` lines of its 2xx event-stream response, so decode cost follows the output: `true`, `false` or `auto` (on with DYN_EPP_COST=predictive; off with `dynamo`, whose TTFT it worsened on the replay simulator, and with `auto`, which decides by Dynamo's cost on large models)",
			Set: func(v string) error {
				c.growthAuto = strings.EqualFold(strings.TrimSpace(v), "auto")
				if c.growthAuto {
					return nil
				}
				if err := boolean(&c.OutputGrowth)(v); err != nil {
					return fmt.Errorf("%q: want true, false or auto", v)
				}
				return nil
			}},
		{Env: "DYN_EPP_FALLBACKS", Flag: "fallbacks", Default: "0", Help: fmt.Sprintf("fallback endpoints returned after the pick in the GAIE destination list (the next-cheapest workers of the destination role on other endpoints, 0 to %d); the booking moves to the one that served", selection.MaxFallbacks), Set: intIn(&c.Fallbacks, 0, selection.MaxFallbacks)},
		{Env: "DYN_EPP_OTLP_ENDPOINT", Flag: "otlp-endpoint", Help: "OpenTelemetry tracing: the OTLP/gRPC collector, `host:port` or an http(s) URL (https: TLS); spans kvselect.pick, kvselect.tokenize, kvselect.book (unset: off)",
			Set: func(v string) error {
				ep, err := oteltracing.ParseEndpoint(v)
				c.OTLPEndpoint = ep
				return err
			}},
		{Env: "DYN_EPP_DEBUG_HEADER", Flag: "debug-header", Default: "false", Help: "return x-kvselect-debug on routed responses: the worker booked and the cheapest candidates' cost terms (reveals load to clients: debugging only)", Set: boolean(&c.DebugHeader)},
		{Env: "DYN_EPP_CONFORMANCE_TEST_HOOKS", Flag: "conformance-test-hooks", Default: "false", Help: "GAIE's conformance-suite hooks: the test-epp-endpoint-selection header steers the pick, the served endpoint comes back as x-conformance-test-served-endpoint (any client could steer its requests: conformance runs only)", Set: boolean(&c.ConformanceTestHooks)},
		// Selection (Dynamo's KvRouterConfig environment).
		{Env: "DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT", Flag: "overlap-score-credit", Default: "4", Help: "prefill blocks saved per cached device block (>= 0; Dynamo's default is 1)", Set: floatMin(&r.OverlapScoreCredit, 0)},
		{Env: "DYN_ROUTER_PREFILL_LOAD_SCALE", Flag: "prefill-load-scale", Default: "2.5", Help: "weight of the prefill term (>= 0; Dynamo's default is 1)", Set: floatMin(&r.PrefillLoadScale, 0)},
		{Env: "DYN_ROUTER_DECODE_ACTIVE_REQUEST_WEIGHT", Flag: "decode-active-request-weight", Default: "0", Help: "block-equivalent cost per active request (>= 0)", Set: floatMin(&r.DecodeActiveRequestWeight, 0)},
		// After the two weights, so that the deprecated alias wins over them.
		{Env: "DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT", Aliases: []string{"DYN_OVERLAP_SCORE_WEIGHT"}, Flag: "overlap-score-weight", Help: "deprecated: sets prefill-load-scale (and credit 0 when 0)",
			Set: func(v string) error {
				var w float64
				if err := floatMin(&w, 0)(v); err != nil {
					return err
				}
				c.Router.PrefillLoadScale = w
				if w == 0 {
					c.Router.OverlapScoreCredit = 0
				}
				return nil
			}},
		{Env: "DYN_ROUTER_HOST_CACHE_HIT_WEIGHT", Flag: "host-cache-hit-weight", Default: "0.75", Help: "credit of host-tier hits [0, 1]", Set: floatMin(&r.HostCacheHitWeight, 0)},
		{Env: "DYN_ROUTER_DISK_CACHE_HIT_WEIGHT", Flag: "disk-cache-hit-weight", Default: "0.25", Help: "credit of disk-tier hits [0, 1]", Set: floatMin(&r.DiskCacheHitWeight, 0)},
		{Env: "DYN_ROUTER_TEMPERATURE", Flag: "router-temperature", Default: "0", Help: "0: cheapest worker; > 0: softmax sampling", Set: floatMin(&r.Temperature, 0)},
		{Env: "DYN_ROUTER_USE_KV_EVENTS", Aliases: []string{"DYN_USE_KV_EVENTS"}, Flag: "use-kv-events", Default: "true", Help: "subscribe to engine KV events (false: approximate index)", Set: boolean(&r.UseKVEvents)},
		{Env: "DYN_EPP_ALLOW_HOSTNAMES", Flag: "allow-hostnames", Default: "false", Help: "route to workers whose endpoint names a host (Envoy's original-destination cluster needs an IP: leave false behind Envoy)", Set: boolean(&r.Endpoints.AllowHostnames)},
		{Env: "DYN_EPP_ALLOW_IPC_EVENTS", Flag: "allow-ipc-events", Default: "false", Help: "accept ipc:// KV-event and replay endpoints (engines on the EPP's own host)", Set: boolean(&r.Endpoints.AllowIPC)},
		{Env: "DYN_EPP_ALLOW_ADDRESSES", Flag: "allow-addresses", Help: "comma-separated CIDRs routed although refused by default (link-local, multicast, unspecified, broadcast)",
			Set: func(v string) error {
				var out []netip.Prefix
				for _, f := range strings.Split(v, ",") {
					if f = strings.TrimSpace(f); f == "" {
						continue
					}
					p, err := netip.ParsePrefix(f)
					if err != nil {
						return fmt.Errorf("%q is not a CIDR prefix (e.g. 169.254.0.0/16)", f)
					}
					out = append(out, p)
				}
				c.Router.Endpoints.Allow = out
				return nil
			}},
		{Env: "DYN_EPP_KV_FEED_CHECKS", Flag: "kv-feed-checks", Default: "true", Help: "judge each worker's KV-event feed (silent, mis-speaking: routed on its own bookings until it heals) and token parity",
			Set: func(v string) error {
				var on bool
				if err := boolean(&on)(v); err != nil {
					return err
				}
				c.Router.FeedTrust.Off = !on
				return nil
			}},
		{Env: "DYN_ROUTER_TRACK_ACTIVE_BLOCKS", Flag: "track-active-blocks", Default: "true", Help: "count booked requests' blocks as decode load", Set: boolean(&r.TrackActiveBlocks)},
		{Env: "DYN_ROUTER_ASSUME_KV_REUSE", Flag: "assume-kv-reuse", Default: "true", Help: "requests sharing a prefix share active blocks", Set: boolean(&r.AssumeKVReuse)},
		{Env: "DYN_ROUTER_TRACK_PREFILL_TOKENS", Flag: "track-prefill-tokens", Default: "true", Help: "count uncached prompt tokens as prefill load", Set: boolean(&r.TrackPrefillTokens)},
		{Env: "DYN_ROUTER_TTL_SECS", Flag: "router-ttl-secs", Default: "120", Help: "approximate-index TTL in seconds",
			Set: func(v string) error {
				var s float64
				if err := floatMin(&s, 0)(v); err != nil {
					return err
				}
				if s > 0 && s < 0.001 || s > 30*86400 {
					return fmt.Errorf("%v s is outside [0.001, %d] (0 means the default)", s, 30*86400)
				}
				c.Router.RouterTTL = time.Duration(s * float64(time.Second))
				return nil
			}},
		{Env: "DYN_ROUTER_QUEUE_THRESHOLD", Flag: "queue-threshold", Help: "enable queueing: busy above threshold x max_num_batched_tokens",
			Set: func(v string) error {
				var th float64
				if err := floatMin(&th, 0)(v); err != nil {
					return err
				}
				c.Router.QueueThreshold = &th
				return nil
			}},
		{Env: "DYN_ROUTER_QUEUE_POLICY", Flag: "queue-policy", Default: "fcfs", Help: "`fcfs`, `lcfs` or `wspt`",
			Set: func(v string) error {
				p, err := selection.ParseQueuePolicy(v)
				if err != nil {
					return fmt.Errorf("%q: want fcfs, lcfs or wspt", v)
				}
				c.Router.QueuePolicy = p
				return nil
			}},
		{Env: "DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT_DECAY", Flag: "overlap-score-credit-decay", Default: "0", Help: "decay of a worker's overlap credit with its queued prefill above the least loaded one's (>= 0; 0: off, as in Dynamo)", Set: floatMin(&r.OverlapCreditDecay, 0)},
		{Env: "DYN_EPP_INFLIGHT_HIT_WEIGHT", Flag: "inflight-hit-weight", Default: "1", Help: "credit for prompt blocks that requests booked on a worker are computing now, as a fraction of a cached block [0, 1] (0: Dynamo's cost)", Set: floatMin(&r.InFlightHitWeight, 0)},
		{Env: "DYN_EPP_COST", Flag: "cost", Default: "auto", Help: fmt.Sprintf("`dynamo` (Dynamo's cost, in blocks), `predictive` (a worker's predicted time to first token, calibrated from the bookings' own times to first token: a fixed overhead, its queued prefill and active requests, the request's uncached prompt at the worker's speed; plus the time that prompt adds to requests queued behind it and a price on more than its share of the recent requests) or `auto` (predictive on a model of up to %d worker ranks, Dynamo's above, where it keeps the decision's cost flat in the number of ranks)", selection.AutoPredictiveMaxRanks),
			Set: func(v string) error {
				m, err := selection.ParseCostModel(v)
				if err != nil {
					return fmt.Errorf("%q: want dynamo, predictive or auto", v)
				}
				c.Router.Cost = m
				return nil
			}},
		{Env: "DYN_EPP_PREFILL_TOKENS_PER_SECOND", Flag: "prefill-tokens-per-second", Default: "10000", Help: "predictive cost: every worker's prefill rate (uncached tokens per second) while the calibration is not ready (32 completed prefills, a token's price told from the noise; 1 to 1e9)", Set: floatIn(&r.Predictive.PrefillTokensPerSecond, selection.MinPrefillTokensPerSecond, selection.MaxPrefillTokensPerSecond)},
		{Env: "DYN_EPP_LEARN_PREFILL_RATE", Flag: "learn-prefill-rate", Default: "true", Help: "predictive cost: calibrate the time to first token from the completed prefills, and each worker's speed (false: DYN_EPP_PREFILL_TOKENS_PER_SECOND for all)",
			Set: func(v string) error {
				var on bool
				if err := boolean(&on)(v); err != nil {
					return err
				}
				c.Router.Predictive.FixedRate = !on
				return nil
			}},
		{Env: "DYN_EPP_PREDICTIVE_BACKLOG_WEIGHT", Flag: "predictive-backlog-weight", Default: "0.5", Help: "predictive cost: extra weight of a request's own uncached prefill, the time it adds to the requests queued behind it, at the calibrated price of a queued token (>= 0)", Set: floatMin(&r.Predictive.BacklogWeight, 0)},
		{Env: "DYN_EPP_PREDICTIVE_SATURATION_GROWTH", Flag: "predictive-saturation-growth", Default: "1", Help: "predictive cost: on a saturated fleet (its workers queue more than 4 mean prompts each on average), the backlog weight grows by this much of itself for each mean prompt queued beyond that (>= 0; 0: off)", Set: floatMin(&r.Predictive.SaturationGrowth, 0)},
		{Env: "DYN_EPP_PREDICTIVE_EVICTION_WEIGHT", Flag: "predictive-eviction-weight", Default: "1", Help: "predictive cost: extra weight of a request's uncached prefill on a worker whose cache runs full, times its cache pressure (the share of its recently stored blocks its engine's removals matched; 0 where caches never fill), which also fades the decode term's spreading (>= 0)", Set: floatMin(&r.Predictive.EvictionWeight, 0)},
		{Env: "DYN_EPP_PREDICTIVE_DECODE_WEIGHT", Flag: "predictive-decode-weight", Default: "0.125", Help: "predictive cost: cost of a worker's active block, in blocks of its prefill time (>= 0)", Set: floatMin(&r.Predictive.DecodeWeight, 0)},
		{Env: "DYN_EPP_BALANCE_WEIGHT", Flag: "balance-weight", Default: "3", Help: "predictive cost: what a worker's cost gains per unit of its share of the recent requests above the mean and DYN_EPP_BALANCE_SLACK, in units of the fleet's time to prefill a mean prompt, so that a cached prefix cannot draw much more than its share (>= 0; 0: off)", Set: floatMin(&r.Predictive.BalanceWeight, 0)},
		{Env: "DYN_EPP_BALANCE_SLACK", Flag: "balance-slack", Default: "0.05", Help: "predictive cost: share of the recent requests above the mean that costs nothing (>= 0)", Set: floatMin(&r.Predictive.BalanceSlack, 0)},
		{Env: "DYN_EPP_BALANCE_WINDOW_SECONDS", Flag: "balance-window-seconds", Default: "300", Help: "predictive cost: time constant, in seconds, over which a worker's recent requests decay (1 to 86400)", Set: secondsIn(&r.Predictive.BalanceWindow, 1, 86400)},
		{Env: "DYN_EPP_SESSION_AFFINITY", Flag: "session-affinity", Default: "soft", Help: "`soft` (a session's requests go to its worker unless it is busy or far costlier), `hard` (always, while schedulable) or `off`",
			Set: func(v string) error {
				m, err := selection.ParseSessionMode(v)
				if err != nil {
					return fmt.Errorf("%q: want soft, hard or off", v)
				}
				c.Router.Sessions.Mode = m
				return nil
			}},
		{Env: "DYN_EPP_SESSION_HEADER", Flag: "session-header", Default: "x-session-id", Help: "request header naming the session (x-dynamo-session-id is read after it); ids over 256 bytes get 400",
			Set: func(v string) error {
				v = strings.ToLower(strings.TrimSpace(v))
				if !httpguts.ValidHeaderFieldName(v) {
					return fmt.Errorf("%q is not a header name", v)
				}
				c.SessionHeader = v
				return nil
			}},
		{Env: "DYN_EPP_MAX_SESSIONS", Flag: "max-sessions", Default: "65536", Help: "session pins held per model (least recently used dropped first)", Set: intIn(&r.Sessions.MaxSessions, 1, 1<<24)},
		{Env: "DYN_EPP_SESSION_TTL_SECS", Flag: "session-ttl-secs", Default: "600", Help: "a session's pin lives this long after its last request", Set: secondsIn(&c.Router.Sessions.IdleTTL, 1, 7*86400)},
		{Env: "DYN_ROUTER_QUEUE_LIMIT", Flag: "queue-limit", Default: "1024", Help: "most requests waiting per model; more get 429", Set: intIn(&r.QueueLimit, 1, 1<<20)},
		{Env: "DYN_EPP_POLICY_CLASSES", Flag: "policy-classes", Help: "fair admission's policy classes, `;`-separated, each `name:key=value,...` with weight (deficit round robin share of the queue, in uncached prompt tokens; default 1), tier (strict priority), queue (most waiting per model), inflight (most held at once) and deadline (a Go duration: a request still waiting then is refused), e.g. `interactive:weight=3,deadline=2s;batch:weight=1,queue=256`; a request's class is its x-dynamo-meta-policy-class header, else its x-gateway-inference-objective, and an unknown or missing one is the first class's (unset: no classes)",
			Set: func(v string) error {
				cs, err := selection.ParseClasses(v)
				if err != nil {
					return err
				}
				c.Router.Classes = cs
				return nil
			}},
		{Env: "DYN_EPP_OVERLOAD_STATUS", Flag: "overload-status", Default: "429", Help: "status of an overload or admission refusal (a full queue, a class's limit, a deadline passed): `429` or `529` (Dynamo's frontend's default), with Retry-After and the reason in x-llm-d-request-dropped-reason",
			Set: func(v string) (err error) {
				c.OverloadStatus, err = gaie.ParseOverloadStatus(v)
				return err
			}},
		{Env: "DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS", Flag: "active-request-expiry-secs", Default: "300", Help: "lease of a booking never freed", Set: secondsIn(&c.Router.ActiveRequestExpiry, 1, 86400)},
		{Env: "DYN_EPP_FAILURE_EJECTION_SECS", Flag: "failure-ejection-secs", Default: "10", Help: "how long a worker stays out of the picks once a response said it failed (a 5xx, or the gateway serving one of the pick's fallbacks)", Set: secondsIn(&c.Router.FailureEjection, 1, 3600)},
	}
}

// ErrConfig wraps every startup configuration problem.
var ErrConfig = errors.New("epp: invalid configuration")

// LoadConfig defines a flag on fs for every variable of the contract, reads
// the environment (through getenv), lets the flags in args override it, and
// returns the configuration or one error (ErrConfig) naming every bad
// variable; flag.ErrHelp when args ask for help. The caller may define flags
// of its own on fs first.
func LoadConfig(fs *flag.FlagSet, args []string, getenv func(string) string) (*Config, error) {
	c := &Config{Router: selection.DefaultConfig(16)}
	c.Router.Endpoints.AllowHostnames = false // the destination header must be an IP
	var errs []error
	if err := envconf.Load(fs, args, getenv, c.settings()); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil, err
		}
		errs = append(errs, err)
	}
	c.Router.BlockSize = c.BlockSize
	if c.growthAuto {
		c.OutputGrowth = c.Router.Cost == selection.CostPredictive
	}
	if c.KVEventPort == 0 && c.KVEventBind == "" {
		c.Router.UseKVEvents = false
	}
	if c.Router.QueueThreshold != nil && c.MaxBatched == 0 && c.PrefillMaxBatched == 0 && c.DecodeMaxBatched == 0 {
		errs = append(errs, errors.New("DYN_EPP_MAX_NUM_BATCHED_TOKENS: required (> 0) when DYN_ROUTER_QUEUE_THRESHOLD enables queueing"))
	}
	if err := c.Router.Validate(); err != nil {
		errs = append(errs, err)
	}
	if lease := c.Router.ActiveRequestExpiry; c.RenewInterval > 0 && lease > 0 && c.RenewInterval >= lease {
		errs = append(errs, fmt.Errorf("DYN_EPP_RENEW_INTERVAL_MS: %v is not shorter than the lease (DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS, %v): a live stream would expire between renewals", c.RenewInterval, lease))
	}
	errs = append(errs, c.checkReplicas()...)
	if len(errs) > 0 {
		return nil, fmt.Errorf("%w:\n  %w", ErrConfig, errors.Join(errs...))
	}
	return c, nil
}

// requireForServing checks what only a real run (Serve: discovery of its
// own) needs.
func (c *Config) requireForServing() error {
	var errs []error
	if c.WorkersFile == "" {
		if c.PoolName == "" {
			errs = append(errs, errors.New("DYN_EPP_INFERENCE_POOL_NAME: required with Kubernetes discovery (or set DYN_EPP_WORKERS_FILE)"))
		}
		if c.Namespace == "" {
			errs = append(errs, errors.New("POD_NAMESPACE: required with Kubernetes discovery"))
		}
	}
	if c.PeerService != "" && c.Namespace == "" {
		errs = append(errs, errors.New("POD_NAMESPACE: required with DYN_EPP_PEER_SERVICE (the peer Service's namespace)"))
	}
	if len(errs) > 0 {
		return fmt.Errorf("%w:\n  %w", ErrConfig, errors.Join(errs...))
	}
	return nil
}

// EnvTable renders the contract as a Markdown table (for the README).
func EnvTable() string {
	var c Config
	return envconf.Table(c.settings())
}

// replicated reports whether the configuration shares load with peers.
func (c *Config) replicated() bool {
	return c.PeerService != "" || len(c.Peers) > 0 || c.NATSURL != ""
}

// embedsNATS reports mode (a): an embedded NATS server routed to the peers.
func (c *Config) embedsNATS() bool { return c.PeerService != "" || len(c.Peers) > 0 }

// checkReplicas checks the replica settings together.
func (c *Config) checkReplicas() []error {
	var errs []error
	if c.NATSURL != "" && c.embedsNATS() {
		errs = append(errs, errors.New("DYN_EPP_NATS_URL: set either an existing NATS cluster (DYN_EPP_NATS_URL) or an embedded one (DYN_EPP_PEER_SERVICE, DYN_EPP_PEERS), not both"))
	}
	if c.PeerService != "" && len(c.Peers) > 0 {
		errs = append(errs, errors.New("DYN_EPP_PEERS: set either DYN_EPP_PEER_SERVICE (peers discovered) or DYN_EPP_PEERS (static), not both"))
	}
	if c.SyncSecret != "" && !c.embedsNATS() {
		errs = append(errs, errors.New("DYN_EPP_REPLICA_SYNC_SECRET: applies to the embedded NATS server (DYN_EPP_PEER_SERVICE or DYN_EPP_PEERS); an existing cluster takes its credentials in DYN_EPP_NATS_URL"))
	}
	if c.PeerService != "" {
		if _, err := netip.ParseAddr(c.PodIP); err != nil {
			errs = append(errs, fmt.Errorf("POD_IP: %q is not an IP address; DYN_EPP_PEER_SERVICE needs this EPP's own IP (downward API status.podIP) to tell itself from its peers", c.PodIP))
		}
	}
	if c.PodIP != "" {
		if _, err := netip.ParseAddr(c.PodIP); err != nil && c.PeerService == "" {
			errs = append(errs, fmt.Errorf("POD_IP: %q is not an IP address", c.PodIP))
		}
	}
	return errs
}

// replicaID is Options.ID of this EPP's replicas: DYN_EPP_REPLICA_ID, else
// POD_NAME, else the host name, sanitised.
func (c *Config) replicaID(hostname func() (string, error)) (string, error) {
	if c.ReplicaID != "" {
		return c.ReplicaID, nil
	}
	name := c.PodName
	if name == "" {
		h, err := hostname()
		if err != nil {
			return "", fmt.Errorf("DYN_EPP_REPLICA_ID: unset, POD_NAME unset and no host name: %w", err)
		}
		name = h
	}
	if id := sanitizeReplicaID(name); id != "" {
		return id, nil
	}
	return "", fmt.Errorf("DYN_EPP_REPLICA_ID: unset, and %q gives no replica ID", name)
}

// sanitizeReplicaID maps s into replica.Options.ID's alphabet: every other
// character becomes '-'; a name longer than replica.MaxIDLen keeps its
// first characters and ends with a hash of the whole (pod names differ at
// their end). "" stays "".
func sanitizeReplicaID(s string) string {
	b := []byte(s)
	for i, ch := range b {
		if !(ch >= 'a' && ch <= 'z' || ch >= 'A' && ch <= 'Z' || ch >= '0' && ch <= '9' || ch == '_' || ch == '-') {
			b[i] = '-'
		}
	}
	if len(b) <= replica.MaxIDLen {
		return string(b)
	}
	sum := sha256.Sum256([]byte(s))
	const hashLen = 16
	return string(b[:replica.MaxIDLen-hashLen-1]) + "-" + hex.EncodeToString(sum[:hashLen/2])
}
