package selection

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/internal/fakeengine"
)

// bindRig is a service whose engines dial into its bind listener.
type bindRig struct {
	t *testing.T
	s *SelectionService
}

func newBindRig(t *testing.T, anyPeer bool) *bindRig {
	t.Helper()
	b := NewSelectionServiceBuilder(DefaultConfig(rigBlock)).SweepInterval(-1).BindEvents("tcp://127.0.0.1:0").
		EventFeed(FeedOptions{ReconnectMin: time.Millisecond, ReconnectMax: 10 * time.Millisecond})
	if anyPeer {
		b = b.BindEventsFromAnyPeer()
	}
	s, err := b.Build(context.Background())
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	return &bindRig{t: t, s: s}
}

func (r *bindRig) worker(id, endpoint string) {
	r.t.Helper()
	_, err := r.s.Workers().Upsert(catalog.Worker{ID: id, Endpoint: endpoint, DPSize: 1, BlockSize: rigBlock})
	require.NoError(r.t, err)
}

// engine starts a fake engine that dials the listener (from 127.0.0.1) and
// publishes under topic; started reports whether its connection was taken.
func (r *bindRig) engine(topic string) (e *fakeengine.Engine, started bool) {
	r.t.Helper()
	e, err := fakeengine.New(fakeengine.Options{BlockSize: rigBlock, CapacityBlocks: 4096, DialAttempts: 5,
		PubMode: fakeengine.PubDial, PubEndpoint: "tcp://" + r.s.Events().BindAddr().String(), Topic: topic})
	require.NoError(r.t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err = e.Start(ctx)
	r.t.Cleanup(func() { _ = e.Close() })
	return e, err == nil
}

// serveUntil serves fresh prompts on e until cond holds (a PUB that dials in
// drops what it sends before its connection is up).
func (r *bindRig) serveUntil(e *fakeengine.Engine, cond func() bool) []uint32 {
	r.t.Helper()
	var last []uint32
	seed := 1
	require.Eventually(r.t, func() bool {
		last = toks(4*rigBlock, seed)
		seed++
		_, err := e.Serve(fakeengine.Request{Tokens: last})
		require.NoError(r.t, err)
		return cond()
	}, 20*time.Second, 5*time.Millisecond)
	return last
}

func (r *bindRig) overlap(id string, tokens []uint32) int {
	r.t.Helper()
	ov, err := overlapScores(r.s, context.Background(), Request{Tokens: tokens})
	require.NoError(r.t, err)
	return ov[catalog.WorkerRank{WorkerID: id}].Device
}

func TestBindRefusesPeersAtNoWorkersAddress(t *testing.T) {
	r := newBindRig(t, false)
	r.worker("w", "127.0.0.2:8000") // the engine dials from 127.0.0.1
	e, _ := r.engine("kv@127.0.0.2@m")
	require.Eventually(t, func() bool { return r.s.Events().Refusals()["not_admitted"] > 0 }, 20*time.Second, 5*time.Millisecond)
	for i := range 20 {
		_, err := e.Serve(fakeengine.Request{Tokens: toks(4*rigBlock, i+1)})
		require.NoError(t, err)
	}
	require.Empty(t, r.s.Events().Sources(), "nothing attributed")
	require.Zero(t, r.overlap("w", toks(4*rigBlock, 1)))
}

func TestBindTakesOnlyTheSendersOwnTopic(t *testing.T) {
	r := newBindRig(t, false)
	r.worker("a", "127.0.0.1:8000")
	r.worker("b", "127.0.0.2:8000")
	r.worker("c", "127.0.0.1:9000")          // shares a's host
	forged, ok := r.engine("kv@127.0.0.2@m") // b's topic, from a's address
	require.True(t, ok)
	ambiguous, ok := r.engine("kv@127.0.0.1@m") // a's and c's host
	require.True(t, ok)
	own, ok := r.engine("kv@127.0.0.1:8000@m")
	require.True(t, ok)
	r.serveUntil(forged, func() bool { return r.s.Events().Refusals()["topic_refused"] >= 2 })
	r.serveUntil(ambiguous, func() bool { return r.s.Events().Refusals()["topic_refused"] >= 4 })
	p := r.serveUntil(own, func() bool { return len(r.s.Events().Sources()) == 1 })
	st := r.s.Events().Sources()
	require.Len(t, st, 1)
	require.Equal(t, "a", st[0].Worker.WorkerID)
	require.Eventually(t, func() bool { return r.overlap("a", p) == 4 }, 20*time.Second, 5*time.Millisecond)
	require.Zero(t, r.overlap("b", p))
	require.Zero(t, r.overlap("c", p))

	// An endpoint change is another engine: a's blocks and its attribution go.
	_, err := r.s.Workers().Upsert(catalog.Worker{ID: "a", Endpoint: "127.0.0.1:8001", DPSize: 1, BlockSize: rigBlock})
	require.NoError(t, err)
	require.Zero(t, r.overlap("a", p))
	require.Empty(t, r.s.Events().Sources())
}

func TestBindFromAnyPeerAdmitsEveryAddress(t *testing.T) {
	r := newBindRig(t, true)
	r.worker("w", "127.0.0.2:8000")
	e, ok := r.engine("kv@127.0.0.2@m")
	require.True(t, ok)
	p := r.serveUntil(e, func() bool { return len(r.s.Events().Sources()) == 1 })
	require.Eventually(t, func() bool { return r.overlap("w", p) == 4 }, 20*time.Second, 5*time.Millisecond)
	require.Empty(t, r.s.Events().Refusals())
}
