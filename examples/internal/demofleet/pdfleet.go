package demofleet

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"time"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/examples/pdsidecar/sidecar"
	"github.com/kvselect/kvselect/internal/enginemodel"
	"github.com/kvselect/kvselect/internal/fakeengine"
)

// PDFleetOptions shape a disaggregated pool of fake engines (see PDFleet).
type PDFleetOptions struct {
	// Prefill and Decode are the numbers of prefill and decode engines
	// (each >= 1).
	Prefill, Decode int
	// Model is the model every engine serves; "" means Model.
	Model string
	// BlockSize is the engines' KV block size in tokens (> 0).
	BlockSize int
	// RoleLabel is the worker label that carries each worker's role
	// (required).
	RoleLabel string
	// PrefillBlocks is each prefill engine's KV cache in blocks, and
	// DecodeBlocks each decode engine's (both > 0).
	PrefillBlocks, DecodeBlocks int
	// Dialect is the prefill engines' KV-event dialect; one whose engines
	// dial their PUB socket is refused.
	Dialect fakeengine.Dialect
	// SleepTTFT makes the engines run their scheduler model in real time
	// (fakeengine.Options.SleepTTFT).
	SleepTTFT bool
	// Timing, when set, is engine i's (of n, prefill engines first)
	// scheduler model (fakeengine.Options.Timing); nil: the defaults.
	Timing func(i, n int) enginemodel.Params
	// TokenInterval is the decode engines' wait between two streamed
	// tokens when they do not run the model (no SleepTTFT), and
	// TransferPerBlock a decode leg's simulated KV pull, per block.
	TokenInterval, TransferPerBlock time.Duration
	// HintKey is the sidecars' HintKey; nil: hints are not signed.
	HintKey []byte
	// Fallback is the sidecars' prefill fallback.
	Fallback sidecar.Fallback
	// Logger is the sidecars' logger; nil discards.
	Logger *slog.Logger
}

// PDFleet is a disaggregated pool on loopback: prefill engines that publish
// their KV events, and decode engines each behind a decode sidecar
// (examples/pdsidecar/sidecar, vLLM NIXL) on its own HTTP server. A decode
// worker's endpoint is its sidecar, as in a pod where the sidecar owns the
// pod's port. The fleet owns every engine, sidecar and server: Close stops
// them and waits for them.
type PDFleet struct {
	prefills []*fakeengine.Engine
	decodes  []*fakeengine.Engine
	sidecars []*sidecar.Sidecar
	// workers are the catalog entries: the prefill workers, then the decode
	// ones.
	workers []catalog.Worker

	servers []*http.Server
	served  []chan struct{} // closed when the server's Serve returns
}

// PDFleetView names a fleet's workers, in its order.
type PDFleetView struct {
	PrefillIDs, PrefillEndpoints []string
	DecodeIDs, DecodeEndpoints   []string // the sidecars' endpoints
}

// StartPDFleet starts the engines and the sidecars. On error, what was
// started is closed.
func StartPDFleet(ctx context.Context, o PDFleetOptions) (f *PDFleet, err error) {
	if o.Prefill < 1 || o.Decode < 1 || o.BlockSize <= 0 || o.PrefillBlocks <= 0 || o.DecodeBlocks <= 0 || o.RoleLabel == "" {
		return nil, errors.New("demofleet: a fleet needs a prefill and a decode engine, a block size, both caches and a role label")
	}
	if o.Model == "" {
		o.Model = Model
	}
	f = &PDFleet{}
	defer func() {
		if err != nil {
			f.Close()
			f = nil
		}
	}()
	start := func(opts fakeengine.Options) (*fakeengine.Engine, error) {
		if o.Timing != nil {
			i := len(f.prefills) + len(f.decodes)
			opts.Timing = o.Timing(i, o.Prefill+o.Decode)
		}
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
	for i := range o.Prefill {
		opts := o.Dialect.Apply(fakeengine.Options{
			BlockSize: o.BlockSize, CapacityBlocks: o.PrefillBlocks, EnableReplay: true, EnableHTTP: true,
			Model: o.Model, Topic: fmt.Sprintf("kv@127.0.0.1@%s", o.Model), SleepTTFT: o.SleepTTFT,
			PDRole: fakeengine.PDRolePrefill, EngineID: fmt.Sprintf("prefill-%d", i),
		})
		if opts.PubMode != fakeengine.PubBind {
			return nil, fmt.Errorf("dialect %s: engines that dial their PUB socket are not supported by the demo", o.Dialect)
		}
		e, err := start(opts)
		if err != nil {
			return nil, err
		}
		f.prefills = append(f.prefills, e)
		f.workers = append(f.workers, catalog.Worker{
			ID: fmt.Sprintf("prefill-%d", i), Identity: fmt.Sprintf("fake prefill engine %d", i), Model: o.Model,
			Endpoint: e.HTTPEndpoint(), DPSize: 1, BlockSize: o.BlockSize,
			KVEventEndpoints: map[int]string{0: e.PubEndpoint()}, ReplayEndpoint: e.ReplayEndpoint(),
			Labels: map[string]string{o.RoleLabel: "prefill"},
		})
	}
	for i := range o.Decode {
		e, err := start(fakeengine.Options{
			BlockSize: o.BlockSize, CapacityBlocks: o.DecodeBlocks, EnableHTTP: true, Model: o.Model,
			SleepTTFT: o.SleepTTFT, TokenInterval: o.TokenInterval, TransferPerBlock: o.TransferPerBlock,
			PDRole: fakeengine.PDRoleDecode, EngineID: fmt.Sprintf("decode-%d", i),
		})
		if err != nil {
			return nil, err
		}
		f.decodes = append(f.decodes, e)
		sc, err := sidecar.New(sidecar.Options{
			Protocol: sidecar.ProtocolVLLMNIXL, DecodeURL: "http://" + e.HTTPEndpoint(), Fallback: o.Fallback,
			HintKey: o.HintKey, Logger: o.Logger,
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
		f.workers = append(f.workers, catalog.Worker{
			ID: fmt.Sprintf("decode-%d", i), Identity: fmt.Sprintf("fake decode engine %d behind its sidecar", i), Model: o.Model,
			Endpoint: lis.Addr().String(), DPSize: 1, BlockSize: o.BlockSize,
			Labels: map[string]string{o.RoleLabel: "decode"},
		})
	}
	return f, nil
}

// Workers are the fleet's catalog entries, what discovery would report: the
// prefill workers (labelled prefill), then the decode ones (labelled decode,
// their endpoints the sidecars').
func (f *PDFleet) Workers() []catalog.Worker { return slices.Clone(f.workers) }

// Sidecars are the decode sidecars, in decode order.
func (f *PDFleet) Sidecars() []*sidecar.Sidecar { return slices.Clone(f.sidecars) }

// TokenizerURL is the base URL of a tokenizer for the fleet's model (the
// first prefill engine's render endpoint).
func (f *PDFleet) TokenizerURL() string { return "http://" + f.prefills[0].HTTPEndpoint() }

// View names the fleet's workers and endpoints by role.
func (f *PDFleet) View() PDFleetView {
	var v PDFleetView
	for i, w := range f.workers { // the prefill workers come first
		if i < len(f.prefills) {
			v.PrefillIDs, v.PrefillEndpoints = append(v.PrefillIDs, w.ID), append(v.PrefillEndpoints, w.Endpoint)
		} else {
			v.DecodeIDs, v.DecodeEndpoints = append(v.DecodeIDs, w.ID), append(v.DecodeEndpoints, w.Endpoint)
		}
	}
	return v
}

// WaitSubscribed waits until an EPP follows every prefill engine's KV events
// (events sent before that are lost).
func (f *PDFleet) WaitSubscribed(ctx context.Context) error {
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

// PrefillStats returns each prefill engine's HTTP counters.
func (f *PDFleet) PrefillStats() []fakeengine.HTTPStats { return httpStats(f.prefills) }

// DecodeStats returns each decode engine's HTTP counters.
func (f *PDFleet) DecodeStats() []fakeengine.HTTPStats { return httpStats(f.decodes) }

func httpStats(es []*fakeengine.Engine) []fakeengine.HTTPStats {
	out := make([]fakeengine.HTTPStats, len(es))
	for i, e := range es {
		out[i] = e.HTTPStats()
	}
	return out
}

// StopPrefill stops prefill engine i (of the fleet's prefill engines, by
// index, not the first: its HTTP endpoint is TokenizerURL): its endpoint then
// refuses connections, as a crashed engine's does, while its catalog entry
// stays what discovery last reported.
func (f *PDFleet) StopPrefill(i int) error {
	if i <= 0 || i >= len(f.prefills) {
		return fmt.Errorf("demofleet: no prefill engine %d to stop (1..%d)", i, len(f.prefills)-1)
	}
	return f.prefills[i].Close()
}

// Close stops the sidecars' servers (gracefully, then not), the sidecars and
// the engines, and waits for all of them. It may be called more than once.
func (f *PDFleet) Close() {
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

// RoundRobinPrefillHitRate replays the workload's prompts through fresh
// prefill engines' cache model (fakeengine's Serve, no sockets), shaped as
// o's prefill engines, request i on engine i mod o.Prefill: the prefill-cache
// hit rate of round-robin prefill placement.
func RoundRobinPrefillHitRate(o PDFleetOptions, workload []Request) (float64, error) {
	if o.Prefill < 1 || o.BlockSize <= 0 {
		return 0, errors.New("demofleet: a replay needs a prefill engine and a block size")
	}
	if o.Model == "" {
		o.Model = Model
	}
	var sts []fakeengine.HTTPStats
	var engines []*fakeengine.Engine
	defer func() {
		for _, e := range engines {
			_ = e.Close()
		}
	}()
	for range o.Prefill {
		e, err := fakeengine.New(o.Dialect.Apply(fakeengine.Options{BlockSize: o.BlockSize, CapacityBlocks: o.PrefillBlocks, Model: o.Model}))
		if err != nil {
			return 0, err
		}
		engines = append(engines, e)
		sts = append(sts, fakeengine.HTTPStats{})
	}
	for i, r := range workload {
		tokens, err := chatTokens(r.Body)
		if err != nil {
			return 0, err
		}
		k := i % len(engines)
		res, err := engines[k].Serve(fakeengine.Request{Tokens: tokens})
		if err != nil {
			return 0, err
		}
		sts[k].PromptTokens += uint64(len(tokens))
		sts[k].CachedTokens += uint64(res.CachedBlocks * o.BlockSize)
	}
	return HitRate(sts), nil
}

// chatTokens returns the token ids a fake engine gives a chat request's body
// (its default template flags).
func chatTokens(body []byte) ([]uint32, error) {
	var req struct {
		Messages []fakeengine.Message `json:"messages"`
	}
	if err := json.Unmarshal(body, &req); err != nil {
		return nil, err
	}
	return fakeengine.ApplyChatTemplate(req.Messages), nil
}
