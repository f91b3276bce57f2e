package attacktest

import (
	"net"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/internal/fakeengine"
)

// maliciousEngine is a raw TCP listener posing as a worker's KV-event PUB:
// the i-th connection the EPP dials gets the i-th hostile sequence (cycling),
// up to max connections; later ones are closed at once. It stops in
// t.Cleanup.
type maliciousEngine struct {
	l      net.Listener
	wg     sync.WaitGroup
	mu     sync.Mutex
	served []string // the sequence names served, in order
	closed int      // connections the EPP closed after its sequence
}

func newMaliciousEngine(t *testing.T, seqs []hostile, max int) *maliciousEngine {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	m := &maliciousEngine{l: l}
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		for i := 0; ; i++ {
			c, err := l.Accept()
			if err != nil {
				return
			}
			if i >= max {
				_ = c.Close()
				continue
			}
			h := seqs[i%len(seqs)]
			m.wg.Add(1)
			go func() {
				defer m.wg.Done()
				defer c.Close()
				_, _ = c.Write(h.bytes)
				// The EPP's greeting and READY are read and dropped; the
				// read ends when the EPP closes (or cleanup does).
				buf := make([]byte, 4096)
				for {
					if _, err := c.Read(buf); err != nil {
						m.mu.Lock()
						m.served = append(m.served, h.name)
						if errClosedByPeer(err) {
							m.closed++
						}
						m.mu.Unlock()
						return
					}
				}
			}()
		}
	}()
	t.Cleanup(func() {
		_ = l.Close()
		m.wg.Wait()
	})
	return m
}

func (m *maliciousEngine) endpoint() string { return "tcp://" + m.l.Addr().String() }

func (m *maliciousEngine) stats() (served []string, closed int) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return append([]string(nil), m.served...), m.closed
}

// TestDialRefusesHostileEngine: the EPP dials a worker's KV-event endpoint
// that answers with a valid greeting and then the hostile frames of the bind
// test. Every connection is refused and counted by reason, the EPP keeps
// redialing it (bounded: the listener serves each sequence once), and another
// worker's feed goes on.
func TestDialRefusesHostileEngine(t *testing.T) {
	seqs := hostileSequences()
	bad := newMaliciousEngine(t, seqs, len(seqs))
	good := boundEngine(t, true)
	p := startEPP(t, eppConfig{
		tokenizer: "http://" + good.HTTPEndpoint(),
		workers: []worker{
			{ID: "good", Endpoint: good.HTTPEndpoint(), KVEvents: good.PubEndpoint()},
			{ID: "bad", Endpoint: bad.l.Addr().String(), KVEvents: bad.endpoint()},
		},
	})
	// The EPP dials the hostile endpoint as soon as discovery syncs, so the
	// counters start at 0 with the process, not at this point.
	want := map[string]float64{}
	for _, h := range seqs {
		want[h.reason]++
	}
	flow(t, p, good, "good")
	// The EPP redials with backoff (100 ms doubling); five refusals take a few
	// seconds.
	p.eventually("every hostile sequence refused", 4*waitTimeout, func() bool {
		for r, n := range want {
			if p.refused(r) < n {
				return false
			}
		}
		return true
	})
	p.alive()
	flow(t, p, good, "good")
	p.eventually("every hostile connection closed by the EPP", waitTimeout, func() bool {
		_, closed := bad.stats()
		return closed == len(seqs)
	})
	served, closed := bad.stats()
	for r, n := range want {
		t.Logf("refused{reason=%q} %v (sequences sent: %v)", r, p.refused(r), n)
	}
	t.Logf("hostile engine served %d sequences, the EPP closed %d; later dials closed at once: refused{reason=\"handshake_io\"} %v",
		len(served), closed, p.refused("handshake_io"))
	require.Zero(t, p.applied("bad"))
}

// TestMadeUpRanksAndOversizedFeed: a worker with one data-parallel rank and a
// declared capacity of 64 blocks publishes batches stamped with ranks
// 1..madeUpRanks, then stores far beyond its capacity on its real rank. The
// made-up ranks are skipped (unknown_rank), the stores beyond the index's
// per-rank limit (4 x 64 blocks) are refused (rank_full), the EPP's RSS
// stays within rssBound of what it was, and another worker's feed goes on.
func TestMadeUpRanksAndOversizedFeed(t *testing.T) {
	const (
		madeUpRanks    = 2000
		blocksPerEvent = 32
		capacity       = 64
		rankLimit      = 4 * capacity // selection's rankLimitFactor
		oversized      = 100          // stores of blocksPerEvent on rank 0
		rssBound       = 64 << 20
	)
	e, legit := boundEngine(t, false), boundEngine(t, true)
	p := startEPP(t, eppConfig{
		tokenizer: "http://" + legit.HTTPEndpoint(),
		workers: []worker{
			{ID: "w", Endpoint: "127.0.0.1:8001", KVEvents: e.PubEndpoint(), TotalKVBlocks: capacity},
			{ID: "legit", Endpoint: legit.HTTPEndpoint(), KVEvents: legit.PubEndpoint()},
		},
	})
	flow(t, p, e, "w")
	flow(t, p, legit, "legit")
	rss0 := p.rss()
	batches0 := p.source("kvselect_kv_event_batches_total", "w")
	applied0, skipped0 := p.applied("w"), p.count("kvselect_kv_events_skipped_total", labels{"role": role, "worker": "w"})
	hash := uint64(1 << 40)
	store := func(rank int) []byte {
		hs := make([]uint64, blocksPerEvent)
		for i := range hs {
			hs[i] = hash
			hash++
		}
		return fakeengine.AppendBatch(nil, fakeengine.Batch{Timestamp: 1, DPRank: rank, HasDPRank: true,
			Events: []fakeengine.Event{{Kind: fakeengine.BlockStored, BlockHashes: hs,
				TokenIDs: uniqueTokens(blocksPerEvent * blockSize), BlockSize: blockSize}}}, fakeengine.Format{})
	}
	for r := 1; r <= madeUpRanks; r++ {
		_, err := e.PublishPayload(store(r))
		require.NoError(t, err)
	}
	for range oversized {
		_, err := e.PublishPayload(store(0))
		require.NoError(t, err)
	}
	total := float64(madeUpRanks + oversized)
	p.eventually("every batch received", 3*waitTimeout, func() bool {
		return p.source("kvselect_kv_event_batches_total", "w") >= batches0+total
	})
	// Received counts a batch as it is taken off the socket; the feed applies
	// it later. The oversized stores come after the made-up ranks: wait until
	// every event was applied or skipped, not only the made-up ranks' ones.
	p.eventually("every event judged", waitTimeout, func() bool {
		judged := p.applied("w") - applied0 + p.count("kvselect_kv_events_skipped_total", labels{"role": role, "worker": "w"}) - skipped0
		return p.skipped("w", "unknown_rank") >= madeUpRanks && judged >= total
	})
	p.alive()
	unknown, full := p.skipped("w", "unknown_rank"), p.skipped("w", "rank_full")
	rss1 := p.rss()
	now := flow(t, p, legit, "legit")
	t.Logf("skipped{unknown_rank} %v, skipped{rank_full} %v, legit applied %v, overflows %v; RSS %d MiB -> %d MiB (bound +%d MiB)",
		unknown, full, now, p.source("kvselect_kv_event_overflows_total", "w"), rss0>>20, rss1>>20, rssBound>>20)
	require.Equal(t, float64(madeUpRanks), unknown)
	// The feed's first flows stored 4 blocks each; the rest of the limit takes
	// at most rankLimit/blocksPerEvent oversized stores.
	require.GreaterOrEqual(t, full, float64(oversized-rankLimit/blocksPerEvent))
	require.Less(t, rss1-rss0, int64(rssBound), "RSS grew by %d MiB", (rss1-rss0)>>20)
}
