package selection

import (
	"context"
	"fmt"
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvselect/kvselect/reservation"
)

// The policy seams (Filter, CostTerm, Picker, Classifier) are what a custom
// Endpoint Picker adds to the service's own decision, set once on the
// SelectionServiceBuilder; docs/POLICY.md shows where each runs.

// Filter decides which candidates may serve a request: a LoRA adapter
// loaded, a label, a taint, a tenant's pool. Filters run in the order they
// were added, each over the candidates the ones before it kept, before any
// cost is computed (c.Cost is 0).
//
// What holds for every seam: it is called on the request's goroutine,
// concurrently with other requests', so it must be safe for concurrent use.
// The *Request, *Scored and []Scored it is handed are the service's copies,
// valid for the call: read them, never modify or keep them. Filters, cost
// terms and the picker run under the model's lock when queueing is on
// (Config.QueueThreshold): they must be quick, must not block and must not
// call the service. The Classifier runs before any lock.
//
// A filter that is not a ScopedFilter turns the sparse decision off: every
// decision then takes the full scan (Stats.PolicyFullScans counts those it
// costs).
type Filter interface {
	// Admit reports whether c may serve req.
	Admit(ctx context.Context, req *Request, c *Scored) bool
}

// FilterFunc is a function that is a Filter.
type FilterFunc func(ctx context.Context, req *Request, c *Scored) bool

// Admit returns f(ctx, req, c).
func (f FilterFunc) Admit(ctx context.Context, req *Request, c *Scored) bool { return f(ctx, req, c) }

// CostTerm prices what the built-in cost cannot see (an SLO class, a GPU
// type, an engine's own queue signal): its value is added to the
// candidate's cost, in the cost's own unit (c.Predicted: seconds, else
// Dynamo's blocks). Lower is better, so a positive value is a penalty and a
// negative one a preference. Terms run in the order they were added; c.Cost
// is the cost so far (the built-in cost plus the terms before this one).
//
// A term that is not a ScopedCostTerm turns the sparse decision off: every
// decision then takes the full scan (Stats.PolicyFullScans counts those it
// costs).
type CostTerm interface {
	// Cost returns what sending req to c adds to c's cost: a finite number
	// (anything else fails the request with ErrPolicy).
	Cost(ctx context.Context, req *Request, c *Scored) float64
}

// CostTermFunc is a function that is a CostTerm (without a scope).
type CostTermFunc func(ctx context.Context, req *Request, c *Scored) float64

// Cost returns f(ctx, req, c).
func (f CostTermFunc) Cost(ctx context.Context, req *Request, c *Scored) float64 {
	return f(ctx, req, c)
}

// ScopedCostTerm is a CostTerm that names, for each request, the only workers
// it may price: it is 0 on every rank of every other worker. The sparse
// decision then stays exact with it: it evaluates the named workers' ranks
// one by one, as it does the ranks the request's prefix touches, and the
// term is 0 on the others, whose costs its order keeps. A scope should be
// small (the workers holding an adapter, a tenant's few workers); a term
// that prices most of the fleet is cheaper unscoped.
type ScopedCostTerm interface {
	CostTerm
	// Scope appends to dst the ids of the workers whose ranks the term may
	// give a non-zero Cost for req, and returns the extended slice.
	Scope(ctx context.Context, req *Request, dst []string) []string
}

// Picker chooses among the scored candidates, in place of the pick by cost
// (the cheapest with ties drawn at random, or Config.Temperature's draw): a
// power of two choices, a custom tie-break. A session's pin is still chosen
// before it (Config.Sessions). A picker turns the sparse decision off.
type Picker interface {
	// Pick returns the index in cands of the candidate to book. cands holds
	// the candidates that are not busy (every one, when all are: Select
	// only), sorted by worker id and rank, with their final Cost; it is
	// never empty. An index out of range fails the request with ErrPolicy.
	Pick(ctx context.Context, req *Request, cands []Scored) int
}

// PickerFunc is a function that is a Picker.
type PickerFunc func(ctx context.Context, req *Request, cands []Scored) int

// Pick returns f(ctx, req, cands).
func (f PickerFunc) Pick(ctx context.Context, req *Request, cands []Scored) int {
	return f(ctx, req, cands)
}

// Classifier admits or refuses each request before anything else is done for
// it (Select and SelectAndReserve, so Book; not PotentialLoads), and sets
// the priority it waits with in the admission queue. It may read ctx (values
// a custom EPP put there from the request's headers: a tenant, a policy
// class) and take a moment (a quota look-up), but it delays the request by
// as much.
type Classifier interface {
	// Classify returns the request's admission: its priority, or a refusal.
	Classify(ctx context.Context, req *Request) Admission
}

// ClassifierFunc is a function that is a Classifier.
type ClassifierFunc func(ctx context.Context, req *Request) Admission

// Classify returns f(ctx, req).
func (f ClassifierFunc) Classify(ctx context.Context, req *Request) Admission { return f(ctx, req) }

// Admission is a Classifier's verdict on a request.
type Admission struct {
	// Priority replaces the request's Priority (its Jump must be finite and
	// >= 0): return req.Priority to keep the caller's.
	Priority Priority
	// Refuse, when not empty, refuses the request: the call returns an error
	// wrapping ErrRefused, and RefusalReason names it "classifier:" + Refuse
	// (a short token: lower-case letters, digits, _ and -; capitals are
	// lowered, other characters become _, and it is cut at 64 bytes).
	Refuse string
	// Class, when not empty, replaces the request's policy class
	// (Request.Class, Config.Classes); empty keeps it.
	Class string
	// Deadline, when not zero, replaces the request's deadline
	// (Request.Deadline); zero keeps it.
	Deadline time.Time
}

// Filter adds a filter (see Filter) named name: the reason its exclusions
// are counted under (Stats.Filtered) and, when it excludes every candidate
// left, the reason the request is refused with (ErrNoEndpoints, its
// RefusalReason "filtered:" + name). name is a short token (lower-case
// letters, digits, _ and -), one per filter. A filter that is not a
// ScopedFilter turns the sparse decision off.
func (b *SelectionServiceBuilder) Filter(name string, f Filter) *SelectionServiceBuilder {
	b.filters = append(b.filters, namedFilter{name, f})
	return b
}

// CostTerm adds a cost term (see CostTerm) named name (a token like a
// filter's, one per term), which the errors it causes name.
func (b *SelectionServiceBuilder) CostTerm(name string, t CostTerm) *SelectionServiceBuilder {
	b.terms = append(b.terms, namedTerm{name, t})
	return b
}

// Picker sets the picker (see Picker); nil restores the pick by cost.
func (b *SelectionServiceBuilder) Picker(p Picker) *SelectionServiceBuilder {
	b.picker = p
	return b
}

// Classifier sets the admission classifier (see Classifier); nil: none.
func (b *SelectionServiceBuilder) Classifier(c Classifier) *SelectionServiceBuilder {
	b.classifier = c
	return b
}

type namedFilter struct {
	name string
	f    Filter
}

type namedTerm struct {
	name string
	t    CostTerm
}

// maxSeamName bounds a filter's or a cost term's name.
const maxSeamName = 64

// validToken reports whether s is a non-empty token of lower-case letters,
// digits, _ and -, at most maxSeamName bytes: fit for a metric label and a
// refusal's reason.
func validToken(s string) bool {
	if s == "" || len(s) > maxSeamName {
		return false
	}
	for _, r := range s {
		if !tokenRune(r) {
			return false
		}
	}
	return true
}

func tokenRune(r rune) bool {
	return r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || r == '_' || r == '-'
}

// seamProblems lists what is wrong with the builder's seams.
func (b *SelectionServiceBuilder) seamProblems() []string {
	var probs []string
	check := func(kind, name string, nilSeam bool, seen map[string]bool) {
		switch {
		case !validToken(name):
			probs = append(probs, fmt.Sprintf("%s name %q is not a token of 1 to %d lower-case letters, digits, _ or -", kind, name, maxSeamName))
		case seen[name]:
			probs = append(probs, fmt.Sprintf("%s name %q is used twice", kind, name))
		}
		if nilSeam {
			probs = append(probs, fmt.Sprintf("%s %q is nil", kind, name))
		}
		seen[name] = true
	}
	seen := map[string]bool{}
	for _, f := range b.filters {
		check("filter", f.name, f.f == nil, seen)
	}
	seen = map[string]bool{}
	for _, t := range b.terms {
		check("cost term", t.name, t.t == nil, seen)
	}
	return probs
}

// policy is a service's seams, fixed at Build; the service holds nil when
// none is set, so a decision without seams pays one nil check per seam
// point.
type policy struct {
	filters    []filterSeam
	terms      []termSeam
	picker     Picker
	classifier Classifier
	// fullScan: a filter or a term without a scope, or the picker, is
	// set, so no decision is sparse
	fullScan bool
	refused  atomic.Uint64 // the Classifier's refusals
}

type filterSeam struct {
	name, reason string // reason: "filtered:" + name
	f            Filter
	scope        ScopedFilter // f's scope; nil when it has none
	excluded     atomic.Uint64
}

type termSeam struct {
	name  string
	t     CostTerm
	scope ScopedCostTerm // t's scope; nil when it has none
}

// newPolicy returns the seams o sets (already checked by seamProblems), or
// nil.
func newPolicy(o *SelectionServiceBuilder) *policy {
	if len(o.filters) == 0 && len(o.terms) == 0 && o.picker == nil && o.classifier == nil {
		return nil
	}
	pol := &policy{
		filters: make([]filterSeam, len(o.filters)), terms: make([]termSeam, len(o.terms)),
		picker: o.picker, classifier: o.classifier,
		fullScan: o.picker != nil,
	}
	for i, f := range o.filters {
		fs := &pol.filters[i]
		fs.name, fs.reason, fs.f = f.name, RefusedFiltered+":"+f.name, f.f
		fs.scope, _ = f.f.(ScopedFilter)
		if fs.scope == nil {
			pol.fullScan = true
		}
	}
	for i, t := range o.terms {
		ts := &pol.terms[i]
		ts.name, ts.t = t.name, t.t
		ts.scope, _ = t.t.(ScopedCostTerm)
		if ts.scope == nil {
			pol.fullScan = true
		}
	}
	return pol
}

// policyScratch is one decision's working memory for the seams, pooled: the
// request as they see it, and its views.
type policyScratch struct {
	ctx context.Context
	req Request
	// views are candidates' views: the evaluation's for the filters (and
	// then the cost terms: evaluated says they are current), the pool's
	// for the picker; one is one candidate's, for the cost terms of the
	// sparse decision and of an evaluation without filters
	views     []Scored
	evaluated bool
	one       Scored
	scope     []string
	excluded  []uint64 // per filter: what the decision's last evaluation excluded
	count     bool     // a decision (not an inspection): its exclusions count
}

var policyPool = sync.Pool{New: func() any { return new(policyScratch) }}

// begin returns the seams' scratch for a request (nil without seams). For a
// decision (not an inspection: PotentialLoads), it asks the Classifier
// first, and sets its priority on req or returns its refusal; and the
// decision's exclusions are counted. end releases the scratch.
func (pol *policy) begin(ctx context.Context, req *Request, decision bool) (*policyScratch, error) {
	if pol == nil {
		return nil, nil
	}
	ps := policyPool.Get().(*policyScratch)
	ps.ctx, ps.req, ps.count = ctx, *req, decision
	ps.excluded = append(ps.excluded[:0], make([]uint64, len(pol.filters))...)
	if pol.classifier == nil || !decision {
		return ps, nil
	}
	adm := pol.classifier.Classify(ctx, &ps.req)
	if adm.Refuse != "" {
		pol.refused.Add(1)
		reason := strings.Map(func(r rune) rune {
			switch {
			case tokenRune(r):
				return r
			case r >= 'A' && r <= 'Z':
				return r + 'a' - 'A'
			}
			return '_'
		}, adm.Refuse[:min(len(adm.Refuse), maxSeamName)])
		return ps, &refusal{RefusedClassifier + ":" + reason, fmt.Errorf("%w: %s (model %q)", ErrRefused, reason, modelOf(req.Model))}
	}
	if j := adm.Priority.Jump; math.IsNaN(j) || math.IsInf(j, 0) || j < 0 {
		return ps, fmt.Errorf("%w: the classifier set Priority.Jump %v, want a finite value >= 0", ErrPolicy, j)
	}
	req.Priority, ps.req.Priority = adm.Priority, adm.Priority
	if adm.Class != "" {
		req.Class, ps.req.Class = adm.Class, adm.Class
	}
	if !adm.Deadline.IsZero() {
		req.Deadline, ps.req.Deadline = adm.Deadline, adm.Deadline
	}
	return ps, nil
}

// end counts the decision's exclusions and releases ps (nil: nothing).
func (pol *policy) end(ps *policyScratch) {
	if ps == nil {
		return
	}
	if ps.count {
		for i, n := range ps.excluded {
			if n > 0 {
				pol.filters[i].excluded.Add(n)
			}
		}
	}
	clear(ps.views)
	ps.one = Scored{}
	ps.ctx, ps.req, ps.views, ps.scope = nil, Request{}, ps.views[:0], ps.scope[:0]
	policyPool.Put(ps)
}

// view fills v with what the seams see of candidate c of rs for pr, its
// clock read at now.
func (s *SelectionService) view(v *Scored, rs *rankSet, c *candidate, pr *prepared, now time.Time) {
	r := &rs.ranks[c.idx]
	clk := s.ledger.PrefillClock(rs.refs[c.idx], now)
	eff := effectivePrefill(c, pr, &pr.w, s.cfg.BlockSize)
	potential := c.activePrefill
	if pr.w.trackPrefill {
		potential += int64(eff)
	}
	*v = Scored{
		WorkerLoad: WorkerLoad{
			WorkerRank:          r.key,
			ActivePrefillTokens: c.activePrefill, ActiveBlocks: c.activeBlocks, ActiveRequests: c.activeRequests,
			MaxNumBatchedTokens: r.maxBatched, Busy: s.busy(c),
			PrefillRate: clk.Rate, Slowness: clk.Slowness, RecentBookings: clk.Arrivals,
			PotentialPrefill: potential, PotentialDecodeBlock: c.activeBlocks + c.newBlocks,
		},
		Endpoint: r.endpoint, Labels: r.labels,
		Overlap:                Overlap{Device: c.device, Host: c.host, Disk: c.disk},
		EffectivePrefillTokens: eff,
		Cost:                   c.cost,
		Predicted:              pr.w.predictive,
	}
}

// viewsOf builds the filters' view of every one of cands in pr's policy
// scratch (ps.views, grown as needed) and returns them; the views' costs
// are left for the cost to fill.
func (s *SelectionService) viewsOf(pr *prepared, rs *rankSet, cands []candidate) []Scored {
	ps := pr.pol
	ps.evaluated = false
	if cap(ps.views) < len(cands) {
		ps.views = make([]Scored, len(cands))
	}
	views := ps.views[:len(cands)]
	ps.views = views
	now := s.now()
	for i := range cands {
		s.view(&views[i], rs, &cands[i], pr, now)
	}
	return views
}

// applyFilters runs the filters over cands (the evaluation's, of sc.rs, with their
// loads and overlaps), then leaves out the ranks of ejected workers (ejected,
// in force at nowNanos) unless that would leave none: ejection yields, as it
// does without filters. It returns the candidates kept, in their order, and
// their ledger handles in sc.refs; or, when a filter keeps none, the
// refusal that names it.
func (s *SelectionService) applyFilters(pr *prepared, sc *evalScratch, cands []candidate, ejected map[string]int64, nowNanos int64) ([]candidate, []reservation.Rank, error) {
	ps, rs := pr.pol, sc.rs
	n := len(cands)
	views := s.viewsOf(pr, rs, cands)
	for fi := range s.pol.filters {
		f := &s.pol.filters[fi]
		kept := 0
		for i := range n {
			if !f.f.Admit(ps.ctx, &ps.req, &views[i]) {
				continue
			}
			if kept != i {
				cands[kept], views[kept] = cands[i], views[i]
			}
			kept++
		}
		ps.excluded[fi] = uint64(n - kept)
		if kept == 0 {
			for j := fi + 1; j < len(ps.excluded); j++ {
				ps.excluded[j] = 0
			}
			return nil, nil, &refusal{f.reason, fmt.Errorf("%w: filter %q excluded all %d candidates of model %q", ErrNoEndpoints, f.name, n, pr.model)}
		}
		n = kept
	}
	cands = cands[:n]
	if ejected != nil {
		out := func(c *candidate) bool {
			until, ok := ejected[rs.ranks[c.idx].key.WorkerID]
			return ok && until > nowNanos
		}
		kept := 0
		for i := range cands {
			if !out(&cands[i]) {
				kept++
			}
		}
		if kept > 0 && kept < len(cands) {
			k := 0
			for i := range cands {
				if !out(&cands[i]) {
					cands[k], views[k] = cands[i], views[i]
					k++
				}
			}
			cands = cands[:k]
		}
	}
	ps.views, ps.evaluated = views[:len(cands)], true
	refs := sc.refs[:0]
	for i := range cands {
		refs = append(refs, rs.refs[cands[i].idx])
	}
	sc.refs = refs
	return cands, refs, nil
}

// price adds the cost terms' values for c, a candidate of rs, to its cost
// and to its extra (which cost adds back whenever it prices c again). v is
// c's view, current but for its cost; nil: price makes it.
func (s *SelectionService) price(pr *prepared, rs *rankSet, c *candidate, v *Scored, now time.Time) error {
	ps := pr.pol
	if v == nil {
		v = &ps.one
		s.view(v, rs, c, pr, now)
	} else {
		v.Cost = c.cost
	}
	for i := range s.pol.terms {
		t := &s.pol.terms[i]
		x := t.t.Cost(ps.ctx, &ps.req, v)
		if math.IsNaN(x) || math.IsInf(x, 0) {
			return fmt.Errorf("%w: cost term %q priced %s at %v, want a finite number", ErrPolicy, t.name, v.WorkerRank, x)
		}
		c.extra += x
		c.cost += x
		v.Cost = c.cost
	}
	return nil
}

// priceAll is price for every candidate of an evaluation, on the views the
// filters saw when there are filters.
func (s *SelectionService) priceAll(pr *prepared, rs *rankSet, cands []candidate) error {
	ps := pr.pol
	views := ps.views
	if !ps.evaluated || len(views) != len(cands) {
		views = nil
	}
	now := s.now()
	for i := range cands {
		var v *Scored
		if views != nil {
			v = &views[i]
		}
		if err := s.price(pr, rs, &cands[i], v, now); err != nil {
			return err
		}
	}
	return nil
}

// scope returns the workers the (scoped) cost terms may price for pr.
func (s *SelectionService) scope(pr *prepared) []string {
	ps := pr.pol
	ps.scope = ps.scope[:0]
	for i := range s.pol.terms {
		ps.scope = s.pol.terms[i].scope.Scope(ps.ctx, &ps.req, ps.scope)
	}
	return ps.scope
}

// pickWith asks the Picker to choose among pool, the candidates of ev it
// may choose from.
func (s *SelectionService) pickWith(pr *prepared, ev *evaluation, pool []candidate) (int, error) {
	ps := pr.pol
	ps.evaluated = false
	if cap(ps.views) < len(pool) {
		ps.views = make([]Scored, len(pool))
	}
	views := ps.views[:len(pool)]
	ps.views = views
	now := s.now()
	for i := range pool {
		s.view(&views[i], ev.rs, &pool[i], pr, now)
	}
	i := s.pol.picker.Pick(ps.ctx, &ps.req, views)
	if i < 0 || i >= len(pool) {
		return 0, fmt.Errorf("%w: the picker chose candidate %d of %d", ErrPolicy, i, len(pool))
	}
	return i, nil
}

// fullScanFor reports whether the seams keep a decision the sparse decision
// could make on the full scan, and counts it.
func (s *SelectionService) fullScanFor() bool {
	if s.pol == nil || !s.pol.fullScan {
		return false
	}
	s.st.policyFullScans.Add(1)
	return true
}

// filteredStats returns Stats.Filtered.
func (pol *policy) filteredStats() map[string]uint64 {
	if pol == nil || len(pol.filters) == 0 {
		return nil
	}
	m := make(map[string]uint64, len(pol.filters))
	for i := range pol.filters {
		m[pol.filters[i].name] = pol.filters[i].excluded.Load()
	}
	return m
}

// refusedStats returns Stats.ClassifierRefusals.
func (pol *policy) refusedStats() uint64 {
	if pol == nil {
		return 0
	}
	return pol.refused.Load()
}
