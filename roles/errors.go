package roles

import (
	"errors"
	"net/http"

	"github.com/kvselect/kvselect/selection"
)

// HTTPStatus returns the HTTP status an HTTP or ext_proc front end should
// answer with for an error of this package: 503 for ErrRoleCatalogEmpty and
// ErrClosed, 400 for invalid options, modes and label keys, 409 for a
// duplicate worker id, 404 for ErrUnknownPlan, and
// selection.HTTPStatus for everything else (the selection errors the legs
// return, which it maps to 400, 404, 409, 429, 503, 504 and 499). A nil error
// is 200.
func HTTPStatus(err error) int {
	switch {
	case err == nil:
		return http.StatusOK
	case errors.Is(err, ErrRoleCatalogEmpty), errors.Is(err, ErrClosed):
		return http.StatusServiceUnavailable
	case errors.Is(err, ErrInvalidOptions), errors.Is(err, ErrInvalidTopologyMode),
		errors.Is(err, ErrInvalidLabelKey):
		return http.StatusBadRequest
	case errors.Is(err, ErrDuplicateID):
		return http.StatusConflict
	case errors.Is(err, ErrUnknownPlan):
		return http.StatusNotFound
	default:
		return selection.HTTPStatus(err)
	}
}
