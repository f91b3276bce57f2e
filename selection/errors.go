package selection

import (
	"context"
	"errors"
	"net/http"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/gaie"
	"github.com/kvselect/kvselect/reservation"
)

// Errors returned by the service, wrapped with context. HTTPStatus maps each to the
// status an HTTP or ext_proc front end should answer with.
var (
	// ErrBadRequest: the request or an override is malformed (400).
	ErrBadRequest = errors.New("selection: bad request")
	// ErrInvalidConfig: Build found problems in the Config; the message lists all.
	ErrInvalidConfig = errors.New("selection: invalid configuration")
	// ErrNotReady: the model has no schedulable worker (503).
	ErrNotReady = errors.New("selection: not ready")
	// ErrNoEndpoints: no worker is eligible for this request, e.g. the allowed
	// subset names none of the model's schedulable workers (503).
	ErrNoEndpoints = errors.New("selection: no eligible endpoints")
	// ErrNotFound: unknown worker id (404).
	ErrNotFound = errors.New("selection: not found")
	// ErrConflict: the reservation id is already booked (409).
	ErrConflict = errors.New("selection: conflict")
	// ErrOverloaded: every eligible worker is busy and the admission queue is full,
	// or queueing is off (429).
	ErrOverloaded = errors.New("selection: overloaded")
	// ErrRefused: the policy's Classifier refused the request; RefusalReason
	// names its reason (429).
	ErrRefused = errors.New("selection: refused by the classifier")
	// ErrAdmission: fair admission refused the request (429): its policy
	// class is at its queue or in-flight limit, or its deadline passed
	// while it waited; RefusalReason names which and the class
	// ("class_queue_full:batch", "class_inflight_full:batch",
	// "deadline:interactive").
	ErrAdmission = errors.New("selection: not admitted")
	// ErrPolicy: a policy seam broke its contract (a cost term's value that
	// is not finite, a picker's index out of range, a classifier's invalid
	// priority): a bug in the seam, not in the request (500).
	ErrPolicy = errors.New("selection: policy seam failed")
	// ErrUnknownReservation: PrefillComplete or Reservations.Free of an id that is
	// not booked (never booked, already freed, expired). Harmless (404).
	ErrUnknownReservation = errors.New("selection: unknown reservation")
	// ErrClosed: the service was closed (503).
	ErrClosed = errors.New("selection: service closed")
	// ErrTooManyRanks: Workers().Upsert refused a worker that would take the
	// service past Config.MaxWorkerRanks data-parallel ranks (400). It wraps
	// catalog.ErrTooManyRanks.
	ErrTooManyRanks = errors.New("selection: too many worker ranks")
)

// HTTPStatus returns the HTTP status code for an error returned by this package
// (and by the packages it wraps): 400 bad request, 404 not found, 409 conflict, 429
// overloaded, refused or not admitted, 503 not ready / no endpoints / closed, 504 for a deadline that
// passed, 499 (nginx's "client closed request") for a cancellation, and 500 for
// anything else. A nil error is 200.
func HTTPStatus(err error) int {
	switch {
	case err == nil:
		return http.StatusOK
	case errors.Is(err, ErrBadRequest), errors.Is(err, ErrInvalidConfig),
		errors.Is(err, reservation.ErrInvalid), errors.Is(err, catalog.ErrInvalidWorker),
		errors.Is(err, ErrTooManyRanks), errors.Is(err, catalog.ErrTooManyRanks):
		return http.StatusBadRequest
	case errors.Is(err, ErrNotFound), errors.Is(err, ErrUnknownReservation),
		errors.Is(err, catalog.ErrNotFound), errors.Is(err, reservation.ErrUnknownReservation):
		return http.StatusNotFound
	case errors.Is(err, ErrConflict), errors.Is(err, reservation.ErrConflict), errors.Is(err, catalog.ErrDuplicateID):
		return http.StatusConflict
	case errors.Is(err, ErrOverloaded), errors.Is(err, ErrRefused), errors.Is(err, ErrAdmission):
		return http.StatusTooManyRequests
	case errors.Is(err, ErrNotReady), errors.Is(err, ErrNoEndpoints), errors.Is(err, ErrClosed):
		return http.StatusServiceUnavailable
	case errors.Is(err, context.DeadlineExceeded):
		return http.StatusGatewayTimeout
	case errors.Is(err, context.Canceled):
		return gaie.StatusClientClosedRequest // the caller is gone
	default:
		return http.StatusInternalServerError
	}
}
