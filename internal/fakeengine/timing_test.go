package fakeengine

import (
	"bufio"
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/internal/enginemodel"
)

// The runner steps the model in (fake) real time: a lone request's first
// token after the overhead and one step, a second one queued behind it for
// the single seat, a request that leaves freeing its seat at once.
func TestModelRunner(t *testing.T) {
	ms := time.Millisecond
	synctest.Test(t, func(t *testing.T) {
		r, err := newModelRunner(enginemodel.Params{RequestOverhead: ms, StepBase: 10 * ms, PrefillToken: -1, DecodeSeq: -1, MaxRunning: 1})
		require.NoError(t, err)
		r.start()
		go r.run()
		defer func() { r.halt(); <-r.done }()
		ctx := context.Background()
		start := time.Now()

		a := modelPacer{r: r, w: r.add(100, 3, 0), out: 3}
		time.Sleep(5 * ms)
		b := modelPacer{r: r, w: r.add(100, 1, 0), out: 1}
		require.True(t, a.first(ctx))
		require.Equal(t, 11*ms, time.Since(start), "1 ms overhead, one 10 ms step")
		require.True(t, a.token(ctx, 3))
		require.Equal(t, 31*ms, time.Since(start), "two decode steps")
		require.True(t, b.all(ctx))
		require.Equal(t, 41*ms, time.Since(start), "b waited for the seat")
		ttft, ok := b.ttft()
		require.True(t, ok)
		require.Equal(t, 36*ms, ttft)

		// A request that leaves frees its seat for the next step.
		c := modelPacer{r: r, w: r.add(1, 1000, 0), out: 1000}
		d := modelPacer{r: r, w: r.add(1, 1, 0), out: 1}
		require.True(t, c.first(ctx))
		c.release()
		c.release()
		cStart := time.Now()
		require.True(t, d.first(ctx))
		// c leaves at once, or after the decode step that may have begun
		// with its first token; not after its 999 other tokens.
		require.LessOrEqual(t, time.Since(cStart), 20*ms, "d's step follows c's last one")

		// A transfer delay postpones the request.
		e := modelPacer{r: r, w: r.add(1, 1, 50*ms), out: 1}
		eStart := time.Now()
		require.True(t, e.all(ctx))
		require.Equal(t, 61*ms, time.Since(eStart))
		ttft, _ = e.ttft()
		require.Equal(t, 61*ms, ttft, "the transfer counts in the TTFT")

		// A waiter gives up when its context ends or the runner stops.
		f := modelPacer{r: r, w: r.add(1, 1, time.Hour), out: 1}
		cctx, cancel := context.WithTimeout(ctx, 5*ms)
		require.False(t, f.first(cctx))
		cancel()
		r.halt()
		require.False(t, f.first(ctx))
	})
}

// A SleepTTFT engine over HTTP: the answer's first byte waits for the model's
// first token, and the usage block reports the model's TTFT, exact for a
// request alone on the engine (1 ms overhead, then a 30 ms step and 20 us per
// prompt token).
func TestHTTPModelTiming(t *testing.T) {
	r := startHTTP(t, Options{SleepTTFT: true, Timing: enginemodel.Params{StepBase: 30 * time.Millisecond}})
	body := `{"prompt":"the quick brown fox","max_tokens":3,"stream":true,"stream_options":{"include_usage":true}}`
	start := time.Now()
	resp, data := r.post(t, "/v1/completions", body)
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", data)
	require.GreaterOrEqual(t, time.Since(start), 91*time.Millisecond, "three steps")
	var usage struct {
		Usage struct {
			PromptTokens  int     `json:"prompt_tokens"`
			SimulatedTTFT float64 `json:"simulated_ttft_ms"`
		} `json:"usage"`
	}
	sc := bufio.NewScanner(strings.NewReader(string(data)))
	chunks := 0
	for sc.Scan() {
		line, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok || line == "[DONE]" {
			continue
		}
		chunks++
		if strings.Contains(line, `"usage"`) {
			require.NoError(t, json.Unmarshal([]byte(line), &usage))
		}
	}
	require.Equal(t, 4, chunks, "three tokens and the usage")
	want := 1 + 30 + 0.02*float64(usage.Usage.PromptTokens)
	require.InDelta(t, want, usage.Usage.SimulatedTTFT, 1e-6)
	// The header went out before the first token: the formula's estimate.
	require.Equal(t, strconvMs(DefaultTTFTBase+time.Duration(usage.Usage.PromptTokens)*DefaultPerTokenPrefill), resp.Header.Get(HeaderTTFT))

	o := r.e.Options().Timing
	require.Equal(t, DefaultTTFTBase, o.RequestOverhead, "TTFTBase is the default overhead")
	require.Equal(t, DefaultPerTokenPrefill, o.PrefillToken)
	require.Equal(t, enginemodel.DefaultMaxBatchedTokens, o.MaxBatchedTokens)
}

func strconvMs(d time.Duration) string {
	b, _ := json.Marshal(durationMs(d))
	s := string(b)
	if !strings.Contains(s, ".") {
		s += "."
	}
	for len(s[strings.Index(s, ".")+1:]) < 3 {
		s += "0"
	}
	return s
}

// A client that goes away takes its request out of the model: the request
// queued behind it for the only seat is then served.
func TestHTTPModelCancelFreesSeat(t *testing.T) {
	r := startHTTP(t, Options{SleepTTFT: true, Timing: enginemodel.Params{MaxRunning: 1}})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, r.base+"/v1/completions",
		strings.NewReader(`{"prompt":"a long answer","max_tokens":20000,"stream":true}`))
	require.NoError(t, err)
	resp, err := r.c.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	line, err := bufio.NewReader(resp.Body).ReadString('\n')
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(line, "data: "), line)
	cancel()
	require.Eventually(t, func() bool { return r.e.HTTPStats().Aborted == 1 }, testTimeout, pollInterval)
	resp2, data := r.post(t, "/v1/completions", `{"prompt":"next","max_tokens":2}`)
	require.Equal(t, http.StatusOK, resp2.StatusCode, "%s", data)
}

func TestTimingOptions(t *testing.T) {
	_, err := New(Options{Timing: enginemodel.Params{MaxRunning: 10, MaxBatchedTokens: 5, Speed: -1}})
	require.ErrorIs(t, err, ErrInvalidOptions)
	require.ErrorContains(t, err, "Timing: MaxBatchedTokens 5 < MaxRunning 10; Speed -1")
	_, err = New(Options{Timing: enginemodel.Params{Cached: func(uint64) int { return 0 }}})
	require.ErrorContains(t, err, "Timing.Cached must be nil")
	e, err := New(Options{TTFTBase: 7 * time.Millisecond, Timing: enginemodel.Params{Speed: 0.5}})
	require.NoError(t, err)
	require.Equal(t, 7*time.Millisecond, e.Options().Timing.RequestOverhead)
	require.Equal(t, 0.5, e.Options().Timing.Speed)
}
