package catalog

import (
	"fmt"
	"strconv"
	"strings"
)

// Lifecycle is where a record stands with respect to routing. Only Schedulable
// records receive new requests. The zero value is not a lifecycle (String
// reports "unknown"); every record the catalog returns has one of the four
// below.
type Lifecycle uint8

const (
	// Incomplete: the worker lacks something routing needs; Reasons say what.
	Incomplete Lifecycle = iota + 1
	// Schedulable: the worker may receive new requests.
	Schedulable
	// Draining: an operator or the caller took the worker out of rotation
	// (SetDraining); requests already booked on it run to completion.
	Draining
	// Unschedulable: the worker was deleted. Only the record returned by
	// Delete (and passed to OnChange) carries it; the catalog no longer holds
	// the worker.
	Unschedulable
)

// String returns the lower-case name ("incomplete", "schedulable", "draining",
// "unschedulable"), "unknown" for the zero value.
func (l Lifecycle) String() string {
	switch l {
	case 0:
		return "unknown"
	case Incomplete:
		return "incomplete"
	case Schedulable:
		return "schedulable"
	case Draining:
		return "draining"
	case Unschedulable:
		return "unschedulable"
	default:
		return "Lifecycle(" + strconv.Itoa(int(l)) + ")"
	}
}

// MarshalText encodes the lifecycle as its String, for JSON and logs.
func (l Lifecycle) MarshalText() ([]byte, error) { return []byte(l.String()), nil }

// Reason names why a record is not Schedulable. Reasons are stable strings,
// fit for logs, status pages and metric labels (use Code for labels: it drops
// the rank).
//
// A reason that concerns one data-parallel rank carries it after the code,
// "kv_event_endpoint_missing:rank=3" (see ForRank); Code and Rank take it apart.
type Reason string

// The reasons a record may carry.
const (
	ReasonNoEndpoint      Reason = "endpoint_missing"
	ReasonNoBlockSize     Reason = "block_size_missing"
	ReasonNoDPSize        Reason = "dp_size_zero"
	ReasonNoMaxBatched    Reason = "max_num_batched_tokens_missing"
	ReasonNoEventEndpoint Reason = "kv_event_endpoint_missing" // always per rank: ReasonNoEventEndpoint.ForRank(r)
	ReasonDraining        Reason = "draining"
	ReasonDeleted         Reason = "deleted"
)

const rankSep = ":rank="

// ForRank returns the reason r for one data-parallel rank: "code:rank=N".
func (r Reason) ForRank(rank int) Reason {
	return Reason(string(r.Code()) + rankSep + strconv.Itoa(rank))
}

// Code returns the reason without its rank, to compare with the constants.
func (r Reason) Code() Reason {
	code, _, _ := strings.Cut(string(r), rankSep)
	return Reason(code)
}

// Rank returns the data-parallel rank the reason is about, if any.
func (r Reason) Rank() (int, bool) {
	_, s, ok := strings.Cut(string(r), rankSep)
	if !ok {
		return 0, false
	}
	n, err := strconv.Atoi(s)
	return n, err == nil
}

// Requirements are what the service needs from a worker before it may route to
// it; they are fixed for a Catalog (a prefill and a decode catalog of one pool
// differ here).
type Requirements struct {
	// KVEvents: the service indexes KV events, so every rank needs an event
	// endpoint.
	KVEvents bool
	// Queueing: the service decides "busy" from max_num_batched_tokens, so
	// workers must report it.
	Queueing bool
	// Endpoints says which endpoint addresses may be used (the zero value is
	// the safe default, see EndpointPolicy).
	Endpoints EndpointPolicy
}

// String renders the requirements for logs, e.g. "kv_events=true queueing=false".
func (r Requirements) String() string {
	return fmt.Sprintf("kv_events=%t queueing=%t", r.KVEvents, r.Queueing)
}

// Evaluate decides whether w can be routed to under req, ignoring draining and
// deletion (which only the Catalog knows). It returns Schedulable and no
// reasons, or Incomplete and every missing piece, in this order:
// ReasonNoEndpoint (empty Endpoint), ReasonNoBlockSize (BlockSize <= 0),
// ReasonNoDPSize (DPSize <= 0), ReasonNoMaxBatched (queueing on and
// MaxNumBatchedTokens <= 0), then ReasonNoEventEndpoint.ForRank(r) for each
// rank r, ascending, without a non-empty event endpoint (events on). An
// endpoint that req.Endpoints refuses adds its reason (ReasonEndpointHostname,
// ReasonEndpointNotRoutable, ReasonEventEndpointScheme): for the worker's
// endpoint as it is, for a rank's event endpoint ForRank(r) (events on), for
// the replay endpoint with the suffix ":replay".
//
// Evaluate is a pure function. It expects a worker that passes Validate; for
// any other worker it still returns without panicking, but the result means
// little.
func Evaluate(w Worker, req Requirements) (Lifecycle, []Reason) {
	var reasons []Reason
	if w.Endpoint == "" {
		reasons = append(reasons, ReasonNoEndpoint)
	} else if r := req.Endpoints.endpointProblem(w.Endpoint); r != "" {
		reasons = append(reasons, r)
	}
	if w.BlockSize <= 0 {
		reasons = append(reasons, ReasonNoBlockSize)
	}
	if w.DPSize <= 0 {
		reasons = append(reasons, ReasonNoDPSize)
	}
	if req.Queueing && w.MaxNumBatchedTokens <= 0 {
		reasons = append(reasons, ReasonNoMaxBatched)
	}
	if req.KVEvents {
		for i := range min(w.DPSize, MaxDPSize) {
			rank := w.DPStart + i
			ep := w.KVEventEndpoints[rank]
			if ep == "" {
				reasons = append(reasons, ReasonNoEventEndpoint.ForRank(rank))
			} else if r := req.Endpoints.zmqProblem(ep); r != "" {
				reasons = append(reasons, r.ForRank(rank))
			}
		}
	}
	if w.ReplayEndpoint != "" {
		if r := req.Endpoints.zmqProblem(w.ReplayEndpoint); r != "" {
			reasons = append(reasons, r+":replay")
		}
	}
	if len(reasons) > 0 {
		return Incomplete, reasons
	}
	return Schedulable, nil
}
