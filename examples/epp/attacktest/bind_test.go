package attacktest

import (
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/internal/fakeengine"
)

// handshakeTimeout is kvevents.DefaultHandshakeTimeout, the guard's bound on
// a peer's greeting and READY, which the EPP does not change.
const handshakeTimeout = 5 * time.Second

// bindFleet starts n engines that dial into a bind-mode EPP, each listed in
// the workers file at its HTTP endpoint, the first also serving as the
// tokenizer. extraWorkers are listed too (engines nobody runs).
func bindFleet(t *testing.T, n int, extra map[string]string, extraWorkers ...worker) (*eppProc, []*dialEngine, []string) {
	t.Helper()
	engines := make([]*dialEngine, n)
	ids := make([]string, n)
	var ws []worker
	for i := range engines {
		engines[i] = newDialEngine(t)
		ids[i] = fmt.Sprintf("engine-%d", i)
		ws = append(ws, worker{ID: ids[i], Endpoint: engines[i].endpoint})
	}
	ws = append(ws, extraWorkers...)
	p := startEPP(t, eppConfig{workers: ws, tokenizer: "http://" + engines[0].endpoint, bind: true, extra: extra})
	return p, engines, ids
}

// TestBindRefusesHostileFrames: a peer at a worker's address (so admitted)
// sends a valid greeting and then a frame header declaring 2^62 or 2^40
// bytes, a command as large, or a READY whose property runs past its end.
// Each connection is closed and counted by reason; the engine's feed goes on.
func TestBindRefusesHostileFrames(t *testing.T) {
	p, engines, ids := bindFleet(t, 1, nil)
	engines[0].dial(t, p.bindPort)
	flow(t, p, engines[0].Engine, ids[0])
	rss0 := p.rss()
	addr := fmt.Sprintf("127.0.0.1:%d", p.bindPort)
	for _, h := range hostileSequences() {
		before := p.refused(h.reason)
		pc := dialPeer(t, nil, addr)
		_, _ = pc.Write(h.bytes)
		require.True(t, pc.waitClosed(waitTimeout), "%s: the EPP kept the connection", h.name)
		p.eventually(h.name+": refusal counted", waitTimeout, func() bool { return p.refused(h.reason) > before })
		p.alive()
		applied := flow(t, p, engines[0].Engine, ids[0])
		t.Logf("%-44s refused{reason=%q} %v -> %v; engine applied %v", h.name, h.reason, before, p.refused(h.reason), applied)
	}
	t.Logf("EPP RSS %d MiB before, %d MiB after", rss0>>20, p.rss()>>20)
}

// TestBindSilentPeersDoNotBlockEngines: three connections that send nothing
// and one that sends only the 10-byte signature hold the bind port; four
// engines then dial in and their events are applied at once, well before the
// guard's handshake timeout frees the silent ones, which it then closes and
// counts.
func TestBindSilentPeersDoNotBlockEngines(t *testing.T) {
	p, engines, ids := bindFleet(t, 4, nil)
	addr := fmt.Sprintf("127.0.0.1:%d", p.bindPort)
	timeoutsBefore := p.refused("handshake_timeout")
	var silent []*peerConn
	for range 3 {
		silent = append(silent, dialPeer(t, nil, addr))
	}
	sig := dialPeer(t, nil, addr)
	_, err := sig.Write(greeting()[:10])
	require.NoError(t, err)
	silent = append(silent, sig)
	held := time.Now()

	start := time.Now()
	for i, e := range engines {
		e.dial(t, p.bindPort)
		flow(t, p, e.Engine, ids[i])
	}
	took := time.Since(start)
	for i, pc := range silent {
		select {
		case <-pc.closed:
			require.FailNow(t, "a silent connection was closed before the engines flowed", "connection %d", i)
		default:
		}
	}
	t.Logf("4 engines dialed in and flowed in %v while 4 silent connections were held", took.Round(time.Millisecond))
	require.Less(t, took, handshakeTimeout-time.Second, "engines waited for the silent connections")

	for i, pc := range silent {
		require.True(t, pc.waitClosed(handshakeTimeout+waitTimeout), "silent connection %d never closed", i)
	}
	t.Logf("silent connections closed %v after they opened", time.Since(held).Round(time.Millisecond))
	p.eventually("handshake timeouts counted", waitTimeout, func() bool {
		return p.refused("handshake_timeout") >= timeoutsBefore+4
	})
	p.alive()
	for i, e := range engines {
		flow(t, p, e.Engine, ids[i])
	}
	t.Logf("refused{reason=\"handshake_timeout\"} %v -> %v", timeoutsBefore, p.refused("handshake_timeout"))
}

// forgedBatch is a batch that, if applied, would clear the worker's index and
// store a prefix the worker never held.
func forgedBatch() []byte {
	toks := uniqueTokens(2 * blockSize)
	return fakeengine.AppendBatch(nil, fakeengine.Batch{Timestamp: 1, HasDPRank: true, Events: []fakeengine.Event{
		{Kind: fakeengine.AllBlocksCleared},
		{Kind: fakeengine.BlockStored, BlockHashes: []uint64{0xF0F0, 0xF0F1}, TokenIDs: toks, BlockSize: blockSize},
	}}, fakeengine.Format{})
}

// lastSeq is the sequence number of the engine's last batch.
func lastSeq(t *testing.T, e *fakeengine.Engine) uint64 {
	t.Helper()
	n := e.NextSeq()
	require.Positive(t, n, "the engine has published nothing yet")
	return n - 1
}

// TestBindForgedPeers: with the default address checks, a PUB that connects
// from 127.0.0.9 (no worker's address) is closed before any byte is read
// (not_admitted), and one from 127.0.0.2 (another worker's address) has its
// message dropped because the topic names a worker at another address
// (topic_refused). Both publish the next in-sequence batch of a real worker's
// topic; neither reaches its index.
func TestBindForgedPeers(t *testing.T) {
	other := worker{ID: "other", Endpoint: "127.0.0.2:8000"}
	p, engines, ids := bindFleet(t, 1, nil, other)
	e, id := engines[0], ids[0]
	e.dial(t, p.bindPort)
	flow(t, p, e.Engine, id)
	addr := fmt.Sprintf("127.0.0.1:%d", p.bindPort)

	for _, c := range []struct {
		from   string
		reason string
	}{
		{"127.0.0.9", "not_admitted"},
		{"127.0.0.2", "topic_refused"},
	} {
		applied := p.applied(id)
		before := p.refused(c.reason)
		pc := publisher(t, net.ParseIP(c.from), addr)
		_, _ = pc.Write(liveMessage(e.Topic(), e.NextSeq(), forgedBatch()))
		p.eventually("forgery from "+c.from+" refused", waitTimeout, func() bool { return p.refused(c.reason) > before })
		p.alive()
		require.Equal(t, applied, p.applied(id), "the forged batch from %s was applied", c.from)
		// The real batch with the seq the forgery used is applied, alone: the
		// forgery neither moved the watermark (stale) nor added events.
		now := flow(t, p, e.Engine, id)
		require.Equal(t, applied+1, now, "events applied besides the real batch")
		require.Zero(t, p.source("kvselect_kv_event_batches_stale_total", id))
		t.Logf("forged PUB from %-9s refused{reason=%q} %v -> %v; %s applied %v -> %v (the real batch only)",
			c.from, c.reason, before, p.refused(c.reason), id, applied, now)
	}
}

// anyPeerWorker starts a bind-mode EPP with DYN_EPP_KV_EVENT_BIND_ANY_PEER
// and one engine that has served (and so cached) prompt through its own API.
func anyPeerWorker(t *testing.T, prompt string) (*eppProc, *dialEngine, string) {
	t.Helper()
	p, engines, ids := bindFleet(t, 1, map[string]string{"DYN_EPP_KV_EVENT_BIND_ANY_PEER": "true"})
	e, id := engines[0], ids[0]
	e.dial(t, p.bindPort)
	flow(t, p, e.Engine, id)
	applied := p.applied(id)
	resp, err := p.httpc.Post("http://"+e.endpoint+"/v1/chat/completions", "application/json", strings.NewReader(string(chatBody(t, prompt))))
	require.NoError(t, err)
	_ = resp.Body.Close()
	require.Equal(t, 200, resp.StatusCode)
	p.eventually("the prompt's blocks applied", waitTimeout, func() bool { return p.applied(id) > applied })
	require.GreaterOrEqual(t, p.promptOverlap(t, prompt, e.endpoint), 4.0, "the prompt is not in the index before the attack")
	return p, e, id
}

// promptOverlap routes prompt and returns how many device blocks the chosen
// worker (which must be dest) held of it in the EPP's index.
func (p *eppProc) promptOverlap(t *testing.T, prompt, dest string) float64 {
	t.Helper()
	chosen := p.count("kvselect_overlap_chosen_blocks_total", labels{"role": role})
	d, err := p.pick(t.Context(), prompt)
	require.NoError(t, err)
	require.Equal(t, 200, d.Status, "%s", d.ImmediateBody)
	require.Equal(t, dest, d.Destination)
	return p.count("kvselect_overlap_chosen_blocks_total", labels{"role": role}) - chosen
}

const probePrompt = "the quick brown fox jumps over the lazy dog and keeps running through the field "

// TestBindForgedFarAheadSeq: with DYN_EPP_KV_EVENT_BIND_ANY_PEER anyone may
// publish as any worker. A forged batch numbered a million past the real
// stream is dropped as suspect: nothing is counted lost, the source is not
// degraded, the real stream that resumes is not taken for a restart, and the
// worker's index (probed through a routing decision) still holds its prefix.
func TestBindForgedFarAheadSeq(t *testing.T) {
	prompt := strings.Repeat(probePrompt, 6)
	p, e, id := anyPeerWorker(t, prompt)
	real := lastSeq(t, e.Engine)
	lost0, suspect0 := p.source("kvselect_kv_event_batches_lost_total", id), p.source("kvselect_kv_event_batches_suspect_total", id)
	applied := p.applied(id)
	pc := publisher(t, net.ParseIP("127.0.0.9"), fmt.Sprintf("127.0.0.1:%d", p.bindPort))
	_, err := pc.Write(liveMessage(e.Topic(), real+1_000_000, forgedBatch()))
	require.NoError(t, err)
	p.eventually("forged batch counted suspect", waitTimeout, func() bool {
		return p.source("kvselect_kv_event_batches_suspect_total", id) > suspect0
	})
	p.alive()
	require.Equal(t, applied, p.applied(id), "the forged batch was applied")

	for range 3 { // the real stream resumes at real+1
		flow(t, p, e.Engine, id)
	}
	lost := p.source("kvselect_kv_event_batches_lost_total", id)
	require.Equal(t, lost0, lost, "batches counted lost")
	require.Zero(t, p.source("kvselect_kv_event_source_degraded", id), "source degraded")
	require.Zero(t, p.source("kvselect_kv_event_restarts_total", id), "restart counted")
	require.Zero(t, p.source("kvselect_kv_event_jumps_total", id), "jump confirmed")
	overlap := p.promptOverlap(t, prompt, e.endpoint)
	require.GreaterOrEqual(t, overlap, 4.0, "the worker's index lost the prompt's blocks")
	t.Logf("forged seq %d (real %d): suspect %v -> %v, lost %v -> %v, degraded 0, restarts 0; applied %v; prompt overlap %v blocks",
		real+1_000_000, real, suspect0, p.source("kvselect_kv_event_batches_suspect_total", id), lost0, lost, p.applied(id), overlap)
}
