package replay

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"strings"
	"time"

	"github.com/kvselect/kvselect/internal/enginemodel"
	"github.com/kvselect/kvselect/internal/trace"
	"github.com/kvselect/kvselect/selection"
)

// Errors of this package.
var (
	// ErrInvalidOptions: Options (or a policy name) failed validation.
	ErrInvalidOptions = errors.New("replay: invalid options")
	// ErrInvalidTrace: the trace cannot be replayed (a request without blocks,
	// or one that fails trace.Request.Validate).
	ErrInvalidTrace = errors.New("replay: invalid trace")
)

// Policy names a routing policy.
type Policy string

// The policies Run knows.
const (
	// KVSelect is the real selection.SelectionService with KV events: the
	// simulated engines' stores and evictions feed its kvindex.Index.
	KVSelect Policy = "kvselect"
	// KVSelectApprox is the SelectionService without KV events
	// (Config.UseKVEvents false): it predicts caches from its own decisions.
	KVSelectApprox Policy = "kvselect-approx"
	// RoundRobin sends request i to worker i mod W.
	RoundRobin Policy = "round-robin"
	// Random picks a worker uniformly (seeded).
	Random Policy = "random"
	// LeastLoaded picks the worker with the fewest unfinished requests (queued
	// or running), ties at random.
	LeastLoaded Policy = "least-loaded"
	// MaxOverlap picks the worker whose cache holds the longest prefix of the
	// request, read from the simulated caches themselves (a perfect view); ties go
	// to the fewest unfinished requests, then at random. It has no load term.
	MaxOverlap Policy = "max-overlap-only"
)

// Policies returns every policy in a stable order.
func Policies() []Policy {
	return []Policy{KVSelect, KVSelectApprox, RoundRobin, Random, LeastLoaded, MaxOverlap}
}

// ParsePolicy returns the policy named s (case-insensitive). Errors:
// ErrInvalidOptions.
func ParsePolicy(s string) (Policy, error) {
	for _, p := range Policies() {
		if strings.EqualFold(s, string(p)) {
			return p, nil
		}
	}
	names := make([]string, 0, 6)
	for _, p := range Policies() {
		names = append(names, string(p))
	}
	return "", fmt.Errorf("%w: unknown policy %q (want one of %s)", ErrInvalidOptions, s, strings.Join(names, ", "))
}

// Defaults of the time model.
const (
	DefaultPrefillTokensPerSecond = 10_000
	DefaultDecodeTokenTime        = 20 * time.Millisecond
	DefaultMaxRunning             = 32
	// DefaultSyncDelay is how long a replica's booking takes to reach its
	// peers: about the p99 package replica measured over NATS on loopback
	// (docs/REPLICAS.md: p50 2.5 ms, p99 2.8 to 5.9 ms).
	DefaultSyncDelay = 5 * time.Millisecond
)

// replayLease is the booking lease the simulator gives the SelectionService:
// long enough that no booking expires during a replay.
const replayLease = 1000 * time.Hour

// Options configure a replay. The zero value is invalid (Workers and
// CapacityBlocks are required); other zero fields mean their defaults.
type Options struct {
	// Workers is the number of simulated workers. > 0.
	Workers int
	// CapacityBlocks is each worker's prefix cache, in trace blocks. > 0.
	CapacityBlocks int
	// BlockSize is the trace's tokens per block. 0 means trace.DefaultBlockSize.
	BlockSize int
	// Speedup divides the trace's arrival times. 0 means 1; otherwise finite
	// and > 0.
	Speedup float64
	// PrefillTokensPerSecond is each worker's prefill speed at Speed 1: a
	// prompt token costs 1/this of its step (enginemodel.Params.PrefillToken).
	// 0 means DefaultPrefillTokensPerSecond; otherwise finite and > 0.
	PrefillTokensPerSecond float64
	// DecodeTokenTime is the time per output token after the first of a
	// request that decodes alone: a step's fixed cost (StepBase) plus one
	// decoding request's (enginemodel.Params.DecodeSeq, the rest). 0 means
	// DefaultDecodeTokenTime; negative means no decode time at all (and no
	// step cost).
	DecodeTokenTime time.Duration
	// StepBase is the part of DecodeTokenTime every engine step costs,
	// whatever it holds (enginemodel.Params.StepBase); each request that
	// decodes in a step adds DecodeTokenTime - StepBase. 0 means all of
	// DecodeTokenTime: a batch of decodes takes as long as one, and a step
	// that prefills costs that much more than its tokens. Must be <=
	// DecodeTokenTime.
	StepBase time.Duration
	// MaxRunning is how many requests hold a seat on a worker at once
	// (vLLM's max_num_seqs); more wait FIFO at the worker. 0 means
	// DefaultMaxRunning; negative is invalid.
	MaxRunning int
	// MaxBatchedTokens is each engine step's token budget (vLLM's
	// max_num_batched_tokens): prompts longer than what is left of it are
	// computed over several steps. 0 means
	// enginemodel.DefaultMaxBatchedTokens; must be >= MaxRunning.
	MaxBatchedTokens int
	// RequestOverhead is the fixed time from a request's arrival at its
	// worker to the moment the worker can schedule it (HTTP, tokenization).
	// Default 0; must be >= 0.
	RequestOverhead time.Duration
	// Speeds make the workers heterogeneous: worker i's steps take
	// 1/Speeds[i mod len(Speeds)] of their nominal time (0.5: twice as slow).
	// Nil means every worker at 1; each value finite and > 0.
	Speeds []float64
	// Replicas is how many router replicas route the trace (the kvselect
	// policies only; the baselines refuse more than 1). Each replica has its
	// own SelectionService and ledger, every engine's KV events reach all of
	// them, and arrival i goes to replica i mod Replicas. 0 means 1; negative
	// is invalid.
	Replicas int
	// SyncDelay is how long, in simulated time, a replica's booking or
	// settling call takes to reach the other replicas (ReplicaPlane.Book,
	// ReplicaPlane.Settle). 0 means DefaultSyncDelay; negative means no delay (the
	// delivery still runs after the event that made it).
	SyncDelay time.Duration
	// NoSync cuts the replicas off from each other: each carries only its own
	// bookings, the baseline replica sync is measured against. No effect with
	// one replica.
	NoSync bool
	// NoSpread keeps synced replicas from pricing the bookings their peers
	// make in the same instant (selection.Peers, which they are told by
	// default: Count R-1, Position their index, Window SyncDelay): the
	// baseline the spreading is measured against. No effect with one
	// replica or NoSync.
	NoSpread bool
	// Hold has synced replicas hold a burst's requests instead of pricing
	// their peers' bookings (selection.Peers.Hold): replica i routes a
	// request of a burst i x Window after its arrival, and its time to
	// first token counts the wait. No effect with one replica, NoSync or
	// NoSpread.
	Hold bool
	// Seed makes random choices (the random policy, tie-breaks, kvselect's
	// sampling) reproducible. Replica 0 draws the stream one router does, each
	// other replica a stream of its own.
	Seed uint64
	// RouterSeed changes the routers' streams (not the workload's) for
	// another draw of the same replay: a router's p90 on a chaotic workload
	// (agent loops) moves with its tie-breaks, and a comparison of router
	// setups takes medians over several. 0 draws the streams Seed alone
	// does.
	RouterSeed uint64
	// Selection is the kvselect policies' configuration. Nil means
	// selection.DefaultConfig. The simulator overrides BlockSize (1: one router
	// token per trace block, see the package doc), Predictive's
	// PrefillTokensPerSecond (PrefillTokensPerSecond in router tokens), UseKVEvents (per policy) and
	// ActiveRequestExpiry (no lease expires), and refuses QueueThreshold (the
	// replay calls the service from one goroutine and cannot wait in its queue).
	Selection *selection.Config
	// Explain makes the kvselect policies score every request with
	// SelectionService.PotentialLoads before routing it, and report in
	// Result.Explain which cost terms pulled decisions away from the worker with
	// the longest cached prefix. It roughly doubles the routing cost. Dynamo's
	// cost only (Selection.Cost).
	Explain bool
	// DecodeHoldsKV makes a running request's generated tokens take cache
	// space on its worker, one block per BlockSize output tokens as they are
	// generated, until it finishes: the prefix cache is what the running
	// requests leave free, as in vLLM, so long generations evict cached
	// prefixes (the router hears the BlockRemoved events).
	DecodeHoldsKV bool
	// OutputGrowth makes the kvselect policies grow each booking by one
	// block per BlockSize output tokens as its decode runs
	// (Reservations.AddOutputBlocks), so a long generation weighs on its
	// worker's decode cost while it runs.
	OutputGrowth bool
	// Now is the wall clock used only to measure Result.Wall. Nil means
	// time.Now.
	Now func() time.Time
}

func (o Options) withDefaults() (Options, error) {
	var errs []error
	bad := func(format string, args ...any) {
		errs = append(errs, fmt.Errorf("%w: "+format, append([]any{ErrInvalidOptions}, args...)...))
	}
	if o.Workers <= 0 {
		bad("Workers %d, want > 0", o.Workers)
	}
	if o.CapacityBlocks <= 0 {
		bad("CapacityBlocks %d, want > 0", o.CapacityBlocks)
	}
	if o.BlockSize < 0 {
		bad("BlockSize %d is negative", o.BlockSize)
	}
	if math.IsNaN(o.Speedup) || math.IsInf(o.Speedup, 0) || o.Speedup < 0 {
		bad("Speedup %v, want a finite value > 0", o.Speedup)
	}
	if math.IsNaN(o.PrefillTokensPerSecond) || math.IsInf(o.PrefillTokensPerSecond, 0) || o.PrefillTokensPerSecond < 0 {
		bad("PrefillTokensPerSecond %v, want a finite value > 0", o.PrefillTokensPerSecond)
	}
	if o.MaxRunning < 0 {
		bad("MaxRunning %d is negative", o.MaxRunning)
	}
	if o.MaxBatchedTokens < 0 {
		bad("MaxBatchedTokens %d is negative", o.MaxBatchedTokens)
	} else if o.MaxBatchedTokens > 0 && o.MaxBatchedTokens < max(o.MaxRunning, 1) {
		bad("MaxBatchedTokens %d < MaxRunning %d", o.MaxBatchedTokens, o.MaxRunning)
	}
	if o.RequestOverhead < 0 {
		bad("RequestOverhead %v is negative", o.RequestOverhead)
	}
	if o.StepBase < 0 {
		bad("StepBase %v is negative", o.StepBase)
	} else if tpot := cmp.Or(o.DecodeTokenTime, DefaultDecodeTokenTime); o.StepBase > 0 && o.StepBase > max(tpot, 0) {
		bad("StepBase %v > DecodeTokenTime %v", o.StepBase, tpot)
	}
	for i, v := range o.Speeds {
		if math.IsNaN(v) || math.IsInf(v, 0) || v <= 0 {
			bad("Speeds[%d] %v, want a finite value > 0", i, v)
		}
	}
	if o.Replicas < 0 {
		bad("Replicas %d is negative", o.Replicas)
	}
	if o.Selection != nil {
		if o.Selection.QueueThreshold != nil {
			bad("Selection.QueueThreshold must be nil: the replay cannot wait in the admission queue")
		}
		c := o.selectionConfig(true)
		if err := c.Validate(); err != nil {
			errs = append(errs, fmt.Errorf("%w: Selection: %w", ErrInvalidOptions, err))
		}
		if o.Explain && c.Cost != selection.CostDynamo {
			bad("Explain breaks Dynamo's cost into its terms: Selection.Cost %v has none of them", c.Cost)
		}
	}
	if len(errs) > 0 {
		return o, errors.Join(errs...)
	}
	if o.BlockSize == 0 {
		o.BlockSize = trace.DefaultBlockSize
	}
	if o.Speedup == 0 {
		o.Speedup = 1
	}
	if o.PrefillTokensPerSecond == 0 {
		o.PrefillTokensPerSecond = DefaultPrefillTokensPerSecond
	}
	if o.DecodeTokenTime == 0 {
		o.DecodeTokenTime = DefaultDecodeTokenTime
	} else if o.DecodeTokenTime < 0 {
		o.DecodeTokenTime = 0
	}
	if o.MaxRunning == 0 {
		o.MaxRunning = DefaultMaxRunning
	}
	if o.StepBase == 0 {
		o.StepBase = o.DecodeTokenTime
	}
	if o.MaxBatchedTokens == 0 {
		o.MaxBatchedTokens = max(enginemodel.DefaultMaxBatchedTokens, o.MaxRunning)
	}
	if o.Replicas == 0 {
		o.Replicas = 1
	}
	if o.SyncDelay == 0 {
		o.SyncDelay = DefaultSyncDelay
	} else if o.SyncDelay < 0 {
		o.SyncDelay = 0
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	return o, nil
}

// engineParams are worker w's engine model: Options mapped onto
// enginemodel.Params (withDefaults applied). cached reads its prefix cache.
func (o Options) engineParams(w int, cached func(id uint64) int) enginemodel.Params {
	p := enginemodel.Params{
		RequestOverhead:  o.RequestOverhead,
		MaxBatchedTokens: o.MaxBatchedTokens,
		MaxRunning:       o.MaxRunning,
		StepBase:         none(o.StepBase),
		PrefillToken:     none(time.Duration(float64(time.Second) / o.PrefillTokensPerSecond)),
		DecodeSeq:        none(o.DecodeTokenTime - o.StepBase),
		Speed:            1,
		Cached:           cached,
	}
	if len(o.Speeds) > 0 {
		p.Speed = o.Speeds[w%len(o.Speeds)]
	}
	return p
}

// none maps a cost onto enginemodel.Params, where 0 means its default: no
// cost is a negative one there.
func none(d time.Duration) time.Duration {
	if d <= 0 {
		return -1
	}
	return d
}

// selectionConfig returns the service configuration for a kvselect policy.
func (o Options) selectionConfig(events bool) selection.Config {
	var c selection.Config
	if o.Selection != nil {
		c = *o.Selection
	} else {
		c = selection.DefaultConfig(1)
	}
	c.BlockSize = 1
	// The predictive cost's prefill rate before a worker learns its own:
	// the simulated one, in router tokens (trace blocks) per second.
	if o.PrefillTokensPerSecond > 0 && o.BlockSize > 0 { // filled (validate checks the rest)
		c.Predictive.PrefillTokensPerSecond = o.PrefillTokensPerSecond / float64(o.BlockSize)
	}
	c.UseKVEvents = events
	c.ActiveRequestExpiry = replayLease
	return c
}
