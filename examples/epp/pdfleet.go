package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/examples/pdsidecar/sidecar"
	"github.com/kvselect/kvselect/internal/fakeengine"
)

// pdFleetOptions shape a disaggregated pool of fake engines (see pdFleet).
type pdFleetOptions struct {
	prefill, decode int
	model           string
	blockSize       int
	roleLabel       string // the label that carries each worker's role
	// prefillBlocks is each prefill engine's KV cache; the decode engines'
	// is decodeBlocks.
	prefillBlocks, decodeBlocks int
	dialect                     fakeengine.Dialect // the prefill engines' KV-event dialect
	sleepTTFT                   bool               // engines wait their simulated TTFT
	tokenInterval               time.Duration      // between two streamed tokens
	transferPerBlock            time.Duration      // a decode leg's simulated KV pull, per block
	hintKey                     []byte             // the sidecars' HintKey; nil: hints are not signed
	fallback                    sidecar.Fallback   // the sidecars' prefill fallback
	logger                      *slog.Logger       // the sidecars' logger
}

// pdFleet is a disaggregated pool on loopback: prefill engines that publish
// their KV events, and decode engines each behind a decode sidecar
// (examples/pdsidecar/sidecar, vLLM NIXL) on its own HTTP server. A decode
// worker's endpoint is its sidecar, as in a pod where the sidecar owns the
// pod's port. The fleet owns every engine, sidecar and server: close stops them
// and waits for them.
type pdFleet struct {
	prefills []*fakeengine.Engine
	decodes  []*fakeengine.Engine
	sidecars []*sidecar.Sidecar
	fronts   []string // host:port of each sidecar, decode order
	// workers are the catalog entries: the prefill workers, then the decode
	// ones.
	workers []catalog.Worker

	servers []*http.Server
	served  []chan struct{} // closed when the server's Serve returns
}

// startPDFleet starts the engines and the sidecars. On error, what was
// started is closed.
func startPDFleet(ctx context.Context, o pdFleetOptions) (f *pdFleet, err error) {
	f = &pdFleet{}
	defer func() {
		if err != nil {
			f.close()
			f = nil
		}
	}()
	start := func(opts fakeengine.Options) (*fakeengine.Engine, error) {
		e, err := fakeengine.New(opts)
		if err != nil {
			return nil, err
		}
		sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		if err := e.Start(sctx); err != nil {
			_ = e.Close()
			return nil, err
		}
		return e, nil
	}
	for i := range o.prefill {
		opts := o.dialect.Apply(fakeengine.Options{
			BlockSize: o.blockSize, CapacityBlocks: o.prefillBlocks, EnableReplay: true, EnableHTTP: true,
			Model: o.model, Topic: fmt.Sprintf("kv@127.0.0.1@%s", o.model), SleepTTFT: o.sleepTTFT,
			PDRole: fakeengine.PDRolePrefill, EngineID: fmt.Sprintf("prefill-%d", i),
		})
		if opts.PubMode != fakeengine.PubBind {
			return nil, fmt.Errorf("dialect %s: engines that dial their PUB socket are not supported by the demo", o.dialect)
		}
		e, err := start(opts)
		if err != nil {
			return nil, err
		}
		f.prefills = append(f.prefills, e)
		f.workers = append(f.workers, catalog.Worker{
			ID: fmt.Sprintf("prefill-%d", i), Identity: fmt.Sprintf("fake prefill engine %d", i), Model: o.model,
			Endpoint: e.HTTPEndpoint(), DPSize: 1, BlockSize: o.blockSize,
			KVEventEndpoints: map[int]string{0: e.PubEndpoint()}, ReplayEndpoint: e.ReplayEndpoint(),
			Labels: map[string]string{o.roleLabel: "prefill"},
		})
	}
	for i := range o.decode {
		e, err := start(fakeengine.Options{
			BlockSize: o.blockSize, CapacityBlocks: o.decodeBlocks, EnableHTTP: true, Model: o.model,
			SleepTTFT: o.sleepTTFT, TokenInterval: o.tokenInterval, TransferPerBlock: o.transferPerBlock,
			PDRole: fakeengine.PDRoleDecode, EngineID: fmt.Sprintf("decode-%d", i),
		})
		if err != nil {
			return nil, err
		}
		f.decodes = append(f.decodes, e)
		sc, err := sidecar.New(sidecar.Options{
			Protocol: sidecar.ProtocolVLLMNIXL, DecodeURL: "http://" + e.HTTPEndpoint(), Fallback: o.fallback,
			HintKey: o.hintKey, Logger: o.logger,
		})
		if err != nil {
			return nil, err
		}
		f.sidecars = append(f.sidecars, sc)
		var lc net.ListenConfig
		lis, err := lc.Listen(ctx, "tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		srv := &http.Server{Handler: sc, ReadHeaderTimeout: 10 * time.Second}
		done := make(chan struct{})
		go func() { defer close(done); _ = srv.Serve(lis) }()
		f.servers, f.served = append(f.servers, srv), append(f.served, done)
		f.fronts = append(f.fronts, lis.Addr().String())
		f.workers = append(f.workers, catalog.Worker{
			ID: fmt.Sprintf("decode-%d", i), Identity: fmt.Sprintf("fake decode engine %d behind its sidecar", i), Model: o.model,
			Endpoint: lis.Addr().String(), DPSize: 1, BlockSize: o.blockSize,
			Labels: map[string]string{o.roleLabel: "decode"},
		})
	}
	return f, nil
}

// waitSubscribed waits until the EPP follows every prefill engine's KV events
// (events sent before that are lost).
func (f *pdFleet) waitSubscribed(ctx context.Context) error {
	for i, e := range f.prefills {
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		err := e.WaitSubscribed(wctx)
		cancel()
		if err != nil {
			return fmt.Errorf("prefill engine %d never subscribed: %w", i, err)
		}
	}
	return nil
}

// prefillStats and decodeStats return each engine's HTTP counters.
func (f *pdFleet) prefillStats() []fakeengine.HTTPStats { return httpStats(f.prefills) }
func (f *pdFleet) decodeStats() []fakeengine.HTTPStats  { return httpStats(f.decodes) }

func httpStats(es []*fakeengine.Engine) []fakeengine.HTTPStats {
	out := make([]fakeengine.HTTPStats, len(es))
	for i, e := range es {
		out[i] = e.HTTPStats()
	}
	return out
}

// close stops the sidecars' servers (gracefully, then not), the sidecars and
// the engines, and waits for all of them. It may be called more than once.
func (f *pdFleet) close() {
	for i, srv := range f.servers {
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		if err := srv.Shutdown(sctx); err != nil && !errors.Is(err, http.ErrServerClosed) {
			_ = srv.Close()
		}
		cancel()
		<-f.served[i]
	}
	f.servers, f.served = nil, nil
	for _, sc := range f.sidecars {
		sc.Close()
	}
	f.sidecars = nil
	for _, e := range append(f.decodes, f.prefills...) {
		_ = e.Close()
	}
	f.decodes, f.prefills = nil, nil
}
