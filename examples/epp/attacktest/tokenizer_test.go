package attacktest

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// hangingServer accepts TCP connections, reads whatever comes and never
// answers. It records how many connections are open at once. It stops in
// t.Cleanup.
type hangingServer struct {
	l  net.Listener
	wg sync.WaitGroup

	mu                     sync.Mutex
	conns                  map[net.Conn]struct{}
	accepted, open, peaked int
}

func newHangingServer(t *testing.T) *hangingServer {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	s := &hangingServer{l: l, conns: map[net.Conn]struct{}{}}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			s.mu.Lock()
			s.conns[c] = struct{}{}
			s.accepted++
			s.open++
			s.peaked = max(s.peaked, s.open)
			s.mu.Unlock()
			s.wg.Add(1)
			go func() {
				defer s.wg.Done()
				buf := make([]byte, 4096)
				for {
					if _, err := c.Read(buf); err != nil {
						break
					}
				}
				_ = c.Close()
				s.mu.Lock()
				delete(s.conns, c)
				s.open--
				s.mu.Unlock()
			}()
		}
	}()
	t.Cleanup(func() {
		_ = l.Close()
		s.mu.Lock()
		for c := range s.conns {
			_ = c.Close()
		}
		s.mu.Unlock()
		s.wg.Wait()
	})
	return s
}

func (s *hangingServer) counts() (accepted, open, peaked int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.accepted, s.open, s.peaked
}

// TestHangingTokenizer: the tokenizer accepts and never answers, and the EPP
// admits 8 requests at a time (DYN_EPP_MAX_INFLIGHT_REQUESTS). With 8
// requests hanging, every further one is shed with 503 at once. Then a storm
// of requests that the client cancels after 30 ms, lasting several tokenizer
// call timeouts: the admitted ones leave detached calls behind that hold
// their slot until the timeout (so the others are shed), and once those end
// the goroutine count and the heap are back where they were; the hanging
// tokenizer never holds more than a bounded number of connections.
func TestHangingTokenizer(t *testing.T) {
	const (
		maxInflight   = 8
		callTimeout   = 500 * time.Millisecond
		shed          = 40 // requests sent while 8 hang
		stormFor      = 3 * callTimeout
		stormWaves    = 150 // at most, whatever stormFor says
		stormParallel = 40
		stormCancel   = 30 * time.Millisecond
		goroutineJoin = 25       // goroutines allowed above the baseline afterwards
		heapBound     = 32 << 20 // heap growth allowed
		rssBound      = 64 << 20
	)
	tok := newHangingServer(t)
	e := boundEngine(t, false)
	p := startEPP(t, eppConfig{
		tokenizer: "http://" + tok.l.Addr().String(),
		workers:   []worker{{ID: "w", Endpoint: "127.0.0.1:8001", KVEvents: e.PubEndpoint()}},
		extra: map[string]string{
			"DYN_EPP_MAX_INFLIGHT_REQUESTS":   fmt.Sprint(maxInflight),
			"DYN_EPP_TOKENIZATION_TIMEOUT_MS": fmt.Sprint(callTimeout.Milliseconds()),
		},
	})
	flow(t, p, e, "w")
	g0 := p.metric("go_goroutines", nil)
	h0 := p.metric("go_memstats_heap_alloc_bytes", nil)
	require.Positive(t, g0, "go_goroutines is not exposed")
	require.Positive(t, h0, "go_memstats_heap_alloc_bytes is not exposed")
	rss0 := p.rss()
	shed0 := p.count("kvselect_epp_requests_total", labels{"status": "503"})

	// 8 requests hang in the tokenizer.
	holdCtx, release := context.WithCancel(t.Context())
	var held sync.WaitGroup
	for i := range maxInflight {
		held.Go(func() { _, _ = p.pick(holdCtx, fmt.Sprintf("held request %d", i)) })
	}
	p.eventually("8 requests hanging in the tokenizer", waitTimeout, func() bool {
		_, open, _ := tok.counts()
		return open == maxInflight && p.metric("kvselect_epp_inflight_requests", nil) == maxInflight
	})

	// Every further request is shed at once.
	for i := range shed {
		ctx, cancel := context.WithTimeout(t.Context(), waitTimeout)
		start := time.Now()
		d, err := p.pick(ctx, fmt.Sprintf("shed request %d", i))
		cancel()
		require.NoError(t, err)
		require.Equal(t, http.StatusServiceUnavailable, d.Status, "request %d beyond the bound", i)
		require.Less(t, time.Since(start), time.Second, "request %d waited instead of being shed", i)
	}
	p.alive()
	release()
	held.Wait()
	// The held requests' tokenizer calls outlive them (detached, bounded by
	// the call timeout) and keep their slots until then.
	p.eventually("the held requests' tokenizer calls ended", callTimeout+waitTimeout, func() bool {
		_, open, _ := tok.counts()
		return open == 0
	})

	// A storm of requests the client cancels.
	outcomes := map[string]int{}
	var mu sync.Mutex
	gPeak := 0.0
	stormStart := time.Now()
	for wave := 0; wave < stormWaves && time.Since(stormStart) < stormFor; wave++ {
		var wg sync.WaitGroup
		for i := range stormParallel {
			wg.Go(func() {
				ctx, cancel := context.WithTimeout(t.Context(), stormCancel)
				defer cancel()
				d, err := p.pick(ctx, fmt.Sprintf("storm %d/%d", wave, i))
				k := fmt.Sprint(d.Status)
				if err != nil {
					k = "cancelled"
				}
				mu.Lock()
				outcomes[k]++
				mu.Unlock()
			})
		}
		wg.Wait()
		gPeak = max(gPeak, p.metric("go_goroutines", nil))
	}
	p.alive()

	// Once the detached tokenizer calls time out, everything is released.
	p.eventually("goroutines back near the baseline", callTimeout+waitTimeout, func() bool {
		_, open, _ := tok.counts()
		return open == 0 && p.metric("go_goroutines", nil) <= g0+goroutineJoin
	})
	g1, h1, rss1 := p.metric("go_goroutines", nil), p.metric("go_memstats_heap_alloc_bytes", nil), p.rss()
	accepted, _, peaked := tok.counts()
	shedN := p.count("kvselect_epp_requests_total", labels{"status": "503"}) - shed0
	t.Logf("storm outcomes %v; 503s %v; goroutines %v -> peak %v -> %v; heap %.1f -> %.1f MiB; RSS %d -> %d MiB; tokenizer connections accepted %d, at most %d open",
		outcomes, shedN, g0, gPeak, g1, h0/(1<<20), h1/(1<<20), rss0>>20, rss1>>20, accepted, peaked)
	t.Logf("tokenizer errors: timeout %v, unavailable %v, canceled %v",
		p.count("kvselect_tokenizer_errors_total", labels{"kind": "timeout"}),
		p.count("kvselect_tokenizer_errors_total", labels{"kind": "unavailable"}),
		p.count("kvselect_tokenizer_errors_total", labels{"kind": "canceled"}))
	require.GreaterOrEqual(t, shedN, float64(shed))
	require.LessOrEqual(t, h1, h0+heapBound, "heap grew")
	require.Less(t, rss1-rss0, int64(rssBound), "RSS grew by %d MiB", (rss1-rss0)>>20)
	// MaxCalls = MaxInflight bounds the calls in progress; a connection the
	// EPP closed may be seen closing just after the next one is accepted.
	require.LessOrEqual(t, peaked, 2*maxInflight, "the hanging tokenizer held too many connections")
	flow(t, p, e, "w")
}
