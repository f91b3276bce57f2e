package kvevents

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/kvselect/kvselect/catalog"
	"github.com/stretchr/testify/require"
)

// countingHandler does nothing but count, and signals when the last seq arrives.
type countingHandler struct {
	n    atomic.Uint64
	last uint64
	done chan struct{}
}

func (h *countingHandler) HandleBatch(_ catalog.WorkerRank, seq uint64, _ []byte) {
	h.n.Add(1)
	if seq == h.last {
		close(h.done)
	}
}

func (h *countingHandler) ResetSource(catalog.WorkerRank) {}

// BenchmarkFeedThroughput measures live batches per second from a PUB on loopback
// through one dial source (SUB, frame parsing, queue, sequencer) into a no-op Handler.
// Each op is one 3-frame message with a 1 KiB payload. The publisher runs in the same
// process, so publishing costs are included; allocations are counted on both sides.
// overflows and lost must stay 0: the rate is only meaningful without loss.
func BenchmarkFeedThroughput(b *testing.B) {
	b.ReportAllocs()
	pub := zmq4.NewPub(context.Background(), zmq4.WithLogger(discardLog))
	defer pub.Close()
	require.NoError(b, pub.Listen("tcp://127.0.0.1:0"))
	h := &countingHandler{last: uint64(b.N - 1), done: make(chan struct{})}
	f, err := NewFeed(FeedOptions{Handler: h})
	require.NoError(b, err)
	w := catalog.WorkerRank{WorkerID: "bench"}
	require.NoError(b, f.AddSource(SourceConfig{Worker: w, Endpoint: "tcp://" + pub.Addr().String()}))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()
	defer func() {
		cancel()
		<-done
	}()
	require.Eventually(b, func() bool { return len(pub.(zmq4.Topics).Topics()) > 0 }, waitFor, time.Millisecond)

	topic := []byte("kv@10.0.0.1:8000@model")
	payload := make([]byte, 1024)
	b.ResetTimer()
	start := time.Now()
	for i := range b.N {
		if err := pub.SendMulti(zmq4.NewMsgFrom(topic, seq8(uint64(i)), payload)); err != nil {
			b.Fatal(err)
		}
	}
	select {
	case <-h.done:
	case <-time.After(time.Minute):
		st, _ := f.SourceStats(w)
		b.Fatalf("not all batches applied: %+v", st)
	}
	elapsed := time.Since(start)
	b.StopTimer()
	st, _ := f.SourceStats(w)
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "batches/s")
	b.ReportMetric(float64(st.Overflows), "overflows")
	b.ReportMetric(float64(st.LostBatches), "lost")
}
