package selection

import (
	"fmt"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/kvindex"
	"github.com/kvselect/kvselect/kvindex/kvevents"
	"github.com/kvselect/kvselect/reservation"
)

// FeedTrust configures how the service judges each worker rank's KV-event feed
// (see FeedState) and the token-parity self-check. Zero fields mean the
// defaults below; negative ones are invalid.
type FeedTrust struct {
	// Off turns the checks off: every worker rank is routed on its events,
	// whatever its feed does, and no parity is measured.
	Off bool
	// CheckInterval is how often feeds are judged. Default 1 s.
	CheckInterval time.Duration
	// SilentBookings and SilentAfter: a feed is silent when at least
	// SilentBookings bookings that leave the engine new blocks to store were made
	// on the rank since its last batch, the oldest SilentAfter ago. Defaults 3
	// and 2 s.
	SilentBookings int
	SilentAfter    time.Duration
	// MinStores and MaxLossRatio: a feed is mis-speaking when, over the last
	// Window, at least MinStores stored events arrived and more than MaxLossRatio
	// of them were lost (refused by the index or undecodable: unknown parent,
	// block size, token count, malformed...; skips by design such as other cache
	// groups do not count). Defaults 8, 0.5 and 10 s.
	MinStores    int
	MaxLossRatio float64
	Window       time.Duration
	// ParityEvery samples one booking in ParityEvery per worker rank for the
	// token-parity check (see FeedHealth.Parity). ParityDelay after the
	// booking's PrefillComplete, the sample is judged: the share of the
	// request's router blocks that the rank held at booking, or that its
	// engine reported storing since, or that it holds now. A sample missing
	// blocks then waits up to 4 ParityDelays for the engine's events (a
	// loaded feed delivers late; a mismatch stays a mismatch) before it is
	// judged as it stands. ParityThreshold is the mean parity below which a
	// rank is reported (WARN) once ParityMinSamples samples were judged.
	// Defaults 16, 2 s, 0.5 and 4.
	ParityEvery      int
	ParityDelay      time.Duration
	ParityThreshold  float64
	ParityMinSamples int
}

// Defaults of FeedTrust.
const (
	DefaultFeedCheckInterval  = time.Second
	DefaultFeedSilentBookings = 3
	DefaultFeedSilentAfter    = 2 * time.Second
	DefaultFeedMinStores      = 8
	DefaultFeedMaxLossRatio   = 0.5
	DefaultFeedWindow         = 10 * time.Second
	DefaultParityEvery        = 16
	DefaultParityDelay        = 2 * time.Second
	DefaultParityThreshold    = 0.5
	DefaultParityMinSamples   = 4
	paritySamplesKept         = 16 // judged samples averaged per rank
	parityLateFactor          = 4  // ParityDelays an incomplete sample waits for late events
	parityPendingMax          = 8  // samples waiting to be judged per rank
	feedWarnInterval          = time.Minute
	feedWindowSlots           = 10
)

func (f FeedTrust) validate(bad func(string, ...any)) {
	for _, d := range []struct {
		name string
		v    time.Duration
	}{{"CheckInterval", f.CheckInterval}, {"SilentAfter", f.SilentAfter}, {"Window", f.Window}, {"ParityDelay", f.ParityDelay}} {
		if d.v < 0 {
			bad("FeedTrust.%s is %v, want >= 0 (0 means the default)", d.name, d.v)
		}
	}
	for _, n := range []struct {
		name string
		v    int
	}{{"SilentBookings", f.SilentBookings}, {"MinStores", f.MinStores}, {"ParityEvery", f.ParityEvery}, {"ParityMinSamples", f.ParityMinSamples}} {
		if n.v < 0 {
			bad("FeedTrust.%s is %d, want >= 0 (0 means the default)", n.name, n.v)
		}
	}
	for _, r := range []struct {
		name string
		v    float64
	}{{"MaxLossRatio", f.MaxLossRatio}, {"ParityThreshold", f.ParityThreshold}} {
		if math.IsNaN(r.v) || r.v < 0 || r.v > 1 {
			bad("FeedTrust.%s is %v, want a value in [0, 1] (0 means the default)", r.name, r.v)
		}
	}
}

func (f FeedTrust) normalized() FeedTrust {
	def := func(v *time.Duration, d time.Duration) {
		if *v == 0 {
			*v = d
		}
	}
	defInt := func(v *int, d int) {
		if *v == 0 {
			*v = d
		}
	}
	defF := func(v *float64, d float64) {
		if *v == 0 {
			*v = d
		}
	}
	def(&f.CheckInterval, DefaultFeedCheckInterval)
	def(&f.SilentAfter, DefaultFeedSilentAfter)
	def(&f.Window, DefaultFeedWindow)
	def(&f.ParityDelay, DefaultParityDelay)
	defInt(&f.SilentBookings, DefaultFeedSilentBookings)
	defInt(&f.MinStores, DefaultFeedMinStores)
	defInt(&f.ParityEvery, DefaultParityEvery)
	defInt(&f.ParityMinSamples, DefaultParityMinSamples)
	defF(&f.MaxLossRatio, DefaultFeedMaxLossRatio)
	defF(&f.ParityThreshold, DefaultParityThreshold)
	return f
}

// FeedState is the service's judgement of one worker rank's KV-event feed.
type FeedState uint8

const (
	// FeedHealthy: the feed's stores are applied and it publishes while the
	// rank is served. The rank is routed on the event index.
	FeedHealthy FeedState = iota
	// FeedSilent: requests that must have made the engine store blocks were
	// booked on the rank, and its feed sent nothing since (wrong endpoint,
	// events off in the engine, a bind listener the engine never reached).
	FeedSilent
	// FeedMisSpeaking: most stored events of the feed are lost (unknown parent,
	// block size, token count, undecodable...): the engine speaks a dialect or
	// configuration the index cannot use.
	FeedMisSpeaking
	// FeedNeverHeard: silent as FeedSilent, and the feed never delivered a
	// batch at all since the rank was registered: nothing ever connected (an
	// engine that dials out to a bind address the service does not listen on,
	// a wrong port, events off in the engine, a firewall), rather than a feed
	// that stopped.
	FeedNeverHeard
)

// String returns "healthy", "silent", "mis-speaking" or "never-heard".
func (f FeedState) String() string {
	switch f {
	case FeedHealthy:
		return "healthy"
	case FeedSilent:
		return "silent"
	case FeedMisSpeaking:
		return "mis-speaking"
	case FeedNeverHeard:
		return "never-heard"
	default:
		return fmt.Sprintf("FeedState(%d)", uint8(f))
	}
}

// Health is what the service knows of one worker rank's KV-event feed.
type FeedHealth struct {
	Worker catalog.WorkerRank
	State  FeedState
	// Trusted is false while State is not FeedHealthy: the rank is then routed
	// as in approximate mode, on the service's own recent bookings of it (with
	// Config.RouterTTL), until its feed is healthy again.
	Trusted bool
	// Since is when State last changed (the rank's registration at first).
	Since time.Time
	// StoresApplied and StoresLost are the stored events applied and lost over
	// the last FeedTrust.Window.
	StoresApplied, StoresLost uint64
	// PendingStores counts bookings since the feed's last batch that left the
	// engine blocks to store.
	PendingStores int
	// Parity is the mean share of a sampled request's blocks (router hashes)
	// that the engine held or stored for it, over the last judged samples; 1
	// means router and engine tokenise and block alike, near 0 that they differ
	// (tokenizer, chat template, block size or cache salt). Evictions do not
	// lower it. NaN before the first sample. ParitySamples counts the samples
	// judged in all; bookings freed before their first output are not judged.
	Parity        float64
	ParitySamples uint64
	// LowParity is true when at least FeedTrust.ParityMinSamples samples were
	// judged and Parity is below FeedTrust.ParityThreshold.
	LowParity bool
}

// paritySample is one sampled booking waiting to be judged. keys, pos and
// cached are fixed at booking; seen is written by the index's store hook and
// read by the judge, both under the rank's mu; prefilled is set by
// PrefillComplete (unix nanos) or to -1 by a free before it.
type paritySample struct {
	id        reservation.ID
	keys      []uint64         // the request's router block keys
	pos       map[uint64]int32 // key -> position in keys
	seen      []bool           // positions the engine reported storing since the booking
	cached    int              // leading blocks the index said the rank held at booking
	at        time.Time
	rank      *rankHealth
	prefilled atomic.Int64
}

// rankHealth is the feed state of one worker rank. The booking path touches
// only the atomics (untrusted, expect*, bookings) and, for one booking in
// ParityEvery, mu; everything else belongs to the monitor (checkFeeds), which
// runs on one goroutine at a time.
type rankHealth struct {
	key catalog.WorkerRank

	untrusted   atomic.Bool
	expect      atomic.Int64  // bookings expecting stores since the last batch
	expectSince atomic.Int64  // unix nanos of the first of them; 0 none
	bookings    atomic.Uint64 // bookings on the rank, for parity sampling

	mu      sync.Mutex // guards pending (and its samples' seen), want and view
	pending []*paritySample
	// want counts, per router key, the pending samples that hold it, so the
	// store hook looks each stored key up once, not once per sample.
	want     map[uint64]int32
	sampling atomic.Int32 // len(pending), for the store hook's fast path
	view     FeedHealth   // the last check's result, for FeedHealth()

	// Monitor-owned.
	state                      FeedState
	batches                    uint64 // the feed's batch count at the last check
	since                      time.Time
	lastApplied, lastLost      uint64
	slots                      [feedWindowSlots]struct{ applied, lost uint64 }
	slot                       int
	slotStart                  time.Time
	ratios                     [paritySamplesKept]float64
	nRatios, nextRatio         int
	paritySamples              uint64
	lastWarnState, lastWarnPar time.Time
}

// healthFor returns the feed state of wr, creating it.
func (s *SelectionService) healthFor(wr catalog.WorkerRank) *rankHealth {
	s.healthMu.Lock()
	defer s.healthMu.Unlock()
	h := s.health[wr]
	if h == nil {
		now := s.now()
		h = &rankHealth{key: wr, since: now, slotStart: now}
		h.view = FeedHealth{Worker: wr, Trusted: true, Since: now, Parity: math.NaN()}
		s.health[wr] = h
		s.healthIdx.Store(wr, h)
	}
	return h
}

// dropHealthLocked forgets the feed state of every rank of worker id that keep does
// not name, taking untrusted ones off p's count. s.mu is held for writing.
func (s *SelectionService) dropHealthLocked(p *partition, id string, keep map[catalog.WorkerRank]bool) {
	s.healthMu.Lock()
	defer s.healthMu.Unlock()
	for wr, h := range s.health {
		if wr.WorkerID != id {
			continue
		}
		if keep[wr] {
			continue
		}
		if h.untrusted.Load() && p != nil {
			p.untrusted.Add(-1)
		}
		delete(s.health, wr)
		s.healthIdx.Delete(wr)
	}
}

// booked records a booking on the rank for the checks: whether it leaves the
// engine blocks to store, and (sampled) its hashes for the parity check. It
// runs on the booking path; h is not nil only while feeds are judged.
func (s *SelectionService) booked(h *rankHealth, seqs []uint64, cached int, id reservation.ID) {
	if len(seqs) > cached && h.expect.Add(1) == 1 {
		h.expectSince.Store(s.now().UnixNano())
	}
	if len(seqs) == 0 || (h.bookings.Add(1)-1)%uint64(s.trust.ParityEvery) != 0 {
		return
	}
	if h.sampling.Load() >= parityPendingMax {
		return // enough samples waiting: build none to throw away
	}
	ps := &paritySample{id: id, keys: append([]uint64(nil), seqs...), pos: make(map[uint64]int32, len(seqs)),
		seen: make([]bool, len(seqs)), cached: min(cached, len(seqs)), at: s.now(), rank: h}
	for i, k := range ps.keys {
		ps.pos[k] = int32(i)
	}
	h.mu.Lock()
	full := len(h.pending) >= parityPendingMax
	if !full {
		h.pending = append(h.pending, ps)
		h.sampling.Store(int32(len(h.pending)))
		if h.want == nil {
			h.want = make(map[uint64]int32)
		}
		for k := range ps.pos {
			h.want[k]++
		}
	}
	h.mu.Unlock()
	if !full {
		s.samples.Store(id, ps)
	}
}

// storedHook is the event index's OnStored: it marks, in the rank's pending
// parity samples, the blocks the engine reports storing. It runs under the
// index's write lock, so it only takes the rank's mu.
func (s *SelectionService) storedHook(w catalog.WorkerRank, keys []uint64) {
	v, ok := s.healthIdx.Load(w)
	if !ok {
		return
	}
	h := v.(*rankHealth)
	if h.sampling.Load() == 0 {
		return
	}
	h.mu.Lock()
	for _, k := range keys {
		if h.want[k] == 0 {
			continue
		}
		for _, ps := range h.pending {
			if i, ok := ps.pos[k]; ok {
				ps.seen[i] = true
			}
		}
	}
	h.mu.Unlock()
}

// forgetSampleLocked takes ps's keys out of h.want. h.mu is held.
func (h *rankHealth) forgetSampleLocked(ps *paritySample) {
	for k := range ps.pos {
		if h.want[k]--; h.want[k] <= 0 {
			delete(h.want, k)
		}
	}
}

// sampleSettled records that booking id reached its first output (prefilled)
// or was freed; a sample freed before its prefill completed is dropped, since
// the engine may never have computed it.
func (s *SelectionService) sampleSettled(id reservation.ID, prefilled bool) {
	v, ok := s.samples.Load(id)
	if !ok {
		return
	}
	ps := v.(*paritySample)
	if prefilled {
		ps.prefilled.CompareAndSwap(0, s.now().UnixNano())
		return
	}
	ps.prefilled.CompareAndSwap(0, -1)
	s.samples.Delete(id)
}

// lostStores counts a source's stored events lost for a reason that is not by
// design, plus its undecodable batches.
func lostStores(st kvevents.HandlerStats) uint64 {
	n := st.StoresRejected + st.DecodeErrors
	for r := range kvevents.SkipReason(kvevents.NumSkipReasons) {
		switch r {
		case kvevents.SkipMalformed, kvevents.SkipTokenRange, kvevents.SkipLimit, kvevents.SkipUnknownMedium:
			n += st.Skipped[r] // decoder reasons, which the handler cannot tell by kind
		}
	}
	return n
}

// checkFeeds judges every rank's feed once, at now; it is the body of the
// monitor goroutine (and of tests, with a test clock). Calls must not overlap.
func (s *SelectionService) checkFeeds(now time.Time) {
	if s.handler == nil || s.trust.Off {
		return
	}
	s.healthMu.Lock()
	hs := make([]*rankHealth, 0, len(s.health))
	for _, h := range s.health {
		hs = append(hs, h)
	}
	s.healthMu.Unlock()
	for _, h := range hs {
		s.checkRank(h, now)
	}
}

func (s *SelectionService) checkRank(h *rankHealth, now time.Time) {
	t := s.trust
	st := s.handler.Stats(h.key)
	if st.Batches != h.batches {
		h.batches = st.Batches
		h.expect.Store(0)
		h.expectSince.Store(0)
	}
	// Slide the loss window: one slot per Window/slots.
	slotLen := t.Window / feedWindowSlots
	for now.Sub(h.slotStart) >= slotLen && slotLen > 0 {
		h.slot = (h.slot + 1) % feedWindowSlots
		h.slots[h.slot] = struct{ applied, lost uint64 }{}
		h.slotStart = h.slotStart.Add(slotLen)
		if now.Sub(h.slotStart) > t.Window {
			h.slotStart = now // idle for a long time: skip ahead
		}
	}
	lost := lostStores(st)
	h.slots[h.slot].applied += st.StoresApplied - min(h.lastApplied, st.StoresApplied)
	h.slots[h.slot].lost += lost - min(h.lastLost, lost)
	h.lastApplied, h.lastLost = st.StoresApplied, lost
	var applied, lostW uint64
	for _, sl := range h.slots {
		applied += sl.applied
		lostW += sl.lost
	}

	state := FeedHealthy
	pending := h.expect.Load()
	if since := h.expectSince.Load(); pending >= int64(t.SilentBookings) && since != 0 && now.Sub(time.Unix(0, since)) >= t.SilentAfter {
		state = FeedSilent
		if st.Batches == 0 {
			state = FeedNeverHeard
		}
	}
	prev := h.state
	switch total := applied + lostW; {
	case total >= uint64(t.MinStores) && float64(lostW) > t.MaxLossRatio*float64(total):
		state = FeedMisSpeaking
	case total < uint64(t.MinStores) && prev == FeedMisSpeaking && state == FeedHealthy:
		// Too few stores to prove it healed: a feed that went quiet is not
		// trusted again on silence alone.
		state = FeedMisSpeaking
	}
	if state != prev {
		h.since = now
		h.state = state
		s.setTrusted(h, state == FeedHealthy)
		if state == FeedHealthy {
			s.logger.Info("kv event feed healthy again; routing on its events", "worker", h.key.String(), "was", prev.String())
		} else {
			h.lastWarnState = now
			s.logger.Warn("kv event feed not trusted; routing this worker on its own bookings (approximate) until it heals",
				"worker", h.key.String(), "state", state.String(), "cause", s.feedCause(state), "pending_stores", pending,
				"stores_applied", applied, "stores_lost", lostW, "skipped", skippedByReason(st))
		}
	} else if state != FeedHealthy && now.Sub(h.lastWarnState) >= feedWarnInterval {
		h.lastWarnState = now
		s.logger.Warn("kv event feed still not trusted", "worker", h.key.String(), "state", state.String(), "cause", s.feedCause(state),
			"since", h.since, "stores_applied", applied, "stores_lost", lostW, "skipped", skippedByReason(st))
	}

	s.judgeParity(h, now, st.Batches > 0)
	mean := math.NaN()
	if h.nRatios > 0 {
		sum := 0.0
		for _, r := range h.ratios[:h.nRatios] {
			sum += r
		}
		mean = sum / float64(h.nRatios)
	}
	low := h.nRatios >= t.ParityMinSamples && mean < t.ParityThreshold
	if low && (h.lastWarnPar.IsZero() || now.Sub(h.lastWarnPar) >= feedWarnInterval) {
		h.lastWarnPar = now
		s.logger.Warn("token parity low: the engine does not store the blocks the router hashed for its requests (tokenizer, chat template, block size or cache salt differ)",
			"worker", h.key.String(), "parity", mean, "samples", h.nRatios, "threshold", t.ParityThreshold)
	}
	h.mu.Lock()
	h.view = FeedHealth{
		Worker: h.key, State: state, Trusted: state == FeedHealthy, Since: h.since,
		StoresApplied: applied, StoresLost: lostW, PendingStores: int(max(pending, 0)),
		Parity: mean, ParitySamples: h.paritySamples, LowParity: low,
	}
	h.mu.Unlock()
}

// feedCause is the likely cause of an untrusted state, and what to check,
// for the WARN.
func (s *SelectionService) feedCause(state FeedState) string {
	switch state {
	case FeedNeverHeard:
		if s.bound != nil {
			return "no event ever reached the bind listener from this worker: check that the engine publishes to " +
				s.bound.String() + " (the address as the engine reaches it), with the topic kv@<its ip:port>@<model>, and that no firewall or NetworkPolicy is in the way"
		}
		return "nothing was ever received from the worker's event endpoint: check the port, that the engine publishes KV events " +
			"(vLLM --kv-events-config), and whether the engine dials out (then the service needs a bind address, DYN_EPP_KV_EVENT_BIND)"
	case FeedSilent:
		return "the feed delivered events before and stopped: the engine restarted with events off, or the connection is stuck"
	case FeedMisSpeaking:
		return "most stored events cannot be applied: block size, hash or encoding differ (see skipped)"
	}
	return ""
}

// skippedByReason lists a source's non-zero skip counters, for log lines.
func skippedByReason(st kvevents.HandlerStats) map[string]uint64 {
	out := map[string]uint64{}
	for r, n := range st.Skipped {
		if n > 0 {
			out[kvevents.SkipReason(r).String()] = n
		}
	}
	if st.DecodeErrors > 0 {
		out["undecodable_batch"] = st.DecodeErrors
	}
	return out
}

// setTrusted switches the rank between event routing and its own bookings,
// keeping its partition's count of untrusted ranks. Lock order: s.mu, then
// s.healthMu.
func (s *SelectionService) setTrusted(h *rankHealth, trusted bool) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	s.healthMu.Lock()
	defer s.healthMu.Unlock()
	if s.health[h.key] != h || h.untrusted.Load() == !trusted {
		return // forgotten meanwhile, or already so
	}
	h.untrusted.Store(!trusted)
	if p := s.workerPart[h.key.WorkerID]; p != nil {
		if trusted {
			p.untrusted.Add(-1)
		} else {
			p.untrusted.Add(1)
		}
	}
}

// judgeParity judges the rank's samples whose prefill completed ParityDelay
// ago: a block counts as matching when the index said the rank held it at
// booking, when the engine reported storing it since, or when the rank holds it
// now. Reports since the booking make evictions harmless; the index at booking
// and now covers blocks the engine already had. Samples freed before their
// prefill, or never settled within the booking lease, are dropped.
func (s *SelectionService) judgeParity(h *rankHealth, now time.Time, heard bool) {
	type ready struct {
		ps   *paritySample
		seen int // positions seen or cached at booking
	}
	var judged []ready
	h.mu.Lock()
	keep := h.pending[:0]
	for _, ps := range h.pending {
		pf := ps.prefilled.Load()
		switch {
		case pf > 0 && now.Sub(time.Unix(0, pf)) >= s.trust.ParityDelay:
			n := 0
			for i, seen := range ps.seen {
				if seen || i < ps.cached {
					n++
				}
			}
			if n < len(ps.seen) && now.Sub(time.Unix(0, pf)) < parityLateFactor*s.trust.ParityDelay {
				// Blocks not reported yet: give late events their time.
				// (Blocks the index holds now also count, at the judging.)
				keep = append(keep, ps)
				continue
			}
			judged = append(judged, ready{ps, n})
			s.samples.Delete(ps.id)
			h.forgetSampleLocked(ps)
		case pf < 0 || now.Sub(ps.at) > s.cfg.ActiveRequestExpiry:
			s.samples.Delete(ps.id)
			h.forgetSampleLocked(ps)
		default:
			keep = append(keep, ps)
		}
	}
	clear(h.pending[len(keep):])
	h.pending = keep
	h.sampling.Store(int32(len(keep)))
	h.mu.Unlock()
	if len(judged) == 0 || !heard {
		return // a feed that never spoke says nothing of parity
	}
	s.mu.RLock()
	p := s.workerPart[h.key.WorkerID]
	s.mu.RUnlock()
	if p == nil || p.index == nil {
		return
	}
	for _, j := range judged {
		held := 0
		for _, m := range p.index.FindMatches(j.ps.keys, kvindex.MatchOptions{}) {
			if m.Worker == h.key {
				held = m.Total()
			}
		}
		n := j.seen
		for i := range min(held, len(j.ps.keys)) {
			if !j.ps.seen[i] && i >= j.ps.cached {
				n++
			}
		}
		h.ratios[h.nextRatio] = float64(n) / float64(len(j.ps.keys))
		h.nextRatio = (h.nextRatio + 1) % paritySamplesKept
		h.nRatios = min(h.nRatios+1, paritySamplesKept)
		h.paritySamples++
	}
}

// Health returns the judgement of every worker rank's KV-event feed as of
// the last check, sorted by worker rank. It is empty without the built-in event
// feed or with FeedTrust.Off.
func (view EventPlane) Health() []FeedHealth {
	s := view.s
	if s.handler == nil || s.trust.Off {
		return nil
	}
	s.healthMu.Lock()
	out := make([]FeedHealth, 0, len(s.health))
	for _, h := range s.health {
		h.mu.Lock()
		out = append(out, h.view)
		h.mu.Unlock()
	}
	s.healthMu.Unlock()
	slices.SortFunc(out, func(a, b FeedHealth) int { return a.Worker.Compare(b.Worker) })
	return out
}
