package selection

import "slices"

// fallbacks returns up to pr.fallback ranks of ev on distinct endpoints other
// than chosen, those not busy first, then by cost (recomputed: pick may have
// reused the costs as weights).
func (s *SelectionService) fallbacks(ev *evaluation, pr *prepared, chosen string) []Fallback {
	type ranked struct {
		i    int
		busy bool
		cost float64
	}
	all := make([]ranked, 0, len(ev.cands))
	for i := range ev.cands {
		c := &ev.cands[i]
		if ev.rs.ranks[c.idx].endpoint == chosen {
			continue
		}
		all = append(all, ranked{i: i, busy: s.busy(c), cost: cost(c, &ev.in, &pr.w)})
	}
	slices.SortStableFunc(all, func(a, b ranked) int {
		switch {
		case a.busy != b.busy:
			if a.busy {
				return 1
			}
			return -1
		case a.cost < b.cost:
			return -1
		case a.cost > b.cost:
			return 1
		}
		return 0
	})
	out := make([]Fallback, 0, pr.fallback)
	for _, x := range all {
		if len(out) == pr.fallback {
			break
		}
		r := ev.rs.ranks[ev.cands[x.i].idx]
		if slices.ContainsFunc(out, func(f Fallback) bool { return f.Endpoint == r.endpoint }) {
			continue
		}
		out = append(out, Fallback{WorkerRank: r.key, Endpoint: r.endpoint, Cost: x.cost})
	}
	return out
}
