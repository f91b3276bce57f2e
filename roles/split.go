package roles

import (
	"fmt"
	"strings"

	"github.com/kvselect/kvselect/catalog"
)

// Excluded is a worker that Split left out of every role catalog, and why.
type Excluded struct {
	ID string
	// Reason is ReasonRoleLabelMissing or ReasonRoleLabelInvalid.
	Reason string
	// Value is the label's value as found (for logs); empty when missing.
	Value string
}

// SplitResult is one desired worker set divided by role. A SplitResult is a
// plain value; its workers share their maps with Split's input.
type SplitResult struct {
	// ByRole holds an entry for every role of the mode (possibly an empty
	// slice), each listing its workers in input order. The sets are disjoint.
	ByRole map[Role][]catalog.Worker
	// Excluded lists the workers no role took, in input order.
	Excluded []Excluded
}

// Split divides one desired worker set (for example the ready pods of one
// InferencePool) by role.
//
// In ModeAggregated every worker goes to Aggregated and no label is read. In
// ModeDisaggregated the worker's label labelKey ("" means DefaultRoleLabel)
// decides: its value, with surrounding white space trimmed and ASCII case
// ignored, must be "prefill" or "decode". A worker without the label, or with an
// empty value, is excluded as ReasonRoleLabelMissing; any other value,
// "aggregated" and "both" included, is excluded as ReasonRoleLabelInvalid.
// There is no fallback role: a worker is in exactly one role catalog or in
// Excluded.
//
// Split does not check ids: a set naming one id twice is refused by
// RoleSelectors.Reconcile before anything is split. Errors:
// ErrInvalidTopologyMode, ErrInvalidLabelKey (disaggregated mode only).
func Split(workers []catalog.Worker, mode TopologyMode, labelKey string) (SplitResult, error) {
	switch mode {
	case ModeAggregated:
		return SplitResult{ByRole: map[Role][]catalog.Worker{Aggregated: workers}}, nil
	case ModeDisaggregated:
	default:
		return SplitResult{}, fmt.Errorf("%w: %v", ErrInvalidTopologyMode, mode)
	}
	if labelKey == "" {
		labelKey = DefaultRoleLabel
	}
	if err := validateLabelKey(labelKey); err != nil {
		return SplitResult{}, err
	}
	res := SplitResult{ByRole: map[Role][]catalog.Worker{Prefill: nil, Decode: nil}}
	for _, w := range workers {
		raw, ok := w.Labels[labelKey]
		r, err := parseRole(raw)
		switch {
		case !ok || strings.TrimSpace(raw) == "":
			res.Excluded = append(res.Excluded, Excluded{ID: w.ID, Reason: ReasonRoleLabelMissing, Value: raw})
		case err != nil || r == Aggregated:
			res.Excluded = append(res.Excluded, Excluded{ID: w.ID, Reason: ReasonRoleLabelInvalid, Value: raw})
		default:
			res.ByRole[r] = append(res.ByRole[r], w)
		}
	}
	return res, nil
}
