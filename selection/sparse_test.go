package selection

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/kvindex"
	"github.com/kvselect/kvselect/reservation"
)

// TestSparseMatchesFullScan is the sparse decision's model test: under random
// weights, fleets, cached prefixes, loads (bookings, prefill completions,
// output blocks, moves, frees), sessions and ejections, the sparse decision
// and the full scan find the same cheapest cost, the same set of tied ranks,
// the same margin and the same pin, and the sparse decision's pick is one of
// the ties, with the full scan's figures.
func TestSparseMatchesFullScan(t *testing.T) {
	for seed := range uint64(40) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) { checkSparseModel(t, seed, 60) })
	}
}

// FuzzSparseMatchesFullScan is the model test from any seed.
func FuzzSparseMatchesFullScan(f *testing.F) {
	f.Add(uint64(1))
	f.Add(uint64(77))
	f.Fuzz(func(t *testing.T, seed uint64) { checkSparseModel(t, seed, 30) })
}

func checkSparseModel(t *testing.T, seed uint64, steps int) {
	checkSparseModelWith(t, seed, steps, nil)
}

// checkSparseModelWith is checkSparseModel on a service whose builder seams
// edits (when set); it returns the service.
func checkSparseModelWith(t *testing.T, seed uint64, steps int, seams func(*SelectionServiceBuilder)) *SelectionService {
	r := rand.New(rand.NewPCG(seed, 21))
	const bs = 16
	cfg := DefaultConfig(bs)
	cfg.Cost = CostDynamo // the sparse decision's cost (CostAuto would predict on these few ranks)
	pickF := func(vs ...float64) float64 { return vs[r.IntN(len(vs))] }
	cfg.OverlapScoreCredit = pickF(0, 1, 4)
	cfg.PrefillLoadScale = pickF(0, 1, 2.5, 0.3)
	cfg.DecodeActiveRequestWeight = pickF(0, 1, 0.5, 3)
	cfg.HostCacheHitWeight = pickF(0, 0.5)
	cfg.InFlightHitWeight = pickF(0, 1, 0.7)
	cfg.TrackPrefillTokens = r.IntN(4) != 0
	cfg.AssumeKVReuse = r.IntN(4) != 0
	cfg.Sessions.Mode = []SessionMode{SessionSoft, SessionHard, SessionOff}[r.IntN(3)]
	cfg.Sessions.SoftSlack = pickF(0, 0.5, 2)
	now := time.Unix(1_000_000, 0)
	clock := func() time.Time { return now }
	rec := &marginRecorder{}
	b := NewSelectionServiceBuilder(cfg).ExternalEvents().SweepInterval(-1).Rand(rand.NewPCG(seed, 1)).Clock(clock)
	if r.IntN(2) == 0 {
		b = b.Recorder(rec) // detail: margins
	}
	if seams != nil {
		seams(b)
	}
	s, err := b.Build(context.Background())
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	s.scan = scanSparse

	// A few prompt families sharing prefixes, so that ranks hold and book
	// parts of each other's prompts.
	roots := make([][]uint32, 1+r.IntN(4))
	for i := range roots {
		roots[i] = make([]uint32, bs*(1+r.IntN(6)))
		for j := range roots[i] {
			roots[i][j] = uint32(r.IntN(50))
		}
	}
	prompt := func() []uint32 {
		p := slices.Clone(roots[r.IntN(len(roots))])
		p = p[:bs*(1+r.IntN(len(p)/bs))]
		for range r.IntN(3 * bs) {
			p = append(p, uint32(r.IntN(3)))
		}
		return p
	}
	hasher, _ := kvindex.NewHasher(bs, kvindex.HashOptions{})
	var ranks []catalog.WorkerRank
	workers := 1 + r.IntN(14)
	for w := range workers {
		id := fmt.Sprintf("w%d", w)
		dp := 1 + r.IntN(3)
		_, err := s.Workers().Upsert(catalog.Worker{ID: id, Endpoint: fmt.Sprintf("10.0.0.%d:80", w+1), DPSize: dp, BlockSize: bs})
		require.NoError(t, err)
		for k := range dp {
			ranks = append(ranks, catalog.WorkerRank{WorkerID: id, Rank: k})
		}
	}
	var engine uint64
	store := func(wr catalog.WorkerRank, toks []uint32) {
		n := len(toks) / bs
		if n == 0 {
			return
		}
		hs := make([]uint64, n)
		for i := range hs {
			engine++
			hs[i] = engine
		}
		require.NoError(t, s.Events().Apply(wr, kvindex.Event{Kind: kvindex.EventStored, BlockHashes: hs, Tokens: toks[:n*bs]}))
	}
	for range r.IntN(2 * len(ranks)) {
		store(ranks[r.IntN(len(ranks))], prompt())
	}
	var live []string
	var sessions []string
	for i := range 4 {
		sessions = append(sessions, fmt.Sprintf("s%d", i))
	}
	nextID := 0
	for step := range steps {
		switch op := r.IntN(10); {
		case op < 4: // a booking on a random rank, some of it shared
			toks := prompt()
			seqs := hasher.AppendSeqHashes(nil, toks)
			nextID++
			id := fmt.Sprintf("b%d", nextID)
			require.NoError(t, s.ledger.Book(reservation.Booking{
				ID: reservation.ID(id), Worker: ranks[r.IntN(len(ranks))], SeqHashes: seqs, PrivateBlocks: r.IntN(3),
				PrefillTokens: r.IntN(4) * bs,
			}))
			live = append(live, id)
		case op == 4 && len(live) > 0:
			j := r.IntN(len(live))
			require.NoError(t, s.ledger.Free(reservation.ID(live[j])))
			live = slices.Delete(live, j, j+1)
		case op == 5 && len(live) > 0:
			_ = s.ledger.PrefillComplete(reservation.ID(live[r.IntN(len(live))]))
		case op == 6 && len(live) > 0:
			require.NoError(t, s.ledger.AddOutputBlocks(reservation.ID(live[r.IntN(len(live))]), 1+r.IntN(2)))
		case op == 7 && len(live) > 0:
			_, err := s.ledger.Move(reservation.ID(live[r.IntN(len(live))]), ranks[r.IntN(len(ranks))])
			require.NoError(t, err)
		case op == 8:
			if r.IntN(2) == 0 {
				require.NoError(t, s.Workers().MarkFailed(ranks[r.IntN(len(ranks))].WorkerID))
			} else {
				now = now.Add(cfg.FailureEjection / 2) // some ejections end
			}
		default:
			store(ranks[r.IntN(len(ranks))], prompt())
		}
		p := s.partition(catalog.DefaultModel)
		if r.IntN(3) == 0 {
			p.sessions.put(sessions[r.IntN(len(sessions))], ranks[r.IntN(len(ranks))], now.UnixNano())
		}
		req := Request{Tokens: prompt()}
		if r.IntN(3) == 0 {
			req.SessionID = sessions[r.IntN(len(sessions))]
		}
		compareSparse(t, s, p, &req, fmt.Sprintf("step %d", step))
	}
	return s
}

// compareSparse decides req both ways, without booking, and compares.
func compareSparse(t *testing.T, s *SelectionService, p *partition, req *Request, msg string) {
	t.Helper()
	ps, err := s.pol.begin(context.Background(), req, false)
	require.NoError(t, err)
	defer s.pol.end(ps)
	pr, err := s.prepare(req)
	require.NoError(t, err)
	defer pr.release()
	pr.pol = ps
	if pr.session != "" {
		pr.pin, pr.pinned = p.sessions.get(pr.session, s.now().UnixNano())
	}
	require.True(t, s.sparseOK(pr, p.ranksOf(), 0), msg)
	matches := p.matches(nil, pr.seqs)
	full, sparse := new(evalScratch), new(evalScratch)
	for _, sc := range []*evalScratch{full, sparse} {
		sc.matches = matches
		sc.resolve(p.ranksOf())
	}
	ev, err := s.evaluate(p, pr, full)
	var fullExcluded []uint64 // what the filters excluded, as Stats.Filtered counts it
	if ps != nil {
		fullExcluded = slices.Clone(ps.excluded)
	}
	if err != nil {
		// Only a filter refuses here: the sparse decision refuses the
		// same way, having counted the same exclusions.
		require.Equal(t, RefusedFiltered, strings.Split(RefusalReason(err), ":")[0], "%s: %v", msg, err)
		_, _, _, ok, serr := s.decideSparse(p, pr, sparse)
		if ok {
			require.Error(t, serr, msg)
			require.Equal(t, err.Error(), serr.Error(), msg)
			require.Equal(t, RefusalReason(err), RefusalReason(serr), msg)
			require.Equal(t, fullExcluded, ps.excluded, msg)
		}
		return
	}
	fc, fpinned, err := s.choose(p, pr, ev)
	require.NoError(t, err, msg)
	fmargin := ev.margin
	best := math.Inf(1)
	for _, c := range ev.cands {
		best = min(best, c.cost)
	}
	var fullTies []int
	byIdx := map[int]candidate{}
	for _, c := range ev.cands {
		byIdx[c.idx] = c
		if c.cost == best {
			fullTies = append(fullTies, c.idx)
		}
	}

	sev, sc, spinned, ok, err := s.decideSparse(p, pr, sparse)
	require.NoError(t, err, msg)
	if !ok {
		return // a request the sparse decision hands back (a repeated hash with the in-flight credit, ejection yielding)
	}
	if ps != nil {
		require.Equal(t, fullExcluded, ps.excluded, msg)
	}
	require.Equal(t, len(ev.cands), sev.candidates, msg)
	require.Equal(t, ev.bestOverlap, sev.bestOverlap, msg)
	require.Equal(t, fpinned, spinned, msg)
	if fpinned {
		require.Equal(t, fc.idx, sc.idx, msg)
	}
	// The sparse decision's ties: touched ranks at the best cost, and the
	// eligible members of the cheapest groups.
	var sparseTies []int
	for _, c := range sev.cands {
		require.Equal(t, byIdx[c.idx].cost, c.cost, "%s: touched rank %d", msg, c.idx)
		if c.cost == best {
			sparseTies = append(sparseTies, c.idx)
		}
	}
	o := p.ranksOf().order
	for _, tier := range sparse.sparse.tiers {
		if tier.cost != best {
			require.Greater(t, tier.cost, best, msg)
			continue
		}
		for _, i := range tier.g.members {
			if o.xmark[i] != o.epoch {
				sparseTies = append(sparseTies, int(i))
			}
		}
	}
	slices.Sort(sparseTies)
	require.Equal(t, fullTies, sparseTies, msg)
	want := byIdx[sc.idx]
	require.Contains(t, byIdx, sc.idx, msg)
	require.Equal(t, want.cost, sc.cost, msg)
	require.Equal(t, want.activePrefill, sc.activePrefill, msg)
	require.Equal(t, want.activeBlocks, sc.activeBlocks, msg)
	require.Equal(t, want.activeRequests, sc.activeRequests, msg)
	require.Equal(t, want.newBlocks, sc.newBlocks, msg)
	require.Equal(t, want.device, sc.device, msg)
	require.Equal(t, want.stamp, sc.stamp, msg)
	if !fpinned {
		require.Contains(t, fullTies, sc.idx, msg)
	}
	require.Equal(t, fmargin, sev.margin, msg)
}

// marginRecorder turns Decision.Margin on.
type marginRecorder struct{ nopRecorder }

// TestSparseTiesUniform: on an idle fleet, where every rank ties, the sparse
// decision picks each rank that is not ejected about equally often (one group
// of 12 ranks, two of them ejected).
func TestSparseTiesUniform(t *testing.T) {
	cfg := DefaultConfig(16)
	cfg.Cost = CostDynamo // the sparse decision's cost
	s, err := NewSelectionServiceBuilder(cfg).ExternalEvents().SweepInterval(-1).Rand(rand.NewPCG(9, 9)).Build(context.Background())
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	s.scan = scanSparse
	for w := range 12 {
		_, err := s.Workers().Upsert(catalog.Worker{ID: fmt.Sprintf("w%d", w), Endpoint: fmt.Sprintf("10.0.0.%d:80", w+1), DPSize: 1, BlockSize: 16})
		require.NoError(t, err)
	}
	require.NoError(t, s.Workers().MarkFailed("w3"))
	require.NoError(t, s.Workers().MarkFailed("w7"))
	toks := make([]uint32, 64)
	for i := range toks {
		toks[i] = uint32(i)
	}
	counts := map[string]int{}
	const n = 10000
	for range n {
		res, err := s.Select(context.Background(), Request{Tokens: toks})
		require.NoError(t, err)
		counts[res.WorkerID]++
	}
	require.Len(t, counts, 10)
	require.NotContains(t, counts, "w3")
	require.NotContains(t, counts, "w7")
	for w, c := range counts {
		require.InDelta(t, n/10, c, 150, w) // about 5 standard deviations
	}
}

// TestSparseConcurrent books and frees from several goroutines at once on a
// fleet where the sparse decision runs (160 ranks), with output blocks on the
// way; afterwards the ledger is idle and the cost order
// agrees with it: every rank in the one group of the idle load point.
func TestSparseConcurrent(t *testing.T) {
	s, err := NewSelectionServiceBuilder(DefaultConfig(16)).ExternalEvents().SweepInterval(-1).Rand(rand.NewPCG(5, 5)).Build(context.Background())
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	for w := range 20 {
		_, err := s.Workers().Upsert(catalog.Worker{ID: fmt.Sprintf("w%d", w), Endpoint: fmt.Sprintf("10.0.0.%d:80", w+1), DPSize: 8, BlockSize: 16})
		require.NoError(t, err)
	}
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Go(func() {
			r := rand.New(rand.NewPCG(uint64(g), 2))
			var held []string
			for i := range 300 {
				toks := make([]uint32, 16*(1+r.IntN(8)))
				for j := range toks {
					toks[j] = uint32(r.IntN(4))
				}
				res, err := s.SelectAndReserve(context.Background(), Request{ReservationID: reservation.ID(fmt.Sprintf("g%d-%d", g, i)), Tokens: toks})
				if !assert.NoError(t, err) {
					return
				}
				held = append(held, string(res.ReservationID))
				if r.IntN(3) == 0 {
					assert.NoError(t, s.Reservations().AddOutputBlocks(res.ReservationID, 1))
				}
				for len(held) > r.IntN(4) {
					assert.NoError(t, s.Reservations().Free(reservation.ID(held[0])))
					held = held[1:]
				}
			}
			for _, id := range held {
				assert.NoError(t, s.Reservations().Free(reservation.ID(id)))
			}
		})
	}
	wg.Wait()
	require.Zero(t, s.Stats().Ledger.Active)
	o := s.partition(catalog.DefaultModel).ranksOf().order
	o.mu.Lock()
	defer o.mu.Unlock()
	require.Equal(t, 1, o.tree.Len())
	g, _ := o.tree.Min()
	require.Equal(t, loadPoint{}, g.pt)
	require.Len(t, g.members, 160)
	require.Equal(t, uint64(1200), s.Stats().Bookings)
}
