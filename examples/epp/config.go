package main

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
	"strconv"
	"strings"
	"time"

	"golang.org/x/net/http/httpguts"
	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/kvselect/kvselect/examples/internal/pdhint"
	"github.com/kvselect/kvselect/replica"
	"github.com/kvselect/kvselect/replica/natsbus"
	"github.com/kvselect/kvselect/roles"
	"github.com/kvselect/kvselect/selection"
)

// config is the EPP's whole configuration, read from the environment contract
// of Dynamo's standalone EPP (so its users can switch) and overridable by flags.
type config struct {
	Mode              string
	SessionHeader     string // read before x-dynamo-session-id; "" for none
	Topology          string // aggregated | disaggregated
	RoleLabel         string
	PDHintKey         []byte        // signs prefill hints; nil: unsigned
	PDHintTTL         time.Duration // lifetime of a hint's signature
	PoolName          string
	Namespace         string
	PodIP             string
	Model             string
	TokenizerURL      string
	TokenizerProtocol string
	TokenizerTimeout  time.Duration
	TokenizerMaxResp  int
	BlockSize         int
	KVEventPort       int
	KVReplayPort      int
	KVEventBind       string
	KVEventBindAny    bool
	TotalKVBlocks     int
	MaxBatched        int
	PrefillMaxBatched int
	LocalPrefillBelow int // conditional disaggregation threshold in tokens (0: off)
	DecodeMaxBatched  int
	MaxInflight       int
	IndexerThreads    int
	SecureServing     bool
	ExtProcAddr       string
	HealthAddr        string
	MetricsAddr       string
	WorkersFile       string
	Kubeconfig        string
	MaxBodyBytes      int
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
	// Long requests and observability (docs/OBSERVABILITY.md).
	RenewInterval time.Duration // lease renewal while a response flows; 0: off
	OutputGrowth  bool          // SSE events grow the decode booking
	growthAuto    bool          // DYN_EPP_OUTPUT_GROWTH=auto: OutputGrowth follows the cost
	Fallbacks     int           // fallback endpoints per pick, 0..16
	OTLPEndpoint  string        // "" : tracing off
	DebugHeader   bool          // x-kvselect-debug on every routed response
	Router        selection.Config
}

// setting is one variable of the contract: its environment name, its flag, its
// default and how it is parsed into config.
type setting struct {
	env      string
	aliases  []string // older names, read when env is unset
	flag     string
	def      string
	required string // "" optional; else when it is required
	help     string
	parse    func(c *config, v string) error
}

func intIn(dst *int, lo, hi int) func(*config, string) error {
	return func(_ *config, v string) error {
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

func floatMin(dst *float64, lo float64) func(*config, string) error {
	return func(_ *config, v string) error {
		f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
		if err != nil || math.IsNaN(f) || math.IsInf(f, 0) {
			return fmt.Errorf("%q is not a finite number", v)
		}
		if f < lo {
			return fmt.Errorf("%v is below %v", f, lo)
		}
		*dst = f
		return nil
	}
}

func boolean(dst *bool) func(*config, string) error {
	return func(_ *config, v string) error {
		b, err := strconv.ParseBool(strings.TrimSpace(v))
		if err != nil {
			return fmt.Errorf("%q is not a boolean (true/false)", v)
		}
		*dst = b
		return nil
	}
}

func str(dst *string) func(*config, string) error {
	return func(_ *config, v string) error { *dst = strings.TrimSpace(v); return nil }
}

func listenAddr(dst *string) func(*config, string) error {
	return func(_ *config, v string) error {
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

// settings returns the contract bound to c. The order is the README table's.
func (c *config) settings() []setting {
	r := &c.Router
	return []setting{
		{env: "DYN_EPP_MODE", flag: "mode", def: "standalone", help: "EPP mode; only `standalone` (the embedded kvselect service) exists here",
			parse: func(c *config, v string) error {
				if strings.TrimSpace(v) != "standalone" {
					return fmt.Errorf("%q: only standalone is supported", v)
				}
				c.Mode = "standalone"
				return nil
			}},
		{env: "DYN_EPP_TOPOLOGY_MODE", flag: "topology", def: "aggregated", help: "`aggregated` or `disaggregated` (prefill/decode split by the role label)",
			parse: func(c *config, v string) error {
				m, err := roles.ParseTopologyMode(v)
				if err != nil {
					return fmt.Errorf("%q: want aggregated or disaggregated", v)
				}
				c.Topology = m.String()
				return nil
			}},
		{env: "DYN_EPP_WORKER_ROLE_LABEL", flag: "role-label", def: roles.DefaultRoleLabel, help: "pod label that carries `prefill` or `decode` (disaggregated mode)", parse: str(&c.RoleLabel)},
		{env: "DYN_EPP_PD_HINT_KEY", flag: "pd-hint-key", help: "signs each prefill hint (x-kvselect-prefiller-signature) with the key the decode sidecars check (their DYN_PD_HINT_KEY): `file:<path>` or an absolute path is read, anything else is the key itself; at least 32 bytes (unset: hints are not signed)",
			parse: func(c *config, v string) error {
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
		{env: "DYN_EPP_PD_HINT_TTL_MS", flag: "pd-hint-ttl-ms", def: "30000", help: "how long a hint's signature is valid, in ms (>= 1000; at most the sidecars' DYN_PD_HINT_MAX_LIFETIME_MS, 300000 by default)",
			parse: func(c *config, v string) error {
				var ms int
				if err := intIn(&ms, 1000, 86_400_000)(c, v); err != nil {
					return err
				}
				c.PDHintTTL = time.Duration(ms) * time.Millisecond
				return nil
			}},
		{env: "DYN_EPP_INFERENCE_POOL_NAME", flag: "inference-pool", required: "with Kubernetes discovery", help: "the InferencePool this EPP serves", parse: str(&c.PoolName)},
		{env: "POD_NAMESPACE", flag: "namespace", required: "with Kubernetes discovery", help: "namespace of the pool and its pods (downward API)", parse: str(&c.Namespace)},
		{env: "POD_IP", flag: "pod-ip", help: "this EPP's own IP (downward API status.podIP): required with DYN_EPP_PEER_SERVICE (self is no peer); the replica sync listener binds it", parse: str(&c.PodIP)},
		{env: "DYN_MODEL_NAME", flag: "model", def: "default", help: "model name: the selection partition of every worker and request", parse: str(&c.Model)},
		{env: "DYN_EPP_TOKENIZER_SERVICE_URL", flag: "tokenizer-url", required: "always (the demo sets it)", help: "absolute http(s) base URL of the engine's tokenizer/render service",
			parse: func(c *config, v string) error {
				u, err := url.Parse(strings.TrimSpace(v))
				if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
					return fmt.Errorf("%q is not an absolute http(s) URL", v)
				}
				c.TokenizerURL = strings.TrimSpace(v)
				return nil
			}},
		{env: "DYN_EPP_TOKENIZER_PROTOCOL", flag: "tokenizer-protocol", def: "vllm-render", help: "`vllm-render`, `vllm-tokenize` or `sglang`", parse: str(&c.TokenizerProtocol)},
		{env: "DYN_EPP_TOKENIZATION_TIMEOUT_MS", flag: "tokenization-timeout-ms", def: "5000", help: "per-call tokenizer timeout in ms (>= 1)",
			parse: func(c *config, v string) error {
				var ms int
				if err := intIn(&ms, 1, 600_000)(c, v); err != nil {
					return err
				}
				c.TokenizerTimeout = time.Duration(ms) * time.Millisecond
				return nil
			}},
		{env: "DYN_EPP_TOKENIZER_MAX_RESPONSE_BYTES", flag: "tokenizer-max-response-bytes", def: "16777216", help: "largest tokenizer response accepted", parse: intIn(&c.TokenizerMaxResp, 1024, 1<<30)},
		{env: "DYN_KV_CACHE_BLOCK_SIZE", flag: "block-size", def: "16", help: "KV block size in tokens; must equal the engines' block size", parse: intIn(&c.BlockSize, 1, 1<<16)},
		{env: "DYN_EPP_KV_EVENT_PORT", flag: "kv-event-port", def: "5557", help: "engines' ZMQ PUB port (0: no KV events, approximate mode)", parse: intIn(&c.KVEventPort, 0, maxPort)},
		{env: "DYN_EPP_KV_EVENT_REPLAY_PORT", flag: "kv-event-replay-port", def: "0", help: "engines' ZMQ replay ROUTER port (0: none)", parse: intIn(&c.KVReplayPort, 0, maxPort)},
		{env: "DYN_EPP_KV_EVENT_BIND", flag: "kv-event-bind", help: "bind a SUB here (tcp://host:port) for engines that dial in, instead of dialing each engine; only workers' addresses may connect, each publishing its own topic", parse: str(&c.KVEventBind)},
		{env: "DYN_EPP_KV_EVENT_BIND_ANY_PEER", flag: "kv-event-bind-any-peer", def: "false", help: "let any address publish on the bind port (engines behind NAT); anyone reaching the port can then publish as any worker", parse: boolean(&c.KVEventBindAny)},
		{env: "DYN_EPP_TOTAL_KV_BLOCKS", flag: "total-kv-blocks", def: "0", help: "per-worker KV capacity in blocks (0: unknown)", parse: intIn(&c.TotalKVBlocks, 0, math.MaxInt32)},
		{env: "DYN_EPP_MAX_NUM_BATCHED_TOKENS", flag: "max-num-batched-tokens", def: "0", required: "when DYN_ROUTER_QUEUE_THRESHOLD is set", help: "engines' max_num_batched_tokens, the busy base of queueing", parse: intIn(&c.MaxBatched, 0, math.MaxInt32)},
		{env: "DYN_EPP_PREFILL_MAX_NUM_BATCHED_TOKENS", flag: "prefill-max-num-batched-tokens", def: "0", help: "prefill workers' value (0: the shared one)", parse: intIn(&c.PrefillMaxBatched, 0, math.MaxInt32)},
		{env: "DYN_EPP_DECODE_MAX_NUM_BATCHED_TOKENS", flag: "decode-max-num-batched-tokens", def: "0", help: "decode workers' value (0: the shared one)", parse: intIn(&c.DecodeMaxBatched, 0, math.MaxInt32)},
		{env: "DYN_EPP_LOCAL_PREFILL_BELOW", flag: "local-prefill-below", def: "0", help: "conditional disaggregation (disaggregated mode): a request whose uncached prompt on its decode worker is at most this many tokens, or that meets a busy prefill pool, skips the prefill leg (0: off)", parse: intIn(&c.LocalPrefillBelow, 0, math.MaxInt32)},
		{env: "DYN_EPP_MAX_INFLIGHT_REQUESTS", flag: "max-inflight", def: "1024", help: "concurrent picks; more are shed with 503", parse: intIn(&c.MaxInflight, 1, 1<<20)},
		{env: "DYN_EPP_SELECTION_INDEXER_THREADS", flag: "indexer-threads", def: "4", help: "accepted for compatibility (each event source applies on its own goroutine)", parse: intIn(&c.IndexerThreads, 1, 1024)},
		{env: "DYN_SECURE_SERVING", flag: "secure-serving", def: "true", help: "TLS with a self-signed certificate on the ext_proc port (false: plaintext h2c)", parse: boolean(&c.SecureServing)},
		{env: "DYN_EPP_EXTPROC_ADDR", flag: "extproc-addr", def: ":9002", help: "ext_proc gRPC listen address", parse: listenAddr(&c.ExtProcAddr)},
		{env: "DYN_EPP_HEALTH_ADDR", flag: "health-addr", def: ":9003", help: "gRPC health listen address", parse: listenAddr(&c.HealthAddr)},
		{env: "DYN_EPP_METRICS_ADDR", flag: "metrics-addr", def: ":9090", help: "Prometheus /metrics listen address", parse: listenAddr(&c.MetricsAddr)},
		{env: "DYN_EPP_WORKERS_FILE", flag: "workers-file", help: "static discovery: a JSON/YAML file of workers, watched (no Kubernetes)", parse: str(&c.WorkersFile)},
		{env: "KUBECONFIG", flag: "kubeconfig", help: "kubeconfig path (default: in-cluster config)", parse: str(&c.Kubeconfig)},
		{env: "DYN_EPP_MAX_BODY_BYTES", flag: "max-body-bytes", def: "8388608", help: "largest request body buffered (excess: 413)", parse: intIn(&c.MaxBodyBytes, 1024, 1<<30)},
		// Replicas (docs/REPLICAS.md).
		{env: "POD_NAME", flag: "pod-name", help: "this EPP's pod name (downward API): the default replica ID", parse: str(&c.PodName)},
		{env: "DYN_EPP_PEER_SERVICE", flag: "peer-service", help: "replicas, embedded NATS: the headless Service (in POD_NAMESPACE) whose ready endpoints are this EPP's peers; their servers are routed to at `<ip>:DYN_EPP_REPLICA_SYNC_PORT` (needs POD_IP; RBAC services get, endpointslices list and watch)",
			parse: func(c *config, v string) error {
				v = strings.TrimSpace(v)
				if errs := validation.IsDNS1035Label(v); len(errs) > 0 {
					return fmt.Errorf("%q is not a Service name: %s", v, strings.Join(errs, "; "))
				}
				c.PeerService = v
				return nil
			}},
		{env: "DYN_EPP_PEERS", flag: "peers", help: "replicas, embedded NATS, without Kubernetes: comma-separated host:port of the peers' sync listeners (static routes)",
			parse: func(c *config, v string) error {
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
				if len(out) > maxPeers {
					return fmt.Errorf("%d peers, at most %d", len(out), maxPeers)
				}
				c.Peers = out
				return nil
			}},
		{env: "DYN_EPP_REPLICA_SYNC_SECRET", flag: "replica-sync-secret", help: "replicas, embedded NATS: a secret every peer's route must present (at least 16 printable ASCII characters, from a Kubernetes Secret); unset, any host that reaches the sync port may join, so keep it behind a NetworkPolicy",
			parse: func(c *config, v string) error {
				v = strings.TrimSpace(v)
				if len(v) < natsbus.MinRouteSecret || strings.IndexFunc(v, func(r rune) bool { return r <= ' ' || r > '~' }) >= 0 {
					return fmt.Errorf("want at least %d printable ASCII characters without spaces", natsbus.MinRouteSecret)
				}
				c.SyncSecret = v
				return nil
			}},
		{env: "DYN_EPP_REPLICA_SYNC_PORT", flag: "replica-sync-port", def: "9092", help: "the embedded NATS server's route (cluster) port, on POD_IP when set, else every interface (0: a free port, logged; for tests)", parse: intIn(&c.SyncPort, 0, maxPort)},
		{env: "DYN_EPP_NATS_URL", flag: "nats-url", help: "replicas over an existing NATS cluster: comma-separated nats:// or tls:// URLs (credentials in the URL); not with DYN_EPP_PEER_SERVICE or DYN_EPP_PEERS",
			parse: func(c *config, v string) error {
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
		{env: "DYN_EPP_REPLICA_ID", flag: "replica-id", help: "this replica's ID among its peers, 1 to 64 of [A-Za-z0-9_-] (default: POD_NAME, else the host name, other characters as `-`)",
			parse: func(c *config, v string) error {
				v = strings.TrimSpace(v)
				if sanitizeReplicaID(v) != v {
					return fmt.Errorf("%q: want 1 to %d characters of [A-Za-z0-9_-]", v, replica.MaxIDLen)
				}
				c.ReplicaID = v
				return nil
			}},
		// Long requests and observability (docs/OBSERVABILITY.md).
		{env: "DYN_EPP_RENEW_INTERVAL_MS", flag: "renew-interval-ms", def: "10000", help: "renew a request's leases this often while its response is starting or flowing (a stream silent for one interval is not renewed, so it expires at its lease); must be shorter than DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS (0: off)",
			parse: func(c *config, v string) error {
				var ms int
				if err := intIn(&ms, 0, 86_400_000)(c, v); err != nil {
					return err
				}
				c.RenewInterval = time.Duration(ms) * time.Millisecond
				return nil
			}},
		{env: "DYN_EPP_OUTPUT_GROWTH", flag: "output-growth", def: "auto", help: "grow a request's decode booking by one block per block-size SSE `data:` lines of its 2xx event-stream response, so decode cost follows the output: `true`, `false` or `auto` (on with DYN_EPP_COST=predictive, off with the Dynamo cost, whose TTFT it worsened on the replay simulator)",
			parse: func(c *config, v string) error {
				c.growthAuto = strings.EqualFold(strings.TrimSpace(v), "auto")
				if c.growthAuto {
					return nil
				}
				if err := boolean(&c.OutputGrowth)(c, v); err != nil {
					return fmt.Errorf("%q: want true, false or auto", v)
				}
				return nil
			}},
		{env: "DYN_EPP_FALLBACKS", flag: "fallbacks", def: "0", help: fmt.Sprintf("fallback endpoints returned after the pick in the GAIE destination list (the next-cheapest workers of the destination role on other endpoints, 0 to %d); the booking moves to the one that served", selection.MaxFallbacks), parse: intIn(&c.Fallbacks, 0, selection.MaxFallbacks)},
		{env: "DYN_EPP_OTLP_ENDPOINT", flag: "otlp-endpoint", help: "OpenTelemetry tracing: the OTLP/gRPC collector, `host:port` or an http(s) URL (https: TLS); spans kvselect.pick, kvselect.tokenize, kvselect.book (unset: off)",
			parse: func(c *config, v string) error {
				ep, err := parseOTLPEndpoint(v)
				c.OTLPEndpoint = ep
				return err
			}},
		{env: "DYN_EPP_DEBUG_HEADER", flag: "debug-header", def: "false", help: "return x-kvselect-debug on routed responses: the worker booked and the cheapest candidates' cost terms (reveals load to clients: debugging only)", parse: boolean(&c.DebugHeader)},
		// Selection (Dynamo's KvRouterConfig environment).
		{env: "DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT", flag: "overlap-score-credit", def: "4", help: "prefill blocks saved per cached device block (>= 0; Dynamo's default is 1)", parse: floatMin(&r.OverlapScoreCredit, 0)},
		{env: "DYN_ROUTER_PREFILL_LOAD_SCALE", flag: "prefill-load-scale", def: "2.5", help: "weight of the prefill term (>= 0; Dynamo's default is 1)", parse: floatMin(&r.PrefillLoadScale, 0)},
		{env: "DYN_ROUTER_DECODE_ACTIVE_REQUEST_WEIGHT", flag: "decode-active-request-weight", def: "0", help: "block-equivalent cost per active request (>= 0)", parse: floatMin(&r.DecodeActiveRequestWeight, 0)},
		// After the two weights, so that the deprecated alias wins over them.
		{env: "DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT", aliases: []string{"DYN_OVERLAP_SCORE_WEIGHT"}, flag: "overlap-score-weight", help: "deprecated: sets prefill-load-scale (and credit 0 when 0)",
			parse: func(c *config, v string) error {
				var w float64
				if err := floatMin(&w, 0)(c, v); err != nil {
					return err
				}
				c.Router.PrefillLoadScale = w
				if w == 0 {
					c.Router.OverlapScoreCredit = 0
				}
				return nil
			}},
		{env: "DYN_ROUTER_HOST_CACHE_HIT_WEIGHT", flag: "host-cache-hit-weight", def: "0.75", help: "credit of host-tier hits [0, 1]", parse: floatMin(&r.HostCacheHitWeight, 0)},
		{env: "DYN_ROUTER_DISK_CACHE_HIT_WEIGHT", flag: "disk-cache-hit-weight", def: "0.25", help: "credit of disk-tier hits [0, 1]", parse: floatMin(&r.DiskCacheHitWeight, 0)},
		{env: "DYN_ROUTER_TEMPERATURE", flag: "router-temperature", def: "0", help: "0: cheapest worker; > 0: softmax sampling", parse: floatMin(&r.Temperature, 0)},
		{env: "DYN_ROUTER_USE_KV_EVENTS", aliases: []string{"DYN_USE_KV_EVENTS"}, flag: "use-kv-events", def: "true", help: "subscribe to engine KV events (false: approximate index)", parse: boolean(&r.UseKVEvents)},
		{env: "DYN_EPP_ALLOW_HOSTNAMES", flag: "allow-hostnames", def: "false", help: "route to workers whose endpoint names a host (Envoy's original-destination cluster needs an IP: leave false behind Envoy)", parse: boolean(&r.Endpoints.AllowHostnames)},
		{env: "DYN_EPP_ALLOW_IPC_EVENTS", flag: "allow-ipc-events", def: "false", help: "accept ipc:// KV-event and replay endpoints (engines on the EPP's own host)", parse: boolean(&r.Endpoints.AllowIPC)},
		{env: "DYN_EPP_ALLOW_ADDRESSES", flag: "allow-addresses", help: "comma-separated CIDRs routed although refused by default (link-local, multicast, unspecified, broadcast)",
			parse: func(c *config, v string) error {
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
		{env: "DYN_EPP_KV_FEED_CHECKS", flag: "kv-feed-checks", def: "true", help: "judge each worker's KV-event feed (silent, mis-speaking: routed on its own bookings until it heals) and token parity",
			parse: func(c *config, v string) error {
				var on bool
				if err := boolean(&on)(c, v); err != nil {
					return err
				}
				c.Router.FeedTrust.Off = !on
				return nil
			}},
		{env: "DYN_ROUTER_TRACK_ACTIVE_BLOCKS", flag: "track-active-blocks", def: "true", help: "count booked requests' blocks as decode load", parse: boolean(&r.TrackActiveBlocks)},
		{env: "DYN_ROUTER_ASSUME_KV_REUSE", flag: "assume-kv-reuse", def: "true", help: "requests sharing a prefix share active blocks", parse: boolean(&r.AssumeKVReuse)},
		{env: "DYN_ROUTER_TRACK_PREFILL_TOKENS", flag: "track-prefill-tokens", def: "true", help: "count uncached prompt tokens as prefill load", parse: boolean(&r.TrackPrefillTokens)},
		{env: "DYN_ROUTER_TTL_SECS", flag: "router-ttl-secs", def: "120", help: "approximate-index TTL in seconds",
			parse: func(c *config, v string) error {
				var s float64
				if err := floatMin(&s, 0)(c, v); err != nil {
					return err
				}
				if s > 0 && s < 0.001 || s > 30*86400 {
					return fmt.Errorf("%v s is outside [0.001, %d] (0 means the default)", s, 30*86400)
				}
				c.Router.RouterTTL = time.Duration(s * float64(time.Second))
				return nil
			}},
		{env: "DYN_ROUTER_QUEUE_THRESHOLD", flag: "queue-threshold", help: "enable queueing: busy above threshold x max_num_batched_tokens",
			parse: func(c *config, v string) error {
				var th float64
				if err := floatMin(&th, 0)(c, v); err != nil {
					return err
				}
				c.Router.QueueThreshold = &th
				return nil
			}},
		{env: "DYN_ROUTER_QUEUE_POLICY", flag: "queue-policy", def: "fcfs", help: "`fcfs`, `lcfs` or `wspt`",
			parse: func(c *config, v string) error {
				p, err := selection.ParseQueuePolicy(v)
				if err != nil {
					return fmt.Errorf("%q: want fcfs, lcfs or wspt", v)
				}
				c.Router.QueuePolicy = p
				return nil
			}},
		{env: "DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT_DECAY", flag: "overlap-score-credit-decay", def: "0", help: "decay of a worker's overlap credit with its queued prefill above the least loaded one's (>= 0; 0: off, as in Dynamo)", parse: floatMin(&r.OverlapCreditDecay, 0)},
		{env: "DYN_EPP_INFLIGHT_HIT_WEIGHT", flag: "inflight-hit-weight", def: "1", help: "credit for prompt blocks that requests booked on a worker are computing now, as a fraction of a cached block [0, 1] (0: Dynamo's cost)", parse: floatMin(&r.InFlightHitWeight, 0)},
		{env: "DYN_EPP_COST", flag: "cost", def: "dynamo", help: "`dynamo` (Dynamo's cost, in blocks) or `predictive` (a worker's predicted time to first token: its queued prefill, drained at its learned prefill rate, plus the request's uncached prompt, plus decode pressure)",
			parse: func(c *config, v string) error {
				m, err := selection.ParseCostModel(v)
				if err != nil {
					return fmt.Errorf("%q: want dynamo or predictive", v)
				}
				c.Router.Cost = m
				return nil
			}},
		{env: "DYN_EPP_PREFILL_TOKENS_PER_SECOND", flag: "prefill-tokens-per-second", def: "10000", help: "predictive cost: a worker's prefill rate (uncached tokens per second) until it has learned its own from 4 completed prefills (> 0)", parse: floatMin(&r.Predictive.PrefillTokensPerSecond, 0)},
		{env: "DYN_EPP_LEARN_PREFILL_RATE", flag: "learn-prefill-rate", def: "true", help: "predictive cost: learn each worker's prefill rate from its completed prefills (false: DYN_EPP_PREFILL_TOKENS_PER_SECOND for all)",
			parse: func(c *config, v string) error {
				var on bool
				if err := boolean(&on)(c, v); err != nil {
					return err
				}
				c.Router.Predictive.FixedRate = !on
				return nil
			}},
		{env: "DYN_EPP_PREDICTIVE_BACKLOG_WEIGHT", flag: "predictive-backlog-weight", def: "0.5", help: "predictive cost: extra weight of a request's own uncached prefill, the time it adds to the requests queued behind it (>= 0)", parse: floatMin(&r.Predictive.BacklogWeight, 0)},
		{env: "DYN_EPP_PREDICTIVE_DECODE_WEIGHT", flag: "predictive-decode-weight", def: "0.125", help: "predictive cost: cost of a worker's active block, in blocks of its prefill time (>= 0)", parse: floatMin(&r.Predictive.DecodeWeight, 0)},
		{env: "DYN_EPP_SESSION_AFFINITY", flag: "session-affinity", def: "soft", help: "`soft` (a session's requests go to its worker unless it is busy or far costlier), `hard` (always, while schedulable) or `off`",
			parse: func(c *config, v string) error {
				m, err := selection.ParseSessionMode(v)
				if err != nil {
					return fmt.Errorf("%q: want soft, hard or off", v)
				}
				c.Router.Sessions.Mode = m
				return nil
			}},
		{env: "DYN_EPP_SESSION_HEADER", flag: "session-header", def: "x-session-id", help: "request header naming the session (x-dynamo-session-id is read after it); ids over 256 bytes get 400",
			parse: func(c *config, v string) error {
				v = strings.ToLower(strings.TrimSpace(v))
				if !httpguts.ValidHeaderFieldName(v) {
					return fmt.Errorf("%q is not a header name", v)
				}
				c.SessionHeader = v
				return nil
			}},
		{env: "DYN_EPP_MAX_SESSIONS", flag: "max-sessions", def: "65536", help: "session pins held per model (least recently used dropped first)", parse: intIn(&r.Sessions.MaxSessions, 1, 1<<24)},
		{env: "DYN_EPP_SESSION_TTL_SECS", flag: "session-ttl-secs", def: "600", help: "a session's pin lives this long after its last request",
			parse: func(c *config, v string) error {
				var s int
				if err := intIn(&s, 1, 7*86400)(c, v); err != nil {
					return err
				}
				c.Router.Sessions.IdleTTL = time.Duration(s) * time.Second
				return nil
			}},
		{env: "DYN_ROUTER_QUEUE_LIMIT", flag: "queue-limit", def: "1024", help: "most requests waiting per model; more get 429", parse: intIn(&r.QueueLimit, 1, 1<<20)},
		{env: "DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS", flag: "active-request-expiry-secs", def: "300", help: "lease of a booking never freed",
			parse: func(c *config, v string) error {
				var s int
				if err := intIn(&s, 1, 86400)(c, v); err != nil {
					return err
				}
				c.Router.ActiveRequestExpiry = time.Duration(s) * time.Second
				return nil
			}},
	}
}

// errConfig wraps every startup configuration problem.
var errConfig = errors.New("epp: invalid configuration")

// loadConfig reads the environment (through getenv), lets flags override it, and
// returns the configuration or one error naming every bad variable.
func loadConfig(fs *flag.FlagSet, args []string, getenv func(string) string) (*config, error) {
	c := &config{Router: selection.DefaultConfig(16)}
	c.Router.Endpoints.AllowHostnames = false // the destination header must be an IP
	sets := c.settings()
	flagVals := make(map[string]*string, len(sets))
	for _, s := range sets {
		flagVals[s.flag] = fs.String(s.flag, "", fmt.Sprintf("%s (env %s)", s.help, s.env))
	}
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	setFlags := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { setFlags[f.Name] = true })
	var errs []error
	raw := map[string]string{}
	for _, s := range sets {
		v, src := s.def, "default"
		if e := getenv(s.env); e != "" {
			v, src = e, s.env
		} else {
			for _, a := range s.aliases {
				if e := getenv(a); e != "" {
					v, src = e, a
					break
				}
			}
		}
		if setFlags[s.flag] {
			v, src = *flagVals[s.flag], "--"+s.flag
		}
		raw[s.env] = v
		if v == "" {
			continue
		}
		if err := s.parse(c, v); err != nil {
			errs = append(errs, fmt.Errorf("%s (from %s): %w", s.env, src, err))
		}
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
		return nil, fmt.Errorf("%w:\n  %w", errConfig, errors.Join(errs...))
	}
	return c, nil
}

// requireForServing checks what only a real (non-demo) run needs.
func (c *config) requireForServing() error {
	var errs []error
	if c.TokenizerURL == "" {
		errs = append(errs, errors.New("DYN_EPP_TOKENIZER_SERVICE_URL: required"))
	}
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
		return fmt.Errorf("%w:\n  %w", errConfig, errors.Join(errs...))
	}
	return nil
}

// envTable renders the contract as a Markdown table (for the README).
func envTable() string {
	var c config
	sets := c.settings()
	var b strings.Builder
	b.WriteString("| Variable | Flag | Default | Meaning |\n|---|---|---|---|\n")
	for _, s := range sets {
		def := s.def
		if def == "" {
			def = "(unset)"
		}
		if s.required != "" {
			def += ", required " + s.required
		}
		name := "`" + s.env + "`"
		for _, a := range s.aliases {
			name += " (alias `" + a + "`)"
		}
		fmt.Fprintf(&b, "| %s | `--%s` | %s | %s |\n", name, s.flag, def, s.help)
	}
	return b.String()
}

// replicated reports whether the configuration shares load with peers.
func (c *config) replicated() bool {
	return c.PeerService != "" || len(c.Peers) > 0 || c.NATSURL != ""
}

// embedsNATS reports mode (a): an embedded NATS server routed to the peers.
func (c *config) embedsNATS() bool { return c.PeerService != "" || len(c.Peers) > 0 }

// checkReplicas checks the replica settings together.
func (c *config) checkReplicas() []error {
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
func (c *config) replicaID(hostname func() (string, error)) (string, error) {
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
