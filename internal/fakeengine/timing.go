package fakeengine

import (
	"context"
	"sync"
	"time"

	"github.com/kvselect/kvselect/internal/enginemodel"
)

// modelRunner steps a SleepTTFT engine's scheduler model (package
// enginemodel) in real time: requests join it when they arrive and their
// answers follow its events. Its one goroutine, run, is started by
// Engine.Start and stopped by Engine.Close, which waits for it.
type modelRunner struct {
	wake chan struct{} // 1-buffered: the model changed, look at Next again
	stop chan struct{} // closed by halt
	done chan struct{} // closed when run returns: waiters give up

	mu      sync.Mutex
	model   *enginemodel.Engine
	origin  time.Time // model time 0
	started bool
	halted  bool
	nextID  uint64
	waiters map[uint64]*modelWaiter
	buf     []enginemodel.Event
}

// modelWaiter is one request in the model, as its handler sees it. Its
// fields are guarded by the runner's mutex.
type modelWaiter struct {
	id       uint64
	notify   chan struct{} // 1-buffered: an event arrived
	arrived  time.Duration // model time of the arrival (before any transfer delay)
	firstAt  time.Duration // model time of the first token, once tokens > 0
	tokens   int
	finished bool
	left     bool // finished or canceled: no longer in the model
}

func newModelRunner(p enginemodel.Params) (*modelRunner, error) {
	m, err := enginemodel.New(p)
	if err != nil {
		return nil, err
	}
	return &modelRunner{
		wake: make(chan struct{}, 1), stop: make(chan struct{}), done: make(chan struct{}),
		model: m, waiters: make(map[uint64]*modelWaiter),
	}, nil
}

// start marks the model's time 0; the caller then runs run on a goroutine it
// owns.
func (r *modelRunner) start() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.origin, r.started = time.Now(), true
}

// halt stops run (idempotent); requests still waiting give up.
func (r *modelRunner) halt() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.halted {
		r.halted = true
		close(r.stop)
	}
}

// active reports whether run is stepping the model.
func (r *modelRunner) active() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.started && !r.halted
}

// run advances the model as real time passes and hands its events to the
// waiters, until halt.
func (r *modelRunner) run() {
	defer close(r.done)
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		r.mu.Lock()
		now := time.Since(r.origin)
		r.buf = r.model.Advance(now, r.buf[:0])
		for _, ev := range r.buf {
			r.deliver(ev)
		}
		next, ok := r.model.Next()
		r.mu.Unlock()
		wait := time.Hour
		if ok {
			wait = next - now
		}
		if wait <= 0 {
			select {
			case <-r.stop:
				return
			default:
				continue
			}
		}
		timer.Reset(wait)
		select {
		case <-r.stop:
			return
		case <-r.wake:
		case <-timer.C:
		}
	}
}

// deliver records ev for its waiter; the caller holds the mutex.
func (r *modelRunner) deliver(ev enginemodel.Event) {
	w := r.waiters[ev.ID]
	if w == nil {
		return
	}
	switch ev.Kind {
	case enginemodel.EventFirstToken:
		w.firstAt = ev.At
	case enginemodel.EventFinished:
		w.finished, w.left = true, true
		delete(r.waiters, ev.ID)
	}
	w.tokens = ev.Tokens
	select {
	case w.notify <- struct{}{}:
	default:
	}
}

// poke tells run that the model changed.
func (r *modelRunner) poke() {
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

// add puts a request in the model now: uncached prompt tokens to compute
// and outputs tokens to generate, schedulable after the model's request
// overhead and delay (a KV transfer).
func (r *modelRunner) add(uncached, outputs int, delay time.Duration) *modelWaiter {
	r.mu.Lock()
	now := time.Since(r.origin)
	w := &modelWaiter{id: r.nextID, notify: make(chan struct{}, 1), arrived: now}
	r.nextID++
	// Neither error can happen: the id is new, the counts are >= 0.
	_ = r.model.Add(w.id, uncached, outputs, now+delay)
	r.waiters[w.id] = w
	r.mu.Unlock()
	r.poke()
	return w
}

// waitTokens waits until w has k output tokens (or has finished); false
// when ctx ended or the runner stopped first.
func (r *modelRunner) waitTokens(ctx context.Context, w *modelWaiter, k int) bool {
	for {
		r.mu.Lock()
		ok := w.tokens >= k || w.finished
		r.mu.Unlock()
		if ok {
			return true
		}
		select {
		case <-ctx.Done():
			return false
		case <-r.done:
			return false
		case <-w.notify:
		}
	}
}

// leave takes w out of the model if it is still there (a client that went
// away, a prefill leg handed over).
func (r *modelRunner) leave(w *modelWaiter) {
	r.mu.Lock()
	if w.left {
		r.mu.Unlock()
		return
	}
	w.left = true
	delete(r.waiters, w.id)
	r.model.Cancel(w.id)
	r.mu.Unlock()
	r.poke()
}

// ttft is w's time from arrival to first token, once it has one.
func (r *modelRunner) ttft(w *modelWaiter) (time.Duration, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return w.firstAt - w.arrived, w.tokens > 0
}

// pacer times a completion answer: when its first token, each later token and
// its end may be written.
type pacer interface {
	// first waits for the first output token; false when ctx ended first.
	first(ctx context.Context) bool
	// token waits for output token k (k >= 2).
	token(ctx context.Context, k int) bool
	// all waits for the last output token.
	all(ctx context.Context) bool
	// ttft is the time to first token the engine took, when it knows it.
	ttft() (time.Duration, bool)
	// release takes the request out of the engine (idempotent).
	release()
}

// sleepPacer is the timing of an engine that does not run the model: the
// first token after ttft (only with SleepTTFT), the others interval apart.
type sleepPacer struct {
	e        *Engine
	wait     time.Duration
	interval time.Duration
}

func (p sleepPacer) first(ctx context.Context) bool        { return p.e.waitTTFT(ctx, p.wait) }
func (p sleepPacer) token(ctx context.Context, _ int) bool { return wait(ctx, p.interval) }
func (p sleepPacer) all(ctx context.Context) bool          { return ctx.Err() == nil }
func (p sleepPacer) ttft() (time.Duration, bool)           { return 0, false }
func (p sleepPacer) release()                              {}

// modelPacer follows the model's events for one request.
type modelPacer struct {
	r   *modelRunner
	w   *modelWaiter
	out int
}

func (p modelPacer) first(ctx context.Context) bool { return p.r.waitTokens(ctx, p.w, 1) }
func (p modelPacer) token(ctx context.Context, k int) bool {
	return p.r.waitTokens(ctx, p.w, min(k, p.out))
}
func (p modelPacer) all(ctx context.Context) bool { return p.r.waitTokens(ctx, p.w, p.out) }
func (p modelPacer) ttft() (time.Duration, bool)  { return p.r.ttft(p.w) }
func (p modelPacer) release()                     { p.r.leave(p.w) }

// pacer returns the timing of a request that computes uncached prompt tokens
// and generates outputs tokens, after a KV transfer of delay: the model's
// when the engine runs it (SleepTTFT, between Start and Close), else the
// reported ttft and TokenInterval.
func (e *Engine) pacer(uncached, outputs int, delay, ttft time.Duration) pacer {
	if e.runner != nil && e.runner.active() {
		return modelPacer{r: e.runner, w: e.runner.add(uncached, outputs, delay), out: max(1, outputs)}
	}
	return sleepPacer{e: e, wait: ttft, interval: e.opts.TokenInterval}
}
