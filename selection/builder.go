package selection

import (
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strings"
	"time"

	"github.com/kvselect/kvselect/catalog"
)

// Recorder receives decision events for metrics. Implementations must be safe for
// concurrent use and must not block; the service calls them outside its locks.
// The zero-cost default records nothing.
type Recorder interface {
	// Selected is called for every successful Select or SelectAndReserve.
	Selected(model string, d Decision)
	// Rejected is called when a request fails with err (see HTTPStatus).
	Rejected(model string, err error)
}

// Decision describes one pick for metrics and logs.
type Decision struct {
	catalog.WorkerRank
	Candidates            int
	ChosenOverlapBlocks   int // device blocks of the chosen worker
	BestOverlapBlocks     int // best device overlap any eligible worker had
	RequestBlocks         int
	EffectivePrefill      int
	QueueWait             time.Duration
	Reserved              bool
	Cost                  float64
	PotentialDecodeBlocks int
	// Retries counts the times the decision was made again because a
	// concurrent booking reached the chosen rank first.
	Retries int
	// Margin is how much cheaper the chosen rank was than the next-cheapest
	// candidate (0 when it was alone, or tied, or chosen by a session pin
	// or a temperature draw over a costlier one: then negative).
	Margin float64
	// Predicted reports that Cost and Margin are the predictive cost's
	// seconds (CostPredictive, or CostAuto on a model it predicts for);
	// otherwise they are Dynamo's logit, in blocks.
	Predicted bool
}

type nopRecorder struct{}

func (nopRecorder) Selected(string, Decision) {}
func (nopRecorder) Rejected(string, error)    {}

// SelectionServiceBuilder builds a SelectionService from a Config and a few
// options. It is not safe for concurrent use; Build may be called more than once,
// each call building an independent service.
type SelectionServiceBuilder struct {
	cfg      Config
	clock    func() time.Time
	rng      rand.Source
	logger   *slog.Logger
	recorder Recorder
	sweep    time.Duration
	feedOpts FeedOptions
	external bool
	bindAddr string
	anyPeer  bool
	observer BookingObserver
	tracer   Tracer
	// the policy seams (policy.go)
	filters    []namedFilter
	terms      []namedTerm
	picker     Picker
	classifier Classifier

	recorderSet bool // Recorder was called with a recorder (set by Build)
}

// FeedOptions tune the KV-event feed the service runs when Config.UseKVEvents is
// true. Zero values take the kvevents defaults.
type FeedOptions struct {
	// QueueLen bounds each source's queue of received batches.
	QueueLen int
	// ReconnectMin and ReconnectMax bound the dial backoff.
	ReconnectMin, ReconnectMax time.Duration
}

// NewSelectionServiceBuilder starts a builder for cfg (see DefaultConfig).
func NewSelectionServiceBuilder(cfg Config) *SelectionServiceBuilder {
	return &SelectionServiceBuilder{cfg: cfg}
}

// Clock sets the service's clock, which must be safe for concurrent use
// (default time.Now). Tests inject a fake one.
func (b *SelectionServiceBuilder) Clock(now func() time.Time) *SelectionServiceBuilder {
	b.clock = now
	return b
}

// Rand sets the random source used for tie-breaks and softmax sampling (default:
// a randomly seeded PCG). Each model partition derives its own generator from it
// at creation, under the service's lock.
func (b *SelectionServiceBuilder) Rand(src rand.Source) *SelectionServiceBuilder {
	b.rng = src
	return b
}

// Logger sets the logger (default: discard).
func (b *SelectionServiceBuilder) Logger(l *slog.Logger) *SelectionServiceBuilder {
	b.logger = l
	return b
}

// Recorder sets the metrics hooks (default: none).
func (b *SelectionServiceBuilder) Recorder(r Recorder) *SelectionServiceBuilder {
	b.recorder = r
	return b
}

// SweepInterval sets how often expired reservations are released by the
// service's own sweeper goroutine (default 1 s; negative disables it, leaving
// Expire to the caller).
func (b *SelectionServiceBuilder) SweepInterval(d time.Duration) *SelectionServiceBuilder {
	b.sweep = d
	return b
}

// EventFeed tunes the KV-event feed.
func (b *SelectionServiceBuilder) EventFeed(o FeedOptions) *SelectionServiceBuilder {
	b.feedOpts = o
	return b
}

// ExternalEvents makes the service take KV events from the caller
// (EventPlane.Apply) instead of running its own ZeroMQ feed: for
// embedders with their own event transport, simulators and tests. Workers then
// need no KV-event endpoints to be schedulable. Meaningful only with
// Config.UseKVEvents.
func (b *SelectionServiceBuilder) ExternalEvents() *SelectionServiceBuilder {
	b.external = true
	return b
}

// BindEvents makes the feed also bind a SUB socket at endpoint
// (tcp://host:port) for engines that dial in instead of binding their PUB.
// Messages are attributed by topic (kv@<host>[:port]@<model>) to the worker whose
// endpoint has that host (and port, when the topic names one); workers then need
// no per-rank event endpoint to be schedulable. EventPlane.BindAddr
// returns the bound address.
//
// Only peers at the IP address of a known worker's endpoint may connect, and a
// message is taken only when its topic names the worker at the sending address;
// a host-only topic that several workers share is refused as ambiguous (name
// the port in the topic). Every refusal is counted (EventPlane.Refusals, and the
// feed's BindStats).
func (b *SelectionServiceBuilder) BindEvents(endpoint string) *SelectionServiceBuilder {
	b.bindAddr = endpoint
	return b
}

// BindEventsFromAnyPeer lifts BindEvents' address checks, for engines behind
// NAT or a proxy whose connections do not come from their endpoint's address.
// The risk: anyone who can reach the bound port can then publish events as any
// worker and steer routing. A single forged batch can fill a worker's index
// with prefixes it does not hold, or clear it (a sequence number that goes
// back looks like an engine restart, and an AllBlocksCleared event like a
// cache reset; only a forged number far ahead (more than 100,000) is held back, see
// kvevents' package doc). Keep such a port on a network only engines reach.
func (b *SelectionServiceBuilder) BindEventsFromAnyPeer() *SelectionServiceBuilder {
	b.anyPeer = true
	return b
}

// Build validates the configuration, reporting every problem at once (wrapped
// ErrInvalidConfig), and returns a running service: its event feed and expiry
// sweeper run until Close. ctx bounds only the start.
func (b *SelectionServiceBuilder) Build(ctx context.Context) (*SelectionService, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if err := b.cfg.Validate(); err != nil {
		return nil, err
	}
	if b.feedOpts.QueueLen < 0 || b.feedOpts.ReconnectMin < 0 || b.feedOpts.ReconnectMax < 0 {
		return nil, fmt.Errorf("%w: negative event feed option %+v", ErrInvalidConfig, b.feedOpts)
	}
	if b.bindAddr != "" && (b.external || !b.cfg.UseKVEvents) {
		return nil, fmt.Errorf("%w: BindEvents needs UseKVEvents and the built-in feed (not ExternalEvents)", ErrInvalidConfig)
	}
	if probs := b.seamProblems(); len(probs) > 0 {
		return nil, fmt.Errorf("%w: %s", ErrInvalidConfig, strings.Join(probs, "; "))
	}
	// o is b with every default filled in.
	o := *b
	o.cfg = b.cfg.normalized()
	if o.clock == nil {
		o.clock = time.Now
	}
	if o.rng == nil {
		o.rng = rand.NewPCG(rand.Uint64(), rand.Uint64())
	}
	if o.logger == nil {
		o.logger = slog.New(slog.DiscardHandler)
	}
	o.recorderSet = o.recorder != nil
	if o.recorder == nil {
		o.recorder = nopRecorder{}
	}
	if o.sweep == 0 {
		o.sweep = time.Second
	}
	return newService(&o)
}
