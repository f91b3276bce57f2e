package httproute

import (
	"context"
	"io"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvselect/kvselect/lifecycle"
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

// exchange is one booked request on its way through the proxy, its booking
// driven by a lifecycle.Follower. settle may run on the context's AfterFunc
// goroutine and renewals on the renewal timer's; everything else runs on the
// request's goroutine (the proxy calls Rewrite, ModifyResponse, ErrorHandler
// and the body on it).
type exchange struct {
	r   *Router
	b   Booked
	f   *lifecycle.Follower
	ctx context.Context // the client's request context
	why string          // the failure the follower is told of, for its log line; the request goroutine's

	once    sync.Once
	settled atomic.Bool

	mu    sync.Mutex  // guards renew against a concurrent Reset and Stop
	renew *time.Timer // nil when renewal is off
}

func (r *Router) newExchange(ctx context.Context, b Booked) *exchange {
	ex := &exchange{r: r, b: b, ctx: ctx}
	ex.f, _ = lifecycle.NewFollower(b.Handle, lifecycle.Options{ // Book checked the Handle
		OutputGrowth: r.opts.OutputGrowth, FailureStatus: r.opts.FailureStatus, Marked: ex.marked,
	})
	return ex
}

// startRenewal arms the renewal timer (RenewInterval > 0).
func (ex *exchange) startRenewal() {
	if every := ex.r.opts.RenewInterval; every > 0 {
		ex.mu.Lock()
		ex.renew = time.AfterFunc(every, ex.renewTick)
		ex.mu.Unlock()
	}
}

// renewTick renews the lease through the follower (while no body byte has
// come, or when body bytes came since the last tick) and re-arms the timer,
// until the exchange is settled. A stream that went silent is not renewed:
// it expires at its lease.
func (ex *exchange) renewTick() {
	if ex.settled.Load() {
		return
	}
	switch renewed, stalled := ex.f.Renew(); {
	case renewed:
		ex.r.st.renewals.Add(1)
	case stalled:
		ex.r.st.stalls.Add(1)
	}
	ex.mu.Lock()
	if !ex.settled.Load() {
		ex.renew.Reset(ex.r.opts.RenewInterval)
	}
	ex.mu.Unlock()
}

// settle ends the booking, once, stops the renewals and counts how the
// exchange ended.
func (ex *exchange) settle(o outcome) {
	ex.once.Do(func() {
		ex.settled.Store(true)
		ex.mu.Lock()
		if ex.renew != nil {
			ex.renew.Stop()
		}
		ex.mu.Unlock()
		_ = ex.f.Done() // an error means the booking was already gone (lease, worker deleted): nothing to do
		st := &ex.r.st
		st.done.Add(1)
		switch o {
		case outcomeEnded:
			st.ended.Add(1)
		case outcomeCanceled:
			st.canceled.Add(1)
			ex.r.log.Debug("httproute: client left", slog.String("worker", ex.b.Worker), slog.String("booking", string(ex.b.ID)))
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

// fail tells the follower the worker failed the request on the wire.
func (ex *exchange) fail(why string) {
	ex.why = why
	ex.f.Fail()
}

// marked counts and logs a worker the follower marked failed (at most once
// per exchange).
func (ex *exchange) marked(_ lifecycle.Cause, err error) {
	ex.r.st.markedFailed.Add(1)
	attrs := []any{slog.String("worker", ex.b.Worker), slog.String("endpoint", ex.b.Endpoint), slog.String("cause", ex.why)}
	if err != nil {
		attrs = append(attrs, slog.String("mark_error", err.Error()))
	}
	ex.r.log.Warn("httproute: worker failed a request; marked failed", attrs...)
}

// settleBody is the upstream response body as the proxy reads it: its first
// bytes complete the prefill (of a 2xx answer), and its end settles the
// booking before the last bytes go out, so a client that has read the whole
// answer finds the booking done.
type settleBody struct {
	io.ReadCloser
	ex   *exchange
	left int64 // bytes still expected; negative when the length is unknown
}

func (b *settleBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if n > 0 {
		if b.ex.f.Body(p[:n]) {
			b.ex.r.st.firstBytes.Add(1)
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
		b.ex.fail("response body: " + err.Error())
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
