package roles

import (
	"errors"
	"fmt"
	"strings"
)

// Errors of this package. Functions wrap them with context; test with errors.Is.
var (
	// ErrRoleCatalogEmpty reports a role with no schedulable worker for the
	// request's model: no decode worker (never answered with a prefill worker),
	// or no prefill worker when the prefill fallback is off. It also wraps the
	// selection error it came from (selection.ErrNotReady), so both HTTPStatus
	// functions map it to 503.
	ErrRoleCatalogEmpty = errors.New("roles: role has no ready workers")
	// ErrInvalidLabelKey reports a worker-role label key that is not a valid
	// Kubernetes label key.
	ErrInvalidLabelKey = errors.New("roles: invalid label key")
	// ErrInvalidTopologyMode reports a topology mode that is not aggregated or
	// disaggregated.
	ErrInvalidTopologyMode = errors.New("roles: invalid topology mode")
	// ErrInvalidOptions reports options that fail validation; the message lists
	// every problem.
	ErrInvalidOptions = errors.New("roles: invalid options")
	// ErrDuplicateID reports a desired worker set that names one id more than
	// once (it also wraps catalog.ErrDuplicateID). Nothing was changed.
	ErrDuplicateID = errors.New("roles: duplicate worker id")
	// ErrClosed reports a call on a closed RoleSelectors.
	ErrClosed = errors.New("roles: closed")
)

// DefaultRoleLabel is the pod label that carries a worker's role in
// disaggregated mode.
const DefaultRoleLabel = "nvidia.com/dynamo-worker-role"

// Reasons a worker is left out of every role catalog in disaggregated mode.
const (
	// ReasonRoleLabelMissing: the worker has no role label (or an empty value).
	ReasonRoleLabelMissing = "role_label_missing"
	// ReasonRoleLabelInvalid: the label's value is neither prefill nor decode.
	ReasonRoleLabelInvalid = "role_label_invalid"
)

// Role is the part a worker plays. The zero value is Aggregated. A Role is a
// plain value, safe to share.
type Role uint8

// Roles.
const (
	// Aggregated workers prefill and decode their own requests.
	Aggregated Role = iota
	// Prefill workers compute the prompt's KV cache and hand it to a decode
	// worker; they are only ever a hint, never a destination.
	Prefill
	// Decode workers receive the request (the destination) and generate.
	Decode
)

// String returns "aggregated", "prefill" or "decode".
func (r Role) String() string {
	switch r {
	case Aggregated:
		return "aggregated"
	case Prefill:
		return "prefill"
	case Decode:
		return "decode"
	default:
		return fmt.Sprintf("Role(%d)", uint8(r))
	}
}

func (r Role) valid() bool { return r <= Decode }

// errInvalidRole reports a role name that is not aggregated, prefill or decode.
var errInvalidRole = errors.New("roles: invalid role")

// parseRole parses "aggregated", "prefill" or "decode", ignoring ASCII case and
// surrounding white space. Anything else is errInvalidRole.
func parseRole(s string) (Role, error) {
	v := strings.TrimSpace(s)
	for _, r := range []Role{Aggregated, Prefill, Decode} {
		if asciiEqualFold(v, r.String()) {
			return r, nil
		}
	}
	return 0, fmt.Errorf("%w: %q, want aggregated, prefill or decode", errInvalidRole, s)
}

// TopologyMode says whether one pool serves requests whole (aggregated) or is
// split by role into prefill and decode workers (disaggregated). The zero value
// is ModeAggregated, the default.
type TopologyMode uint8

// Topology modes.
const (
	// ModeAggregated: every worker is Aggregated; role labels are never read.
	ModeAggregated TopologyMode = iota
	// ModeDisaggregated: the role label splits the pool into Prefill and Decode.
	ModeDisaggregated
)

// String returns "aggregated" or "disaggregated".
func (m TopologyMode) String() string {
	switch m {
	case ModeAggregated:
		return "aggregated"
	case ModeDisaggregated:
		return "disaggregated"
	default:
		return fmt.Sprintf("TopologyMode(%d)", uint8(m))
	}
}

// Roles returns the roles of the mode, in order: [Aggregated], or [Prefill,
// Decode]. Nil for an unknown mode.
func (m TopologyMode) Roles() []Role {
	switch m {
	case ModeAggregated:
		return []Role{Aggregated}
	case ModeDisaggregated:
		return []Role{Prefill, Decode}
	default:
		return nil
	}
}

// Destination is the role a request is sent to: Aggregated, or Decode.
func (m TopologyMode) Destination() Role {
	if m == ModeDisaggregated {
		return Decode
	}
	return Aggregated
}

func (m TopologyMode) valid() bool { return m <= ModeDisaggregated }

// ParseTopologyMode parses "aggregated" or "disaggregated", ignoring ASCII case
// and surrounding white space. Anything else, the empty string included, is
// ErrInvalidTopologyMode: there is no fallback mode (an unset setting is the
// caller's to default, to the zero value ModeAggregated).
func ParseTopologyMode(s string) (TopologyMode, error) {
	v := strings.TrimSpace(s)
	for _, m := range []TopologyMode{ModeAggregated, ModeDisaggregated} {
		if asciiEqualFold(v, m.String()) {
			return m, nil
		}
	}
	return 0, fmt.Errorf("%w: %q, want aggregated or disaggregated", ErrInvalidTopologyMode, s)
}

// asciiEqualFold is strings.EqualFold restricted to ASCII letters, so that no
// Unicode look-alike (the Kelvin sign, the long s) matches a role name.
func asciiEqualFold(s, lower string) bool {
	if len(s) != len(lower) {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if 'A' <= c && c <= 'Z' {
			c += 'a' - 'A'
		}
		if c != lower[i] {
			return false
		}
	}
	return true
}

// Kubernetes label key limits.
const (
	maxLabelPrefix = 253
	maxLabelName   = 63
)

// validateLabelKey checks key against the Kubernetes label key rules: an
// optional prefix and "/", then a name. The prefix is a DNS-1123 subdomain (at
// most 253 characters; dot-separated parts of lower-case letters, digits and
// '-', each starting and ending with a letter or digit); the name has 1 to 63
// characters, letters, digits, '-', '_' and '.', starting and ending with a
// letter or digit. The error wraps ErrInvalidLabelKey and says what is wrong.
func validateLabelKey(key string) error {
	prefix, name, hasPrefix := strings.Cut(key, "/")
	if !hasPrefix {
		name, prefix = prefix, ""
	}
	var errs []error
	if hasPrefix {
		if err := validatePrefix(prefix); err != nil {
			errs = append(errs, err)
		}
	}
	if err := validateName(name); err != nil {
		errs = append(errs, err)
	}
	if len(errs) == 0 {
		return nil
	}
	return fmt.Errorf("%w: %q: %w", ErrInvalidLabelKey, key, errors.Join(errs...))
}

func alnum(c byte) bool {
	return 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9'
}

func validateName(name string) error {
	switch {
	case name == "":
		return errors.New("name is empty")
	case len(name) > maxLabelName:
		return fmt.Errorf("name has %d characters, at most %d allowed", len(name), maxLabelName)
	case !alnum(name[0]) || !alnum(name[len(name)-1]):
		return errors.New("name must start and end with a letter or digit")
	}
	for i := 0; i < len(name); i++ {
		if c := name[i]; !alnum(c) && c != '-' && c != '_' && c != '.' {
			return fmt.Errorf("name has the character %q; letters, digits, '-', '_' and '.' are allowed", c)
		}
	}
	return nil
}

func validatePrefix(prefix string) error {
	switch {
	case prefix == "":
		return errors.New("prefix before '/' is empty")
	case len(prefix) > maxLabelPrefix:
		return fmt.Errorf("prefix has %d characters, at most %d allowed", len(prefix), maxLabelPrefix)
	}
	for part := range strings.SplitSeq(prefix, ".") {
		if part == "" {
			return fmt.Errorf("prefix %q has an empty DNS label", prefix)
		}
		lowerAlnum := func(c byte) bool { return 'a' <= c && c <= 'z' || '0' <= c && c <= '9' }
		if !lowerAlnum(part[0]) || !lowerAlnum(part[len(part)-1]) {
			return fmt.Errorf("prefix label %q must start and end with a lower-case letter or digit", part)
		}
		for i := 0; i < len(part); i++ {
			if c := part[i]; !lowerAlnum(c) && c != '-' {
				return fmt.Errorf("prefix label %q has the character %q; lower-case letters, digits and '-' are allowed", part, c)
			}
		}
	}
	return nil
}
