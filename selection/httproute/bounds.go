package httproute

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/kvselect/kvselect/tokenize"
)

// initialBodyBuffer is the most a body's buffer holds before its bytes
// arrive: a client may declare far more than it sends.
const initialBodyBuffer = 16 << 10

// refusalLogInterval is how often a refusal reason is logged at most.
const refusalLogInterval = 10 * time.Second

// Inflight is the number of requests being read, tokenized or booked, which
// Options.MaxInflight bounds.
func (r *Router) Inflight() int { return int(r.inflight.Load()) }

// admit reads, tokenizes and books the request in one of the MaxInflight
// slots, which it leaves when it returns, panicking or not. body is nil when
// the body was not read to its end (the slot was refused, or the read failed).
func (r *Router) admit(w http.ResponseWriter, req *http.Request) ([]byte, Booked, error) {
	if r.inflight.Add(1) > int64(r.opts.MaxInflight) {
		r.inflight.Add(-1)
		return nil, Booked{}, fmt.Errorf("%w: %d requests are being read, tokenized or booked (MaxInflight)", ErrOverloaded, r.opts.MaxInflight)
	}
	defer r.inflight.Add(-1)
	body, err := r.readBody(w, req)
	if err != nil {
		return nil, Booked{}, err
	}
	b, err := r.book(req, body)
	return body, b, err
}

// readBody reads the whole body, at most MaxBodyBytes, within BodyTimeout.
func (r *Router) readBody(w http.ResponseWriter, req *http.Request) ([]byte, error) {
	limit := r.opts.MaxBodyBytes
	if req.ContentLength > limit {
		return nil, fmt.Errorf("%w: %d bytes, the limit is %d", ErrBodyTooLarge, req.ContentLength, limit)
	}
	rc := http.NewResponseController(w)
	deadline := r.opts.BodyTimeout > 0 && req.ContentLength != 0 && rc.SetReadDeadline(time.Now().Add(r.opts.BodyTimeout)) == nil
	bound := limit
	if req.ContentLength >= 0 {
		bound = req.ContentLength
	}
	body, err := readAll(http.MaxBytesReader(w, req.Body, limit), bound)
	var tooLarge *http.MaxBytesError
	switch {
	case errors.As(err, &tooLarge):
		return nil, fmt.Errorf("%w: the limit is %d bytes", ErrBodyTooLarge, limit)
	case err != nil && deadline && isTimeout(err):
		// Before the context: net/http cancels it when a read fails.
		return nil, fmt.Errorf("%w: not all of it within %v (BodyTimeout)", ErrBodyTimeout, r.opts.BodyTimeout)
	case err != nil && req.Context().Err() != nil:
		return nil, fmt.Errorf("httproute: reading the body: %w", req.Context().Err())
	case err != nil:
		return nil, fmt.Errorf("%w: reading the body: %v", ErrBadRequest, err)
	}
	if deadline {
		// Lift it: what follows is the answer, which may take minutes, while
		// the server reads the connection to notice a client that leaves
		// (net/http's HTTP/1 server also lifts it when it starts that read).
		_ = rc.SetReadDeadline(time.Time{})
	}
	return body, nil
}

// readAll reads r to its end, expecting at most bound bytes (the declared
// length, else the limit). Its buffer starts at bound+1 (room to see the end
// without growing), at most initialBodyBuffer, and doubles as bytes arrive,
// to bound+1 at most while they fit: memory follows the bytes received, never
// the bytes declared, and an honest body ends in one buffer of its size.
func readAll(r io.Reader, bound int64) ([]byte, error) {
	b := make([]byte, 0, min(bound+1, initialBodyBuffer))
	for {
		if len(b) == cap(b) {
			next := int64(2 * cap(b))
			if int64(len(b)) <= bound && next >= bound {
				next = bound + 1
			}
			b = slices.Grow(b, int(next)-len(b))
		}
		n, err := r.Read(b[len(b):cap(b)])
		b = b[:len(b)+n]
		switch {
		case err == io.EOF:
			return b, nil
		case err != nil:
			return nil, err
		}
	}
}

// refusal names a bound a request was refused by.
type refusal uint8

const (
	refusedOverloaded refusal = iota
	refusedBodyTimeout
	refusedBodyTooLarge
	refusedPromptTooLong
	// degraded is no refusal: a request routed without tokens because the
	// tokenizer failed (Options.NoDegrade off). It shares the rate limit.
	degraded
	numRefusals
)

var refusalNames = [numRefusals]string{"overloaded", "body_timeout", "body_too_large", "prompt_too_long", "tokenizer_degraded"}

// refusalOf returns the bound err refused a request by; false for any other
// error.
func refusalOf(err error) (refusal, bool) {
	switch {
	case errors.Is(err, ErrOverloaded):
		return refusedOverloaded, true
	case errors.Is(err, ErrBodyTimeout):
		return refusedBodyTimeout, true
	case errors.Is(err, ErrBodyTooLarge):
		return refusedBodyTooLarge, true
	case errors.Is(err, tokenize.ErrPromptTooLong):
		return refusedPromptTooLong, true
	}
	return 0, false
}

// countRefusal counts a refusal past a bound and logs it (rate-limited); other
// errors are left alone.
func (r *Router) countRefusal(err error, status int) {
	k, ok := refusalOf(err)
	if !ok {
		return
	}
	r.st.refused[k].Add(1)
	if n, log := r.refusals.note(k, time.Now()); log {
		r.log.Warn("httproute: request refused", slog.String("reason", refusalNames[k]), slog.Int("status", status),
			slog.String("error", err.Error()), slog.Uint64("count_since_last_line", n))
	}
}

// refusalLog limits the refusal lines: each reason is logged at once the first
// time, then at most once every refusalLogInterval, with the count since the
// previous line. It is safe for concurrent use.
type refusalLog struct {
	mu    sync.Mutex
	last  [numRefusals]time.Time
	since [numRefusals]uint64
}

// note counts one refusal for k and reports whether to log it now, with the
// refusals it stands for.
func (l *refusalLog) note(k refusal, now time.Time) (uint64, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.since[k]++
	if !l.last[k].IsZero() && now.Sub(l.last[k]) < refusalLogInterval {
		return 0, false
	}
	n := l.since[k]
	l.last[k], l.since[k] = now, 0
	return n, true
}
