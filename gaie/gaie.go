package gaie

import (
	"fmt"
	"slices"
	"strings"
)

// The Endpoint Picker protocol (GAIE's docs/proposals/004-endpoint-picker-protocol).
const (
	// HeaderDestination carries the chosen endpoint (host:port; with
	// fallbacks, "pick,fallback,...") from the picker to the gateway, as a
	// request header and as the key of the destination in MetadataNamespace.
	HeaderDestination = "x-gateway-destination-endpoint"
	// HeaderDestinationSubset is the key of the subset hint (the endpoints a
	// request may go to) the gateway sends the picker in its request
	// metadata.
	HeaderDestinationSubset = "x-gateway-destination-endpoint-subset"
	// HeaderDestinationServed is the key, in MetadataNamespace of the
	// response metadata, of the endpoint that really served the request.
	HeaderDestinationServed = "x-gateway-destination-endpoint-served"
	// HeaderDestinationScores carries endpoint scores in some pickers;
	// kvselect never reads it from a client.
	HeaderDestinationScores = "x-gateway-destination-endpoint-scores"
	// MetadataNamespace is the dynamic-metadata namespace of the destination
	// (picker to gateway) and of the served endpoint (gateway to picker).
	MetadataNamespace = "envoy.lb"
	// SubsetNamespace is the request filter-metadata namespace of the subset
	// hint.
	SubsetNamespace = "envoy.lb.subset_hint"
	// HeaderTestSelection is the conformance suite's request header that
	// names the endpoint a test picker must choose.
	HeaderTestSelection = "test-epp-endpoint-selection"
	// HeaderTestServed is the conformance suite's response header naming the
	// endpoint that served the request.
	HeaderTestServed = "x-conformance-test-served-endpoint"
	// HeaderDroppedReason is llm-d's response header saying why a request
	// was dropped.
	HeaderDroppedReason = "x-llm-d-request-dropped-reason"
)

// Prefill/decode serving: the picker's hint to the decode worker's sidecar.
const (
	// HeaderPrefiller carries the prefill worker's host:port (an IP literal,
	// IPv6 in brackets) to the decode worker's sidecar.
	HeaderPrefiller = "x-prefiller-host-port"
	// HeaderPrefillerSignature carries kvselect's signature of the hint; a
	// sidecar configured with the key refuses a hint without it.
	HeaderPrefillerSignature = "x-kvselect-prefiller-signature"
	// HeaderFailedLeg is the decode sidecar's response header naming the
	// leg of a prefill/decode request that failed when it is not the decode
	// worker's own (FailedLegPrefill), so that the picker marks the prefill
	// worker failed rather than the destination. It is the routing layer's
	// business: a gateway does not pass it on to the client.
	HeaderFailedLeg = "x-kvselect-failed-leg"
	// FailedLegPrefill is HeaderFailedLeg's value for a failed prefill leg.
	FailedLegPrefill = "prefill"
)

// Dynamo's EPP contract and the OpenAI-compatible front ends.
const (
	// HeaderSessionID is the common session header (read first).
	HeaderSessionID = "x-session-id"
	// HeaderDynamoSessionID is Dynamo's session header (read after it).
	HeaderDynamoSessionID = "x-dynamo-session-id"
	// HeaderDynamoPriority is a request's queue jump, in seconds (>= 0).
	HeaderDynamoPriority = "x-dynamo-request-priority"
	// HeaderDynamoStrictPriority is a request's strict priority tier.
	HeaderDynamoStrictPriority = "x-dynamo-request-strict-priority"
	// HeaderPolicyClass names a request's policy class (fair admission:
	// selection.Request.Class), as Dynamo's selection service reads it.
	HeaderPolicyClass = "x-dynamo-meta-policy-class"
	// HeaderInferenceObjective is GAIE's and llm-d's request header naming
	// the request's InferenceObjective; read after HeaderPolicyClass, its
	// value is taken as the policy class of the same name.
	HeaderInferenceObjective = "x-gateway-inference-objective"
)

// StatusSiteOverloaded is the status Dynamo's frontend answers an overload
// with by default (529, no standard code), which a gateway may be
// configured to answer in place of 429.
const StatusSiteOverloaded = 529

// ParseOverloadStatus parses the status a front end is configured to answer
// an overload with: "429" (Too Many Requests) or "529"
// (StatusSiteOverloaded).
func ParseOverloadStatus(s string) (int, error) {
	switch s {
	case "429":
		return 429, nil
	case "529":
		return StatusSiteOverloaded, nil
	}
	return 0, fmt.Errorf("overload status %q: want 429 or 529", s)
}

// StatusClientClosedRequest is the status answered for a client that went
// away before its answer (the nginx convention, no standard code).
const StatusClientClosedRequest = 499

// controlHeaders: see ControlHeaders.
var controlHeaders = []string{
	HeaderDestination,
	HeaderDestinationSubset,
	HeaderDestinationServed,
	HeaderDestinationScores,
	HeaderPrefiller,
	HeaderPrefillerSignature,
	HeaderDroppedReason,
	HeaderTestSelection,
	"x-dynamo-worker-instance-id",
	"x-dynamo-prefill-instance-id",
	"x-dynamo-dp-rank",
	"x-dynamo-prefill-dp-rank",
	"x-dynamo-routing-mode",
}

// ControlHeaders returns the request headers a client could use to steer
// routing downstream (choose the destination, the prefill worker or the
// candidate set of a sidecar or another gateway) or to fake a gateway's
// report, lower case. A gateway removes them from every request it
// forwards.
func ControlHeaders() []string { return slices.Clone(controlHeaders) }

// IsControlHeader reports whether a request header (any case) is one of
// ControlHeaders, or otherwise the routing layer's business: any
// x-gateway-destination-endpoint*, x-gateway-inference-* or x-kvselect-*
// header, and the gateway's model rewrite. A sidecar passes none of them
// on to its engine.
func IsControlHeader(name string) bool {
	n := strings.ToLower(name)
	switch {
	case slices.Contains(controlHeaders, n), n == "x-gateway-model-name-rewrite":
		return true
	case strings.HasPrefix(n, "x-kvselect-"),
		strings.HasPrefix(n, HeaderDestination),
		strings.HasPrefix(n, "x-gateway-inference-"):
		return true
	}
	return false
}
