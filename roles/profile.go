package roles

import (
	"errors"
	"fmt"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/selection"
)

// ProfileOptions are the per-role settings that are not part of
// selection.Config. The zero value keeps every worker's own values.
type ProfileOptions struct {
	// PrefillMaxNumBatchedTokens and DecodeMaxNumBatchedTokens replace the
	// max_num_batched_tokens of every worker of that role (the busy base of the
	// admission queue). >= 0; 0 keeps the worker's own value, which discovery
	// fills from the shared setting, so a per-role value falls back to the
	// shared one.
	PrefillMaxNumBatchedTokens int
	DecodeMaxNumBatchedTokens  int
}

// profile is how one role's SelectionService is configured and used.
// deriveProfiles derives one per role from a single base Config. A profile is a
// plain value; do not modify the Overrides it points to.
type profile struct {
	Role Role
	// Config builds the role's service.
	Config selection.Config
	// Override is merged over every request of the role (its non-nil fields
	// win over the caller's Override); nil for none.
	Override *selection.Override
	// LocalPrefillOverride, for Decode only, books a decode worker as an
	// aggregated one when it must prefill the prompt itself (the pair booker's
	// PrefillDecodeOnly fallback): the base's credit, KV reuse and prefill
	// tracking, undoing what Config and Override turn off.
	LocalPrefillOverride *selection.Override
	// MaxNumBatchedTokens replaces each worker's value when > 0.
	MaxNumBatchedTokens int
}

// worker returns the copy of w that the role's service is given: without KV
// event and replay endpoints when the role runs without KV events (a decode
// worker is then schedulable without them, and no subscription is attempted),
// and with the role's max_num_batched_tokens when set. w is not modified.
func (p profile) worker(w catalog.Worker) catalog.Worker {
	if !p.Config.UseKVEvents {
		w.KVEventEndpoints = nil
		w.ReplayEndpoint = ""
	}
	if p.MaxNumBatchedTokens > 0 {
		w.MaxNumBatchedTokens = p.MaxNumBatchedTokens
	}
	return w
}

func ptr[T any](v T) *T { return &v }

// deriveProfiles derives the profile of every role from base:
//
//   - Aggregated: base as it is.
//   - Prefill: base as it is (KV events on when base has them), with
//     PrefillMaxNumBatchedTokens.
//   - Decode: KV events off (so no event or replay endpoint), overlap credit 0,
//     KV reuse not assumed and prefill tokens not tracked, both in Config and as
//     a per-request Override applied to every decode selection and booking;
//     DecodeMaxNumBatchedTokens. selection has no predict-on-route index, so
//     there is no predicted-TTL setting to clear; RouterTTL (the approximate
//     index a service without KV events keeps) stays as in base.
//
// base must pass Validate. Errors wrap selection.ErrInvalidConfig or
// ErrInvalidOptions and list every problem.
func deriveProfiles(base selection.Config, opts ProfileOptions) (map[Role]profile, error) {
	var errs []error
	if err := base.Validate(); err != nil {
		errs = append(errs, err)
	}
	if opts.PrefillMaxNumBatchedTokens < 0 {
		errs = append(errs, fmt.Errorf("%w: PrefillMaxNumBatchedTokens is %d, want >= 0", ErrInvalidOptions, opts.PrefillMaxNumBatchedTokens))
	}
	if opts.DecodeMaxNumBatchedTokens < 0 {
		errs = append(errs, fmt.Errorf("%w: DecodeMaxNumBatchedTokens is %d, want >= 0", ErrInvalidOptions, opts.DecodeMaxNumBatchedTokens))
	}
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}

	decode := base
	decode.UseKVEvents = false
	decode.OverlapScoreCredit = 0
	decode.AssumeKVReuse = false
	decode.TrackPrefillTokens = false

	credit := base.OverlapScoreCredit
	return map[Role]profile{
		Aggregated: {Role: Aggregated, Config: base},
		Prefill:    {Role: Prefill, Config: base, MaxNumBatchedTokens: opts.PrefillMaxNumBatchedTokens},
		Decode: {
			Role:   Decode,
			Config: decode,
			Override: &selection.Override{
				OverlapScoreCredit: ptr(0.0),
				AssumeKVReuse:      ptr(false),
				TrackPrefillTokens: ptr(false),
			},
			LocalPrefillOverride: &selection.Override{
				OverlapScoreCredit: ptr(credit),
				AssumeKVReuse:      ptr(base.AssumeKVReuse),
				TrackPrefillTokens: ptr(base.TrackPrefillTokens),
			},
			MaxNumBatchedTokens: opts.DecodeMaxNumBatchedTokens,
		},
	}, nil
}

// mergeOverride returns caller with forced's non-nil fields laid over it,
// without modifying either. It returns one of them unchanged when the other is
// nil, so the common case allocates nothing.
func mergeOverride(caller, forced *selection.Override) *selection.Override {
	if forced == nil {
		return caller
	}
	if caller == nil {
		return forced
	}
	o := *caller
	if forced.OverlapScoreCredit != nil {
		o.OverlapScoreCredit = forced.OverlapScoreCredit
	}
	if forced.PrefillLoadScale != nil {
		o.PrefillLoadScale = forced.PrefillLoadScale
	}
	if forced.Temperature != nil {
		o.Temperature = forced.Temperature
	}
	if forced.AssumeKVReuse != nil {
		o.AssumeKVReuse = forced.AssumeKVReuse
	}
	if forced.TrackPrefillTokens != nil {
		o.TrackPrefillTokens = forced.TrackPrefillTokens
	}
	return &o
}
