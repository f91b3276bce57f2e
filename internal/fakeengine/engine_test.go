package fakeengine

import (
	"context"
	"net"
	"strings"
	"sync"
	"testing"

	"github.com/go-zeromq/zmq4"
	"github.com/stretchr/testify/require"
)

func TestLiveFramesInOrder(t *testing.T) {
	e := startEngine(t, Options{BlockSize: 4, Encoding: EncodingArray})
	require.True(t, strings.HasPrefix(e.PubEndpoint(), "tcp://127.0.0.1:"))
	require.NotEqual(t, "tcp://127.0.0.1:0", e.PubEndpoint())
	require.Empty(t, e.ReplayEndpoint(), "replay disabled")
	sub := subscribe(t, e)

	prompts := [][]uint32{seqTokens(0, 8), seqTokens(0, 12), seqTokens(100, 4)}
	for _, p := range prompts {
		_, err := e.Serve(Request{Tokens: p})
		require.NoError(t, err)
	}
	h1, h2 := e.BlockHashes(prompts[1], "", ""), e.BlockHashes(prompts[2], "", "")
	wantRuns := [][]uint64{h1[:2], h1[2:], h2}
	for i, want := range wantRuns {
		seq, payload := recvLive(t, sub, DefaultTopic)
		require.Equal(t, uint64(i), seq)
		d := decodeBatch(t, payload)
		require.Equal(t, int64(0), asInt(t, d.dp))
		require.Len(t, d.events, 1)
		require.Equal(t, want, asHashes(t, d.events[0]["block_hashes"]))
	}
	st := e.Stats()
	require.Equal(t, uint64(3), st.LiveSent)
	require.Equal(t, uint64(3), st.NextSeq)
}

func TestEmptyTopicFrame(t *testing.T) {
	e := startEngine(t, Options{EmptyTopic: true})
	sub := subscribe(t, e)
	_, err := e.PublishEvents(Event{Kind: AllBlocksCleared})
	require.NoError(t, err)
	seq, payload := recvLive(t, sub, "")
	require.Zero(t, seq)
	require.Equal(t, "AllBlocksCleared", decodeBatch(t, payload).events[0]["type"])
}

func TestPubDialIntoBoundSub(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	sub := zmq4.NewSub(ctx)
	defer sub.Close()
	require.NoError(t, sub.SetOption(zmq4.OptionSubscribe, "kv@"))
	require.NoError(t, sub.Listen("tcp://127.0.0.1:0"))
	ep := "tcp://" + sub.Addr().String()

	e := startEngine(t, Options{PubMode: PubDial, PubEndpoint: ep})
	require.Equal(t, ep, e.PubEndpoint())
	require.NoError(t, e.WaitSubscribed(ctx))
	_, err := e.Serve(Request{Tokens: seqTokens(0, 32)})
	require.NoError(t, err)
	seq, payload := recvLive(t, sub, DefaultTopic)
	require.Zero(t, seq)
	require.Equal(t, "BlockStored", decodeBatch(t, payload).events[0]["type"])
}

func TestPubDialGivesUp(t *testing.T) {
	// A port nobody listens on: take one and release it.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	ep := "tcp://" + l.Addr().String()
	require.NoError(t, l.Close())

	e, err := New(Options{PubMode: PubDial, PubEndpoint: ep, DialAttempts: 3, DialBackoff: 1})
	require.NoError(t, err)
	err = e.Start(context.Background())
	require.ErrorIs(t, err, ErrSocket)
	require.Contains(t, err.Error(), "3 attempts")
	require.Empty(t, e.PubEndpoint())
	require.NoError(t, e.Close())
}

func TestReplayLayouts(t *testing.T) {
	for _, layout := range []ReplayLayout{ReplayWithTopic, ReplayNoTopic} {
		t.Run(layout.String(), func(t *testing.T) {
			e := startEngine(t, Options{BlockSize: 2, EnableReplay: true, ReplayLayout: layout})
			require.True(t, strings.HasPrefix(e.ReplayEndpoint(), "tcp://127.0.0.1:"))
			var want [][]byte
			for i := 0; i < 4; i++ {
				_, err := e.Serve(Request{Tokens: seqTokens(i*100, 4)})
				require.NoError(t, err)
				e.mu.Lock()
				want = append(want, e.ring.at(i).payload)
				e.mu.Unlock()
			}
			d := dealer(t, e)

			got := requestReplay(t, d, 1, layout, DefaultTopic)
			require.Len(t, got, 3)
			for i, r := range got {
				require.Equal(t, uint64(i+1), r.seq)
				require.Equal(t, want[i+1], r.payload)
			}
			require.Len(t, requestReplay(t, d, 0, layout, DefaultTopic), 4)
			require.Empty(t, requestReplay(t, d, 99, layout, DefaultTopic), "only the end marker")

			st := e.Stats()
			require.Equal(t, uint64(3), st.ReplayRequests)
			require.Equal(t, uint64(3), st.ReplaysAnswered)
			require.Equal(t, uint64(7), st.ReplayBatchesSent)
		})
	}
}

func TestReplayIgnoresMalformedAndDropped(t *testing.T) {
	e := startEngine(t, Options{EnableReplay: true})
	for i := 0; i < 2; i++ {
		_, err := e.Serve(Request{Tokens: seqTokens(i*100, 16)})
		require.NoError(t, err)
	}
	d := dealer(t, e)
	require.NoError(t, d.Send(zmq4.NewMsgFrom([]byte{}, []byte("short"))))
	require.NoError(t, d.Send(zmq4.NewMsgFrom(be64(0))))
	require.Eventually(t, func() bool { return e.Stats().ReplayMalformed == 2 }, testTimeout, pollInterval)

	e.DropReplay(true)
	require.NoError(t, d.Send(zmq4.NewMsgFrom([]byte{}, be64(0))))
	require.Eventually(t, func() bool { return e.Stats().ReplayDropped == 1 }, testTimeout, pollInterval)

	// None of the above was answered: the next thing the dealer sees is the reply
	// to this request, from seq 1.
	e.DropReplay(false)
	got := requestReplay(t, d, 1, ReplayWithTopic, DefaultTopic)
	require.Len(t, got, 1)
	require.Equal(t, uint64(1), got[0].seq)
}

func TestTruncateReplayStartsLater(t *testing.T) {
	e := startEngine(t, Options{EnableReplay: true, ReplayLayout: ReplayNoTopic, ReplayBuffer: 4})
	for i := 0; i < 6; i++ {
		_, err := e.Serve(Request{Tokens: seqTokens(i*100, 16)})
		require.NoError(t, err)
	}
	d := dealer(t, e)
	got := requestReplay(t, d, 0, ReplayNoTopic, "")
	require.Len(t, got, 4, "buffer rolled over")
	require.Equal(t, uint64(2), got[0].seq)

	e.TruncateReplay(4)
	got = requestReplay(t, d, 3, ReplayNoTopic, "")
	require.Len(t, got, 2)
	require.Equal(t, uint64(4), got[0].seq, "starts later than asked")
	st := e.Stats()
	require.Equal(t, 2, st.Buffered)
	require.Equal(t, uint64(4), st.BufferedOldest)
	require.Equal(t, uint64(5), st.BufferedNewest)
}

func TestDropNextMakesAGapThatReplayFills(t *testing.T) {
	e := startEngine(t, Options{EnableReplay: true})
	sub := subscribe(t, e)
	_, err := e.Serve(Request{Tokens: seqTokens(0, 16)})
	require.NoError(t, err)
	e.DropNext(2)
	for i := 1; i < 4; i++ {
		_, err := e.Serve(Request{Tokens: seqTokens(i*100, 16)})
		require.NoError(t, err)
	}
	seq, _ := recvLive(t, sub, DefaultTopic)
	require.Equal(t, uint64(0), seq)
	seq, _ = recvLive(t, sub, DefaultTopic)
	require.Equal(t, uint64(3), seq, "seq 1 and 2 were dropped")
	require.Equal(t, uint64(2), e.Stats().LiveDropped)

	got := requestReplay(t, dealer(t, e), 1, ReplayWithTopic, DefaultTopic)
	require.Len(t, got, 3)
	for i, r := range got {
		require.Equal(t, uint64(i+1), r.seq)
		require.Equal(t, "BlockStored", decodeBatch(t, r.payload).events[0]["type"])
	}
}

func TestCorruptNextGarblesLiveOnly(t *testing.T) {
	e := startEngine(t, Options{EnableReplay: true})
	sub := subscribe(t, e)
	e.CorruptNext(1)
	for i := 0; i < 2; i++ {
		_, err := e.Serve(Request{Tokens: seqTokens(i*100, 16)})
		require.NoError(t, err)
	}
	seq, bad := recvLive(t, sub, DefaultTopic)
	require.Zero(t, seq)
	require.Equal(t, byte(0xc1), bad[0])
	seq, good := recvLive(t, sub, DefaultTopic)
	require.Equal(t, uint64(1), seq)
	decodeBatch(t, good)

	got := requestReplay(t, dealer(t, e), 0, ReplayWithTopic, DefaultTopic)
	require.Len(t, got, 2)
	require.Equal(t, bad[1:], got[0].payload[1:])
	require.NotEqual(t, byte(0xc1), got[0].payload[0])
	decodeBatch(t, got[0].payload)
	require.Equal(t, uint64(1), e.Stats().LiveCorrupted)
}

func TestRestartResetsSequenceCacheAndBuffer(t *testing.T) {
	e := startEngine(t, Options{EnableReplay: true})
	sub := subscribe(t, e)
	p := seqTokens(0, 32)
	for i := 0; i < 2; i++ {
		_, err := e.Serve(Request{Tokens: seqTokens(i*100, 32)})
		require.NoError(t, err)
	}
	e.Restart()
	require.Zero(t, e.Blocks())
	require.Zero(t, e.NextSeq())
	r, err := e.Serve(Request{Tokens: p})
	require.NoError(t, err)
	require.Equal(t, Result{StoredBlocks: 2, Published: true, Seq: 0}, r, "cache was emptied")

	var seqs []uint64
	for i := 0; i < 3; i++ {
		seq, payload := recvLive(t, sub, DefaultTopic)
		seqs = append(seqs, seq)
		for _, ev := range decodeBatch(t, payload).events {
			require.NotEqual(t, "AllBlocksCleared", ev["type"], "no clear event on restart")
		}
	}
	require.Equal(t, []uint64{0, 1, 0}, seqs)
	got := requestReplay(t, dealer(t, e), 0, ReplayWithTopic, DefaultTopic)
	require.Len(t, got, 1, "buffer emptied by the restart")
	require.Equal(t, uint64(1), e.Stats().Restarts)
}

func TestSendFramesRaw(t *testing.T) {
	e := startEngine(t, Options{})
	sub := subscribe(t, e)
	require.NoError(t, e.SendFrames([]byte(DefaultTopic), []byte{1, 2, 3}))
	f := recv(t, sub)
	require.Equal(t, [][]byte{[]byte(DefaultTopic), {1, 2, 3}}, f)
	require.Zero(t, e.NextSeq(), "raw frames take no sequence number")
	require.Equal(t, uint64(1), e.Stats().RawSent)
}

func TestPublishPayloadAndUnknownRemoval(t *testing.T) {
	e := startEngine(t, Options{HashFormat: HashInt64})
	sub := subscribe(t, e)
	_, err := e.PublishPayload([]byte{0x90})
	require.NoError(t, err)
	_, err = e.PublishEvents(Event{Kind: BlockRemoved, BlockHashes: []uint64{^uint64(0)}, Medium: MediumGPU})
	require.NoError(t, err)
	seq, payload := recvLive(t, sub, DefaultTopic)
	require.Equal(t, uint64(0), seq)
	require.Equal(t, []byte{0x90}, payload)
	seq, payload = recvLive(t, sub, DefaultTopic)
	require.Equal(t, uint64(1), seq)
	require.Equal(t, []uint64{^uint64(0)}, asHashes(t, decodeBatch(t, payload).events[0]["block_hashes"]))
}

func TestConcurrentServeKeepsSeqOrder(t *testing.T) {
	e := startEngine(t, Options{BlockSize: 1, CapacityBlocks: 64})
	sub := subscribe(t, e)
	const workers, each = 4, 25
	var wg sync.WaitGroup
	var mu sync.Mutex
	published := 0
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < each; i++ {
				// Distinct first token per call: every Serve stores and publishes.
				r, err := e.Serve(Request{Tokens: []uint32{uint32(w*1000 + i), 1, 2}})
				if err == nil && r.Published {
					mu.Lock()
					published++
					mu.Unlock()
				}
				e.HeldPrefix([]uint32{uint32(w * 1000)}, "", "")
				_ = e.Stats()
			}
		}()
	}
	wg.Wait()
	require.Equal(t, workers*each, published)
	for i := 0; i < published; i++ {
		seq, payload := recvLive(t, sub, DefaultTopic)
		require.Equal(t, uint64(i), seq)
		decodeBatch(t, payload)
	}
	require.LessOrEqual(t, e.Blocks(), 64)
}

func TestLifecycle(t *testing.T) {
	e, err := New(Options{EnableReplay: true})
	require.NoError(t, err)
	require.Empty(t, e.PubEndpoint())
	require.False(t, e.Subscribed())
	require.ErrorIs(t, e.WaitSubscribed(context.Background()), ErrNotStarted)

	// Before Start: numbered and buffered, not sent; replayable after Start.
	_, err = e.Serve(Request{Tokens: seqTokens(0, 16)})
	require.NoError(t, err)
	require.Equal(t, uint64(1), e.Stats().LiveUnsent)

	ctx := context.Background()
	require.NoError(t, e.Start(ctx))
	require.ErrorIs(t, e.Start(ctx), ErrAlreadyStarted)
	got := requestReplay(t, dealer(t, e), 0, ReplayWithTopic, DefaultTopic)
	require.Len(t, got, 1)

	require.NoError(t, e.Close())
	require.NoError(t, e.Close(), "idempotent")
	require.ErrorIs(t, e.Start(ctx), ErrClosed)
	_, err = e.Serve(Request{Tokens: seqTokens(0, 32)})
	require.ErrorIs(t, err, ErrClosed)
	_, err = e.PublishPayload(nil)
	require.ErrorIs(t, err, ErrClosed)
	require.ErrorIs(t, e.SendFrames([]byte("x")), ErrClosed)
	require.ErrorIs(t, e.WaitSubscribed(ctx), ErrClosed)
	require.Equal(t, 1, e.Blocks(), "truth still readable")

	// Close without Start.
	e2, err := New(Options{})
	require.NoError(t, err)
	require.NoError(t, e2.Close())
}

func TestSubscribedMatchesTopicPrefix(t *testing.T) {
	e := startEngine(t, Options{Topic: "kv@10.0.0.1@m"})
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	other := zmq4.NewSub(ctx)
	defer other.Close()
	require.NoError(t, other.Dial(e.PubEndpoint()))
	require.NoError(t, other.SetOption(zmq4.OptionSubscribe, "zz"))
	require.Eventually(t, func() bool {
		e.mu.Lock()
		defer e.mu.Unlock()
		return len(e.pub.(zmq4.Topics).Topics()) == 1
	}, testTimeout, pollInterval)
	require.False(t, e.Subscribed(), "a subscription to another topic does not count")
	s := zmq4.NewSub(ctx)
	defer s.Close()
	require.NoError(t, s.Dial(e.PubEndpoint()))
	require.NoError(t, s.SetOption(zmq4.OptionSubscribe, "kv@"))
	require.NoError(t, e.WaitSubscribed(ctx))
	_, err := e.PublishEvents(Event{Kind: AllBlocksCleared})
	require.NoError(t, err)
	seq, _ := recvLive(t, s, "kv@10.0.0.1@m")
	require.Zero(t, seq)
}
