package extproc

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/examples/internal/extproctest"
	"github.com/kvselect/kvselect/gaie"
)

// followSettler is a Settler and a Follower that records, in order, what it
// is told.
type followSettler struct {
	fakeSettler
	mu     sync.Mutex
	events []string
	body   strings.Builder
}

func (f *followSettler) log(e string) {
	f.mu.Lock()
	f.events = append(f.events, e)
	f.mu.Unlock()
}

func (f *followSettler) Served(ep string) { f.log("served " + ep) }
func (f *followSettler) ResponseHeaders(r Response) {
	line := "headers " + http.StatusText(r.Status) + " " + r.ContentType
	if r.PrefillFailed {
		line += " prefill-failed"
	}
	f.log(line)
}
func (f *followSettler) ResponseBody(chunk []byte) {
	f.mu.Lock()
	f.body.Write(chunk)
	f.mu.Unlock()
}
func (f *followSettler) FirstByte() { f.log("first byte"); f.fakeSettler.FirstByte() }
func (f *followSettler) Done()      { f.log("done"); f.fakeSettler.Done() }

// The destination goes out as the GAIE list (primary, then the valid,
// distinct fallbacks, in header and metadata alike); a Follower hears the
// served endpoint when it is a fallback, the response status and type, and
// every body byte; the debug value comes back as a response header.
func TestFallbackListFollowerAndDebugHeader(t *testing.T) {
	primary, fallback := newBackend(t, "primary"), newBackend(t, "fallback")
	var settlers []*followSettler
	var mu sync.Mutex
	picker := PickerFunc(func(context.Context, PickRequest) (Pick, error) {
		s := &followSettler{}
		mu.Lock()
		settlers = append(settlers, s)
		mu.Unlock()
		return Pick{
			Destination: primary.addr(),
			Fallbacks:   []string{fallback.addr(), "not-an-ip:80", primary.addr(), fallback.addr()},
			Debug:       "w=a/0 cost=1.5",
			Settle:      s,
		}, nil
	})
	rec := newFakeRecorder()
	h := newHarness(t, Options{Picker: picker, Metrics: rec})
	client := forwardClient(t)

	d, err := h.client.Do(testCtx(t), extproctest.HTTPRequest{Body: chatBody()})
	require.NoError(t, err)
	require.Equal(t, primary.addr()+","+fallback.addr(), d.Destination)
	require.Equal(t, d.Destination, d.MetadataDestination, "header and metadata carry the same list")

	// The primary cannot be reached: the gateway serves on the fallback.
	onFallback := func(_ string, req *http.Request) (*http.Response, error) {
		req.URL.Host = fallback.addr()
		return client.Do(req)
	}
	res, err := h.client.Roundtrip(testCtx(t), extproctest.HTTPRequest{Body: chatBody()}, onFallback)
	require.NoError(t, err)
	require.Equal(t, expectedBody("fallback"), string(res.Body))
	require.Equal(t, []string{"w=a/0 cost=1.5"}, res.Header[HeaderDebug])
	require.Equal(t, 1, rec.snapshot().mismatches)
	mu.Lock()
	s := settlers[1]
	mu.Unlock()
	require.Equal(t, []string{"served " + fallback.addr(), "headers OK text/event-stream", "first byte", "done"}, s.events)
	require.Equal(t, expectedBody("fallback"), s.body.String())

	// Served where picked: no Served call.
	res, err = h.client.Roundtrip(testCtx(t), extproctest.HTTPRequest{Body: chatBody()}, extproctest.HTTPForward(client))
	require.NoError(t, err)
	require.Equal(t, expectedBody("primary"), string(res.Body))
	mu.Lock()
	s = settlers[2]
	mu.Unlock()
	require.Equal(t, []string{"headers OK text/event-stream", "first byte", "done"}, s.events)
}

// A debug value that is not a short printable string is left out; the
// request is served without it.
func TestInvalidDebugHeaderIsLeftOut(t *testing.T) {
	b := newBackend(t, "b")
	for _, debug := range []string{"bad\nvalue", strings.Repeat("x", MaxDebugLen+1)} {
		picker := PickerFunc(func(context.Context, PickRequest) (Pick, error) {
			return Pick{Destination: b.addr(), Debug: debug}, nil
		})
		h := newHarness(t, Options{Picker: picker})
		res, err := h.client.Roundtrip(testCtx(t), extproctest.HTTPRequest{Body: chatBody()}, extproctest.HTTPForward(forwardClient(t)))
		require.NoError(t, err)
		require.Equal(t, http.StatusOK, res.StatusCode)
		require.Empty(t, res.Header[HeaderDebug])
	}
}

// A decode sidecar's report that the prefill leg failed reaches the
// Follower with the status, and the header does not reach the client.
func TestFailedPrefillLegReachesTheFollower(t *testing.T) {
	sidecar := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set(gaie.HeaderFailedLeg, gaie.FailedLegPrefill)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusBadGateway)
		_, _ = io.WriteString(w, `{"error":{"code":"prefill_upstream_unavailable"}}`)
	}))
	t.Cleanup(sidecar.Close)
	s := &followSettler{}
	picker := PickerFunc(func(context.Context, PickRequest) (Pick, error) {
		return Pick{Destination: sidecar.Listener.Addr().String(), Settle: s}, nil
	})
	h := newHarness(t, Options{Picker: picker})
	res, err := h.client.Roundtrip(testCtx(t), extproctest.HTTPRequest{Body: chatBody()}, extproctest.HTTPForward(forwardClient(t)))
	require.NoError(t, err)
	require.Equal(t, http.StatusBadGateway, res.StatusCode)
	require.Empty(t, res.Header[gaie.HeaderFailedLeg], "the routing layer's header stays with the EPP")
	s.mu.Lock()
	defer s.mu.Unlock()
	require.Equal(t, []string{"headers Bad Gateway application/json prefill-failed", "first byte", "done"}, s.events)
}
