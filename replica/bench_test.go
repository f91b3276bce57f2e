package replica_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvselect/kvselect/internal/benchfleet"
	"github.com/kvselect/kvselect/replica"
	"github.com/kvselect/kvselect/reservation"
	"github.com/kvselect/kvselect/selection"
)

// discardBus takes every publish and answers nothing: the cost of sharing,
// without a peer's.
type discardBus struct{ bytes atomic.Int64 }

func (d *discardBus) Publish(_ string, data []byte) error { d.bytes.Add(int64(len(data))); return nil }
func (d *discardBus) Subscribe(string, func(string, []byte)) (func(), error) {
	return func() {}, nil
}

func (d *discardBus) Request(context.Context, string, []byte) ([]byte, error) {
	return nil, errNoResponders
}

func (d *discardBus) Respond(string, func([]byte) []byte) (func(), error) {
	return func() {}, nil
}

// benchService builds a service with an event-fed index: 16 workers of
// 16-token blocks, each holding 16 cached prompts of 2k tokens from 8 shared
// system prompts, with obs (nil: none) as its observer.
func benchService(b *testing.B, obs selection.BookingObserver) (*selection.SelectionService, [][]uint32) {
	bld := selection.NewSelectionServiceBuilder(selection.DefaultConfig(16)).ExternalEvents().SweepInterval(-1).Rand(rand.NewPCG(1, 1))
	if obs != nil {
		bld = bld.Observe(obs)
	}
	s, err := bld.Build(context.Background())
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = s.Close() })
	prompts, err := benchfleet.Warm(benchfleet.Service{Upsert: s.Workers().Upsert, ApplyEvent: s.Events().Apply}, benchfleet.Fleet{Workers: 16, PerWorker: 16, Fresh: 16})
	if err != nil {
		b.Fatal(err)
	}
	return s, prompts
}

// BenchmarkSelectAndReserveReplicated is one request's booking and free of
// 2k-token prompts with the service's observer off and on (a Replicator
// publishing to a bus that discards): the request path's cost of sharing,
// plus the publisher's encoding running beside it. Both services are built
// and warmed before either is timed, so neither pays the process's warm-up.
// cpu-ns/op is the process's CPU time per op, every goroutine counted: on a
// shared machine it is steadier than the wall time.
func BenchmarkSelectAndReserveReplicated(b *testing.B) {
	off, prompts := benchService(b, nil)
	bus := &discardBus{}
	r, err := replica.New(replica.Options{Bus: bus, ID: "bench"})
	if err != nil {
		b.Fatal(err)
	}
	on, _ := benchService(b, r)
	if err := r.Start(on); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = r.Close() })
	ids := make([]string, len(prompts))
	for i := range ids {
		ids[i] = fmt.Sprintf("req-%d", i)
	}
	ctx := context.Background()
	once := func(tb testing.TB, s *selection.SelectionService, i int) {
		k := i % len(prompts)
		if _, err := s.SelectAndReserve(ctx, selection.Request{ReservationID: reservation.ID(ids[k]), Tokens: prompts[k]}); err != nil {
			tb.Fatal(err)
		}
		if err := s.Reservations().Free(reservation.ID(ids[k])); err != nil {
			tb.Fatal(err)
		}
	}
	for i := range 5000 {
		once(b, off, i)
		once(b, on, i)
	}
	run := func(s *selection.SelectionService) func(*testing.B) {
		return func(b *testing.B) {
			b.ReportAllocs()
			cpu := cpuTime()
			for i := 0; b.Loop(); i++ {
				once(b, s, i)
			}
			if d := cpuTime() - cpu; d > 0 {
				b.ReportMetric(float64(d.Nanoseconds())/float64(b.N), "cpu-ns/op")
			}
		}
	}
	b.Run("off", run(off))
	b.Run("on", func(b *testing.B) {
		before := bus.bytes.Load()
		run(on)(b)
		b.ReportMetric(float64(bus.bytes.Load()-before)/float64(b.N), "wire-B/op")
	})
	// interleaved alternates one request on each service and times each, so
	// that both see the same machine moment by moment: on/off is the ratio
	// of their wall times, steadier than two sub-benchmarks run one after
	// the other on a shared machine.
	b.Run("interleaved", func(b *testing.B) {
		b.ReportAllocs()
		var offT, onT time.Duration
		for i := 0; b.Loop(); i++ {
			t0 := time.Now()
			once(b, off, i)
			t1 := time.Now()
			once(b, on, i)
			onT += time.Since(t1)
			offT += t1.Sub(t0)
		}
		b.ReportMetric(float64(offT.Nanoseconds())/float64(b.N), "off-ns/op")
		b.ReportMetric(float64(onT.Nanoseconds())/float64(b.N), "on-ns/op")
		b.ReportMetric(float64(onT)/float64(offT), "on/off")
	})
}
