package eppserver

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"strings"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/examples/epp/extproc"
	"github.com/kvselect/kvselect/examples/policies"
	"github.com/kvselect/kvselect/roles"
	"github.com/kvselect/kvselect/selection"
)

// DYN_EPP_LORA_AFFINITY's values.
const (
	loraOff     = "off"
	loraPrefer  = "prefer"
	loraRequire = "require"
)

// loraPolicy is LoRA-adapter affinity (DYN_EPP_LORA_AFFINITY, package
// policies): a request whose body names a model other than the EPP's
// (DYN_MODEL_NAME) names an adapter, which goes in its
// selection.Request.LoRAName (so its blocks hash as the engines hash an
// adapter's); the filter or the cost term the setting names reads it, on
// every role's service, over the adapters the workers' labels say they
// have loaded. A nil *loraPolicy is off: each method then passes its
// argument through. Apply updates adapters (one goroutine); the rest only
// reads, on the requests' goroutines.
type loraPolicy struct {
	model    string // the EPP's model: a body naming it names no adapter
	require  bool   // a filter, else a cost term
	adapters *policies.Adapters
}

// newLoRA returns cfg's LoRA policy: nil when it is off.
func newLoRA(cfg *Config) (*loraPolicy, error) {
	if cfg.LoRA == "" || cfg.LoRA == loraOff {
		return nil, nil
	}
	a, err := policies.NewAdapters(cfg.LoRALabelPrefix)
	if err != nil {
		return nil, fmt.Errorf("%w: DYN_EPP_LORA_LABEL_PREFIX: %w", ErrConfig, err)
	}
	return &loraPolicy{model: cfg.Model, require: cfg.LoRA == loraRequire, adapters: a}, nil
}

// configure adds the policy's seam to a role's service.
func (l *loraPolicy) configure(b *selection.SelectionServiceBuilder) {
	switch {
	case l == nil:
	case l.require:
		b.Filter("lora", policies.LoRAFilter{Adapters: l.adapters})
	default:
		b.CostTerm("lora-affinity", policies.LoRAAffinity{
			Adapters: l.adapters, Blocks: policies.DefaultAffinityBlocks, Seconds: policies.DefaultAffinitySeconds,
		})
	}
}

// picker wraps the router: it reads the adapter a request names into its
// context, where booker finds it.
func (l *loraPolicy) picker(next extproc.Picker) extproc.Picker {
	if l == nil {
		return next
	}
	return loraPicker{l, next}
}

// booker wraps the router's booker: it sets each request's LoRAName from
// its context.
func (l *loraPolicy) booker(next booker) booker {
	if l == nil {
		return next
	}
	return loraBooker{next}
}

// update gives the adapters a discovery snapshot's workers.
func (l *loraPolicy) update(desired []catalog.Worker) {
	if l != nil {
		l.adapters.Update(desired)
	}
}

type loraKey struct{}

type loraPicker struct {
	l    *loraPolicy
	next extproc.Picker
}

func (p loraPicker) Pick(ctx context.Context, req extproc.PickRequest) (extproc.Pick, error) {
	if m := bodyModel(req.Body); m != "" && m != p.l.model {
		ctx = context.WithValue(ctx, loraKey{}, m)
	}
	return p.next.Pick(ctx, req)
}

type loraBooker struct{ next booker }

func (b loraBooker) Book(ctx context.Context, req selection.Request) (roles.Plan, error) {
	req.LoRAName, _ = ctx.Value(loraKey{}).(string)
	return b.next.Book(ctx, req)
}

func (b loraBooker) Scores(ctx context.Context, req selection.Request) ([]selection.Scored, error) {
	req.LoRAName, _ = ctx.Value(loraKey{}).(string)
	return b.next.Scores(ctx, req)
}

// bodyModel returns the top-level "model" string of an OpenAI request body,
// "" when there is none (or the body is no JSON object). It reads up to the
// key (OpenAI clients send it first) and skips the values before it
// without decoding them.
func bodyModel(body []byte) string {
	dec := json.NewDecoder(bytes.NewReader(body))
	if t, err := dec.Token(); err != nil || t != json.Delim('{') {
		return ""
	}
	for dec.More() {
		t, err := dec.Token()
		if err != nil {
			return ""
		}
		key, _ := t.(string)
		if key == "model" {
			var m string
			if dec.Decode(&m) != nil {
				return ""
			}
			return strings.TrimSpace(m)
		}
		var skip json.RawMessage
		if dec.Decode(&skip) != nil {
			return ""
		}
	}
	return ""
}
