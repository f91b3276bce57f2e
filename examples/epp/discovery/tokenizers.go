package discovery

import (
	"log/slog"
	"slices"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/tokenize"
)

// EngineLabel names a worker's engine, as a pod label or a label in the
// workers file (neither the file nor the catalog records an engine
// otherwise): a worker whose value is not the tokenizer protocol's engine
// is no tokenizer when a pool follows discovery (Tokenizers).
// TensorRT-LLM serves no tokenizer endpoint: label its pods
// kvselect.io/engine=trtllm. Unlabelled workers are taken to be the
// protocol's engine.
const EngineLabel = "kvselect.io/engine"

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

// Tokenizers keeps a tokenizer pool's URLs equal to the discovered workers'
// own endpoints (every vLLM and SGLang pod serves its model's render and
// tokenize endpoints): every worker of the model, reached at
// http://<its endpoint>, except those whose EngineLabel names another engine
// than the protocol's. The EPP and the gateway use it when no tokenizer URL
// is configured. Not safe for concurrent use: the consumer of the
// snapshots calls Follow, one snapshot at a time.
type Tokenizers struct {
	pool   *tokenize.Pool
	model  string // the EPP's model, normalised
	engine string // protocolEngine of the configured protocol
	log    *slog.Logger
	// leftOut are the ids the last snapshot left out by their engine label;
	// starved is set while a synced snapshot has workers of the model but
	// none of them can tokenize. Both only to log changes once.
	leftOut []string
	starved bool
	over    int // workers past MaxTokenizers in the last snapshot
}

// NewTokenizers returns a Tokenizers that gives pool the tokenizers of
// model's workers for protocol (one of tokenize.Protocols) and logs to log.
func NewTokenizers(pool *tokenize.Pool, model, protocol string, log *slog.Logger) *Tokenizers {
	return &Tokenizers{pool: pool, model: modelOf(model), engine: protocolEngine(protocol), log: log}
}

// Engine is the engine whose workers serve the protocol: a worker whose
// EngineLabel names another one is left out.
func (t *Tokenizers) Engine() string { return t.engine }

// modelOf normalises a model name as the catalog does.
func modelOf(m string) string {
	if m == "" {
		return catalog.DefaultModel
	}
	return m
}

// MaxTokenizers bounds the workers a Tokenizers gives its pool: the first
// of a snapshot's (in its order, by worker id), as many as the EPP takes
// configured URLs. A large pool does not make a client per pod; the rest
// are logged as left out.
const MaxTokenizers = 64

// urls returns the tokenizer base URLs of ws, in ws's order and each once,
// at most MaxTokenizers of them, the ids of the workers of the model left
// out by their engine label, how many workers of the model there were, and
// how many that could tokenize were past the bound.
func (t *Tokenizers) urls(ws []catalog.Worker) (urls, leftOut []string, ofModel, over int) {
	for _, w := range ws {
		if modelOf(w.Model) != t.model || w.Endpoint == "" {
			continue
		}
		ofModel++
		if e, ok := w.Labels[EngineLabel]; ok && e != t.engine {
			leftOut = append(leftOut, w.ID)
			continue
		}
		if u := "http://" + w.Endpoint; !slices.Contains(urls, u) {
			if len(urls) == MaxTokenizers {
				over++
				continue
			}
			urls = append(urls, u)
		}
	}
	return urls, leftOut, ofModel, over
}

// Follow gives the pool the tokenizers of a discovery snapshot's workers,
// and logs the workers left out when they change, and a WARN when a synced
// snapshot leaves no worker of the model to tokenize.
func (t *Tokenizers) Follow(ws []catalog.Worker, synced bool) {
	urls, leftOut, ofModel, over := t.urls(ws)
	if err := t.pool.SetBaseURLs(urls); err != nil { // discovery checked the endpoints: not expected
		t.log.Warn("the discovered workers' tokenizer URLs were refused; the tokenizer pool keeps its endpoints", "err", err)
	}
	if !slices.Equal(leftOut, t.leftOut) && len(leftOut) > 0 {
		t.log.Info("workers left out of the tokenizer pool: their engine label names another engine than the tokenizer protocol's",
			"label", EngineLabel, "protocol_engine", t.engine, "workers", leftOut)
	}
	t.leftOut = leftOut
	if over != t.over && over > 0 {
		t.log.Info("workers left out of the tokenizer pool: past its bound; the first by worker id are the tokenizers",
			"max", MaxTokenizers, "left_out", over)
	}
	t.over = over
	starved := synced && ofModel > 0 && len(urls) == 0
	if starved && !t.starved {
		t.log.Warn("no discovered worker can serve as a tokenizer; requests are routed on load alone until one can: give a render service's URL (DYN_EPP_TOKENIZER_SERVICE_URL; TensorRT-LLM serves no tokenizer endpoint)",
			"workers", ofModel, "left_out", len(leftOut), "label", EngineLabel)
	}
	t.starved = starved
}
