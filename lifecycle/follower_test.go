package lifecycle_test

import (
	"errors"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/lifecycle"
)

// recorder is a Handle that records its calls, one line each.
type recorder struct {
	mu    sync.Mutex
	calls []string
	move  error // what Move answers
	renew error // what Renew answers
}

func (r *recorder) log(s string) {
	r.mu.Lock()
	r.calls = append(r.calls, s)
	r.mu.Unlock()
}

func (r *recorder) PrefillComplete() error { r.log("prefill"); return nil }
func (r *recorder) Renew() error           { r.log("renew"); return r.renew }
func (r *recorder) Generated(tokens int) error {
	r.log("generated " + strings.Repeat("|", tokens))
	return nil
}
func (r *recorder) Move(to catalog.WorkerRank) error { r.log("move " + to.WorkerID); return r.move }
func (r *recorder) MarkFailed() error                { r.log("failed"); return nil }
func (r *recorder) Done() error                      { r.log("done"); return errors.New("gone") }

func (r *recorder) take() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := r.calls
	r.calls = nil
	return out
}

func follow(t *testing.T, opts lifecycle.Options) (*lifecycle.Follower, *recorder, *[]lifecycle.Cause) {
	t.Helper()
	h := &recorder{}
	var causes []lifecycle.Cause
	opts.Marked = func(c lifecycle.Cause, err error) {
		require.NoError(t, err)
		causes = append(causes, c)
	}
	f, err := lifecycle.NewFollower(h, opts)
	require.NoError(t, err)
	return f, h, &causes
}

func TestNewFollowerNeedsAHandle(t *testing.T) {
	_, err := lifecycle.NewFollower(nil, lifecycle.Options{})
	require.ErrorIs(t, err, lifecycle.ErrNoHandle)
}

// A streamed 2xx answer: the first chunk is the first output, the data lines
// are the output so far (split anywhere), Done once whatever the repeats.
func TestFollowAStream(t *testing.T) {
	f, h, causes := follow(t, lifecycle.Options{OutputGrowth: true})
	f.Response(200, "text/event-stream; charset=utf-8")
	require.True(t, f.Body([]byte("data: {\"a\"}\n\nda")))
	require.False(t, f.Body([]byte("ta: {\"b\"}\n\n")), "only the first chunk is the first output")
	require.False(t, f.Body(nil), "an empty chunk is nothing")
	require.False(t, f.Body([]byte(": a comment, not data\n\n")))
	require.Equal(t, []string{"prefill", "generated |", "generated ||"}, h.take())
	require.EqualError(t, f.Done(), "gone", "the first Done returns the handle's answer")
	require.NoError(t, f.Done())
	require.Equal(t, []string{"done"}, h.take())
	require.Empty(t, *causes)
}

// Output growth counts only a 2xx event stream, and only when it is on.
func TestFollowCountsOnlyAStream(t *testing.T) {
	for _, tc := range []struct {
		name   string
		growth bool
		status int
		ct     string
	}{
		{"growth off", false, 200, "text/event-stream"},
		{"not a stream", true, 200, "application/json"},
		{"not 2xx", true, 429, "text/event-stream"},
		{"status unknown", true, 0, "text/event-stream"},
		{"a bad content type", true, 200, "text/event-stream; ;;"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f, h, _ := follow(t, lifecycle.Options{OutputGrowth: tc.growth})
			f.Response(tc.status, tc.ct)
			f.Body([]byte("data: x\n\ndata: y\n\n"))
			for _, c := range h.take() {
				require.NotContains(t, c, "generated")
			}
		})
	}
}

// A failure status marks the worker once; the body of an error answer is no
// first output. A 4xx, 501 and 505 are the request's answer, not the
// worker's health.
func TestFollowAFailureStatus(t *testing.T) {
	for code, want := range map[int]bool{500: true, 502: true, 503: true, 504: true, 507: true, 599: true,
		501: false, 505: false, 400: false, 404: false, 413: false, 429: false, 499: false, 200: false, 0: false, 600: false} {
		require.Equal(t, want, lifecycle.FailureStatus(code), "status %d", code)
	}
	f, h, causes := follow(t, lifecycle.Options{})
	f.Response(503, "application/json")
	require.False(t, f.Body([]byte(`{"error":"overloaded"}`)))
	f.Fail()
	require.Equal(t, []string{"failed"}, h.take(), "marked once, no first output")
	require.Equal(t, []lifecycle.Cause{lifecycle.CauseStatus}, *causes)

	f, h, causes = follow(t, lifecycle.Options{FailureStatus: func(code int) bool { return code == 429 }})
	f.Response(429, "")
	f.Response(503, "")
	require.Equal(t, []string{"failed"}, h.take(), "the caller's FailureStatus decides")
	require.Equal(t, []lifecycle.Cause{lifecycle.CauseStatus}, *causes)
}

// pairRecorder is a Handle with a prefill leg of its own.
type pairRecorder struct{ recorder }

func (r *pairRecorder) MarkPrefillFailed() error { r.log("prefill failed"); return nil }

// A failed prefill leg (the decode sidecar's report) marks the prefill
// worker, not the destination, even when the failure status follows; a
// handle without a prefill leg is marked for nothing.
func TestFollowAFailedPrefillLeg(t *testing.T) {
	h := &pairRecorder{}
	var causes []lifecycle.Cause
	f, err := lifecycle.NewFollower(h, lifecycle.Options{Marked: func(c lifecycle.Cause, err error) {
		require.NoError(t, err)
		causes = append(causes, c)
	}})
	require.NoError(t, err)
	f.PrefillFailed()
	f.Response(502, "application/json")
	f.Fail()
	f.PrefillFailed()
	require.Equal(t, []string{"prefill failed"}, h.take(), "the prefill worker marked, once; the destination never")
	require.Equal(t, []lifecycle.Cause{lifecycle.CausePrefill}, causes)
	require.Equal(t, "prefill", lifecycle.CausePrefill.String())

	f, plain, plainCauses := follow(t, lifecycle.Options{})
	f.PrefillFailed()
	f.Response(502, "")
	require.Empty(t, plain.take(), "no prefill leg to mark, and the destination is not to blame")
	require.Empty(t, *plainCauses)
}

// Served by a fallback: the pick is marked failed, then the booking moves;
// by a retry elsewhere: it moves only. Move's error goes to the caller.
func TestFollowServedElsewhere(t *testing.T) {
	f, h, causes := follow(t, lifecycle.Options{})
	require.NoError(t, f.Served(catalog.WorkerRank{WorkerID: "b"}, true))
	require.Equal(t, []string{"failed", "move b"}, h.take())
	require.Equal(t, []lifecycle.Cause{lifecycle.CauseFallback}, *causes)

	f, h, causes = follow(t, lifecycle.Options{})
	h.move = errors.New("no such rank")
	require.EqualError(t, f.Served(catalog.WorkerRank{WorkerID: "c"}, false), "no such rank")
	require.Equal(t, []string{"move c"}, h.take())
	require.Empty(t, *causes)
	f.Fail()
	f.Fail()
	require.Equal(t, []string{"failed"}, h.take())
	require.Equal(t, []lifecycle.Cause{lifecycle.CauseUpstream}, *causes)
	require.Equal(t, "upstream", lifecycle.CauseUpstream.String())
	require.Equal(t, "unknown", lifecycle.Cause(0).String())
}

// Renew renews before the body and while chunks come, skips a stalled
// stream, and stops at Done.
func TestFollowRenews(t *testing.T) {
	f, h, _ := follow(t, lifecycle.Options{})
	renewed, stalled := f.Renew()
	require.True(t, renewed, "nothing came yet: the worker prefills")
	require.False(t, stalled)
	renewed, _ = f.Renew()
	require.True(t, renewed, "still nothing: still prefilling")
	f.Response(200, "application/json")
	f.Body([]byte("{"))
	renewed, _ = f.Renew()
	require.True(t, renewed, "a chunk came")
	renewed, stalled = f.Renew()
	require.False(t, renewed)
	require.True(t, stalled, "nothing since the last tick")
	f.Body([]byte("}"))
	h.renew = errors.New("gone")
	renewed, stalled = f.Renew()
	require.False(t, renewed, "the handle refused")
	require.False(t, stalled)
	require.Equal(t, []string{"renew", "renew", "prefill", "renew", "renew"}, h.take())
	_ = f.Done()
	renewed, stalled = f.Renew()
	require.False(t, renewed || stalled)
	require.Equal(t, []string{"done"}, h.take())
}

// Done races itself and the owner's ticks: one Done reaches the handle.
func TestFollowDoneOnce(t *testing.T) {
	f, h, _ := follow(t, lifecycle.Options{})
	var wg sync.WaitGroup
	wg.Go(func() {
		for range 100 {
			f.Renew()
		}
	})
	for range 8 {
		wg.Go(func() { _ = f.Done() })
	}
	wg.Wait()
	n := 0
	for _, c := range h.take() {
		if c == "done" {
			n++
		}
	}
	require.Equal(t, 1, n)
}

// Data lines are counted wherever the chunks split them, and only at the
// start of a line.
func TestFollowCountsDataLinesAcrossChunks(t *testing.T) {
	stream := "data: a\n\n: comment data: no\n\nevent: x\ndata: b\ndata:c\n\nid: 1 data:\ndata: [DONE]\n\n"
	for split := 1; split < len(stream); split++ {
		f, h, _ := follow(t, lifecycle.Options{OutputGrowth: true})
		f.Response(200, "text/event-stream")
		f.Body([]byte(stream[:split]))
		f.Body([]byte(stream[split:]))
		calls := h.take()
		require.Equal(t, "generated ||||", calls[len(calls)-1], "split at %d", split)
	}
	f, h, _ := follow(t, lifecycle.Options{OutputGrowth: true})
	f.Response(200, "text/event-stream")
	f.Body([]byte("dat"))
	f.Body([]byte("a: x"))
	f.Body([]byte(" more data: not a line start\n"))
	require.Equal(t, []string{"prefill", "generated |"}, h.take())
}
