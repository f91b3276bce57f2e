package policies

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"

	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/selection"
)

// DefaultLabelPrefix is the default prefix of the labels that name a
// worker's loaded adapters: lora.kvselect.io/sql-lora=true says the worker
// has adapter sql-lora loaded.
const DefaultLabelPrefix = "lora.kvselect.io/"

// LabelLoaded is the value of an adapter's label on a worker that has it
// loaded; any other value says it has not.
const LabelLoaded = "true"

// ErrLabelPrefix reports a label prefix that cannot begin a label key.
var ErrLabelPrefix = errors.New("policies: invalid LoRA label prefix")

// Adapters knows which workers have which LoRA adapters loaded, from their
// labels (see the package comment). Build it with NewAdapters; it is safe
// for concurrent use.
type Adapters struct {
	prefix string
	index  atomic.Pointer[adapterIndex]
}

// adapterIndex is one Update's view, never changed once published.
type adapterIndex struct {
	holders map[string][]string    // adapter -> the workers that have it, by id
	loaded  map[adapterWorker]bool // (adapter, worker) -> loaded
}

type adapterWorker struct{ adapter, worker string }

// NewAdapters returns an empty Adapters that reads the labels beginning with
// prefix (DefaultLabelPrefix when ""). prefix must make a Kubernetes label
// key with an adapter's name after it: a DNS subdomain and a slash
// (lora.example.com/), or the start of a name (lora-); else the error wraps
// ErrLabelPrefix.
func NewAdapters(prefix string) (*Adapters, error) {
	if prefix == "" {
		prefix = DefaultLabelPrefix
	}
	if errs := validation.IsQualifiedName(prefix + "a"); len(errs) > 0 {
		return nil, fmt.Errorf("%w: %q: %s", ErrLabelPrefix, prefix, strings.Join(errs, "; "))
	}
	a := &Adapters{prefix: prefix}
	a.index.Store(&adapterIndex{})
	return a, nil
}

// Update replaces what a knows with the adapters ws's labels name: ws is
// the whole fleet (a discovery snapshot), and a worker missing from it has
// no adapter.
func (a *Adapters) Update(ws []catalog.Worker) {
	ix := &adapterIndex{holders: map[string][]string{}, loaded: map[adapterWorker]bool{}}
	for _, w := range ws {
		for key, v := range w.Labels {
			name, ok := strings.CutPrefix(key, a.prefix)
			if !ok || name == "" || v != LabelLoaded {
				continue
			}
			k := adapterWorker{name, w.ID}
			if !ix.loaded[k] {
				ix.loaded[k] = true
				ix.holders[name] = append(ix.holders[name], w.ID)
			}
		}
	}
	for _, ids := range ix.holders {
		slices.Sort(ids)
	}
	a.index.Store(ix)
}

// Loaded reports whether worker has adapter loaded.
func (a *Adapters) Loaded(adapter, worker string) bool {
	return a.index.Load().loaded[adapterWorker{adapter, worker}]
}

// AppendHolders appends to dst the ids of the workers that have adapter
// loaded, in order, and returns the extended slice.
func (a *Adapters) AppendHolders(dst []string, adapter string) []string {
	return append(dst, a.index.Load().holders[adapter]...)
}

// LoRAFilter requires a request's LoRA adapter (Request.LoRAName): it
// admits only the workers that have it loaded, and every worker for a
// request without one. Its scope is the adapter's holders (AdmitsOnly), so
// the sparse decision stays exact with it.
type LoRAFilter struct {
	Adapters *Adapters
}

var _ selection.ScopedFilter = LoRAFilter{}

// Admit reports whether c has req's adapter loaded (true without one).
func (f LoRAFilter) Admit(_ context.Context, req *selection.Request, c *selection.Scored) bool {
	return req.LoRAName == "" || f.Adapters.Loaded(req.LoRAName, c.WorkerID)
}

// Scope appends the holders of req's adapter: the only workers the filter
// admits. Without an adapter it refuses nobody.
func (f LoRAFilter) Scope(_ context.Context, req *selection.Request, dst []string) ([]string, selection.FilterScope) {
	if req.LoRAName == "" {
		return dst, selection.RefusesOnly
	}
	return f.Adapters.AppendHolders(dst, req.LoRAName), selection.AdmitsOnly
}

// Defaults of LoRAAffinity's preference: about what a worker's loading an
// adapter from its host memory delays a request by, and Dynamo's cost of as
// much work.
const (
	DefaultAffinityBlocks  = 32
	DefaultAffinitySeconds = 0.25
)

// LoRAAffinity prefers the workers that have a request's LoRA adapter
// (Request.LoRAName) loaded: it takes Blocks off their cost under Dynamo's
// cost, Seconds under the predictive one, and adds nothing elsewhere or
// for a request without an adapter. Its scope is the adapter's holders,
// so the sparse decision stays exact with it. Blocks and Seconds must be
// finite (0: no preference in that unit).
type LoRAAffinity struct {
	Adapters *Adapters
	Blocks   float64
	Seconds  float64
}

var _ selection.ScopedCostTerm = LoRAAffinity{}

// Cost returns minus the preference when c has req's adapter loaded, else 0.
func (t LoRAAffinity) Cost(_ context.Context, req *selection.Request, c *selection.Scored) float64 {
	if req.LoRAName == "" || !t.Adapters.Loaded(req.LoRAName, c.WorkerID) {
		return 0
	}
	if c.Predicted {
		return -t.Seconds
	}
	return -t.Blocks
}

// Scope appends the holders of req's adapter: the only workers Cost prices.
func (t LoRAAffinity) Scope(_ context.Context, req *selection.Request, dst []string) []string {
	if req.LoRAName == "" {
		return dst
	}
	return t.Adapters.AppendHolders(dst, req.LoRAName)
}
