package eppserver

import (
	"log/slog"
	"slices"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/tokenize"
)

// engineLabel names a worker's engine, as a pod label or a label in the
// workers file (neither the file nor the catalog records an engine
// otherwise): a worker whose value is not the tokenizer protocol's engine
// (protocolEngine) is no tokenizer when the pool follows discovery.
// TensorRT-LLM serves no tokenizer endpoint: label its pods
// kvselect.io/engine=trtllm. Unlabelled workers are taken to be the
// protocol's engine.
const engineLabel = "kvselect.io/engine"

// protocolEngine is the engine whose pods serve a tokenizer protocol's
// endpoints: vLLM's render and tokenize, SGLang's tokenize and renderer.
func protocolEngine(protocol string) string {
	switch protocol {
	case tokenize.ProtocolSGLang, tokenize.ProtocolSGLangRenderer:
		return "sglang"
	default:
		return "vllm"
	}
}

// workerTokenizers keeps the tokenizer pool's URLs equal to the discovered
// workers' own endpoints when DYN_EPP_TOKENIZER_SERVICE_URL is unset: every
// worker of the EPP's model, reached at http://<its endpoint>, except those
// whose engine label names another engine. Apply owns it (one goroutine).
type workerTokenizers struct {
	pool   *tokenize.Pool
	model  string // the EPP's model, normalised
	engine string // protocolEngine of the configured protocol
	log    *slog.Logger
	// leftOut are the ids the last snapshot left out by their engine label;
	// starved is set while a synced snapshot has workers of the model but
	// none of them can tokenize. Both only to log changes once.
	leftOut []string
	starved bool
}

func newWorkerTokenizers(pool *tokenize.Pool, cfg *Config, log *slog.Logger) *workerTokenizers {
	return &workerTokenizers{pool: pool, model: modelOf(cfg.Model), engine: protocolEngine(cfg.TokenizerProtocol), log: log}
}

// modelOf normalises a model name as the catalog does.
func modelOf(m string) string {
	if m == "" {
		return catalog.DefaultModel
	}
	return m
}

// urls returns the tokenizer base URLs of ws, in ws's order and each once,
// the ids of the workers of the model left out by their engine label, and
// how many workers of the model there were.
func (t *workerTokenizers) urls(ws []catalog.Worker) (urls, leftOut []string, ofModel int) {
	for _, w := range ws {
		if modelOf(w.Model) != t.model || w.Endpoint == "" {
			continue
		}
		ofModel++
		if e, ok := w.Labels[engineLabel]; ok && e != t.engine {
			leftOut = append(leftOut, w.ID)
			continue
		}
		if u := "http://" + w.Endpoint; !slices.Contains(urls, u) {
			urls = append(urls, u)
		}
	}
	return urls, leftOut, ofModel
}

// follow gives the pool the tokenizers of a discovery snapshot's workers,
// and logs the workers left out when they change, and a WARN when a synced
// snapshot leaves no worker of the model to tokenize.
func (t *workerTokenizers) follow(ws []catalog.Worker, synced bool) {
	urls, leftOut, ofModel := t.urls(ws)
	if err := t.pool.SetBaseURLs(urls); err != nil { // discovery checked the endpoints: not expected
		t.log.Warn("the discovered workers' tokenizer URLs were refused; the tokenizer pool keeps its endpoints", "err", err)
	}
	if !slices.Equal(leftOut, t.leftOut) && len(leftOut) > 0 {
		t.log.Info("workers left out of the tokenizer pool: their engine label names another engine than the tokenizer protocol's",
			"label", engineLabel, "protocol_engine", t.engine, "workers", leftOut)
	}
	t.leftOut = leftOut
	starved := synced && ofModel > 0 && len(urls) == 0
	if starved && !t.starved {
		t.log.Warn("no discovered worker can serve as a tokenizer; requests are routed on load alone until one can: set DYN_EPP_TOKENIZER_SERVICE_URL to a render service (TensorRT-LLM serves no tokenizer endpoint)",
			"workers", ofModel, "left_out", len(leftOut), "label", engineLabel)
	}
	t.starved = starved
}
