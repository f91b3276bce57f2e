package selection

import (
	"errors"
	"fmt"
	"math"
	"strings"
	"time"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/reservation"
)

// QueuePolicy orders requests that wait in the admission queue within one strict
// priority tier.
type QueuePolicy uint8

// Queue policies (Dynamo's router_queue_policy).
const (
	// QueueFCFS serves the earliest arrival first (priority jump moves a request
	// ahead by that many seconds). Optimises tail TTFT. The default.
	QueueFCFS QueuePolicy = iota
	// QueueLCFS serves the latest arrival first. For experiments.
	QueueLCFS
	// QueueWSPT serves the request with the best (1+jump)/prefill-tokens ratio
	// first (weighted shortest processing time). Optimises mean TTFT.
	QueueWSPT
)

// String returns "fcfs", "lcfs" or "wspt".
func (p QueuePolicy) String() string {
	switch p {
	case QueueFCFS:
		return "fcfs"
	case QueueLCFS:
		return "lcfs"
	case QueueWSPT:
		return "wspt"
	default:
		return fmt.Sprintf("QueuePolicy(%d)", uint8(p))
	}
}

// ParseQueuePolicy parses "fcfs", "lcfs" or "wspt" (case-insensitive).
func ParseQueuePolicy(s string) (QueuePolicy, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "fcfs":
		return QueueFCFS, nil
	case "lcfs":
		return QueueLCFS, nil
	case "wspt":
		return QueueWSPT, nil
	}
	return 0, fmt.Errorf("%w: queue policy %q, want fcfs, lcfs or wspt", ErrInvalidConfig, s)
}

// CostModel names a cost function (Config.Cost).
type CostModel uint8

// Cost functions.
const (
	// CostDynamo is Dynamo's logit, in blocks: the prefill term (queued and
	// the request's prompt tokens, less the overlap credit, times
	// PrefillLoadScale) plus the decode term (active blocks). DynamoConfig's.
	CostDynamo CostModel = iota
	// CostPredictive is the rank's predicted time to first token, in
	// seconds, as the ledger's calibration fits it from the bookings'
	// observed times to first token (a fixed overhead, the rank's queued
	// prefill tokens and active requests, the request's uncached prompt,
	// each rank's tokens at its own speed: reservation.Calibration); plus
	// the time its prefill adds to requests queued behind it, decode
	// pressure and a price on taking more than a fair share of the requests
	// (Config.Predictive).
	CostPredictive
	// CostAuto is CostPredictive on a model of at most
	// AutoPredictiveMaxRanks ranks and CostDynamo on a larger one, settled
	// at each decision. The predictive cost reads every rank's clock at the
	// time of the decision, so it needs the full scan; on a larger model
	// Dynamo's cost takes the sparse decision instead (see the package
	// documentation), which keeps a decision's cost flat in the number of
	// ranks. DefaultConfig's.
	CostAuto
)

// AutoPredictiveMaxRanks is the largest model CostAuto decides with the
// predictive cost: one rank below where the sparse decision begins.
const AutoPredictiveMaxRanks = sparseMinRanks - 1

// String returns "dynamo", "predictive" or "auto".
func (m CostModel) String() string {
	switch m {
	case CostDynamo:
		return "dynamo"
	case CostPredictive:
		return "predictive"
	case CostAuto:
		return "auto"
	default:
		return fmt.Sprintf("CostModel(%d)", uint8(m))
	}
}

// ParseCostModel parses "dynamo", "predictive" or "auto" (case-insensitive).
func ParseCostModel(s string) (CostModel, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "dynamo":
		return CostDynamo, nil
	case "predictive":
		return CostPredictive, nil
	case "auto":
		return CostAuto, nil
	}
	return 0, fmt.Errorf("%w: cost %q, want dynamo, predictive or auto", ErrInvalidConfig, s)
}

// PredictiveCost configures CostPredictive (and CostAuto where it predicts).
type PredictiveCost struct {
	// PrefillTokensPerSecond is every rank's prefill rate while the
	// ledger's calibration is not Ready (before
	// reservation.CalibrationSamples completed prefills, and while their
	// times do not tell the price of a token from their noise; the
	// calibration's prior), and always with FixedRate. Finite, > 0.
	// Default 10,000.
	PrefillTokensPerSecond float64
	// FixedRate prices every rank's queue and prompt at
	// PrefillTokensPerSecond and never uses the calibration.
	FixedRate bool
	// BacklogWeight counts the request's own uncached prefill this many
	// more times: the time it adds to every request that queues behind it
	// on the rank. At 0 the cost is the request's own time to first token,
	// which under a burst spreads a cached prefix's requests over idle
	// ranks that must each compute it again. In [0, MaxWeight]. Default
	// DefaultPredictiveBacklogWeight.
	BacklogWeight float64
	// SaturationGrowth raises BacklogWeight on a saturated fleet, where
	// more requests queue behind each prefill: with D the candidates' mean
	// predicted queue in units of P (the balance term's: their mean time to
	// prefill the model's mean prompt), the backlog weight is BacklogWeight
	// x (1 + SaturationGrowth x max(0, D - SaturationDepth)). Below
	// SaturationDepth mean prompts queued (every rank busy with several)
	// the cost is unchanged. In [0, MaxWeight]; 0 turns it off. Default
	// DefaultSaturationGrowth.
	SaturationGrowth float64
	// DecodeWeight prices decode pressure, which spreads requests whose
	// prefix is cached: each of the rank's active blocks (with the request's
	// new ones) costs the time the rank takes to prefill DecodeWeight
	// blocks. In [0, MaxWeight]. Default DefaultPredictiveDecodeWeight.
	DecodeWeight float64
	// EvictionWeight prices what a request evicts where its prefix is not
	// cached, on a rank whose cache is full: its uncached prompt costs
	// EvictionWeight x the rank's cache pressure more of the rank's time
	// per token, and the decode term's spreading (which assumes room)
	// fades by the same pressure. A rank's cache pressure is the share of
	// the device blocks it stored lately that its engine's removals matched
	// (WorkerLoad.CachePressure): 0 on a cache that never fills, where the
	// cost is unchanged. It needs KV events. In [0, MaxWeight]. Default
	// DefaultPredictiveEvictionWeight.
	EvictionWeight float64
	// BalanceWeight prices a rank's share of the recent requests: a rank
	// whose recent bookings (reservation.PrefillClock's Arrivals: this
	// service's and, through ReplicaPlane.Book, its peers') are (1 + BalanceSlack
	// + x) times the candidates' mean costs x times BalanceWeight times P
	// more, where P is the candidates' mean time to prefill the model's mean
	// prompt (over its last few hundred decisions): the price scales with
	// the fleet's own request times, milliseconds or seconds. A cached
	// prefix keeps its requests until the price of its rank's excess
	// exceeds what sending one elsewhere costs, and the first requests sent
	// away are those that lose least there: a short prompt, or one whose
	// prefix another rank holds too. Off while the mean is below one
	// booking. In [0, MaxWeight]; 0 turns it off.
	// Default DefaultBalanceWeight.
	BalanceWeight float64
	// BalanceSlack is the share above the mean that costs nothing. In [0,
	// MaxWeight]. Default DefaultBalanceSlack.
	BalanceSlack float64
	// BalanceWindow is the time constant over which recent bookings decay
	// (reservation.Options.ArrivalWindow). >= 1 s. Default
	// DefaultBalanceWindow.
	BalanceWindow time.Duration
}

// Config holds the router settings (Dynamo's KvRouterConfig fields that kvselect
// supports). Start from DefaultConfig (or DynamoConfig) and change fields:
// several defaults are true or non-zero, so a Config written as a literal is
// not the default one, and Validate (so Build) refuses it, saying so.
type Config struct {
	// BlockSize is the KV-cache block size in tokens shared by the engines and
	// the index. Required, > 0.
	BlockSize int

	// OverlapScoreCredit is how many prefill blocks one device-tier cached block
	// saves. In [0, MaxWeight] (values above 1 give extra credit). Default 4
	// (DefaultConfig; DynamoConfig: 1).
	OverlapScoreCredit float64
	// PrefillLoadScale multiplies the prefill term after the credits. In
	// [0, MaxWeight]. Default 2.5 (DefaultConfig; DynamoConfig: 1).
	PrefillLoadScale float64
	// DecodeActiveRequestWeight is the block-equivalent cost of each active
	// request. In [0, MaxWeight]. Default 0.
	DecodeActiveRequestWeight float64
	// HostCacheHitWeight and DiskCacheHitWeight credit lower-tier cache hits, in
	// [0, 1]. Defaults 0.75 and 0.25.
	HostCacheHitWeight float64
	DiskCacheHitWeight float64
	// Temperature 0 picks the cheapest worker (ties at random); > 0 samples a
	// softmax over range-normalised costs. In [0, MaxWeight]. Default 0.
	Temperature float64

	// UseKVEvents subscribes to the engines' KV events (exact index). False
	// uses the approximate index fed by the router's own decisions. Default true.
	UseKVEvents bool
	// TrackActiveBlocks counts booked requests' blocks as decode load. Default
	// true.
	TrackActiveBlocks bool
	// AssumeKVReuse makes requests sharing a prefix share active blocks; false
	// counts every request's blocks as new. Default true.
	AssumeKVReuse bool
	// TrackPrefillTokens counts the uncached prompt tokens of booked requests as
	// prefill load until PrefillComplete. Default true.
	TrackPrefillTokens bool

	// RouterTTL is how long the approximate index assumes a routed prefix stays
	// cached (router_ttl_secs). Used only without KV events. >= 0; 0 means the
	// default 120 s.
	RouterTTL time.Duration
	// ApproxMaxBlocks caps the approximate index. 0 means 2^20.
	ApproxMaxBlocks int

	// QueueThreshold enables queueing when non-nil: a worker is busy when its
	// active prefill tokens exceed QueueThreshold x its max_num_batched_tokens,
	// and a request waits while every eligible worker is busy. Finite, >= 0.
	// Default nil (never queue).
	QueueThreshold *float64
	// QueuePolicy orders waiting requests within a priority tier. Default FCFS.
	QueuePolicy QueuePolicy
	// QueueLimit is the most requests one model may have waiting; one more is
	// ErrOverloaded. >= 0; 0 means 1024.
	QueueLimit int
	// Classes are fair admission's policy classes (see Class): each
	// request belongs to one (Request.Class), and within a strict tier the
	// admission queue serves the classes that wait by deficit round robin,
	// in proportion to their weights, and each class earliest deadline
	// first. A class's limits and deadline hold with or without queueing.
	// At most MaxClasses. Default none: one queue ordered by
	// Request.Priority.
	Classes []Class
	// DefaultClass names the class of a request whose Class is empty or
	// names no class. Default: the first of Classes.
	DefaultClass string

	// FailureEjection is how long MarkFailed takes a worker out of the picks
	// (a gateway saw it refuse connections or fail requests). >= 0; 0 means
	// 10 s.
	FailureEjection time.Duration
	// ActiveRequestExpiry is the lease of a booking: one not freed by then is an
	// orphan and its load is released. > 0; 0 means 300 s.
	ActiveRequestExpiry time.Duration
	// Endpoints says which worker and KV-event endpoint addresses may be routed
	// to (the catalog reports the others in the record's reasons and never
	// routes to them). Its zero value accepts IP literals of unicast addresses
	// (loopback and private ones included) and tcp:// event endpoints, and
	// refuses hostnames, link-local (cloud metadata), unspecified, broadcast
	// and multicast addresses and ipc:// endpoints; DefaultConfig and
	// DynamoConfig also accept hostnames (a gateway that resolves names can
	// route to them; an Envoy original-destination cluster cannot, so the
	// reference EPP refuses them).
	Endpoints catalog.EndpointPolicy
	// MaxWorkerRanks bounds the data-parallel ranks of all the service's
	// workers together (the sum of their DPSize, every model and lifecycle):
	// an Workers().Upsert that would pass it is refused with ErrTooManyRanks
	// (WorkerRefusals counts it under RefusedTooManyRanks) and changes
	// nothing. >= 0; 0 means DefaultMaxWorkerRanks.
	MaxWorkerRanks int
	// FeedTrust decides when a worker rank's KV-event feed is not trusted
	// (silent or mis-speaking, see FeedState) and its rank is routed on the
	// service's own bookings instead, and runs the token-parity self-check.
	// Used with the built-in event feed only. The zero value means the
	// defaults (checks on).
	FeedTrust FeedTrust
	// InFlightHitWeight credits a rank, beyond the prefix its index shows,
	// for the request's leading blocks that requests booked there are
	// prefilling now (active in the ledger, not yet reported by the
	// engine's events), at this fraction of a cached block: in a burst, the
	// requests after the first find the prefix the first is computing. In
	// [0, 1]; 0 (Dynamo's behaviour) turns it off. Used with KV events and
	// AssumeKVReuse only (without events the index already holds bookings).
	InFlightHitWeight float64
	// OverlapCreditDecay is Dynamo's overlap_score_credit_decay, k: a rank's
	// device credit is divided by 1 + k x (its active prefill blocks above
	// the least loaded candidate's) / the request's blocks, so that under a
	// burst a cached prefix stops drawing requests to a worker whose queue
	// has grown. >= 0; 0 (the default, as in Dynamo) turns it off. On the
	// replay simulator's bursts with a hot prefix, k = 1 lowered TTFT p99
	// from 7.5 s to 6.9 s and the request imbalance from 1.74 to 1.37, but
	// it cost hit rate elsewhere (agent loops 0.869 to 0.847, the Mooncake
	// trace 0.622 to 0.607); the predictive cost spreads such a burst
	// without it (docs/ROUTING.md).
	OverlapCreditDecay float64
	// Sessions configures session affinity (Request.SessionID).
	Sessions SessionConfig
	// Cost chooses the cost function. Default CostAuto (DynamoConfig:
	// CostDynamo).
	Cost CostModel
	// Predictive configures CostPredictive; unused by CostDynamo.
	Predictive PredictiveCost

	// fromDefaults is set by DefaultConfig and DynamoConfig: a Config written
	// as a literal has several defaults at their zero value (UseKVEvents,
	// TrackActiveBlocks, the weights...), which routes almost at random, so
	// Validate refuses it.
	fromDefaults bool
}

// Defaults that are not zero values.
const (
	DefaultQueueLimit          = 1024
	DefaultActiveRequestExpiry = 300 * time.Second
	DefaultFailureEjection     = 10 * time.Second
	DefaultRouterTTL           = 120 * time.Second
	// DefaultMaxWorkerRanks is MaxWorkerRanks's default,
	// catalog.DefaultMaxRanks (65,536; see there why).
	DefaultMaxWorkerRanks = catalog.DefaultMaxRanks
	// DefaultMaxNumBatchedTokens is the busy base of a worker that does not
	// report max_num_batched_tokens: large enough that it is never busy.
	DefaultMaxNumBatchedTokens = 10_000_000
)

// MaxWeight bounds every cost weight and the temperature: a larger one makes
// costs overflow to +Inf and every worker tie.
const MaxWeight = 1e6

// kvselect's default weights, where they differ from Dynamo's (1 and 1).
const (
	DefaultOverlapScoreCredit = 4.0
	DefaultPrefillLoadScale   = 2.5
	// DefaultInFlightHitWeight is DefaultConfig's InFlightHitWeight, chosen
	// on the replay simulator's workloads (8 workers, 8 req/s): on on/off
	// bursts with a hot prefix it raised the hit rate from 0.767 to 0.807
	// and cut TTFT p90 from 7.7 s to 5.5 s (p99 10.0 s to 7.5 s), on agent
	// loops from 0.853 to 0.886 (p90 1.38 s to 1.07 s), on the Mooncake
	// synthetic trace 0.619 to 0.622.
	DefaultInFlightHitWeight = 1.0
	// DefaultPrefillTokensPerSecond is PredictiveCost.PrefillTokensPerSecond's
	// default.
	DefaultPrefillTokensPerSecond = 10_000.0
	// MinPrefillTokensPerSecond and MaxPrefillTokensPerSecond bound
	// PredictiveCost.PrefillTokensPerSecond: no engine prefills slower than
	// a token a second or faster than a billion.
	MinPrefillTokensPerSecond = 1.0
	MaxPrefillTokensPerSecond = 1e9
	// DefaultPredictiveDecodeWeight is PredictiveCost.DecodeWeight's default.
	DefaultPredictiveDecodeWeight = 0.125
	// DefaultPredictiveBacklogWeight is PredictiveCost.BacklogWeight's
	// default.
	DefaultPredictiveBacklogWeight = 0.5
	// DefaultSaturationGrowth is PredictiveCost.SaturationGrowth's
	// default, and SaturationDepth the queue depth it starts from, chosen
	// on the replay's overloaded fleets and generators (docs/ROUTING.md,
	// "Saturation").
	DefaultSaturationGrowth = 1.0
	SaturationDepth         = 4.0
	// DefaultPredictiveEvictionWeight is PredictiveCost.EvictionWeight's
	// default, chosen on the demo's engines (caches of two and a half
	// system prompts) and the replay's (docs/ROUTING.md, "Cache pressure").
	DefaultPredictiveEvictionWeight = 1.0
	// DefaultBalanceWeight, DefaultBalanceSlack and DefaultBalanceWindow
	// are PredictiveCost's balance defaults, chosen on the replay
	// simulator's workloads (docs/ROUTING.md): a rank with 15% more than
	// the mean share costs 0.3 times the time to prefill a mean prompt.
	DefaultBalanceWeight = 3.0
	DefaultBalanceSlack  = 0.05
	DefaultBalanceWindow = reservation.DefaultArrivalWindow
)

// DefaultConfig returns kvselect's defaults for a block size: Dynamo's
// (DynamoConfig) except for three weights, OverlapScoreCredit 4 (Dynamo: 1),
// PrefillLoadScale 2.5 (Dynamo: 1) and InFlightHitWeight 1 (Dynamo has no such
// credit; see DefaultInFlightHitWeight). With Dynamo's weights the decode term (a
// worker's active blocks) outweighs a cached prefix whenever requests of one
// prefix run together, so long prompts are pulled away from their cache: on the
// Mooncake trace replay (docs/BENCHMARKS.md, median of five seeds) they reach
// 83% of the reachable hit rate, against 97% with these weights at a similar
// request imbalance (1.08-1.09), and these weights also lower TTFT p50 and p90
// in every replay scenario measured (faster arrivals, smaller caches, more
// workers, the synthetic shared-prefix workload).
func DefaultConfig(blockSize int) Config {
	c := DynamoConfig(blockSize)
	c.OverlapScoreCredit = DefaultOverlapScoreCredit
	c.PrefillLoadScale = DefaultPrefillLoadScale
	c.InFlightHitWeight = DefaultInFlightHitWeight
	c.Cost = CostAuto
	return c
}

// DynamoConfig returns exactly the defaults of Dynamo's KV router for a block
// size, for parity with a Dynamo deployment.
func DynamoConfig(blockSize int) Config {
	return Config{
		BlockSize:          blockSize,
		OverlapScoreCredit: 1,
		PrefillLoadScale:   1,
		HostCacheHitWeight: 0.75,
		DiskCacheHitWeight: 0.25,
		UseKVEvents:        true,
		TrackActiveBlocks:  true,
		AssumeKVReuse:      true,
		TrackPrefillTokens: true,
		Endpoints:          catalog.EndpointPolicy{AllowHostnames: true},
		Sessions:           SessionConfig{SoftSlack: DefaultSessionSoftSlack},
		Predictive: PredictiveCost{
			PrefillTokensPerSecond: DefaultPrefillTokensPerSecond,
			BacklogWeight:          DefaultPredictiveBacklogWeight, DecodeWeight: DefaultPredictiveDecodeWeight,
			SaturationGrowth: DefaultSaturationGrowth, EvictionWeight: DefaultPredictiveEvictionWeight,
			BalanceWeight: DefaultBalanceWeight, BalanceSlack: DefaultBalanceSlack, BalanceWindow: DefaultBalanceWindow,
		},
		fromDefaults: true,
	}
}

// Validate reports every problem with c, each naming its field, joined into one
// error that wraps ErrInvalidConfig.
func (c Config) Validate() error {
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	if !c.fromDefaults {
		bad("Config was not made by DefaultConfig(blockSize) or DynamoConfig(blockSize): start from one of them and change fields (a literal Config leaves UseKVEvents, TrackActiveBlocks, the weights and other defaults at zero)")
	}
	if c.BlockSize <= 0 {
		bad("BlockSize is %d, want > 0", c.BlockSize)
	}
	nonNeg := func(name string, v float64) {
		if math.IsNaN(v) || math.IsInf(v, 0) || v < 0 || v > MaxWeight {
			bad("%s is %v, want a value in [0, %g]", name, v, MaxWeight)
		}
	}
	unit := func(name string, v float64) {
		if math.IsNaN(v) || v < 0 || v > 1 {
			bad("%s is %v, want a value in [0, 1]", name, v)
		}
	}
	nonNeg("OverlapScoreCredit", c.OverlapScoreCredit)
	nonNeg("OverlapCreditDecay", c.OverlapCreditDecay)
	nonNeg("PrefillLoadScale", c.PrefillLoadScale)
	nonNeg("DecodeActiveRequestWeight", c.DecodeActiveRequestWeight)
	unit("HostCacheHitWeight", c.HostCacheHitWeight)
	unit("DiskCacheHitWeight", c.DiskCacheHitWeight)
	unit("InFlightHitWeight", c.InFlightHitWeight)
	nonNeg("Temperature", c.Temperature)
	if c.RouterTTL < 0 || (c.RouterTTL > 0 && c.RouterTTL < time.Millisecond) {
		bad("RouterTTL is %v, want >= 1ms (or 0 for the default)", c.RouterTTL)
	}
	if c.ApproxMaxBlocks < 0 {
		bad("ApproxMaxBlocks is %d, want >= 0", c.ApproxMaxBlocks)
	}
	if c.MaxWorkerRanks < 0 {
		bad("MaxWorkerRanks is %d, want >= 0 (0 for the default)", c.MaxWorkerRanks)
	}
	if t := c.QueueThreshold; t != nil && (math.IsNaN(*t) || math.IsInf(*t, 0) || *t < 0) {
		bad("QueueThreshold is %v, want a finite value >= 0", *t)
	}
	if c.QueuePolicy > QueueWSPT {
		bad("QueuePolicy is %v, want fcfs, lcfs or wspt", c.QueuePolicy)
	}
	if c.QueueLimit < 0 {
		bad("QueueLimit is %d, want >= 0", c.QueueLimit)
	}
	if c.FailureEjection < 0 {
		bad("FailureEjection is %v, want >= 0 (0 for the default)", c.FailureEjection)
	}
	if c.ActiveRequestExpiry < 0 || (c.ActiveRequestExpiry > 0 && c.ActiveRequestExpiry < time.Millisecond) {
		bad("ActiveRequestExpiry is %v, want >= 1ms (or 0 for the default)", c.ActiveRequestExpiry)
	}
	if c.Cost > CostAuto {
		bad("Cost is %v, want dynamo, predictive or auto", c.Cost)
	}
	if r := c.Predictive.PrefillTokensPerSecond; !(r >= MinPrefillTokensPerSecond && r <= MaxPrefillTokensPerSecond) {
		// A subnormal rate would pass "> 0" and make every cost infinite.
		bad("Predictive.PrefillTokensPerSecond is %v, want %v to %v", r, MinPrefillTokensPerSecond, MaxPrefillTokensPerSecond)
	}
	nonNeg("Predictive.BacklogWeight", c.Predictive.BacklogWeight)
	nonNeg("Predictive.DecodeWeight", c.Predictive.DecodeWeight)
	nonNeg("Predictive.EvictionWeight", c.Predictive.EvictionWeight)
	nonNeg("Predictive.SaturationGrowth", c.Predictive.SaturationGrowth)
	nonNeg("Predictive.BalanceWeight", c.Predictive.BalanceWeight)
	nonNeg("Predictive.BalanceSlack", c.Predictive.BalanceSlack)
	if c.Predictive.BalanceWindow < time.Second {
		bad("Predictive.BalanceWindow is %v, want >= 1s", c.Predictive.BalanceWindow)
	}
	classProblems(c.Classes, c.DefaultClass, bad)
	c.FeedTrust.validate(bad)
	c.Sessions.validate(bad)
	if len(errs) == 0 {
		return nil
	}
	return fmt.Errorf("%w: %w", ErrInvalidConfig, errors.Join(errs...))
}

// normalized returns c with zero defaults filled. c must be valid.
func (c Config) normalized() Config {
	if c.RouterTTL == 0 {
		c.RouterTTL = DefaultRouterTTL
	}
	if c.QueueLimit == 0 {
		c.QueueLimit = DefaultQueueLimit
	}
	if c.FailureEjection == 0 {
		c.FailureEjection = DefaultFailureEjection
	}
	if c.ActiveRequestExpiry == 0 {
		c.ActiveRequestExpiry = DefaultActiveRequestExpiry
	}
	return c
}

// Override changes some weights for one request. Nil fields keep the service's
// values. OverlapScoreCredit and PrefillLoadScale are CostDynamo's: the
// predictive cost has neither.
type Override struct {
	OverlapScoreCredit *float64
	PrefillLoadScale   *float64
	Temperature        *float64
	AssumeKVReuse      *bool
	TrackPrefillTokens *bool
}

// weights are the effective per-request scoring parameters.
type weights struct {
	credit, scale, activeReqWeight, hostW, diskW, temperature, inflightW, decay float64
	assumeReuse, trackPrefill, trackActive                                      bool
	// the configured cost, and whether this decision predicts (CostAuto
	// settles it per decision: see forRanks)
	cost       CostModel
	predictive bool
	// the predictive cost's: whether ranks learn their prefill rates, the
	// rate until they have, its backlog, decode, eviction and balance
	// weights and the balance's slack
	learn                                               bool
	rate, backlogW, decodeW, evictW, balanceW, balSlack float64
	satGrowth                                           float64
}

// forRanks settles whether a decision over n ranks predicts.
func (w *weights) forRanks(n int) {
	w.predictive = w.cost == CostPredictive || w.cost == CostAuto && n <= AutoPredictiveMaxRanks
}

func (c Config) weights() weights {
	return weights{
		credit: c.OverlapScoreCredit, scale: c.PrefillLoadScale, activeReqWeight: c.DecodeActiveRequestWeight,
		hostW: c.HostCacheHitWeight, diskW: c.DiskCacheHitWeight, temperature: c.Temperature,
		inflightW: c.InFlightHitWeight, decay: c.OverlapCreditDecay, assumeReuse: c.AssumeKVReuse, trackPrefill: c.TrackPrefillTokens, trackActive: c.TrackActiveBlocks,
		cost: c.Cost, predictive: c.Cost == CostPredictive, learn: !c.Predictive.FixedRate,
		rate: c.Predictive.PrefillTokensPerSecond, backlogW: c.Predictive.BacklogWeight, decodeW: c.Predictive.DecodeWeight,
		evictW: c.Predictive.EvictionWeight, satGrowth: c.Predictive.SaturationGrowth, balanceW: c.Predictive.BalanceWeight, balSlack: c.Predictive.BalanceSlack,
	}
}

// apply returns w changed by o, or ErrBadRequest naming the bad field.
func (o *Override) apply(w weights) (weights, error) {
	if o == nil {
		return w, nil
	}
	check := func(name string, p *float64) error {
		if p != nil && (math.IsNaN(*p) || math.IsInf(*p, 0) || *p < 0) {
			return fmt.Errorf("%w: override %s is %v, want a finite value >= 0", ErrBadRequest, name, *p)
		}
		return nil
	}
	for _, f := range []struct {
		name string
		p    *float64
	}{{"OverlapScoreCredit", o.OverlapScoreCredit}, {"PrefillLoadScale", o.PrefillLoadScale}, {"Temperature", o.Temperature}} {
		if err := check(f.name, f.p); err != nil {
			return w, err
		}
	}
	if o.OverlapScoreCredit != nil {
		w.credit = *o.OverlapScoreCredit
	}
	if o.PrefillLoadScale != nil {
		w.scale = *o.PrefillLoadScale
	}
	if o.Temperature != nil {
		w.temperature = *o.Temperature
	}
	if o.AssumeKVReuse != nil {
		w.assumeReuse = *o.AssumeKVReuse
	}
	if o.TrackPrefillTokens != nil {
		w.trackPrefill = *o.TrackPrefillTokens
	}
	return w, nil
}
