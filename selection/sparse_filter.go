package selection

import (
	"context"
	"fmt"
)

// ScopedFilter is a Filter that names, for each request, the workers its
// verdict is confined to, so that the sparse decision stays exact with it.
// Either the filter may admit only the workers it names and refuses every
// other (AdmitsOnly: the workers holding a LoRA adapter, a tenant's pool),
// or it may refuse only the workers it names and admits every other
// (RefusesOnly: a few tainted or cordoned workers). The sparse decision
// evaluates the named workers' ranks one by one, as it does the ranks the
// request's prefix touches, and applies the filter to them; the other ranks
// keep their place in its order (RefusesOnly) or are all left out
// (AdmitsOnly). A scope should be small: a filter that names most of the
// fleet costs about a full scan, scoped or not.
//
// Admit must agree with the scope: a verdict outside it (a worker admitted
// outside an AdmitsOnly scope, refused outside a RefusesOnly one) makes
// the sparse decision and the full scan disagree.
type ScopedFilter interface {
	Filter
	// Scope appends to dst the ids of the workers the filter's verdict on
	// req is confined to and returns the extended slice, with what they
	// are: AdmitsOnly or RefusesOnly. A filter with nothing to say about
	// req returns dst and RefusesOnly.
	Scope(ctx context.Context, req *Request, dst []string) ([]string, FilterScope)
}

// FilterScope is what the workers a ScopedFilter names are.
type FilterScope uint8

const (
	// RefusesOnly: the filter may refuse only the workers named; it admits
	// every other.
	RefusesOnly FilterScope = iota
	// AdmitsOnly: the filter may admit only the workers named; it refuses
	// every other.
	AdmitsOnly
)

// String returns "refuses-only" or "admits-only".
func (f FilterScope) String() string {
	if f == AdmitsOnly {
		return "admits-only"
	}
	return "refuses-only"
}

// filterScratch is the sparse decision's working memory for the filters (in
// sparseScratch).
type filterScratch struct {
	ids   []string      // every filter's scope, one after the other
	modes []FilterScope // per filter, what its scope is
}

// filterScopes asks every filter (all scoped: sparseOK) for its scope on
// pr's request, and calls add for each rank of the workers they name.
func (s *SelectionService) filterScopes(pr *prepared, rs *rankSet, fs *filterScratch, add func(int32)) {
	ps := pr.pol
	fs.ids, fs.modes = fs.ids[:0], fs.modes[:0]
	for i := range s.pol.filters {
		var mode FilterScope
		fs.ids, mode = s.pol.filters[i].scope.Scope(ps.ctx, &ps.req, fs.ids)
		fs.modes = append(fs.modes, mode)
	}
	for _, id := range fs.ids {
		for _, i := range rs.byWorker[id] {
			add(i)
		}
	}
}

// filterSparse is applyFilters for the sparse decision. cands are the
// touched ranks (with the ranks of the filters' scopes and of the ejected
// workers among them, see filterScopes), their loads and overlaps set; cold
// is the number of the other ranks, which every filter admits or, from
// the first AdmitsOnly one on, refuses. It runs the filters over cands in
// order, as the full scan does over every rank, counts each one's
// exclusions as the full scan would, and returns the candidates kept, in
// their order, and how many cold ranks are. Then it leaves out the kept
// ranks of ejected workers (ejected, in force at nowNanos), reporting
// yield when they are all that is left: ejection yields then, and the full
// scan says how. ps.views holds the kept candidates' views, cost aside.
// When a filter keeps none, it returns the refusal that names it.
func (s *SelectionService) filterSparse(pr *prepared, rs *rankSet, fs *filterScratch, cands []candidate, cold int, ejected map[string]int64, nowNanos int64) (kept []candidate, coldKept int, yield bool, err error) {
	ps := pr.pol
	n := len(cands)
	views := s.viewsOf(pr, rs, cands)
	for fi := range s.pol.filters {
		f := &s.pol.filters[fi]
		before, k := n+cold, 0
		for i := range n {
			if !f.f.Admit(ps.ctx, &ps.req, &views[i]) {
				continue
			}
			if k != i {
				cands[k], views[k] = cands[i], views[i]
			}
			k++
		}
		if fs.modes[fi] == AdmitsOnly {
			cold = 0
		}
		n = k
		ps.excluded[fi] = uint64(before - n - cold)
		if n+cold == 0 {
			for j := fi + 1; j < len(ps.excluded); j++ {
				ps.excluded[j] = 0
			}
			return nil, 0, false, &refusal{f.reason, fmt.Errorf("%w: filter %q excluded all %d candidates of model %q", ErrNoEndpoints, f.name, before, pr.model)}
		}
	}
	cands = cands[:n]
	if ejected != nil {
		k := 0
		for i := range cands {
			if until, ok := ejected[rs.ranks[cands[i].idx].key.WorkerID]; ok && until > nowNanos {
				continue
			}
			if k != i {
				cands[k], views[k] = cands[i], views[i]
			}
			k++
		}
		if k == 0 && cold == 0 {
			return nil, 0, true, nil
		}
		cands = cands[:k]
	}
	ps.views = views[:len(cands)]
	return cands, cold, false, nil
}
