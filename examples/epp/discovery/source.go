package discovery

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"sync/atomic"

	"github.com/kvselect/kvselect/catalog"
)

// Sentinel errors. Functions wrap them with context; test with errors.Is.
var (
	// ErrInvalidOptions reports KubeOptions or StaticOptions that fail
	// validation. The message lists every problem found.
	ErrInvalidOptions = errors.New("discovery: invalid options")
	// ErrInvalidFile reports a workers file that cannot be parsed or whose
	// content fails validation. The message lists every problem found.
	ErrInvalidFile = errors.New("discovery: invalid workers file")
	// ErrTooManyWorkers reports a workers file listing more workers than
	// Limits.MaxWorkers. It comes wrapped with ErrInvalidFile.
	ErrTooManyWorkers = errors.New("discovery: too many workers")
	// ErrTooManyRanks reports a workers file whose workers have more
	// data-parallel ranks together than Limits.MaxRanks. It comes wrapped
	// with ErrInvalidFile.
	ErrTooManyRanks = errors.New("discovery: too many worker ranks")
	// ErrInvalidWorkers reports a fixed worker set (StaticWorkers) with a
	// malformed worker or a duplicate id.
	ErrInvalidWorkers = errors.New("discovery: invalid workers")
	// ErrAlreadyRun reports a second call of a source's Run. Every source runs
	// at most once.
	ErrAlreadyRun = errors.New("discovery: Run called twice")
)

// Reasons a Kubernetes source gives in a Snapshot that is not Synced.
const (
	// ReasonPoolNotFound: the caches have synced but the namespace holds no
	// InferencePool of the configured name (or it was deleted).
	ReasonPoolNotFound = "inference pool not found"
	// ReasonPoolInvalid prefixes the reason for an InferencePool whose spec
	// cannot drive discovery (no selector labels, no target port); the rest of
	// the reason names the problem.
	ReasonPoolInvalid = "inference pool invalid"
)

// Source produces the complete desired set of workers every time it changes.
//
// Run blocks until ctx is done and returns only after every goroutine it
// started has exited; it then returns ctx.Err(), or an earlier error that
// stopped it. It calls sink from a single goroutine, one call at a time, in
// order: a later Snapshot always supersedes an earlier one, and a sink that
// blocks delays the next Snapshot without losing changes (changes made
// meanwhile are folded into the next one). The sink owns the Snapshot it is
// given: nothing in it is shared with the source.
//
// Implementations in this package: *Kubernetes, *Static and StaticWorkers.
type Source interface {
	Run(ctx context.Context, sink func(Snapshot)) error
}

// Snapshot is the complete desired set of workers at one moment.
//
// A consumer reconciles its catalog to Workers (upsert what is listed, delete
// what is not) and may report ready once it has seen a Snapshot with Synced
// set. Snapshot is a plain value with no locking; the receiver owns it.
type Snapshot struct {
	// Workers is the desired set, sorted by ID, ids unique; nil when the
	// source knows of no eligible worker.
	Workers []catalog.Worker
	// Synced reports that the source has read its whole input: for Kubernetes,
	// both informer caches have synced and the InferencePool resolved to a
	// usable spec; for a file, the file parsed. A Snapshot that is not Synced
	// carries no workers.
	Synced bool
	// Reason says why Synced is false (ReasonPoolNotFound, or ReasonPoolInvalid
	// followed by details). Empty when Synced is true.
	Reason string
}

// Equal reports whether s and o hold the same flags and the same workers in
// the same order (compared with catalog.Worker.Equal).
func (s Snapshot) Equal(o Snapshot) bool {
	return s.Synced == o.Synced && s.Reason == o.Reason &&
		slices.EqualFunc(s.Workers, o.Workers, catalog.Worker.Equal)
}

// clone returns a deep copy of s; an empty Workers becomes nil.
func (s Snapshot) clone() Snapshot {
	c := s
	c.Workers = nil
	if len(s.Workers) == 0 {
		return c
	}
	c.Workers = make([]catalog.Worker, len(s.Workers))
	for i, w := range s.Workers {
		c.Workers[i] = w.Clone()
	}
	return c
}

// checkWorkers validates every worker and rejects duplicate ids; it returns
// all problems found, nil when there are none.
func checkWorkers(ws []catalog.Worker) []string {
	var problems []string
	seen := make(map[string]int, len(ws))
	for i, w := range ws {
		if err := w.Validate(); err != nil {
			problems = append(problems, fmt.Sprintf("worker %d: %v", i, err))
		}
		if w.ID == "" {
			continue
		}
		if j, dup := seen[w.ID]; dup {
			problems = append(problems, fmt.Sprintf("worker %d: id %q already used by worker %d", i, w.ID, j))
			continue
		}
		seen[w.ID] = i
	}
	return problems
}

func sortWorkers(ws []catalog.Worker) {
	slices.SortFunc(ws, func(a, b catalog.Worker) int { return strings.Compare(a.ID, b.ID) })
}

// fixed is the Source returned by StaticWorkers.
type fixed struct {
	snap Snapshot
	err  error
	once onceGuard
}

// StaticWorkers returns a Source whose Run emits one Synced Snapshot holding
// (deep copies of) ws, sorted by ID, and then waits for ctx to be done. Run
// returns an error wrapping ErrInvalidWorkers, without emitting anything, when
// a worker fails catalog.Worker.Validate or two workers share an id. The
// Source may be Run once; it is safe to hand to another goroutine.
func StaticWorkers(ws []catalog.Worker) Source {
	f := &fixed{}
	if problems := checkWorkers(ws); len(problems) > 0 {
		f.err = fmt.Errorf("%w: %s", ErrInvalidWorkers, strings.Join(problems, "; "))
		return f
	}
	f.snap = Snapshot{Workers: make([]catalog.Worker, len(ws)), Synced: true}
	for i, w := range ws {
		f.snap.Workers[i] = w.Clone()
	}
	sortWorkers(f.snap.Workers)
	return f
}

func (f *fixed) Run(ctx context.Context, sink func(Snapshot)) error {
	if sink == nil {
		return fmt.Errorf("%w: sink is nil", ErrInvalidOptions)
	}
	if !f.once.start() {
		return ErrAlreadyRun
	}
	if f.err != nil {
		return f.err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	sink(f.snap.clone())
	<-ctx.Done()
	return ctx.Err()
}

// census logs how many workers a source offers, per role, at the first synced
// snapshot and whenever the total or a role's count crosses zero. It is used
// by one goroutine only.
type census struct {
	log       *slog.Logger
	roleLabel string
	source    string
	logged    bool
	total     int
	roles     map[string]int // every role value seen so far, with its last count
}

// noRole is the census key for workers without the role label.
const noRole = "(none)"

func (c *census) observe(s Snapshot) {
	if !s.Synced && !c.logged {
		return
	}
	counts := make(map[string]int, len(c.roles))
	for role := range c.roles {
		counts[role] = 0
	}
	if c.roleLabel != "" {
		for _, w := range s.Workers {
			role := w.Labels[c.roleLabel]
			if role == "" {
				role = noRole
			}
			counts[role]++
		}
	}
	crossed := !c.logged || (c.total == 0) != (len(s.Workers) == 0)
	for role, n := range counts {
		if (c.roles[role] == 0) != (n == 0) {
			crossed = true
		}
	}
	c.logged, c.total, c.roles = true, len(s.Workers), counts
	if !crossed {
		return
	}
	attrs := []any{slog.String("source", c.source), slog.Int("workers", len(s.Workers)), slog.Bool("synced", s.Synced)}
	if s.Reason != "" {
		attrs = append(attrs, slog.String("reason", s.Reason))
	}
	if c.roleLabel != "" {
		roleAttrs := make([]any, 0, len(counts))
		for _, role := range slices.Sorted(maps.Keys(counts)) {
			roleAttrs = append(roleAttrs, slog.Int(role, counts[role]))
		}
		attrs = append(attrs, slog.String("role_label", c.roleLabel), slog.Group("roles", roleAttrs...))
	}
	c.log.Info("discovery census", attrs...)
}

// onceGuard lets Run start once.
type onceGuard struct{ started atomic.Bool }

func (g *onceGuard) start() bool { return g.started.CompareAndSwap(false, true) }
