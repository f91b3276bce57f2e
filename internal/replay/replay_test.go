package replay

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/internal/trace"
	"github.com/kvselect/kvselect/selection"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func workload(t testing.TB, cfg trace.SharedPrefixConfig) []trace.Request {
	t.Helper()
	reqs, err := trace.SharedPrefix(cfg)
	require.NoError(t, err)
	return reqs
}

// loaded is a shared-prefix workload that keeps 8 workers busy.
func loaded(t testing.TB) []trace.Request {
	return workload(t, trace.SharedPrefixConfig{Groups: 24, PromptsPerGroup: 12, SystemBlocks: 12, QuestionBlocks: 2,
		OutputTokens: 100, Rate: 12, Seed: 3})
}

func fixedNow() time.Time { return time.Unix(0, 0) }

func TestRunInvariantsEveryPolicy(t *testing.T) {
	reqs := loaded(t)
	sum := trace.Summarize(reqs)
	for _, p := range Policies() {
		t.Run(string(p), func(t *testing.T) {
			opts := Options{Workers: 8, CapacityBlocks: 200, Seed: 1, Now: fixedNow}
			res, err := Run(context.Background(), reqs, p, opts)
			require.NoError(t, err)
			require.Equal(t, p, res.Policy)
			require.Equal(t, len(reqs), res.Requests)
			total := 0
			for _, n := range res.PerWorker {
				total += n
			}
			require.Equal(t, len(reqs), total, "every request routed once")
			require.EqualValues(t, sum.Blocks, res.Blocks)
			require.InDelta(t, sum.ReachableHitRate, res.ReachableHitRate, 1e-12)
			require.LessOrEqual(t, res.HitRate, res.ReachableHitRate+1e-12)
			require.GreaterOrEqual(t, res.Imbalance, 1.0)
			require.LessOrEqual(t, res.TTFTP50, res.TTFTP90)
			require.LessOrEqual(t, res.TTFTP90, res.TTFTP99)
			require.Greater(t, res.TTFTP50, time.Duration(0))
			require.GreaterOrEqual(t, res.Makespan, reqs[len(reqs)-1].Arrival)
			require.Zero(t, res.Wall)
			require.GreaterOrEqual(t, res.StoredBlocks, res.EvictedBlocks)
			require.LessOrEqual(t, res.StoredBlocks-res.EvictedBlocks, int64(8*200))
			if p == KVSelect {
				require.Positive(t, res.Events)
			} else {
				require.Zero(t, res.Events)
			}
			again, err := Run(context.Background(), reqs, p, opts)
			require.NoError(t, err)
			require.Equal(t, res, again, "a replay is deterministic")
		})
	}
}

func TestRoundRobinIsBalanced(t *testing.T) {
	reqs := loaded(t) // 288 requests
	res, err := Run(context.Background(), reqs, RoundRobin, Options{Workers: 8, CapacityBlocks: 100})
	require.NoError(t, err)
	require.Equal(t, 1.0, res.Imbalance)
	for _, n := range res.PerWorker {
		require.Equal(t, 36, n)
	}
}

// The index the service builds from the simulated engines' events matches the
// caches exactly: with arrivals far apart (no queueing, so the cache does not
// change between routing and prefill) the router's overlap is the hit, and at
// the end the index's overlap of every request on every worker is the worker's
// cached prefix.
func TestKVSelectIndexMatchesCaches(t *testing.T) {
	for _, decodeKV := range []bool{false, true} {
		t.Run(fmt.Sprint("decode-holds-kv=", decodeKV), func(t *testing.T) { indexMatchesCaches(t, decodeKV) })
	}
}

// indexMatchesCaches: with decodeKV, long generations take cache space while
// they run, and the evictions they cause reach the index too.
func indexMatchesCaches(t *testing.T, decodeKV bool) {
	out := 20
	if decodeKV {
		out = 4 * trace.DefaultBlockSize // 80 s of decode: requests overlap
	}
	reqs := workload(t, trace.SharedPrefixConfig{Groups: 6, PromptsPerGroup: 10, SystemBlocks: 6, QuestionBlocks: 3,
		OutputTokens: out, Seed: 5})
	for i := range reqs {
		reqs[i].Arrival = time.Duration(i) * 10 * time.Second
	}
	ctx := context.Background()
	o, err := Options{Workers: 4, CapacityBlocks: 25, Seed: 9, DecodeHoldsKV: decodeKV, OutputGrowth: decodeKV}.withDefaults()
	require.NoError(t, err)
	s, err := prepare(ctx, reqs, KVSelect, o)
	require.NoError(t, err)
	require.NoError(t, s.run(ctx))
	res := s.result()
	require.Positive(t, res.EvictedBlocks, "the small caches evict")
	require.Equal(t, res.HitRate, res.BelievedHitRate)
	for i := range s.reqs {
		require.Equal(t, s.reqs[i].hit, s.reqs[i].believed)
	}
	k := s.router.(*kvRouter)
	for i := range s.reqs {
		scored, err := k.svcs[0].PotentialLoads(ctx, selection.Request{Tokens: s.reqs[i].tokens})
		require.NoError(t, err)
		scores := make(map[catalog.WorkerRank]selection.Overlap, len(scored))
		for _, x := range scored {
			scores[x.WorkerRank] = x.Overlap
		}
		for w, rank := range k.ranks {
			require.Equal(t, s.workers[w].cache.Prefix(s.reqs[i].keys), scores[rank].Device, "request %d worker %d", i, w)
		}
	}
	st := k.svcs[0].Stats()
	require.EqualValues(t, len(reqs), st.Bookings)
	require.EqualValues(t, len(reqs), st.PrefillCompleted)
	require.EqualValues(t, len(reqs), st.Frees)
	require.Zero(t, st.UnknownReservations)
	require.NoError(t, k.close())
}

func TestKVSelectBeatsBaselines(t *testing.T) {
	reqs := loaded(t)
	opts := Options{Workers: 8, CapacityBlocks: 200, Seed: 1, PrefillTokensPerSecond: 12_000}
	results := map[Policy]Result{}
	for _, p := range []Policy{KVSelect, RoundRobin, LeastLoaded} {
		res, err := Run(context.Background(), reqs, p, opts)
		require.NoError(t, err)
		results[p] = res
		t.Logf("%-14s hit %.3f (reachable %.3f) imbalance %.3f TTFT p90 %v", p, res.HitRate, res.ReachableHitRate, res.Imbalance, res.TTFTP90)
	}
	kv, rr, ll := results[KVSelect], results[RoundRobin], results[LeastLoaded]
	require.Greater(t, kv.HitRate, 1.5*rr.HitRate)
	require.Greater(t, kv.HitRate, 0.7*kv.ReachableHitRate)
	require.Less(t, kv.TTFTP90, rr.TTFTP90)
	require.Less(t, kv.TTFTP90, ll.TTFTP90)
	// 288 requests in groups of 12 over 8 workers: a worker that holds one
	// group more than its share of three is at 1.33; a collapse would be 2+.
	require.LessOrEqual(t, kv.Imbalance, 1.34)
}

// When every request shares its first block, every worker soon holds it, and
// kvselect must keep spreading the load rather than pile onto one worker.
func TestSharedFirstBlockDoesNotCollapse(t *testing.T) {
	reqs := workload(t, trace.SharedPrefixConfig{Groups: 48, PromptsPerGroup: 6, CommonBlocks: 1, SystemBlocks: 8,
		QuestionBlocks: 2, OutputTokens: 100, Rate: 12, Seed: 11})
	for _, p := range []Policy{KVSelect, KVSelectApprox} {
		res, err := Run(context.Background(), reqs, p, Options{Workers: 8, CapacityBlocks: 200, Seed: 1, PrefillTokensPerSecond: 20_000})
		require.NoError(t, err)
		t.Logf("%s: imbalance %.3f per worker %v hit %.3f", p, res.Imbalance, res.PerWorker, res.HitRate)
		require.LessOrEqual(t, res.Imbalance, 1.25, p)
		for _, n := range res.PerWorker {
			require.Positive(t, n)
		}
	}
}

// The time model, by hand: one worker, prefill 512 tokens/s (1 block/s),
// 100 ms per output token after the first, all of it the engine step's fixed
// cost (StepBase defaults to DecodeTokenTime): a step that prefills n tokens
// lasts 100 ms + n/512 s, one that only decodes 100 ms.
func TestTimeModel(t *testing.T) {
	reqs := []trace.Request{
		{Arrival: 0, InputTokens: 1024, OutputTokens: 3, Blocks: []uint64{1, 2}},
		{Arrival: 0, InputTokens: 1024, OutputTokens: 3, Blocks: []uint64{1, 3}},
	}
	base := Options{Workers: 1, CapacityBlocks: 10, PrefillTokensPerSecond: 512, DecodeTokenTime: 100 * time.Millisecond}
	ms := time.Millisecond
	for _, tc := range []struct {
		running        int
		p50, p99, span time.Duration
		hits           int64
	}{
		// One seat: A prefills (2.1 s) and decodes (2 x 100 ms); then B reads
		// the cache, finds block 1 and prefills its one uncached block (1.1
		// s), and decodes.
		{1, 2100 * ms, 3400 * ms, 3600 * ms, 1},
		// Two seats: both are admitted at 0, before A has stored anything, and
		// prefill together in one step (100 ms + 4 s).
		{2, 4100 * ms, 4100 * ms, 4300 * ms, 0},
	} {
		o := base
		o.MaxRunning = tc.running
		for _, p := range []Policy{RoundRobin, KVSelect} {
			res, err := Run(context.Background(), reqs, p, o)
			require.NoError(t, err)
			require.Equal(t, tc.p50, res.TTFTP50, "running %d %s", tc.running, p)
			require.Equal(t, tc.p99, res.TTFTP99)
			require.Equal(t, tc.span, res.Makespan)
			require.Equal(t, tc.hits, res.HitBlocks)
			require.InDelta(t, float64(tc.hits)/4, res.HitRate, 1e-12)
			require.InDelta(t, 0.25, res.ReachableHitRate, 1e-12)
		}
	}
	// Budget, overhead, step base and speed: MaxBatchedTokens 512 splits A's
	// prompt over two steps; B, 300 ms later, is schedulable 50 ms after
	// that and joins the second step; the worker runs at half speed.
	o := base
	o.MaxRunning, o.MaxBatchedTokens, o.RequestOverhead, o.StepBase, o.Speeds = 4, 512, 50*ms, 40*ms, []float64{0.5}
	late := []trace.Request{reqs[0], reqs[1]}
	late[1].Arrival = 300 * ms
	res, err := Run(context.Background(), late, RoundRobin, o)
	require.NoError(t, err)
	// A: ready at 50 ms; step 1 (512 of A) 2 x (40 ms + 1 s) = 2.08 s, to 2.13
	// s; step 2 (A's last 512) 2.08 s, to 4.21 s: A's TTFT 4.21 s. B (ready
	// at 350 ms) waits: the budget is A's. Step 3: A decodes (60 ms a
	// sequence); B reads the cache A has just filled, finds block 1, and
	// takes 511 of its 512 other tokens: 2 x (40 + 60 ms +
	// 998.046875 ms) = 2196.09375 ms, to 6406.09375 ms. Step 4: A decodes, B's
	// last token: 2 x (100 ms + 1.953125 ms) = 203.90625 ms, to 6.61 s: B's
	// first token, TTFT 6.31 s; A is done. Two decode steps for B (2 x 2 x 100
	// ms) end at 7.01 s.
	require.Equal(t, 4210*ms, res.TTFTP50)
	require.Equal(t, 6310*ms, res.TTFTP99)
	require.Equal(t, 7010*ms, res.Makespan)
	require.EqualValues(t, 1, res.HitBlocks, "B was admitted after A stored its blocks")

	// Speedup divides arrivals.
	late = []trace.Request{reqs[0], reqs[1]}
	late[1].Arrival = 10 * time.Second
	res, err = Run(context.Background(), late, RoundRobin, Options{Workers: 1, CapacityBlocks: 10, PrefillTokensPerSecond: 512, DecodeTokenTime: -1, Speedup: 4})
	require.NoError(t, err)
	require.Equal(t, 2500*time.Millisecond+time.Second, res.Makespan)
}

func TestRunErrors(t *testing.T) {
	ctx := context.Background()
	reqs := []trace.Request{{InputTokens: 512, Blocks: []uint64{1}}}
	_, err := Run(ctx, reqs, RoundRobin, Options{})
	require.ErrorIs(t, err, ErrInvalidOptions)
	require.ErrorContains(t, err, "Workers 0")
	require.ErrorContains(t, err, "CapacityBlocks 0")

	_, err = Run(ctx, reqs, RoundRobin, Options{Workers: 1, CapacityBlocks: 1, Speedup: -1, PrefillTokensPerSecond: -2, MaxRunning: -1, BlockSize: -1})
	for _, want := range []string{"Speedup -1", "PrefillTokensPerSecond -2", "MaxRunning -1", "BlockSize -1"} {
		require.ErrorContains(t, err, want)
	}
	thr := 1.0
	cfg := selection.DefaultConfig(1)
	cfg.QueueThreshold = &thr
	cfg.Temperature = -1
	_, err = Run(ctx, reqs, KVSelect, Options{Workers: 1, CapacityBlocks: 1, Selection: &cfg})
	require.ErrorIs(t, err, ErrInvalidOptions)
	require.ErrorContains(t, err, "QueueThreshold")
	require.ErrorContains(t, err, "Temperature")

	_, err = Run(ctx, reqs, KVSelect, Options{Workers: 1, CapacityBlocks: 1, Replicas: -1})
	require.ErrorIs(t, err, ErrInvalidOptions)
	require.ErrorContains(t, err, "Replicas -1")
	_, err = Run(ctx, reqs, LeastLoaded, Options{Workers: 1, CapacityBlocks: 1, Replicas: 3})
	require.ErrorIs(t, err, ErrInvalidOptions)
	require.ErrorContains(t, err, `policy "least-loaded" is one router`)

	_, err = Run(ctx, reqs, "fastest", Options{Workers: 1, CapacityBlocks: 1})
	require.ErrorIs(t, err, ErrInvalidOptions)
	p, err := ParsePolicy("KVSelect-Approx")
	require.NoError(t, err)
	require.Equal(t, KVSelectApprox, p)

	_, err = Run(ctx, []trace.Request{{}}, RoundRobin, Options{Workers: 1, CapacityBlocks: 1})
	require.ErrorIs(t, err, ErrInvalidTrace)
	_, err = Run(ctx, []trace.Request{{InputTokens: 5000, Blocks: []uint64{1}}}, RoundRobin, Options{Workers: 1, CapacityBlocks: 1})
	require.ErrorIs(t, err, ErrInvalidTrace)

	canceled, cancel := context.WithCancel(ctx)
	cancel()
	_, err = Run(canceled, loaded(t), KVSelect, Options{Workers: 2, CapacityBlocks: 10})
	require.ErrorIs(t, err, context.Canceled)

	res, err := Run(ctx, nil, KVSelect, Options{Workers: 2, CapacityBlocks: 10})
	require.NoError(t, err)
	require.Zero(t, res.Requests)
}

func TestExplain(t *testing.T) {
	// Without the in-flight credit, a decision that gave up cached blocks paid
	// for them in the overlap credit.
	cfg := selection.DefaultConfig(1)
	cfg.InFlightHitWeight, cfg.Cost = 0, selection.CostDynamo
	res, err := Run(context.Background(), loaded(t), KVSelect, Options{Workers: 8, CapacityBlocks: 200, Seed: 1, Explain: true, Selection: &cfg})
	require.NoError(t, err)
	e := res.Explain
	require.NotNil(t, e)
	require.Equal(t, res.Requests, e.Decisions)
	if e.Missed > 0 {
		require.Positive(t, e.MissedBlocks)
		require.Positive(t, e.OverlapCredit)
		require.LessOrEqual(t, e.PrefillLoad+e.OverlapCredit+e.ActiveBlocks+e.NewBlocks+e.ActiveRequests, 1e-9)
	}
	res, err = Run(context.Background(), loaded(t), RoundRobin, Options{Workers: 8, CapacityBlocks: 200, Explain: true})
	require.NoError(t, err)
	require.Nil(t, res.Explain)
}

// sharedTracePath finds the public Mooncake synthetic trace (see the trace
// package's tests); the test skips when it is absent.
func sharedTracePath(t testing.TB) string {
	if p := os.Getenv("KVSELECT_MOONCAKE_TRACE"); p != "" {
		return p
	}
	p := filepath.Join("..", "..", "..", "shared", "data", "mooncake_synthetic_trace.jsonl")
	if _, err := os.Stat(p); err != nil {
		t.Skip("Mooncake synthetic trace not found; set KVSELECT_MOONCAKE_TRACE to run")
	}
	return p
}

// The full synthetic Mooncake trace, 8 workers x 10,000 blocks: numbers are
// logged; the assertions are the targets the default configuration meets.
func TestMooncakeSyntheticReplay(t *testing.T) {
	if testing.Short() {
		t.Skip("full trace replay")
	}
	reqs, err := trace.ReadFile(sharedTracePath(t), trace.ReaderOptions{})
	require.NoError(t, err)
	results := map[Policy]Result{}
	for _, p := range []Policy{KVSelect, RoundRobin, LeastLoaded} {
		res, err := Run(context.Background(), reqs, p, Options{Workers: 8, CapacityBlocks: 10_000, Seed: 1})
		require.NoError(t, err)
		results[p] = res
		t.Logf("%-14s hit %.3f reachable %.3f imbalance %.3f TTFT p90 %v wall %v", p, res.HitRate, res.ReachableHitRate,
			res.Imbalance, res.TTFTP90, res.Wall)
		require.Less(t, res.Wall, 60*time.Second)
	}
	kv, rr, ll := results[KVSelect], results[RoundRobin], results[LeastLoaded]
	require.Greater(t, kv.HitRate, 2*rr.HitRate)
	require.Less(t, kv.TTFTP90, rr.TTFTP90)
	require.Less(t, kv.TTFTP90, ll.TTFTP90)
}

// replicated is the command's default synthetic workload at 12 req/s, which
// keeps 8 workers busy enough for replicas to collide: `go run ./examples/replay
// --rate 12 --replicas 1,3 --no-sync` replays the same trace.
func replicated(t testing.TB) []trace.Request {
	return workload(t, trace.SharedPrefixConfig{Groups: 64, PromptsPerGroup: 16, SystemBlocks: 16, QuestionBlocks: 2,
		OutputTokens: 200, Rate: 12, Seed: 1})
}

// Three replicas that share their bookings route as one router does; three
// that do not pile onto the same workers (kvselect: tail TTFT) and, without
// KV events, miss each other's prefixes (kvselect-approx: hit rate).
func TestReplicasWithSyncMatchOneRouter(t *testing.T) {
	reqs := replicated(t)
	ctx := context.Background()
	for _, p := range []Policy{KVSelect, KVSelectApprox} {
		t.Run(string(p), func(t *testing.T) {
			opts := Options{Workers: 8, CapacityBlocks: 10_000, Seed: 1, Now: fixedNow}
			one, err := Run(ctx, reqs, p, opts)
			require.NoError(t, err)
			opts.Replicas = 3
			synced, err := Run(ctx, reqs, p, opts)
			require.NoError(t, err)
			opts.NoSync = true
			apart, err := Run(ctx, reqs, p, opts)
			require.NoError(t, err)
			for _, c := range []struct {
				name string
				r    Result
			}{{"R=1", one}, {"R=3 sync 5ms", synced}, {"R=3 no sync", apart}} {
				t.Logf("%-13s hit %.4f TTFT p90 %v p99 %v imbalance %.3f remote bookings %d", c.name, c.r.HitRate,
					c.r.TTFTP90.Round(time.Millisecond), c.r.TTFTP99.Round(time.Millisecond), c.r.Imbalance, c.r.RemoteBookings)
			}
			require.Equal(t, 1, one.Replicas)
			require.Equal(t, 3, synced.Replicas)
			require.EqualValues(t, 2*len(reqs), synced.RemoteBookings, "every booking reaches both peers")
			require.Zero(t, apart.RemoteBookings)

			require.InEpsilon(t, one.HitRate, synced.HitRate, 0.03, "hit rate")
			// p90 sits between the cached and the uncached requests' TTFTs and
			// jumps with a few of them; what sync must prevent is a worse one.
			require.LessOrEqual(t, synced.TTFTP90.Seconds(), 1.03*one.TTFTP90.Seconds(), "TTFT p90")
			if p == KVSelectApprox {
				// Its index is its own bookings: apart, each replica knows a
				// third of the prefixes.
				require.Less(t, apart.HitRate, 0.95*one.HitRate)
				require.Greater(t, apart.TTFTP90, one.TTFTP90*13/10)
			} else {
				// Every replica sees every engine's events, so the prefixes are
				// known to all; what each misses is the others' load. (Each
				// still balances its own third of the arrivals, so the
				// request counts can stay even while the queues are not.)
				require.Greater(t, apart.TTFTP99, one.TTFTP99*13/10)
				require.Greater(t, apart.TTFTP90, one.TTFTP90*13/10)
			}

			again, err := Run(ctx, reqs, p, opts)
			require.NoError(t, err)
			require.Equal(t, apart, again, "a replicated replay is deterministic")
		})
	}
}

// A booking and each of its settling calls reach the other replica exactly
// SyncDelay later in simulated time; with NoSync, never.
func TestReplicaSyncDelay(t *testing.T) {
	reqs := []trace.Request{{Arrival: 0, InputTokens: 1024, OutputTokens: 3, Blocks: []uint64{1, 2}}}
	ctx := context.Background()
	for _, noSync := range []bool{false, true} {
		o, err := Options{Workers: 2, CapacityBlocks: 10, PrefillTokensPerSecond: 512, DecodeTokenTime: 100 * time.Millisecond,
			Replicas: 2, SyncDelay: 10 * time.Millisecond, NoSync: noSync}.withDefaults()
		require.NoError(t, err)
		s, err := prepare(ctx, reqs, KVSelect, o)
		require.NoError(t, err)
		k := s.router.(*kvRouter)
		type step struct {
			at   time.Duration
			same bool // replica 1's loads equal replica 0's
		}
		var got []step
		var lastOwn, lastPeer any
		for s.events.Len() > 0 {
			require.NoError(t, s.step(ctx))
			own, peer := k.svcs[0].Loads(""), k.svcs[1].Loads("")
			for i := range own { // each replica times its arrivals as it hears them
				own[i].RecentBookings = 0
			}
			for i := range peer {
				peer[i].RecentBookings = 0
			}
			// The engine's own steps (a decode, the next step's start) change
			// no booking: only the events that do are listed.
			if !reflect.DeepEqual(own, lastOwn) || !reflect.DeepEqual(peer, lastPeer) {
				got = append(got, step{s.now, reflect.DeepEqual(own, peer)})
			}
			lastOwn, lastPeer = own, peer
			if noSync {
				for _, l := range peer {
					require.Zero(t, l.ActiveRequests)
				}
			}
		}
		ms := time.Millisecond
		want := []step{
			{0, false}, {10 * ms, true}, // booked (2.1 s prefill: a 100 ms step plus 2 s of tokens), then heard of
			{2100 * ms, false}, {2110 * ms, true}, // prefilled (two 100 ms decode steps)
			{2300 * ms, false}, {2310 * ms, true}, // freed
		}
		if noSync {
			want = []step{{0, false}, {2100 * ms, false}, {2300 * ms, true}} // the peer never carried it
		}
		require.Equal(t, want, got, "no sync %v", noSync)
		require.NoError(t, k.close())
	}
}

// With output growth, every booking grows by one block per BlockSize output
// tokens while it decodes, on the booking replica and on its peers; the
// replay stays deterministic.
func TestOutputGrowth(t *testing.T) {
	reqs := workload(t, trace.SharedPrefixConfig{Groups: 16, PromptsPerGroup: 8, SystemBlocks: 8, QuestionBlocks: 2,
		OutputTokens: 4 * trace.DefaultBlockSize, Rate: 12, Seed: 2})
	ctx := context.Background()
	opts := Options{Workers: 8, CapacityBlocks: 10_000, Seed: 1, Now: fixedNow, OutputGrowth: true}
	res, err := Run(ctx, reqs, KVSelect, opts)
	require.NoError(t, err)
	var want int64
	for _, r := range reqs {
		for k := trace.DefaultBlockSize; k < r.OutputTokens; k += trace.DefaultBlockSize {
			want++
		}
	}
	require.Positive(t, want)
	require.Equal(t, want, res.OutputBlocks)
	opts.Replicas = 3
	rep, err := Run(ctx, reqs, KVSelect, opts)
	require.NoError(t, err, "a peer applies the growth of a booking it holds")
	require.Equal(t, want, rep.OutputBlocks)
	again, err := Run(ctx, reqs, KVSelect, opts)
	require.NoError(t, err)
	require.Equal(t, rep, again)
	opts.OutputGrowth, opts.Replicas = false, 1
	flat, err := Run(ctx, reqs, KVSelect, opts)
	require.NoError(t, err)
	require.Zero(t, flat.OutputBlocks)
	t.Logf("output growth: hit %.4f TTFT p90 %v; without: hit %.4f TTFT p90 %v", res.HitRate, res.TTFTP90, flat.HitRate, flat.TTFTP90)
}

// TestDecisionTimes: a replay reports the distribution of its decision times,
// measured on the wall clock it is given: on a fleet of 256 workers (where
// kvselect takes its sparse decision), ordered percentiles within the wall
// time; on a clock that stands still, zero.
func TestDecisionTimes(t *testing.T) {
	reqs := loaded(t)
	for _, p := range []Policy{KVSelect, RoundRobin} {
		res, err := Run(context.Background(), reqs, p, Options{Workers: 256, CapacityBlocks: 200, Seed: 1})
		require.NoError(t, err)
		d := res.Decision
		require.Positive(t, d.P50, p)
		require.LessOrEqual(t, d.P50, d.P90, p)
		require.LessOrEqual(t, d.P90, d.P99, p)
		require.LessOrEqual(t, d.P99, d.Max, p)
		require.LessOrEqual(t, d.Max, res.Wall, p)
	}
	res, err := Run(context.Background(), reqs, KVSelect, Options{Workers: 8, CapacityBlocks: 200, Seed: 1, Now: fixedNow})
	require.NoError(t, err)
	require.Zero(t, res.Decision)
}

// Explain splits Dynamo's cost into its terms; the predictive cost has none,
// so it is refused.
func TestExplainRefusesThePredictiveCost(t *testing.T) {
	cfg := selection.DefaultConfig(1)
	cfg.Cost = selection.CostPredictive
	reqs := []trace.Request{{InputTokens: 512, OutputTokens: 1, Blocks: []uint64{1}}}
	_, err := Run(context.Background(), reqs, KVSelect, Options{Workers: 2, CapacityBlocks: 8, Selection: &cfg, Explain: true})
	require.ErrorIs(t, err, ErrInvalidOptions)
	require.ErrorContains(t, err, "Explain")
}

// Three replicas that hold a burst's requests (Options.Hold) decide a burst
// of same-instant arrivals in turn, as one router does: on RAG traffic in
// batches of ten their TTFT p90 stays within 10% of one router's, below
// what pricing the peers' likely bookings gives, itself below deciding
// blind.
func TestReplicasHoldBursts(t *testing.T) {
	for _, w := range []trace.Workload{trace.WorkloadRAG, trace.WorkloadMultiTurn} {
		t.Run(string(w), func(t *testing.T) {
			reqs, err := trace.Generate(w, trace.WorkloadConfig{Requests: 1024, Rate: 8, BlockSize: 512, OutputTokens: 200, Seed: 1})
			require.NoError(t, err)
			trace.BatchArrivals(reqs, 10)
			ctx := context.Background()
			opts := Options{Workers: 8, CapacityBlocks: 10_000, Seed: 1, Now: fixedNow}
			run := func(replicas int, noSpread, hold bool) Result {
				o := opts
				o.Replicas, o.NoSpread, o.Hold = replicas, noSpread, hold
				r, err := Run(ctx, reqs, KVSelect, o)
				require.NoError(t, err)
				return r
			}
			one, blind, spread, held := run(1, false, false), run(3, true, false), run(3, false, false), run(3, false, true)
			t.Logf("TTFT p90: one router %v; three blind %v, pricing their peers %v, holding %v", one.TTFTP90.Round(time.Millisecond),
				blind.TTFTP90.Round(time.Millisecond), spread.TTFTP90.Round(time.Millisecond), held.TTFTP90.Round(time.Millisecond))
			require.LessOrEqual(t, held.TTFTP90.Seconds(), 1.10*one.TTFTP90.Seconds())
			require.Less(t, held.TTFTP90, spread.TTFTP90)
			require.Less(t, spread.TTFTP90, blind.TTFTP90)
			require.InEpsilon(t, one.HitRate, held.HitRate, 0.03, "hit rate")
		})
	}
}
