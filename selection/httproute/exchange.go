package httproute

import (
	"context"
	"io"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvselect/kvselect/selection"
)

// outcome is how an exchange ended, for Stats.
type outcome uint8

const (
	outcomeEnded outcome = iota
	outcomeCanceled
	outcomeFailed
	outcomeAborted
)

type exchangeKey struct{}

func exchangeOf(ctx context.Context) *exchange {
	return ctx.Value(exchangeKey{}).(*exchange) // set by ServeHTTP on every request the proxy sees
}

// exchange is one booked request on its way through the proxy. settle may run
// on the context's AfterFunc goroutine and renewals on the renewal timer's;
// everything else runs on the request's goroutine (the proxy calls Rewrite,
// ModifyResponse, ErrorHandler and the body on it).
type exchange struct {
	r   *Router
	b   *selection.Booking
	ctx context.Context // the client's request context

	once    sync.Once
	settled atomic.Bool
	marked  atomic.Bool

	mu    sync.Mutex  // guards renew against a concurrent Reset and Stop
	renew *time.Timer // nil when renewal is off
	// progress counts the body reads that returned bytes; renewTick (the only
	// reader of seen) renews after the first one only when it moved.
	progress atomic.Uint64
	seen     uint64
}

// startRenewal arms the renewal timer (RenewInterval > 0).
func (ex *exchange) startRenewal() {
	if every := ex.r.opts.RenewInterval; every > 0 {
		ex.mu.Lock()
		ex.renew = time.AfterFunc(every, ex.renewTick)
		ex.mu.Unlock()
	}
}

// renewTick renews the lease, while no body byte has come (the worker
// prefills, or computes an answer it does not stream) or when body bytes came
// since the last tick, and re-arms the timer, until the exchange is settled.
// A stream that went silent is not renewed: it expires at its lease.
func (ex *exchange) renewTick() {
	if ex.settled.Load() {
		return
	}
	if p := ex.progress.Load(); p == 0 || p != ex.seen {
		ex.seen = p
		if ex.b.Renew() == nil {
			ex.r.st.renewals.Add(1)
		}
	} else {
		ex.r.st.stalls.Add(1)
	}
	ex.mu.Lock()
	if !ex.settled.Load() {
		ex.renew.Reset(ex.r.opts.RenewInterval)
	}
	ex.mu.Unlock()
}

// settle frees the booking, once, stops the renewals and counts how the
// exchange ended.
func (ex *exchange) settle(o outcome) {
	ex.once.Do(func() {
		ex.settled.Store(true)
		ex.mu.Lock()
		if ex.renew != nil {
			ex.renew.Stop()
		}
		ex.mu.Unlock()
		_ = ex.b.Done() // an error means the booking was already gone (lease, worker deleted): nothing to do
		st := &ex.r.st
		st.done.Add(1)
		switch o {
		case outcomeEnded:
			st.ended.Add(1)
		case outcomeCanceled:
			st.canceled.Add(1)
			ex.r.log.Debug("httproute: client left", slog.String("worker", ex.b.Worker), slog.String("reservation", ex.b.ReservationID))
		case outcomeFailed:
			st.failed.Add(1)
		default:
			st.aborted.Add(1)
		}
	})
}

// endOutcome is the outcome of an exchange the proxy returned from without
// settling it: the client left, or the answer stopped short some other way.
func (ex *exchange) endOutcome() outcome {
	if ex.ctx.Err() != nil {
		return outcomeCanceled
	}
	return outcomeAborted
}

// markFailed reports the worker to the service, at most once per exchange.
func (ex *exchange) markFailed(why string) {
	if ex.marked.Swap(true) {
		return
	}
	ex.r.st.markedFailed.Add(1)
	err := ex.r.opts.Service.MarkFailed(ex.b.Worker)
	attrs := []any{slog.String("worker", ex.b.Worker), slog.String("endpoint", ex.b.Endpoint), slog.String("cause", why)}
	if err != nil {
		attrs = append(attrs, slog.String("mark_error", err.Error()))
	}
	ex.r.log.Warn("httproute: worker failed a request; marked failed", attrs...)
}

// firstByte reports the first body byte of a successful answer.
func (ex *exchange) firstByte() {
	if ex.b.PrefillComplete() == nil {
		ex.r.st.firstBytes.Add(1)
	}
}

// settleBody is the upstream response body as the proxy reads it: its first
// bytes complete the prefill (of a 2xx answer), and its end settles the
// booking before the last bytes go out, so a client that has read the whole
// answer finds the booking done.
type settleBody struct {
	io.ReadCloser
	ex      *exchange
	left    int64 // bytes still expected; negative when the length is unknown
	success bool  // a 2xx answer
	started bool
	sse     *SSECounter // a 2xx event stream's data lines; nil otherwise
}

func (b *settleBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if n > 0 {
		b.ex.progress.Add(1)
		if !b.started {
			b.started = true
			if b.success {
				b.ex.firstByte()
			}
		}
		if b.sse != nil && b.sse.Scan(p[:n]) {
			_ = b.ex.b.Generated(b.sse.Events()) // gone already: nothing to grow
		}
		if b.left >= 0 {
			if b.left -= int64(n); b.left <= 0 {
				b.ex.settle(outcomeEnded)
			}
		}
	}
	switch {
	case err == io.EOF:
		b.ex.settle(outcomeEnded)
	case err != nil && b.ex.ctx.Err() != nil:
		b.ex.settle(outcomeCanceled)
	case err != nil:
		// The worker cut its answer short while the client was still there.
		b.ex.r.st.upstreamErrors.Add(1)
		b.ex.markFailed("response body: " + err.Error())
		b.ex.settle(outcomeFailed)
	}
	return n, err
}

// Close settles an exchange the proxy gives up on before the body's end (its
// write to the client failed).
func (b *settleBody) Close() error {
	err := b.ReadCloser.Close()
	b.ex.settle(b.ex.endOutcome())
	return err
}

// SSECounter counts the data lines of a server-sent event stream ("data:" at
// the start of a line) across reads that may split a line anywhere. An
// OpenAI-compatible engine streams one chunk per generated token (more with
// speculative decoding, which the count then under-reports), so the count is
// the tokens generated so far (the final "data: [DONE]" adds one, less than a
// block): what Booking.Generated takes. The Router counts with it; the
// reference EPP counts ext_proc response body chunks with it. The zero value
// is ready; it is not safe for concurrent use.
type SSECounter struct {
	col     int // bytes into the current line
	matched int // bytes of "data:" matched at its start
	events  int
}

// Scan counts p's data lines and reports whether it found one.
func (c *SSECounter) Scan(p []byte) bool {
	const field = "data:"
	before := c.events
	for _, ch := range p {
		if ch == '\n' {
			c.col, c.matched = 0, 0
			continue
		}
		if c.col == c.matched && c.matched < len(field) && ch == field[c.matched] {
			if c.matched++; c.matched == len(field) {
				c.events++
			}
		}
		c.col++
	}
	return c.events != before
}

// Events is the data lines counted so far.
func (c *SSECounter) Events() int { return c.events }
