package catalog

import "strconv"

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
	// Unschedulable: the worker was deleted. Only the record Delete returns
	// carries it; the catalog no longer holds the worker.
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

// Reason names why a record is not Schedulable. Reasons are stable strings, fit
// for logs and status pages.
//
// A reason that concerns one data-parallel rank carries it after the code,
// "kv_event_endpoint_missing:rank=3"; one about the replay endpoint carries
// ":replay". No code contains a colon, so the text before the first one is the
// code, fit for a metric label.
type Reason string

// The reasons a record may carry.
const (
	ReasonNoEndpoint      Reason = "endpoint_missing"
	ReasonNoBlockSize     Reason = "block_size_missing"
	ReasonNoDPSize        Reason = "dp_size_zero"
	ReasonNoMaxBatched    Reason = "max_num_batched_tokens_missing"
	ReasonNoEventEndpoint Reason = "kv_event_endpoint_missing" // always with its rank: "kv_event_endpoint_missing:rank=N"
	ReasonDraining        Reason = "draining"
	ReasonDeleted         Reason = "deleted"
)

// forRank returns the reason r about one data-parallel rank: "code:rank=N".
func (r Reason) forRank(rank int) Reason {
	return r + ":rank=" + Reason(strconv.Itoa(rank))
}

// Requirements are what the service needs from a worker before it may route to
// it; they are fixed for a Catalog (a prefill and a decode catalog of one pool
// differ here).
//
// Under Requirements a worker is Schedulable, or Incomplete with a Reason for
// every problem, in this order:
//
//   - ReasonNoEndpoint for an empty Endpoint, or the reason Endpoints refuses
//     it for;
//   - ReasonNoBlockSize (BlockSize <= 0);
//   - ReasonNoDPSize (DPSize <= 0);
//   - ReasonNoMaxBatched (Queueing, and MaxNumBatchedTokens <= 0);
//   - with KVEvents, for each rank in ascending order: ReasonNoEventEndpoint
//     if the rank has no non-empty event endpoint, or the reason Endpoints
//     refuses that endpoint for, either with ":rank=N" appended;
//   - the reason Endpoints refuses ReplayEndpoint for, with ":replay" appended.
//
// Endpoints refuses an address with ReasonEndpointHostname,
// ReasonEndpointNotRoutable or ReasonEventEndpointScheme.
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

// evaluate decides whether w can be routed to under req, ignoring draining
// and deletion (which only the Catalog knows): Schedulable and no reasons, or
// Incomplete and the reasons in the order Requirements documents.
//
// It is a pure function. It expects a worker that passes Validate; for any
// other worker it still returns without panicking, but the result means
// little.
func evaluate(w Worker, req Requirements) (Lifecycle, []Reason) {
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
				reasons = append(reasons, ReasonNoEventEndpoint.forRank(rank))
			} else if r := req.Endpoints.zmqProblem(ep); r != "" {
				reasons = append(reasons, r.forRank(rank))
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
