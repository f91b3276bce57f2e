package roles

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/kvindex"
	"github.com/kvselect/kvselect/reservation"
	"github.com/kvselect/kvselect/selection"
)

// fakeLeg is a leg whose behaviour the test chooses: before booking it runs
// before (nil: book at once), which may fail, block, or signal.
type fakeLeg struct {
	name   string
	before func(ctx context.Context, req selection.Request) error

	mu       sync.Mutex
	booked   map[reservation.ID]bool
	requests []selection.Request
	done     []reservation.ID // prefill-complete calls
	renewed  []reservation.ID // renew calls
	failed   []string         // workers marked failed
}

func newFakeLeg(name string) *fakeLeg { return &fakeLeg{name: name, booked: map[reservation.ID]bool{}} }

func (f *fakeLeg) SelectAndReserve(ctx context.Context, req selection.Request) (selection.Result, error) {
	f.mu.Lock()
	f.requests = append(f.requests, req)
	f.mu.Unlock()
	if f.before != nil {
		if err := f.before(ctx, req); err != nil {
			return selection.Result{}, err
		}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.booked[req.ReservationID] {
		return selection.Result{}, fmt.Errorf("%w: %q", selection.ErrConflict, req.ReservationID)
	}
	f.booked[req.ReservationID] = true
	return selection.Result{ReservationID: req.ReservationID, WorkerRank: catalog.WorkerRank{WorkerID: f.name + "-0"}, Endpoint: f.name + ":8000"}, nil
}

// Select answers as a booking would, without booking (conditional
// disaggregation's advisory read).
func (f *fakeLeg) Select(_ context.Context, req selection.Request) (selection.Result, error) {
	return selection.Result{WorkerRank: catalog.WorkerRank{WorkerID: f.name + "-0"}, Endpoint: f.name + ":8000",
		EffectivePrefillTokens: len(req.Tokens)}, nil
}

func (f *fakeLeg) FreeReservation(id reservation.ID) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.booked[id] {
		return fmt.Errorf("%w: %q", selection.ErrUnknownReservation, id)
	}
	delete(f.booked, id)
	return nil
}

func (f *fakeLeg) PrefillComplete(id reservation.ID) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.booked[id] {
		return fmt.Errorf("%w: %q", selection.ErrUnknownReservation, id)
	}
	f.done = append(f.done, id)
	return nil
}

func (f *fakeLeg) RenewReservation(id reservation.ID) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.booked[id] {
		return fmt.Errorf("%w: %q", selection.ErrUnknownReservation, id)
	}
	f.renewed = append(f.renewed, id)
	return nil
}

func (f *fakeLeg) AddOutputBlocks(id reservation.ID, n int) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.booked[id] {
		return fmt.Errorf("%w: %q", selection.ErrUnknownReservation, id)
	}
	return nil
}

func (f *fakeLeg) MoveSessionReservation(id reservation.ID, _ catalog.WorkerRank, _ string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.booked[id] {
		return fmt.Errorf("%w: %q", selection.ErrUnknownReservation, id)
	}
	return nil
}

func (f *fakeLeg) MarkFailed(worker string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.failed = append(f.failed, worker)
	return nil
}

func (f *fakeLeg) PotentialLoads(context.Context, selection.Request) ([]selection.Scored, error) {
	return nil, nil
}

func (f *fakeLeg) bookedIDs() []reservation.ID {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []reservation.ID
	for id := range f.booked {
		out = append(out, id)
	}
	slices.Sort(out)
	return out
}

func (f *fakeLeg) lastRequest() selection.Request {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.requests[len(f.requests)-1]
}

func fakeBooker(t *testing.T, opts BookerOptions) (*PairBooker, *fakeLeg, *fakeLeg) {
	t.Helper()
	ps, err := deriveProfiles(selection.DefaultConfig(4), ProfileOptions{})
	require.NoError(t, err)
	pre, dec := newFakeLeg("prefill"), newFakeLeg("decode")
	b, err := newPairBooker(Decode, pre, dec, ps[Decode], opts)
	require.NoError(t, err)
	return b, pre, dec
}

// failWith makes a leg fail at once.
func failWith(err error) func(context.Context, selection.Request) error {
	return func(context.Context, selection.Request) error { return err }
}

// blockUntilDone makes a leg wait until its context ends, as a queued request
// does.
func blockUntilDone(entered chan<- struct{}) func(context.Context, selection.Request) error {
	return func(ctx context.Context, _ selection.Request) error {
		if entered != nil {
			close(entered)
		}
		<-ctx.Done()
		return fmt.Errorf("queue: %w", ctx.Err())
	}
}

// requireNothingBooked: neither fake holds a booking and no plan is live.
func requireNothingBooked(t *testing.T, b *PairBooker, legs ...*fakeLeg) {
	t.Helper()
	for _, l := range legs {
		require.Empty(t, l.bookedIDs(), "%s leg", l.name)
	}
	require.Zero(t, b.plans.Len())
}

// testCtx bounds a test that would otherwise hang on a compensation bug.
func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func TestCompensationPrefillFails(t *testing.T) {
	b, pre, dec := fakeBooker(t, BookerOptions{})
	pre.before = failWith(fmt.Errorf("%w: queue full", selection.ErrOverloaded))
	_, err := b.Book(testCtx(t), selection.Request{ReservationID: "r", Tokens: toks(8, 1)})
	require.ErrorIs(t, err, selection.ErrOverloaded)
	require.ErrorContains(t, err, "prefill")
	require.Equal(t, http.StatusTooManyRequests, HTTPStatus(err))
	requireNothingBooked(t, b, pre, dec)
	st := b.Stats()
	require.Equal(t, int64(1), st.Failed)
	require.Equal(t, int64(1), st.Compensated, "the decode leg booked and was freed")
}

func TestCompensationDecodeEmpty(t *testing.T) {
	b, pre, dec := fakeBooker(t, BookerOptions{PrefillFallback: PrefillDecodeOnly})
	dec.before = failWith(fmt.Errorf("%w: no schedulable worker", selection.ErrNotReady))
	_, err := b.Book(testCtx(t), selection.Request{Tokens: toks(8, 1)})
	require.ErrorIs(t, err, ErrRoleCatalogEmpty)
	require.ErrorContains(t, err, "decode")
	require.Equal(t, http.StatusServiceUnavailable, HTTPStatus(err))
	requireNothingBooked(t, b, pre, dec)
	require.Len(t, dec.requests, 1, "an empty decode role never falls back")
	require.Equal(t, int64(1), b.Stats().Compensated)
}

func TestCompensationCancelsPendingLeg(t *testing.T) {
	b, pre, dec := fakeBooker(t, BookerOptions{})
	entered := make(chan struct{})
	pre.before = blockUntilDone(entered)
	dec.before = func(context.Context, selection.Request) error {
		<-entered // fail only once the prefill leg is waiting
		return fmt.Errorf("%w: subset", selection.ErrNoEndpoints)
	}
	_, err := b.Book(testCtx(t), selection.Request{Tokens: toks(8, 1)})
	require.ErrorIs(t, err, selection.ErrNoEndpoints, "the failing leg's error, not the cancelled one's")
	require.NotErrorIs(t, err, context.Canceled)
	requireNothingBooked(t, b, pre, dec)
}

func TestCompensationTimeout(t *testing.T) {
	b, pre, dec := fakeBooker(t, BookerOptions{Timeout: 20 * time.Millisecond})
	pre.before = blockUntilDone(nil)
	_, err := b.Book(context.Background(), selection.Request{Tokens: toks(8, 1)})
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.Equal(t, http.StatusGatewayTimeout, HTTPStatus(err))
	requireNothingBooked(t, b, pre, dec)
	require.Equal(t, int64(1), b.Stats().Compensated)
}

// TestCompensationLateLeg: the caller cancels while both legs are in flight
// and both legs book anyway, after the cancellation: both are freed.
func TestCompensationLateLeg(t *testing.T) {
	b, pre, dec := fakeBooker(t, BookerOptions{})
	release := make(chan struct{})
	var entered sync.WaitGroup
	entered.Add(2)
	late := func(context.Context, selection.Request) error {
		entered.Done()
		<-release // ignores its context, like a leg already past its last check
		return nil
	}
	pre.before, dec.before = late, late
	ctx, cancel := context.WithCancel(testCtx(t))
	errc := make(chan error, 1)
	go func() {
		_, err := b.Book(ctx, selection.Request{Tokens: toks(8, 1)})
		errc <- err
	}()
	entered.Wait()
	cancel()
	close(release)
	err := <-errc
	require.ErrorIs(t, err, context.Canceled)
	require.Equal(t, 499, HTTPStatus(err))
	requireNothingBooked(t, b, pre, dec)
	require.Equal(t, int64(2), b.Stats().Compensated)
}

// TestCompensationLateLegAfterFailure: one leg fails while the other is still
// booking; Book waits for the late one and frees it.
func TestCompensationLateLegAfterFailure(t *testing.T) {
	b, pre, dec := fakeBooker(t, BookerOptions{})
	release := make(chan struct{})
	entered := make(chan struct{})
	pre.before = func(context.Context, selection.Request) error {
		close(entered)
		<-release
		return nil
	}
	failed := make(chan struct{})
	dec.before = func(context.Context, selection.Request) error {
		<-entered
		defer close(failed)
		return errors.New("decode exploded")
	}
	errc := make(chan error, 1)
	go func() {
		_, err := b.Book(testCtx(t), selection.Request{Tokens: toks(8, 1)})
		errc <- err
	}()
	<-failed
	close(release)
	err := <-errc
	require.ErrorContains(t, err, "decode exploded")
	require.Equal(t, http.StatusInternalServerError, HTTPStatus(err))
	requireNothingBooked(t, b, pre, dec)
}

func TestCompensationCancelledBeforeBook(t *testing.T) {
	b, pre, dec := fakeBooker(t, BookerOptions{})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := b.Book(ctx, selection.Request{Tokens: toks(8, 1)})
	require.ErrorIs(t, err, context.Canceled)
	requireNothingBooked(t, b, pre, dec)
}

func TestPlanIDConflicts(t *testing.T) {
	b, pre, dec := fakeBooker(t, BookerOptions{PrefillFallback: PrefillDecodeOnly})
	ctx := testCtx(t)
	dup, err := b.Book(ctx, selection.Request{ReservationID: "dup", Tokens: toks(8, 1)})
	require.NoError(t, err)
	require.Equal(t, reservation.ID("dup"), dup.ID)
	_, err = b.Book(ctx, selection.Request{ReservationID: "dup", Tokens: toks(8, 1)})
	require.ErrorIs(t, err, selection.ErrConflict)
	require.Equal(t, http.StatusConflict, HTTPStatus(err))
	require.Equal(t, []reservation.ID{"dup/prefill"}, pre.bookedIDs(), "the live plan keeps its legs")
	require.Equal(t, []reservation.ID{"dup/decode"}, dec.bookedIDs())

	// A live local-prefill plan "x" and a pair plan "x": the legs book (their
	// ids are free) but the plan id is taken, so both legs are freed.
	pre.before = failWith(selection.ErrNotReady)
	x, err := b.Book(ctx, selection.Request{ReservationID: "x", Tokens: toks(8, 1)})
	require.NoError(t, err)
	require.True(t, x.LocalPrefill)
	pre.before = nil
	_, err = b.Book(ctx, selection.Request{ReservationID: "x", Tokens: toks(8, 1)})
	require.ErrorIs(t, err, reservation.ErrConflict)
	require.Equal(t, []reservation.ID{"dup/prefill"}, pre.bookedIDs())
	require.Equal(t, []reservation.ID{"dup/decode", "x/aggregated"}, dec.bookedIDs())

	require.NoError(t, dup.Done())
	require.NoError(t, x.Done())
	requireNothingBooked(t, b, pre, dec)
	require.NoError(t, x.Done(), "a repeated Done changes nothing")
	require.ErrorIs(t, x.Renew(), ErrUnknownPlan, "a plan done is gone")
	never := Plan{ID: "never"}
	require.ErrorIs(t, never.PrefillComplete(), ErrUnknownPlan)
	require.Equal(t, http.StatusNotFound, HTTPStatus(never.PrefillComplete()))
}

// TestDecodeOverrideOnEveryDecodeRequest: the decode leg always carries the
// decode override, merged over the caller's; the prefill leg gets the caller's
// unchanged; a local-prefill fallback books with prefill tracking.
func TestDecodeOverrideOnEveryDecodeRequest(t *testing.T) {
	b, pre, dec := fakeBooker(t, BookerOptions{PrefillFallback: PrefillDecodeOnly})
	ctx := testCtx(t)
	caller := &selection.Override{Temperature: ptr(0.7), TrackPrefillTokens: ptr(true), OverlapScoreCredit: ptr(3.0), AssumeKVReuse: ptr(true)}
	plan, err := b.Book(ctx, selection.Request{Tokens: toks(8, 1), Override: caller})
	require.NoError(t, err)
	d := dec.lastRequest().Override
	require.Equal(t, 0.0, *d.OverlapScoreCredit)
	require.False(t, *d.AssumeKVReuse)
	require.False(t, *d.TrackPrefillTokens)
	require.Equal(t, 0.7, *d.Temperature, "the caller's other fields stay")
	require.Same(t, caller, pre.lastRequest().Override)
	require.NoError(t, plan.Done())

	plan, err = b.Book(ctx, selection.Request{Tokens: toks(8, 1)})
	require.NoError(t, err)
	require.False(t, *dec.lastRequest().Override.TrackPrefillTokens)
	require.NoError(t, plan.Done())

	pre.before = failWith(fmt.Errorf("%w: none", selection.ErrNotReady))
	plan, err = b.Book(ctx, selection.Request{Tokens: toks(8, 1)})
	require.NoError(t, err)
	require.True(t, plan.LocalPrefill)
	l := dec.lastRequest()
	require.Equal(t, plan.ID+suffixAggregated, l.ReservationID)
	require.True(t, *l.Override.TrackPrefillTokens)
	require.True(t, *l.Override.AssumeKVReuse)
	require.Equal(t, selection.DefaultConfig(4).OverlapScoreCredit, *l.Override.OverlapScoreCredit, "the base credit is restored")
	require.Equal(t, []reservation.ID{plan.ID + suffixAggregated}, dec.bookedIDs(), "the decode-override leg was freed")
	require.NoError(t, plan.PrefillComplete())
	require.Equal(t, []reservation.ID{plan.ID + suffixAggregated}, dec.done)
	require.NoError(t, plan.Done())
	requireNothingBooked(t, b, pre, dec)
	st := b.Stats()
	require.Equal(t, int64(3), st.Booked)
	require.Equal(t, int64(1), st.Fallbacks)
	require.Equal(t, int64(1), st.LocalPrefill)
}

func TestBookerOptions(t *testing.T) {
	_, err := NewPairBooker(nil, BookerOptions{})
	require.ErrorIs(t, err, ErrInvalidOptions)
	rs := newRoles(t, testOptions(ModeDisaggregated, newFakeClock()))
	_, err = NewPairBooker(rs, BookerOptions{PrefillFallback: 9, PlanLease: -1})
	require.ErrorIs(t, err, ErrInvalidOptions)
	require.ErrorContains(t, err, "PrefillFallback")
	require.ErrorContains(t, err, "PlanLease")
}

// TestDecodeOverrideReadBackThroughLoads: the same prompt books its prefill
// tokens on the prefill selector and none on the decode one, whose blocks are
// never shared (no assumed reuse), even when the caller's override asks for
// the opposite.
func TestDecodeOverrideReadBackThroughLoads(t *testing.T) {
	clk := newFakeClock()
	opts := testOptions(ModeDisaggregated, clk)
	// Without the in-flight credit, so that the second copy of the prompt
	// is booked as a full prefill: the figures below are the overrides' alone.
	opts.Base.InFlightHitWeight = 0
	rs := newRoles(t, opts)
	_, err := rs.Reconcile([]catalog.Worker{wk("p", "prefill"), wk("d", "decode")})
	require.NoError(t, err)
	b := newBooker(t, rs, BookerOptions{Now: clk.Now})
	ctx := testCtx(t)
	prompt := toks(40, 1) // 10 blocks of 4
	caller := &selection.Override{TrackPrefillTokens: ptr(true), AssumeKVReuse: ptr(true), OverlapScoreCredit: ptr(5.0)}
	p1, err := b.Book(ctx, selection.Request{Tokens: prompt})
	require.NoError(t, err)
	p2, err := b.Book(ctx, selection.Request{Tokens: prompt, Override: caller})
	require.NoError(t, err)

	pl := load(t, rs, Prefill, "p")
	require.Equal(t, int64(80), pl.ActivePrefillTokens, "prefill tracks both prompts")
	require.Equal(t, 10, pl.ActiveBlocks, "prefill shares the prompt's blocks")
	require.Equal(t, 2, pl.ActiveRequests)
	dl := load(t, rs, Decode, "d")
	require.Zero(t, dl.ActivePrefillTokens, "decode tracks no prefill tokens")
	require.Equal(t, 20, dl.ActiveBlocks, "decode assumes no reuse")
	require.Equal(t, 2, dl.ActiveRequests)
	require.Equal(t, 40, p1.Prefill.EffectivePrefillTokens)

	// The same request booked directly on the decode service without the
	// override would track prefill tokens: the override is what prevents it.
	direct, err := rs.Service(Decode).SelectAndReserve(ctx, selection.Request{Tokens: toks(40, 2), Override: caller})
	require.NoError(t, err)
	require.Equal(t, int64(40), load(t, rs, Decode, "d").ActivePrefillTokens)
	require.NoError(t, rs.Service(Decode).Reservations().Free(direct.ReservationID))

	require.NoError(t, p1.PrefillComplete())
	require.Equal(t, int64(40), load(t, rs, Prefill, "p").ActivePrefillTokens)
	require.Equal(t, 1, load(t, rs, Prefill, "p").ActiveRequests)
	require.Equal(t, 2, load(t, rs, Decode, "d").ActiveRequests, "hand-off keeps the decode leg")
	require.NoError(t, p1.PrefillComplete(), "hand-off is idempotent")
	require.NoError(t, p1.Done())
	require.NoError(t, p2.Done())
	requireIdle(t, rs)
}

func TestDecodeOnlyFallbackTracksPrefill(t *testing.T) {
	clk := newFakeClock()
	rs := newRoles(t, testOptions(ModeDisaggregated, clk))
	_, err := rs.Reconcile([]catalog.Worker{wk("d", "decode")})
	require.NoError(t, err)
	ctx := testCtx(t)

	fail := newBooker(t, rs, BookerOptions{Now: clk.Now})
	_, err = fail.Book(ctx, selection.Request{Tokens: toks(40, 2)})
	require.ErrorIs(t, err, ErrRoleCatalogEmpty)
	require.ErrorContains(t, err, "prefill")
	requireIdle(t, rs)

	b := newBooker(t, rs, BookerOptions{Now: clk.Now, PrefillFallback: PrefillDecodeOnly})
	plan, err := b.Book(ctx, selection.Request{Tokens: toks(40, 1)})
	require.NoError(t, err)
	require.True(t, plan.LocalPrefill)
	require.Equal(t, "d", plan.Decode.WorkerID)
	dl := load(t, rs, Decode, "d")
	require.Equal(t, int64(40), dl.ActivePrefillTokens, "a local prefill is tracked")
	require.Equal(t, 1, dl.ActiveRequests)
	require.NoError(t, plan.PrefillComplete())
	require.Zero(t, load(t, rs, Decode, "d").ActivePrefillTokens)
	require.NoError(t, plan.Done())
	requireIdle(t, rs)
}

// TestCompensationQueuedPrefillTimesOut uses real services: the only prefill
// worker is busy, so the prefill leg waits in its queue while the decode leg
// books; the timeout withdraws the prefill request and frees the decode leg.
func TestCompensationQueuedPrefillTimesOut(t *testing.T) {
	clk := newFakeClock()
	opts := testOptions(ModeDisaggregated, clk)
	zero := 0.0
	opts.Base.QueueThreshold = &zero
	rs := newRoles(t, opts)
	_, err := rs.Reconcile([]catalog.Worker{wk("p", "prefill"), wk("d", "decode")})
	require.NoError(t, err)
	hog, err := rs.Service(Prefill).SelectAndReserve(context.Background(), selection.Request{Tokens: toks(40, 9)})
	require.NoError(t, err)

	b := newBooker(t, rs, BookerOptions{Now: clk.Now, Timeout: 30 * time.Millisecond})
	_, err = b.Book(context.Background(), selection.Request{Tokens: toks(40, 1)})
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.Equal(t, uint64(1), rs.Service(Prefill).Stats().QueueCanceled)
	require.Zero(t, load(t, rs, Decode, "d").ActiveRequests)
	require.Equal(t, 1, load(t, rs, Prefill, "p").ActiveRequests, "only the hog")
	require.Zero(t, b.plans.Len())

	// A full prefill queue with the decode-only fallback: booked locally.
	opts = testOptions(ModeDisaggregated, clk)
	opts.Base.QueueThreshold = &zero
	opts.Base.QueueLimit = 1
	rs2 := newRoles(t, opts)
	_, err = rs2.Reconcile([]catalog.Worker{wk("p", "prefill"), wk("d", "decode")})
	require.NoError(t, err)
	hog2, err := rs2.Service(Prefill).SelectAndReserve(context.Background(), selection.Request{Tokens: toks(40, 9)})
	require.NoError(t, err)
	b2 := newBooker(t, rs2, BookerOptions{Now: clk.Now, PrefillFallback: PrefillDecodeOnly})
	queued := make(chan error, 1)
	qctx, cancelQueued := context.WithCancel(context.Background())
	go func() {
		_, err := rs2.Service(Prefill).SelectAndReserve(qctx, selection.Request{Tokens: toks(40, 8)})
		queued <- err
	}()
	require.Eventually(t, func() bool { return rs2.Service(Prefill).Stats().Queued == 1 }, 5*time.Second, time.Millisecond)
	plan, err := b2.Book(testCtx(t), selection.Request{Tokens: toks(40, 1)})
	require.NoError(t, err)
	require.True(t, plan.LocalPrefill)
	require.Equal(t, int64(1), b2.Stats().Fallbacks)
	cancelQueued()
	require.ErrorIs(t, <-queued, context.Canceled)
	require.NoError(t, plan.Done())

	require.NoError(t, rs.Service(Prefill).Reservations().Free(hog.ReservationID))
	require.NoError(t, rs2.Service(Prefill).Reservations().Free(hog2.ReservationID))
	requireIdle(t, rs)
	requireIdle(t, rs2)
}

func TestExpireSettlesPlans(t *testing.T) {
	clk := newFakeClock()
	rs := newRoles(t, testOptions(ModeDisaggregated, clk))
	_, err := rs.Reconcile([]catalog.Worker{wk("p", "prefill"), wk("d", "decode")})
	require.NoError(t, err)
	b := newBooker(t, rs, BookerOptions{Now: clk.Now, PlanLease: time.Minute})
	ctx := testCtx(t)
	p1, err := b.Book(ctx, selection.Request{Tokens: toks(40, 1)})
	require.NoError(t, err)
	clk.Advance(30 * time.Second)
	p2, err := b.Book(ctx, selection.Request{Tokens: toks(40, 2)})
	require.NoError(t, err)
	require.NoError(t, p2.PrefillComplete())
	next, ok := b.plans.NextExpiry()
	require.True(t, ok)
	require.Equal(t, clk.Now().Add(30*time.Second), next)

	clk.Advance(30 * time.Second)
	require.Equal(t, 1, b.Expire())
	require.Equal(t, 1, load(t, rs, Decode, "d").ActiveRequests)
	require.Zero(t, load(t, rs, Prefill, "p").ActiveRequests)
	require.ErrorIs(t, p1.Done(), ErrUnknownPlan)
	clk.Advance(30 * time.Second)
	require.Equal(t, 1, b.Expire())
	require.Zero(t, b.plans.Len())
	requireIdle(t, rs)
	require.Equal(t, int64(2), b.Stats().Plans.Expired)
}

// TestConcurrentPairBookings: thousands of pair bookings from many goroutines,
// with random hand-offs, completions, cancellations and a worker whose label
// keeps flipping between prefill, decode and invalid. At the end every load is
// exactly zero and no plan is left.
func TestConcurrentPairBookings(t *testing.T) {
	runConcurrentPairBookings(t, false, 5000)
}

// TestConcurrentPairBookingsQueued is the same over queueing selectors, so
// legs wait in admission queues and cancellations withdraw them.
func TestConcurrentPairBookingsQueued(t *testing.T) {
	n := int64(3000)
	if raceEnabled {
		n = 1000 // the race detector slows queue hand-offs ~10x
	}
	runConcurrentPairBookings(t, true, n)
}

// tickingClock advances by a microsecond on every reading. (With a clock that
// stands still, the decode service's approximate index keeps every refresh of
// a block in its expiry heap, since the refreshes share one timestamp, and
// compacts that heap on every booking; a clock that moves avoids this
// quadratic path, which production clocks do not hit.)
type tickingClock struct{ ns atomic.Int64 }

func (c *tickingClock) Now() time.Time { return time.Unix(1_000_000, c.ns.Add(1000)) }

func runConcurrentPairBookings(t *testing.T, queueing bool, total int64) {
	clk := &tickingClock{}
	opts := RoleOptions{
		Mode: ModeDisaggregated,
		Base: selection.DefaultConfig(4),
		Configure: func(r Role, b *selection.SelectionServiceBuilder) {
			b.Clock(clk.Now).Rand(rand.NewPCG(1, uint64(r)+2)).SweepInterval(-1).ExternalEvents()
		},
	}
	if queueing {
		one := 1.0
		opts.Base.QueueThreshold = &one // busy above 100 prefill tokens
	}
	rs := newRoles(t, opts)
	base := append(pool("p", 3, "prefill"), pool("d", 3, "decode")...)
	flip := wk("flip", "prefill")
	_, err := rs.Reconcile(append(base, flip))
	require.NoError(t, err)
	b := newBooker(t, rs, BookerOptions{Now: clk.Now})

	const workers = 32
	var next, booked, cancelled atomic.Int64
	var wg sync.WaitGroup
	for g := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(g), 11))
			for {
				n := next.Add(1)
				if n > total {
					return
				}
				if n%50 == 0 { // the label of one worker flips while requests run
					w := flip
					w.Labels = map[string]string{DefaultRoleLabel: []string{"decode", "prefill", "bogus"}[n/50%3]}
					if _, err := rs.Reconcile(append(slices.Clone(base), w)); err != nil {
						t.Error(err)
						return
					}
				}
				ctx, cancel := context.WithCancel(context.Background())
				req := selection.Request{Tokens: toks(16+r.IntN(64), r.IntN(50))}
				mode := r.IntN(8)
				if mode == 0 {
					go cancel() // cancel mid-flight
				}
				plan, err := b.Book(ctx, req)
				cancel()
				if err != nil {
					if !errors.Is(err, context.Canceled) {
						t.Errorf("book: %v", err)
						return
					}
					cancelled.Add(1)
					continue
				}
				booked.Add(1)
				switch mode % 4 {
				case 1:
					_ = plan.Done()
				case 2:
					_ = plan.PrefillComplete()
					_ = plan.PrefillComplete()
					_ = plan.Done()
					if err := plan.Done(); err != nil {
						t.Errorf("a second Done: %v, want nil", err)
					}
				default:
					_ = plan.PrefillComplete()
					_ = plan.Done()
				}
			}
		}()
	}
	wg.Wait()
	require.Equal(t, total, booked.Load()+cancelled.Load())
	require.Greater(t, booked.Load(), total/2)
	t.Logf("booked %d, cancelled %d, queued %d, compensated legs %d", booked.Load(), cancelled.Load(),
		rs.Service(Prefill).Stats().Queued, b.Stats().Compensated)
	require.Zero(t, b.plans.Len())
	requireIdle(t, rs)
	st := b.Stats()
	require.Equal(t, st.Booked, st.Plans.Registered)
	require.Equal(t, st.Plans.Registered, st.Plans.Completed)
}

// TestDecodeLegWithoutPrefixPicksTheSame: the decode leg carries the prompt's
// length only (the default) or the whole prompt (DecodePrefixHashes); both
// make the same picks at the same costs and leave the same loads.
func TestDecodeLegWithoutPrefixPicksTheSame(t *testing.T) {
	var books [2]*PairBooker
	var sels [2]*RoleSelectors
	ws := append(pool("p", 2, "prefill"), pool("d", 5, "decode")...)
	for i, full := range []bool{false, true} {
		clk := newFakeClock()
		sels[i] = newRoles(t, testOptions(ModeDisaggregated, clk))
		_, err := sels[i].Reconcile(ws)
		require.NoError(t, err)
		books[i] = newBooker(t, sels[i], BookerOptions{Now: clk.Now, DecodePrefixHashes: full})
	}
	ctx := testCtx(t)
	r := rand.New(rand.NewPCG(2, 3))
	var live [][2]Plan
	for i := range 200 {
		req := selection.Request{Tokens: toks(1+r.IntN(120), r.IntN(10))}
		if i%4 == 0 {
			h, err := kvindexHashes(req.Tokens)
			require.NoError(t, err)
			if len(h) > 0 {
				req = selection.Request{SeqHashes: h, ISL: len(req.Tokens)}
			}
		}
		var got [2]Plan
		for k := range 2 {
			p, err := books[k].Book(ctx, req)
			require.NoError(t, err)
			got[k] = p
		}
		require.Equal(t, got[1].Decode.WorkerID, got[0].Decode.WorkerID, "request %d", i)
		require.Equal(t, got[1].Decode.Cost, got[0].Decode.Cost, "request %d", i)
		require.Equal(t, got[1].Decode.PotentialDecodeBlocks, got[0].Decode.PotentialDecodeBlocks)
		live = append(live, got)
		if r.IntN(3) == 0 && len(live) > 0 {
			j := r.IntN(len(live))
			for k := range 2 {
				require.NoError(t, live[j][k].Done())
			}
			live = slices.Delete(live, j, j+1)
		}
	}
	require.Equal(t, sels[1].Service(Decode).Loads(""), sels[0].Service(Decode).Loads(""))
	for _, ps := range live {
		for k := range 2 {
			require.NoError(t, ps[k].Done())
		}
	}
	requireIdle(t, sels[0])
	requireIdle(t, sels[1])
}

func kvindexHashes(tokens []uint32) ([]uint64, error) {
	h, err := kvindex.NewHasher(4, kvindex.HashOptions{})
	if err != nil {
		return nil, err
	}
	return h.SeqHashes(tokens), nil
}

// A Plan is its own handle: PrefillComplete hands off, Renew renews the legs
// it still holds, Done completes; repeats change nothing.
func TestPlanHandle(t *testing.T) {
	b, pre, dec := fakeBooker(t, BookerOptions{})
	p, err := b.Book(context.Background(), selection.Request{ReservationID: "h", Tokens: make([]uint32, 16)})
	require.NoError(t, err)
	require.NoError(t, p.Renew())
	require.Equal(t, []reservation.ID{"h/prefill"}, pre.renewed)
	require.Equal(t, []reservation.ID{"h/decode"}, dec.renewed)

	copyOf := p
	require.NoError(t, p.PrefillComplete())
	require.NoError(t, copyOf.PrefillComplete(), "a copy settles the same plan; a second hand-off is a no-op")
	require.Empty(t, pre.bookedIDs(), "hand-off frees the prefill leg")
	require.Equal(t, []reservation.ID{"h/decode"}, dec.done)
	require.NoError(t, p.Renew())
	require.Equal(t, []reservation.ID{"h/prefill"}, pre.renewed, "a handed-off prefill leg is not renewed")
	require.Equal(t, []reservation.ID{"h/decode", "h/decode"}, dec.renewed)

	require.NoError(t, p.Move(catalog.WorkerRank{WorkerID: "decode-9"}))
	require.NoError(t, p.MarkFailed())
	require.NoError(t, copyOf.MarkFailed(), "a second mark changes nothing")
	require.Equal(t, []string{"decode-9"}, dec.failed, "the worker the plan moved to is marked, once")

	require.NoError(t, p.Done())
	require.Empty(t, dec.bookedIDs())
	require.NoError(t, p.Done(), "a repeated Done changes nothing")
	require.NoError(t, copyOf.PrefillComplete(), "nor does a hand-off after Done")
	require.ErrorIs(t, p.Renew(), ErrUnknownPlan)
	require.ErrorIs(t, p.Generated(64), ErrUnknownPlan)
	require.ErrorIs(t, p.Move(catalog.WorkerRank{WorkerID: "decode-0"}), ErrUnknownPlan)
	require.ErrorIs(t, Plan{ID: "x"}.Done(), ErrUnknownPlan, "a Plan not from Book settles nothing")
	st := b.Stats()
	require.Equal(t, int64(1), st.Plans.Completed)
	require.Zero(t, st.Plans.Active)
}

// A failed prefill leg marks the prefill worker, on the prefill role's
// service, once, and leaves the destination alone; a plan whose destination
// prefills locally has no prefill worker to mark.
func TestPlanMarkPrefillFailed(t *testing.T) {
	b, pre, dec := fakeBooker(t, BookerOptions{})
	p, err := b.Book(context.Background(), selection.Request{ReservationID: "pf", Tokens: make([]uint32, 16)})
	require.NoError(t, err)
	require.NoError(t, p.MarkPrefillFailed())
	require.NoError(t, p.MarkPrefillFailed(), "a second mark changes nothing")
	require.Equal(t, []string{"prefill-0"}, pre.failed)
	require.Empty(t, dec.failed, "the destination is not to blame")
	require.NoError(t, p.Done())
	require.NoError(t, p.MarkPrefillFailed(), "after Done: nothing to do")
	require.Equal(t, []string{"prefill-0"}, pre.failed)

	local := Plan{ID: "l", LocalPrefill: true, b: b}
	require.NoError(t, local.MarkPrefillFailed())
	require.ErrorIs(t, Plan{ID: "x"}.MarkPrefillFailed(), ErrUnknownPlan)
	require.Equal(t, []string{"prefill-0"}, pre.failed)
}

// A plan that expired answers its first Done with ErrUnknownPlan (nothing
// to do) and the next with nil, as a booking whose lease passed does.
func TestPlanDoneAfterExpiry(t *testing.T) {
	clk := newFakeClock()
	b, _, dec := fakeBooker(t, BookerOptions{Now: clk.Now, PlanLease: time.Minute})
	p, err := b.Book(context.Background(), selection.Request{ReservationID: "e", Tokens: make([]uint32, 16)})
	require.NoError(t, err)
	clk.Advance(2 * time.Minute)
	require.Equal(t, 1, b.Expire())
	require.Empty(t, dec.bookedIDs())
	require.ErrorIs(t, p.PrefillComplete(), ErrUnknownPlan)
	require.ErrorIs(t, p.Done(), ErrUnknownPlan)
	require.NoError(t, p.Done())
	require.Equal(t, int64(1), b.Stats().Plans.Expired)
	require.Zero(t, b.Stats().Plans.Completed)
}

// NewPairBooker's sweeper expires plans on its own, until Close.
func TestPairBookerSweeps(t *testing.T) {
	clk := newFakeClock()
	rs := newRoles(t, testOptions(ModeAggregated, clk))
	_, err := rs.Reconcile([]catalog.Worker{wk("a", noLabel)})
	require.NoError(t, err)
	b, err := NewPairBooker(rs, BookerOptions{Now: clk.Now, PlanLease: time.Minute, ExpireEvery: time.Millisecond})
	require.NoError(t, err)
	defer b.Close()
	_, err = b.Book(testCtx(t), selection.Request{Tokens: toks(8, 1)})
	require.NoError(t, err)
	clk.Advance(2 * time.Minute)
	require.Eventually(t, func() bool { return b.Stats().Plans.Expired == 1 }, 10*time.Second, time.Millisecond)
	b.Close()
	b.Close() // idempotent
}

// Renew moves a plan's lease: a renewed plan outlives its first deadline.
func TestPlanRenewExtendsLease(t *testing.T) {
	clk := newFakeClock()
	b, _, dec := fakeBooker(t, BookerOptions{Now: clk.Now, PlanLease: time.Minute})
	p, err := b.Book(context.Background(), selection.Request{ReservationID: "r", Tokens: make([]uint32, 16)})
	require.NoError(t, err)
	clk.Advance(50 * time.Second)
	require.NoError(t, p.Renew())
	clk.Advance(50 * time.Second)
	require.Zero(t, b.Expire(), "renewed 50 s ago with a 1 min lease")
	clk.Advance(11 * time.Second)
	require.Equal(t, 1, b.Expire())
	require.Empty(t, dec.bookedIDs())
}

// With the predictive cost, a pair's decode leg is scored by decode pressure
// alone (the decode role tracks no prefill, so a prompt its approximate index
// holds does not draw it), and a prefill leg is predicted to wait behind the
// prefill queued ahead of it.
func TestPredictiveCostPairs(t *testing.T) {
	clk := newFakeClock()
	opts := testOptions(ModeDisaggregated, clk)
	opts.Base.Cost = selection.CostPredictive
	rs := newRoles(t, opts)
	_, err := rs.Reconcile([]catalog.Worker{wk("p", "prefill"), wk("d1", "decode"), wk("d2", "decode")})
	require.NoError(t, err)
	b := newBooker(t, rs, BookerOptions{Now: clk.Now})
	ctx := testCtx(t)
	p1, err := b.Book(ctx, selection.Request{Tokens: toks(40, 1)})
	require.NoError(t, err)
	p2, err := b.Book(ctx, selection.Request{Tokens: toks(40, 1)})
	require.NoError(t, err)
	require.NotEqual(t, p1.Decode.WorkerID, p2.Decode.WorkerID, "the second decode leg avoids the first one's blocks, not follows its prompt")
	p3, err := b.Book(ctx, selection.Request{Tokens: toks(40, 2)})
	require.NoError(t, err)
	require.Equal(t, "p", p1.Prefill.WorkerID)
	require.Equal(t, 40, p3.Prefill.EffectivePrefillTokens)
	require.Greater(t, p3.Prefill.Cost, p1.Prefill.Cost, "the third prefill waits behind the first's")
	for _, p := range []Plan{p1, p2, p3} {
		require.NoError(t, p.Done())
	}
	requireIdle(t, rs)
}
