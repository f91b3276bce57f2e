package selection

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/internal/fakeengine"
	"github.com/kvselect/kvselect/kvindex"
)

// warmRig is a set of fake engines (real ZeroMQ PUB and replay ROUTER) and
// the workers that name them, split over two models.
type warmRig struct {
	t       *testing.T
	engines []*fakeengine.Engine
	workers []catalog.Worker
	rng     *rand.Rand
}

func newWarmRig(t *testing.T, n, replayBuffer int) *warmRig {
	t.Helper()
	r := &warmRig{t: t, rng: rand.New(rand.NewPCG(5, 5))}
	for i := range n {
		e, err := fakeengine.New(fakeengine.Options{BlockSize: 4, CapacityBlocks: 96, EnableReplay: true, ReplayBuffer: replayBuffer})
		require.NoError(t, err)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		require.NoError(t, e.Start(ctx))
		cancel()
		t.Cleanup(func() { _ = e.Close() })
		r.engines = append(r.engines, e)
		r.workers = append(r.workers, catalog.Worker{
			ID: fmt.Sprintf("e%d", i), Model: []string{"m1", "m2"}[i%2], Endpoint: fmt.Sprintf("127.0.0.%d:8000", i+1),
			DPSize: 1, BlockSize: 4, TotalKVBlocks: 96,
			KVEventEndpoints: map[int]string{0: e.PubEndpoint()}, ReplayEndpoint: e.ReplayEndpoint(),
		})
	}
	return r
}

// service builds a service following every engine.
func (r *warmRig) service() *SelectionService {
	r.t.Helper()
	s, err := NewSelectionServiceBuilder(DefaultConfig(4)).SweepInterval(-1).
		EventFeed(FeedOptions{ReconnectMin: time.Millisecond, ReconnectMax: 10 * time.Millisecond}).Build(context.Background())
	require.NoError(r.t, err)
	r.t.Cleanup(func() { _ = s.Close() })
	for _, w := range r.workers {
		_, err := s.Workers().Upsert(w)
		require.NoError(r.t, err)
	}
	// A PUB drops what it sends before a subscription reaches it, and an
	// engine cannot tell its subscribers apart: publish until s has heard
	// every engine live (what it missed meanwhile it replays).
	require.Eventually(r.t, func() bool {
		st := s.Events().Sources()
		heard := len(st) == len(r.engines)
		for i, e := range r.engines {
			if !heard || st[i].Received == 0 {
				heard = false
				_, err := e.Serve(fakeengine.Request{Tokens: r.prompt()})
				require.NoError(r.t, err)
			}
		}
		return heard
	}, 10*time.Second, 5*time.Millisecond)
	return s
}

// prompt draws a request from a few shared prefixes.
func (r *warmRig) prompt() []uint32 {
	g := r.rng.IntN(6)
	p := make([]uint32, 0, 64)
	for i := range 8 + 4*g {
		p = append(p, uint32(g*1000+i))
	}
	for range r.rng.IntN(30) + 1 {
		p = append(p, uint32(r.rng.IntN(40)+10000))
	}
	return p
}

// serve sends n requests drawn from a few shared prefixes to random engines.
func (r *warmRig) serve(n int) {
	for range n {
		_, err := r.engines[r.rng.IntN(len(r.engines))].Serve(fakeengine.Request{Tokens: r.prompt()})
		require.NoError(r.t, err)
	}
}

// converge waits until s applied every batch every engine numbered.
func (r *warmRig) converge(s *SelectionService) {
	r.t.Helper()
	require.Eventually(r.t, func() bool {
		st := s.Events().Sources()
		if len(st) != len(r.engines) {
			return false
		}
		for i, e := range r.engines {
			if x := st[i]; e.NextSeq() > 0 && (x.Applied == 0 || x.Watermark != e.NextSeq()-1 || x.Queued > 0) {
				return false
			}
		}
		return true
	}, 20*time.Second, 2*time.Millisecond)
}

func indexBytes(t *testing.T, s *SelectionService) []byte {
	t.Helper()
	var buf bytes.Buffer
	require.NoError(t, s.Events().WriteSnapshot(&buf))
	return buf.Bytes()
}

// TestIndexSnapshotWarmStart: a service that joins after 1,000 requests, when
// the engines can replay only their last 40 batches each, loads a peer's
// snapshot taken while the engines kept publishing, and ends with an index
// equal to the peer's, byte for byte (every model, every rank's blocks,
// tiers and chains, and each source's last batch); without the snapshot it
// would not.
func TestIndexSnapshotWarmStart(t *testing.T) {
	r := newWarmRig(t, 3, 40)
	peer := r.service()
	r.serve(1000)
	r.converge(peer)

	joiner := r.service()
	r.serve(30) // applied live by both
	r.converge(joiner)
	require.NotEqual(t, indexBytes(t, peer), indexBytes(t, joiner), "the joiner rebuilt the history cold: the test proves nothing")

	var snap bytes.Buffer
	require.NoError(t, peer.Events().WriteSnapshot(&snap))
	r.serve(30) // after the cut: the joiner's resume replays them
	rep, err := joiner.Events().LoadSnapshot(context.Background(), &snap)
	require.NoError(t, err)
	require.Equal(t, IndexLoad{Models: 2, Sources: 3, Resumed: 3}, rep)
	r.serve(30)
	r.converge(peer)
	r.converge(joiner)
	require.Equal(t, indexBytes(t, peer), indexBytes(t, joiner))
	for _, st := range joiner.Events().Sources() {
		require.False(t, st.Degraded, "%v", st.Worker)
		require.EqualValues(t, 1, st.Resumes, "%v", st.Worker)
	}
}

// TestIndexSnapshotSkipsUnknownWorkers: sources of workers the joiner does
// not have, or has under another model, are skipped; the others load.
func TestIndexSnapshotSkipsUnknownWorkers(t *testing.T) {
	r := newWarmRig(t, 3, 0)
	peer := r.service()
	r.serve(100)
	r.converge(peer)
	snap := indexBytes(t, peer)

	joiner := r.service()
	_, err := joiner.Workers().Delete("e0")
	require.NoError(t, err)
	moved := r.workers[1]
	moved.Model = "m3"
	_, err = joiner.Workers().Upsert(moved)
	require.NoError(t, err)
	rep, err := joiner.Events().LoadSnapshot(context.Background(), bytes.NewReader(snap))
	require.NoError(t, err)
	require.Equal(t, IndexLoad{Models: 2, Sources: 3, Resumed: 1, Skipped: 2}, rep)
}

// TestIndexSnapshotRefused: a damaged, truncated, foreign or oversized
// snapshot changes nothing and says why; a service without the built-in feed
// has no snapshot to write or load.
func TestIndexSnapshotRefused(t *testing.T) {
	r := newWarmRig(t, 2, 0)
	peer := r.service()
	r.serve(50)
	r.converge(peer)
	snap := indexBytes(t, peer)
	joiner := r.service()
	// The joiner may still be replaying what the engines published while it
	// subscribed: let it settle so that only a snapshot could change it.
	r.converge(joiner)
	before := indexBytes(t, joiner)

	flip := bytes.Clone(snap)
	flip[len(flip)/2] ^= 0x10
	wrongModels := bytes.Clone(snap)
	binary.LittleEndian.PutUint32(wrongModels[12:], maxWarmModels+1)
	version := bytes.Clone(snap)
	version[8] = 9
	for name, c := range map[string]struct {
		in   []byte
		want error
	}{
		"flipped":   {flip, kvindex.ErrSnapshotCorrupt},
		"truncated": {snap[:len(snap)-3], kvindex.ErrSnapshotCorrupt},
		"empty":     {nil, kvindex.ErrSnapshotCorrupt},
		"magic":     {append([]byte("KVSELIDY"), snap[8:]...), kvindex.ErrSnapshotCorrupt},
		"version":   {version, kvindex.ErrSnapshotVersion},
		"models":    {wrongModels, kvindex.ErrSnapshotLimit},
		"trailing":  {append(bytes.Clone(snap[:len(snap)-4]), 1, 2, 3, 4), kvindex.ErrSnapshotCorrupt},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := joiner.Events().LoadSnapshot(context.Background(), bytes.NewReader(c.in))
			require.ErrorIs(t, err, c.want)
			require.ErrorIs(t, err, ErrBadRequest)
		})
	}
	require.Equal(t, before, indexBytes(t, joiner), "a refused snapshot changed the index")

	other, err := NewSelectionServiceBuilder(DefaultConfig(8)).SweepInterval(-1).Build(context.Background())
	require.NoError(t, err)
	defer other.Close()
	_, err = other.Events().LoadSnapshot(context.Background(), bytes.NewReader(snap))
	require.ErrorIs(t, err, kvindex.ErrBlockSize)

	cfg := DefaultConfig(4)
	cfg.UseKVEvents = false
	approx, err := NewSelectionServiceBuilder(cfg).SweepInterval(-1).Build(context.Background())
	require.NoError(t, err)
	defer approx.Close()
	require.ErrorIs(t, approx.Events().WriteSnapshot(&bytes.Buffer{}), ErrBadRequest)
	_, err = approx.Events().LoadSnapshot(context.Background(), bytes.NewReader(snap))
	require.ErrorIs(t, err, ErrBadRequest)
}

// FuzzReadIndexSnapshot: no input makes the reader panic, fail with
// anything but its sentinels, or accept a snapshot that does not read back
// the same once written again. Each input is also tried with its trailer
// repaired, so that mutations reach the parser behind the checksum.
func FuzzReadIndexSnapshot(f *testing.F) {
	ix, _ := kvindex.New(kvindex.Options{BlockSize: 4})
	w := catalog.WorkerRank{WorkerID: "a"}
	_ = ix.Apply(w, kvindex.Event{Kind: kvindex.EventStored, BlockHashes: []uint64{1, 2}, Tokens: []uint32{1, 2, 3, 4, 5, 6, 7, 8}})
	seed := encodeWarm(f, []indexCut{{model: "m", snap: ix.Snapshot(), sources: map[catalog.WorkerRank]uint64{w: 7}}})
	f.Add(seed)
	f.Add(seed[:20])
	f.Add(encodeWarm(f, nil))
	f.Fuzz(func(t *testing.T, b []byte) {
		inputs := [][]byte{b}
		if len(b) >= 4 {
			fixed := bytes.Clone(b)
			binary.LittleEndian.PutUint32(fixed[len(b)-4:], crc32.Checksum(b[:len(b)-4], crc32.MakeTable(crc32.Castagnoli)))
			inputs = append(inputs, fixed)
		}
		for _, in := range inputs {
			parts, err := readIndexSnapshot(bytes.NewReader(in), 4)
			if err != nil {
				require.ErrorIs(t, err, ErrBadRequest)
				require.Nil(t, parts)
				continue
			}
			again := encodeWarm(t, cutsOf(parts))
			parts2, err := readIndexSnapshot(bytes.NewReader(again), 4)
			require.NoError(t, err)
			require.Equal(t, again, encodeWarm(t, cutsOf(parts2)))
			for i := range parts {
				require.Equal(t, parts[i].model, parts2[i].model)
				require.Equal(t, parts[i].sources, parts2[i].sources)
			}
		}
	})
}

func cutsOf(parts []loadedPart) []indexCut {
	cuts := make([]indexCut, len(parts))
	for i, p := range parts {
		cuts[i] = indexCut{model: p.model, snap: p.ix.Snapshot(), sources: p.sources}
	}
	return cuts
}

// encodeWarm is EventPlane.WriteSnapshot's encoding of cuts.
func encodeWarm(t testing.TB, cuts []indexCut) []byte {
	var buf bytes.Buffer
	require.NoError(t, writeIndexCuts(&buf, cuts))
	return buf.Bytes()
}
