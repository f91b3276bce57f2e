package catalog

import (
	"errors"
	"fmt"
	"maps"
	"math"
	"net"
	"slices"
	"strconv"
	"strings"
)

// DefaultModel is the model of a worker with an empty Model, and of a
// selection request that names none: the two meet in one partition.
const DefaultModel = "default"

// MaxDPSize bounds Worker.DPSize. Real deployments use a few dozen
// data-parallel ranks at most; the bound keeps a typo (or a hostile input) from
// making Ranks or the catalog allocate without limit.
const MaxDPSize = 4096

// DefaultMaxRanks is a Catalog's default bound on the data-parallel ranks of
// all its workers together (the sum of their DPSize, whatever their
// lifecycle): 64 workers of 1,024 ranks, or 65,536 workers of one. Every rank
// costs the selection service a candidate, a load entry and, with KV events,
// an event source, so a handful of workers each within MaxDPSize (500 of 4,096
// ranks in a 32 KB workers file) must not add up to millions of them. It is
// kvindex.ReadOptions.MaxWorkerRanks's default too: a catalog at the bound
// still loads a peer's index snapshot.
const DefaultMaxRanks = 65_536

// Sentinel errors. Functions wrap them with context; test with errors.Is.
var (
	// ErrInvalidWorker reports a Worker that is plainly malformed (see
	// Worker.Validate). The message lists every problem found.
	ErrInvalidWorker = errors.New("catalog: invalid worker")
	// ErrNotFound reports an id that is not in the catalog.
	ErrNotFound = errors.New("catalog: worker not found")
	// ErrDuplicateID reports a desired set that names one id more than once.
	ErrDuplicateID = errors.New("catalog: duplicate worker id")
	// ErrTooManyRanks reports an upsert that would take a catalog's workers
	// past its bound on data-parallel ranks (Options.MaxRanks).
	ErrTooManyRanks = errors.New("catalog: too many worker ranks")
)

// Worker describes one inference engine: where it serves requests, where it
// publishes KV events, and the capacity figures the router needs.
//
// Worker is a plain value. Its maps make it a reference type in part, so share
// it between goroutines only if nobody mutates it, or hand out Clone copies. The
// Catalog never keeps or returns a caller's maps: it stores and returns clones.
//
// A zero field means "not known"; whether a missing value prevents routing is
// decided by the catalog's Requirements, not by Validate. In particular DPSize 0 is not
// defaulted to 1: such a worker is Incomplete with ReasonNoDPSize (Dynamo's
// "dp_size 0" rule). A worker without data parallelism sets DPStart 0 and
// DPSize 1.
type Worker struct {
	// ID identifies the worker service-wide (across models); for example
	// "namespace/pod". Required.
	ID string
	// Model is the partition key: requests for a model are only ever routed to
	// workers of that model. Empty means DefaultModel; the catalog stores the
	// normalised name.
	Model string
	// Endpoint is the host:port that serves requests, without a scheme (IPv6
	// hosts in brackets). Empty means not known yet.
	Endpoint string
	// DPStart is the first global data-parallel rank the worker serves.
	DPStart int
	// DPSize is the number of data-parallel ranks: DPStart .. DPStart+DPSize-1.
	// At most MaxDPSize.
	DPSize int
	// KVEventEndpoints maps a global data-parallel rank to the ZMQ endpoint that
	// publishes its KV events: "tcp://host:port" or "ipc://path". Every key must
	// be one of the worker's ranks. An empty value counts as missing.
	KVEventEndpoints map[int]string
	// ReplayEndpoint is the optional ZMQ ROUTER endpoint that replays missed
	// event batches; same syntax as the event endpoints. How ranks map onto
	// replay sockets is the caller's business.
	ReplayEndpoint string
	// BlockSize is the engine's KV block size in tokens; 0 means not known.
	BlockSize int
	// TotalKVBlocks is the engine's KV cache capacity in blocks; 0 means not known.
	TotalKVBlocks int
	// MaxNumBatchedTokens is the engine's per-step token budget; 0 means not known.
	MaxNumBatchedTokens int
	// Labels are free-form key/value pairs (for example the pod's labels).
	Labels map[string]string
	// Identity is a free-form, human-readable name (for example the pod name).
	Identity string
}

// modelName returns the partition a model name stands for: model, or
// DefaultModel when model is empty.
func modelName(model string) string {
	if model == "" {
		return DefaultModel
	}
	return model
}

// Ranks returns the worker's global data-parallel ranks in ascending order, or
// nil when DPSize is not positive. DPSize above MaxDPSize is clamped, so an
// unvalidated worker cannot cause a huge allocation.
func (w Worker) Ranks() []int {
	n := min(w.DPSize, MaxDPSize)
	if n <= 0 {
		return nil
	}
	ranks := make([]int, n)
	for i := range ranks {
		ranks[i] = w.DPStart + i
	}
	return ranks
}

// rankCount is the number of data-parallel ranks w holds a place for: DPSize,
// 0 when it is not positive, clamped to MaxDPSize like Ranks.
func (w Worker) rankCount() int { return max(min(w.DPSize, MaxDPSize), 0) }

// TotalRanks returns the data-parallel ranks of ws together: the sum of their
// DPSize, each clamped to [0, MaxDPSize] as Ranks clamps it. It is what a
// Catalog's Options.MaxRanks bounds, for checking a desired set as a whole
// before any of it is applied.
func TotalRanks(ws []Worker) int {
	n := 0
	for _, w := range ws {
		n += w.rankCount()
	}
	return n
}

// hasRank reports whether rank is one of the worker's data-parallel ranks.
func (w Worker) hasRank(rank int) bool {
	return w.DPSize > 0 && rank >= w.DPStart && rank-w.DPStart < w.DPSize
}

// EventEndpoint returns the KV-event endpoint of one of the worker's ranks. It
// reports false when rank is not one of the worker's ranks or has no non-empty
// endpoint.
func (w Worker) EventEndpoint(rank int) (string, bool) {
	if !w.hasRank(rank) {
		return "", false
	}
	ep := w.KVEventEndpoints[rank]
	return ep, ep != ""
}

// Clone returns a deep copy of w: the copy shares no map with w. Empty maps
// become nil.
func (w Worker) Clone() Worker {
	c := w
	c.KVEventEndpoints = cloneMap(w.KVEventEndpoints)
	c.Labels = cloneMap(w.Labels)
	return c
}

func cloneMap[K comparable, V any](m map[K]V) map[K]V {
	if len(m) == 0 {
		return nil
	}
	return maps.Clone(m)
}

// Equal reports whether w and o describe the same worker: every field is equal,
// an empty Model equals DefaultModel, and a nil map equals an empty one.
func (w Worker) Equal(o Worker) bool {
	return w.ID == o.ID && modelName(w.Model) == modelName(o.Model) && w.Endpoint == o.Endpoint &&
		w.DPStart == o.DPStart && w.DPSize == o.DPSize &&
		w.ReplayEndpoint == o.ReplayEndpoint && w.BlockSize == o.BlockSize &&
		w.TotalKVBlocks == o.TotalKVBlocks && w.MaxNumBatchedTokens == o.MaxNumBatchedTokens &&
		w.Identity == o.Identity &&
		maps.Equal(w.KVEventEndpoints, o.KVEventEndpoints) && maps.Equal(w.Labels, o.Labels)
}

// normalized returns a deep copy with the model name filled in: the form the
// catalog stores.
func (w Worker) normalized() Worker {
	c := w.Clone()
	c.Model = modelName(w.Model)
	return c
}

// Validate reports input that is plainly malformed, as opposed to information
// that is merely missing (which the catalog reports as reasons). It returns nil or
// an error wrapping ErrInvalidWorker that lists every problem:
//
//   - an empty ID;
//   - a negative DPStart, DPSize, BlockSize, TotalKVBlocks or
//     MaxNumBatchedTokens, a DPSize above MaxDPSize, or a rank range that
//     overflows 32 bits;
//   - a non-empty Endpoint that is not host:port with a non-empty host and a
//     port in 1..65535 (a scheme such as "http://" is rejected);
//   - a non-empty KV-event or replay endpoint that is not tcp://host:port or
//     ipc://path;
//   - a KV-event endpoint keyed by a rank outside DPStart .. DPStart+DPSize-1
//     (not checked while DPSize is 0: the ranks are then unknown, and the
//     catalog reports ReasonNoDPSize).
func (w Worker) Validate() error {
	var problems []string
	add := func(format string, args ...any) { problems = append(problems, fmt.Sprintf(format, args...)) }
	if w.ID == "" {
		add("id is empty")
	}
	if w.Endpoint != "" {
		if err := checkHostPort(w.Endpoint); err != nil {
			add("endpoint %q: %v", w.Endpoint, err)
		}
	}
	nonNegative := []struct {
		name string
		v    int
	}{
		{"dp_start", w.DPStart}, {"dp_size", w.DPSize}, {"block_size", w.BlockSize},
		{"total_kv_blocks", w.TotalKVBlocks}, {"max_num_batched_tokens", w.MaxNumBatchedTokens},
	}
	for _, f := range nonNegative {
		if f.v < 0 {
			add("%s %d is negative", f.name, f.v)
		}
	}
	// With DPSize 0 the ranks are unknown (the catalog reports ReasonNoDPSize), so
	// event endpoint keys cannot be judged yet.
	rangeOK := w.DPStart >= 0 && w.DPSize > 0
	if w.DPSize > MaxDPSize {
		add("dp_size %d exceeds %d", w.DPSize, MaxDPSize)
		rangeOK = false
	}
	if rangeOK && int64(w.DPStart)+int64(w.DPSize) > math.MaxInt32 {
		add("dp ranks %d+%d overflow 32 bits", w.DPStart, w.DPSize)
		rangeOK = false
	}
	eventsOK := true
	for rank, ep := range w.KVEventEndpoints { // fast path: no allocation
		if (rangeOK && !w.hasRank(rank)) || (ep != "" && checkZMQEndpoint(ep) != nil) {
			eventsOK = false
			break
		}
	}
	if !eventsOK { // report the problems in rank order
		for _, rank := range slices.Sorted(maps.Keys(w.KVEventEndpoints)) {
			ep := w.KVEventEndpoints[rank]
			if rangeOK && !w.hasRank(rank) {
				add("kv event endpoint for rank %d outside ranks %s", rank, rankRange(w.DPStart, w.DPSize))
			}
			if ep != "" {
				if err := checkZMQEndpoint(ep); err != nil {
					add("kv event endpoint for rank %d %q: %v", rank, ep, err)
				}
			}
		}
	}
	if w.ReplayEndpoint != "" {
		if err := checkZMQEndpoint(w.ReplayEndpoint); err != nil {
			add("replay endpoint %q: %v", w.ReplayEndpoint, err)
		}
	}
	if len(problems) == 0 {
		return nil
	}
	if w.ID == "" {
		return fmt.Errorf("%w: %s", ErrInvalidWorker, strings.Join(problems, "; "))
	}
	return fmt.Errorf("%w %q: %s", ErrInvalidWorker, w.ID, strings.Join(problems, "; "))
}

func rankRange(start, size int) string {
	return fmt.Sprintf("%d..%d", start, start+size-1)
}

// checkHostPort accepts host:port with a non-empty host free of spaces,
// control characters and URL punctuation, and a decimal port in 1..65535.
func checkHostPort(s string) error {
	if strings.Contains(s, "://") {
		return errors.New("want host:port without a scheme")
	}
	host, port, err := net.SplitHostPort(s)
	if err != nil {
		return err
	}
	if host == "" {
		return errors.New("host is empty")
	}
	for _, r := range host {
		if r <= ' ' || r == 0x7f || strings.ContainsRune("/?#@\\", r) {
			return fmt.Errorf("host contains %q", r)
		}
	}
	p, err := strconv.ParseUint(port, 10, 16)
	if err != nil || p == 0 {
		return fmt.Errorf("port %q is not in 1..65535", port)
	}
	return nil
}

// checkZMQEndpoint accepts tcp://host:port and ipc://path.
func checkZMQEndpoint(s string) error {
	scheme, rest, ok := strings.Cut(s, "://")
	if !ok {
		return errors.New("want tcp://host:port or ipc://path")
	}
	switch scheme {
	case "tcp":
		return checkHostPort(rest)
	case "ipc":
		if rest == "" {
			return errors.New("ipc path is empty")
		}
		return nil
	default:
		return fmt.Errorf("scheme %q is not tcp or ipc", scheme)
	}
}
