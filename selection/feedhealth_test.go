package selection

import (
	"context"
	"fmt"
	"log/slog"
	"math"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/internal/fakeengine"
	"github.com/kvselect/kvselect/internal/logtest"
)

// syncBuffer is a log sink safe for concurrent writes and the test's reads.
type syncBuffer = logtest.Buffer

// feedRig is a service with real fake engines over loopback ZeroMQ, whose feed
// checks the test drives itself (checkFeeds on the test clock).
type feedRig struct {
	t       *testing.T
	s       *SelectionService
	clk     *fakeClock
	logs    *syncBuffer
	engines map[string]*fakeengine.Engine
}

const rigBlock = 4

func newFeedRig(t *testing.T, trust FeedTrust, ids ...string) *feedRig {
	t.Helper()
	return newFeedRigBlocks(t, trust, rigBlock, ids...)
}

// newFeedRigBlocks is newFeedRig with engines whose real block size is
// engineBlock (the workers are still registered with the router's).
func newFeedRigBlocks(t *testing.T, trust FeedTrust, engineBlock int, ids ...string) *feedRig {
	t.Helper()
	cfg := DefaultConfig(rigBlock)
	// The rig books on one worker at a time to test its feed; the balance
	// term would then send the next request elsewhere.
	cfg.Predictive.BalanceWeight = 0
	trust.CheckInterval = time.Hour // the test calls checkFeeds
	cfg.FeedTrust = trust
	r := &feedRig{t: t, clk: newFakeClock(), logs: &syncBuffer{}, engines: map[string]*fakeengine.Engine{}}
	s, err := NewSelectionServiceBuilder(cfg).Clock(r.clk.Now).Rand(rand.NewPCG(5, 5)).SweepInterval(-1).
		Logger(slog.New(slog.NewTextHandler(r.logs, nil))).
		EventFeed(FeedOptions{ReconnectMin: time.Millisecond, ReconnectMax: 10 * time.Millisecond}).Build(context.Background())
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	r.s = s
	for i, id := range ids {
		e, err := fakeengine.New(fakeengine.Options{BlockSize: engineBlock, CapacityBlocks: 4096})
		require.NoError(t, err)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		require.NoError(t, e.Start(ctx))
		cancel()
		t.Cleanup(func() { _ = e.Close() })
		rec, err := s.Workers().Upsert(catalog.Worker{
			ID: id, Endpoint: fmt.Sprintf("127.0.0.%d:8000", i+1), DPSize: 1, BlockSize: rigBlock,
			KVEventEndpoints: map[int]string{0: e.PubEndpoint()},
		})
		require.NoError(t, err)
		require.Equal(t, catalog.Schedulable, rec.Lifecycle, rec.Reasons)
		r.engines[id] = e
	}
	for _, e := range r.engines {
		require.NoError(t, e.WaitSubscribed(context.Background()))
	}
	return r
}

// settle waits until the service has handled every batch engine id published.
// Handler.Batches counts a batch as its handling starts, before its events
// are applied; the source's Applied counts it once HandleBatch has returned.
func (r *feedRig) settle(id string) {
	r.t.Helper()
	want := r.engines[id].NextSeq()
	require.Eventually(r.t, func() bool {
		for _, st := range r.s.Events().Sources() {
			if st.Worker.WorkerID == id {
				return st.Handler.Batches == want && st.Applied == want
			}
		}
		return want == 0
	}, 20*time.Second, time.Millisecond)
}

func (r *feedRig) health(id string) FeedHealth {
	r.t.Helper()
	for _, h := range r.s.Events().Health() {
		if h.Worker.WorkerID == id {
			return h
		}
	}
	r.t.Fatalf("no feed health for %s", id)
	return FeedHealth{}
}

// book books tokens on worker id and frees the booking.
func (r *feedRig) book(id string, tokens []uint32) Result {
	r.t.Helper()
	res, err := r.s.SelectAndReserve(context.Background(), Request{Tokens: tokens, Allowed: []string{id}})
	require.NoError(r.t, err)
	require.Equal(r.t, id, res.WorkerID)
	require.NoError(r.t, r.s.Reservations().Free(res.ReservationID))
	return res
}

func (r *feedRig) overlap(id string, tokens []uint32) int {
	r.t.Helper()
	ov, err := overlapScores(r.s, context.Background(), Request{Tokens: tokens})
	require.NoError(r.t, err)
	return ov[catalog.WorkerRank{WorkerID: id}].Device
}

// rootless publishes what engine e would store for tokens, but with every run
// hanging from a parent the router never saw: a feed that drops every root.
func rootless(t *testing.T, e *fakeengine.Engine, tokens []uint32) {
	t.Helper()
	hs := e.BlockHashes(tokens, "", "")
	_, err := e.PublishEvents(fakeengine.Event{Kind: fakeengine.BlockStored, BlockHashes: hs,
		HasParent: true, ParentHash: 0xdead, TokenIDs: tokens[:len(hs)*rigBlock], BlockSize: rigBlock})
	require.NoError(t, err)
}

func TestFeedThatDropsEveryRootFallsBackAndHeals(t *testing.T) {
	r := newFeedRig(t, FeedTrust{}, "bad", "good")
	good := r.engines["good"]
	var prompts [][]uint32
	for i := range DefaultFeedMinStores {
		p := toks(8*rigBlock, i+1)
		prompts = append(prompts, p)
		r.book("bad", p)
		rootless(t, r.engines["bad"], p)
		_, err := good.Serve(fakeengine.Request{Tokens: p})
		require.NoError(t, err)
	}
	r.settle("bad")
	r.settle("good")
	require.Zero(t, r.overlap("bad", prompts[0]), "nothing of the bad feed is indexed")
	r.s.checkFeeds(r.clk.Now())

	bad, ok := r.health("bad"), r.health("good")
	require.Equal(t, FeedMisSpeaking, bad.State)
	require.False(t, bad.Trusted)
	require.EqualValues(t, DefaultFeedMinStores, bad.StoresLost)
	require.Equal(t, FeedHealthy, ok.State)
	require.True(t, ok.Trusted)
	require.EqualValues(t, DefaultFeedMinStores, ok.StoresApplied)
	logs := r.logs.String()
	require.Contains(t, logs, "kv event feed not trusted")
	require.Contains(t, logs, "state=mis-speaking")
	require.Contains(t, logs, "reason=unknown_parent") // the handler's own warning

	// Untrusted, the worker is routed on its own bookings, as in approximate
	// mode: what was booked on it counts as cached there.
	fresh := toks(6*rigBlock, 77)
	r.book("bad", fresh)
	require.Equal(t, 6, r.overlap("bad", fresh))
	res, err := r.s.Select(context.Background(), Request{Tokens: fresh})
	require.NoError(t, err)
	require.Equal(t, "bad", res.WorkerID)
	require.Equal(t, 6, res.Overlap.Device)

	// Quiet for a whole window is not healed: too few stores to judge.
	r.clk.Advance(DefaultFeedWindow + time.Second)
	r.s.checkFeeds(r.clk.Now())
	require.Equal(t, FeedMisSpeaking, r.health("bad").State)

	// The engine is fixed: its stores apply again. Once the lost ones have left
	// the window the feed is trusted again and routing is on its events.
	for i := range DefaultFeedMinStores {
		_, err := r.engines["bad"].Serve(fakeengine.Request{Tokens: toks(8*rigBlock, 50+i)})
		require.NoError(t, err)
	}
	r.settle("bad")
	r.clk.Advance(DefaultFeedWindow + time.Second)
	r.s.checkFeeds(r.clk.Now())
	bad = r.health("bad")
	require.Equal(t, FeedHealthy, bad.State, "%+v", bad)
	require.True(t, bad.Trusted)
	require.Zero(t, r.overlap("bad", fresh), "its own bookings no longer count")
	require.Equal(t, 8, r.overlap("bad", toks(8*rigBlock, 50)))
	require.Contains(t, r.logs.String(), "kv event feed healthy again")
}

func TestSilentFeedFallsBackUntilItPublishes(t *testing.T) {
	r := newFeedRig(t, FeedTrust{}, "quiet")
	for i := range DefaultFeedSilentBookings {
		r.book("quiet", toks(4*rigBlock, 10*(i+1)))
	}
	r.s.checkFeeds(r.clk.Now())
	require.Equal(t, FeedHealthy, r.health("quiet").State, "not silent before SilentAfter")
	r.clk.Advance(DefaultFeedSilentAfter)
	r.s.checkFeeds(r.clk.Now())
	h := r.health("quiet")
	require.Equal(t, FeedNeverHeard, h.State, "its feed never delivered a batch: nothing ever connected")
	require.Equal(t, DefaultFeedSilentBookings, h.PendingStores)
	require.False(t, h.Trusted)
	require.Contains(t, r.logs.String(), "state=never-heard")
	require.Contains(t, r.logs.String(), "DYN_EPP_KV_EVENT_BIND", "the WARN names the likely cause and the fix")

	// A booking that is all cache hits expects nothing: it does not count.
	_, err := r.engines["quiet"].Serve(fakeengine.Request{Tokens: toks(4*rigBlock, 10)})
	require.NoError(t, err)
	r.settle("quiet")
	r.s.checkFeeds(r.clk.Now())
	h = r.health("quiet")
	require.Equal(t, FeedHealthy, h.State)
	require.True(t, h.Trusted)
	require.Zero(t, h.PendingStores)

	// Once it has spoken, the same silence is FeedSilent: the feed stopped.
	for i := range DefaultFeedSilentBookings {
		r.book("quiet", toks(4*rigBlock, 1000*(i+1)))
	}
	r.clk.Advance(DefaultFeedSilentAfter)
	r.s.checkFeeds(r.clk.Now())
	require.Equal(t, FeedSilent, r.health("quiet").State)
	require.Contains(t, r.logs.String(), "state=silent")
	require.Equal(t, "never-heard", FeedNeverHeard.String())
}

func TestFeedChecksCanBeTurnedOff(t *testing.T) {
	r := newFeedRig(t, FeedTrust{Off: true}, "quiet")
	for i := range 2 * DefaultFeedSilentBookings {
		r.book("quiet", toks(4*rigBlock, 10*(i+1)))
	}
	r.clk.Advance(time.Hour)
	r.s.checkFeeds(r.clk.Now())
	require.Empty(t, r.s.Events().Health())
	require.Zero(t, r.s.partitions[catalog.DefaultModel].untrusted.Load())
}

// serveBooked books tokens on worker id, has its engine serve what the
// engine's own tokenizer makes of them, waits for the events, then settles the
// booking as a gateway does: first output, then end of stream.
func (r *feedRig) serveBooked(id string, tokens, engineTokens []uint32) {
	r.t.Helper()
	res, err := r.s.SelectAndReserve(context.Background(), Request{Tokens: tokens, Allowed: []string{id}})
	require.NoError(r.t, err)
	_, err = r.engines[id].Serve(fakeengine.Request{Tokens: engineTokens})
	require.NoError(r.t, err)
	r.settle(id)
	require.NoError(r.t, r.s.Reservations().PrefillComplete(res.ReservationID))
	require.NoError(r.t, r.s.Reservations().Free(res.ReservationID))
}

func TestTokenParity(t *testing.T) {
	same := func(p []uint32) []uint32 { return p }
	cases := []struct {
		name        string
		engineBlock int
		serve       func([]uint32) []uint32 // what the engine's own tokenizer makes of the router's tokens
		low         bool
	}{
		{"identical tokenizer", rigBlock, same, false},
		{"engine blocks a multiple of the router's", 2 * rigBlock, same, false},
		{"one extra token", rigBlock, func(p []uint32) []uint32 { return append([]uint32{7}, p...) }, true},
		{"another block size", rigBlock + 2, same, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r := newFeedRigBlocks(t, FeedTrust{ParityEvery: 1}, tc.engineBlock, "w")
			for i := range DefaultParityMinSamples {
				p := toks(6*rigBlock+1, 20+i)
				r.serveBooked("w", p, tc.serve(p))
			}
			r.s.checkFeeds(r.clk.Now())
			require.True(t, math.IsNaN(r.health("w").Parity), "judged only ParityDelay after the prefill")
			r.clk.Advance(DefaultParityDelay)
			r.s.checkFeeds(r.clk.Now())
			h := r.health("w")
			if tc.low {
				// Incomplete samples wait for late events, up to 4 ParityDelays.
				require.Zero(t, h.ParitySamples, "a sample missing blocks waits for late events")
				r.clk.Advance(3 * DefaultParityDelay)
				r.s.checkFeeds(r.clk.Now())
				h = r.health("w")
			}
			require.EqualValues(t, DefaultParityMinSamples, h.ParitySamples)
			require.Equal(t, tc.low, h.LowParity)
			if tc.low {
				require.Less(t, h.Parity, DefaultParityThreshold)
				require.Contains(t, r.logs.String(), "token parity low")
			} else {
				require.Equal(t, FeedHealthy, h.State)
				require.Equal(t, 1.0, h.Parity)
				require.False(t, strings.Contains(r.logs.String(), "token parity low"))
			}
		})
	}
}

// Parity is about what the engine stored for a request, not what it still
// holds: evictions after the store, and prefixes the engine already held, keep
// it at 1. A booking freed before its first output is not judged.
func TestTokenParityIgnoresEvictionsAndCachedPrefixes(t *testing.T) {
	r := newFeedRig(t, FeedTrust{ParityEvery: 1}, "w")
	shared := toks(4*rigBlock, 90)
	for i := range DefaultParityMinSamples {
		p := append(append([]uint32(nil), shared...), toks(4*rigBlock, 60+i)...)
		r.serveBooked("w", p, p) // from the second on, the shared prefix is cached: not stored again
	}
	var res Result
	_, err := r.engines["w"].ResetPrefixCache() // then everything is evicted before the judgement
	require.NoError(t, err)
	r.settle("w")
	res, err = r.s.SelectAndReserve(context.Background(), Request{Tokens: toks(8*rigBlock, 70), Allowed: []string{"w"}})
	require.NoError(t, err)
	require.NoError(t, r.s.Reservations().Free(res.ReservationID)) // cancelled before any output
	r.clk.Advance(DefaultParityDelay)
	r.s.checkFeeds(r.clk.Now())
	h := r.health("w")
	require.EqualValues(t, DefaultParityMinSamples, h.ParitySamples)
	require.Equal(t, 1.0, h.Parity)
	require.False(t, h.LowParity)
}

func TestFeedTrustValidation(t *testing.T) {
	cfg := DefaultConfig(16)
	cfg.FeedTrust = FeedTrust{CheckInterval: -1, SilentBookings: -1, MaxLossRatio: 2, ParityThreshold: math.NaN()}
	err := cfg.Validate()
	require.ErrorIs(t, err, ErrInvalidConfig)
	for _, f := range []string{"FeedTrust.CheckInterval", "FeedTrust.SilentBookings", "FeedTrust.MaxLossRatio", "FeedTrust.ParityThreshold"} {
		require.ErrorContains(t, err, f)
	}
}

// An engine that dials into the bind listener replays its gaps from the replay
// endpoint of its worker record, like a dialed source.
func TestBoundEngineReplaysGapsFromItsWorkerRecord(t *testing.T) {
	s, err := NewSelectionServiceBuilder(DefaultConfig(rigBlock)).SweepInterval(-1).BindEvents("tcp://127.0.0.1:0").
		EventFeed(FeedOptions{ReconnectMin: time.Millisecond, ReconnectMax: 10 * time.Millisecond}).Build(context.Background())
	require.NoError(t, err)
	defer s.Close()
	e, err := fakeengine.New(fakeengine.Dialect(fakeengine.DialectExternal).Apply(fakeengine.Options{
		BlockSize: rigBlock, CapacityBlocks: 4096, EnableReplay: true,
		PubMode: fakeengine.PubDial, PubEndpoint: "tcp://" + s.Events().BindAddr().String(), Topic: "kv@127.0.0.1@m",
	}))
	require.NoError(t, err)
	// Only a known worker's address may connect: register it first.
	w := catalog.Worker{ID: "w", Endpoint: "127.0.0.1:8000", DPSize: 1, BlockSize: rigBlock}
	_, err = s.Workers().Upsert(w)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, e.Start(ctx))
	defer e.Close()
	w.ReplayEndpoint = e.ReplayEndpoint()
	_, err = s.Workers().Upsert(w)
	require.NoError(t, err)
	var prompts [][]uint32
	serve := func(seed int) {
		p := toks(4*rigBlock, seed)
		prompts = append(prompts, p)
		_, err := e.Serve(fakeengine.Request{Tokens: p})
		require.NoError(t, err)
	}
	// The listener learns the engine's topic from its first batch (a PUB that
	// dials in drops what it sends before the connection is up: keep serving).
	require.Eventually(t, func() bool {
		serve(len(prompts) + 1)
		return len(s.Events().Sources()) == 1
	}, 20*time.Second, 5*time.Millisecond)
	e.DropNext(3)
	for range 5 {
		serve(len(prompts) + 1)
	}
	require.Eventually(t, func() bool {
		st := s.Events().Sources()
		return len(st) == 1 && st[0].Watermark+1 == e.NextSeq()
	}, 20*time.Second, 5*time.Millisecond)
	st := s.Events().Sources()[0]
	require.True(t, st.Bound)
	require.Positive(t, st.ReplaysOK, "the gap was replayed")
	require.False(t, st.Degraded)
	last := prompts[len(prompts)-1]
	ov, err := overlapScores(s, context.Background(), Request{Tokens: last})
	require.NoError(t, err)
	require.Equal(t, 4, ov[catalog.WorkerRank{WorkerID: "w"}].Device)
}

// A feed that never delivered a batch says nothing of parity: its samples
// are dropped, not judged (a parity read off a silent feed misleads).
func TestNoParityWithoutEvents(t *testing.T) {
	r := newFeedRig(t, FeedTrust{ParityEvery: 1}, "w")
	for i := range DefaultParityMinSamples {
		res, err := r.s.SelectAndReserve(context.Background(), Request{Tokens: toks(6*rigBlock+1, 20+i), Allowed: []string{"w"}})
		require.NoError(t, err)
		require.NoError(t, r.s.Reservations().PrefillComplete(res.ReservationID))
		require.NoError(t, r.s.Reservations().Free(res.ReservationID))
	}
	r.clk.Advance(DefaultParityDelay)
	r.s.checkFeeds(r.clk.Now())
	h := r.health("w")
	require.Zero(t, h.ParitySamples)
	require.True(t, math.IsNaN(h.Parity))
	require.False(t, h.LowParity)
	require.NotContains(t, r.logs.String(), "token parity low")
}

// The engine's events arriving after ParityDelay (a loaded feed) still
// count: a sample missing blocks waits up to 4 ParityDelays for them, so
// parity stays exactly 1 with the same tokenizer.
func TestParityWaitsForLateEvents(t *testing.T) {
	r := newFeedRig(t, FeedTrust{ParityEvery: 1}, "w")
	r.serveBooked("w", toks(4*rigBlock, 1), toks(4*rigBlock, 1)) // the feed has spoken
	r.clk.Advance(DefaultParityDelay)
	r.s.checkFeeds(r.clk.Now())
	before := r.health("w").ParitySamples
	p := toks(6*rigBlock+1, 77)
	res, err := r.s.SelectAndReserve(context.Background(), Request{Tokens: p, Allowed: []string{"w"}})
	require.NoError(t, err)
	require.NoError(t, r.s.Reservations().PrefillComplete(res.ReservationID))
	r.clk.Advance(DefaultParityDelay)
	r.s.checkFeeds(r.clk.Now())
	require.Equal(t, before, r.health("w").ParitySamples, "not judged while its blocks are unreported")
	_, err = r.engines["w"].Serve(fakeengine.Request{Tokens: p}) // the events, late
	require.NoError(t, err)
	r.settle("w")
	require.NoError(t, r.s.Reservations().Free(res.ReservationID))
	r.clk.Advance(DefaultParityDelay)
	r.s.checkFeeds(r.clk.Now())
	h := r.health("w")
	require.Equal(t, before+1, h.ParitySamples)
	require.Equal(t, 1.0, h.Parity)
}
