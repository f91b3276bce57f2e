package selection

import (
	"fmt"
	"math"
	"strings"
	"sync"
	"time"

	"github.com/kvselect/kvselect/catalog"
)

// SessionMode is how a session's pin binds its requests (Request.SessionID).
type SessionMode uint8

// Session modes.
const (
	// SessionSoft sends a session's request to its pinned worker rank unless
	// that rank is busy or costs more than the best one by more than
	// SessionConfig.SoftSlack request sizes. The default.
	SessionSoft SessionMode = iota
	// SessionHard always sends a session's request to its pinned rank while
	// the rank is schedulable (registered, not draining, not ejected, allowed
	// by the request), busy or not.
	SessionHard
	// SessionOff ignores Request.SessionID.
	SessionOff
)

// String returns "soft", "hard" or "off".
func (m SessionMode) String() string {
	switch m {
	case SessionSoft:
		return "soft"
	case SessionHard:
		return "hard"
	case SessionOff:
		return "off"
	}
	return fmt.Sprintf("SessionMode(%d)", uint8(m))
}

// ParseSessionMode parses "soft", "hard" or "off" (case-insensitive).
func ParseSessionMode(s string) (SessionMode, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "soft":
		return SessionSoft, nil
	case "hard":
		return SessionHard, nil
	case "off":
		return SessionOff, nil
	}
	return 0, fmt.Errorf("%w: session mode %q, want soft, hard or off", ErrInvalidConfig, s)
}

// Session defaults and bounds.
const (
	// DefaultMaxSessions is SessionConfig.MaxSessions' default.
	DefaultMaxSessions = 1 << 16
	// DefaultSessionIdleTTL is SessionConfig.IdleTTL's default.
	DefaultSessionIdleTTL = 10 * time.Minute
	// DefaultSessionSoftSlack is SessionConfig.SoftSlack's default.
	DefaultSessionSoftSlack = 2.0
	// MaxSessionIDLen is the longest Request.SessionID accepted, in bytes.
	MaxSessionIDLen = 256
)

// SessionConfig configures session affinity: the first booked request of a
// session (Request.SessionID) pins the session to the worker rank it got,
// and the session's later requests go there too (see SessionMode), so a
// conversation finds its own KV cache again even where the index cannot see
// it (approximate mode, a feed not yet trusted, a cache the engine evicted
// and will rebuild). A request that goes elsewhere (the pin was not
// schedulable, or soft and too costly) moves the pin.
type SessionConfig struct {
	// Mode is SessionSoft (the zero value), SessionHard or SessionOff.
	Mode SessionMode
	// MaxSessions bounds the pins held per model; when full, the least
	// recently used pin is dropped. 0 means DefaultMaxSessions.
	MaxSessions int
	// IdleTTL is how long a pin lives after its session's last booking.
	// 0 means DefaultSessionIdleTTL.
	IdleTTL time.Duration
	// SoftSlack is how much costlier than the best candidate a soft pin may
	// be and still be kept, in units of the request's cold cost (what it
	// costs on an idle worker that holds none of it: under CostDynamo
	// PrefillLoadScale x its blocks, plus its blocks; under CostPredictive
	// its predicted cost there at PrefillTokensPerSecond): 2 keeps the pin unless moving saves more than
	// twice that, about two requests of the session's size in flight. 0 keeps
	// it only when it is among the cheapest. Finite, >= 0. DefaultConfig sets
	// DefaultSessionSoftSlack.
	SoftSlack float64
}

func (c SessionConfig) validate(bad func(string, ...any)) {
	if c.Mode > SessionOff {
		bad("Sessions.Mode is %v, want SessionSoft, SessionHard or SessionOff", c.Mode)
	}
	if c.MaxSessions < 0 {
		bad("Sessions.MaxSessions is %d, want >= 0 (0: %d)", c.MaxSessions, DefaultMaxSessions)
	}
	if c.IdleTTL < 0 {
		bad("Sessions.IdleTTL is %v, want >= 0 (0: %v)", c.IdleTTL, DefaultSessionIdleTTL)
	}
	if math.IsNaN(c.SoftSlack) || math.IsInf(c.SoftSlack, 0) || c.SoftSlack < 0 {
		bad("Sessions.SoftSlack is %v, want a finite value >= 0", c.SoftSlack)
	}
}

// sessionTable is one model's pins, most recently used first. Its mutex is
// taken only by requests that carry a session id (and by ReplicaPlane.Book).
type sessionTable struct {
	mu    sync.Mutex
	max   int
	ttl   int64 // nanoseconds
	m     map[string]*sessionPin
	front sessionPin // sentinel of the recency list: front.next is the newest
	st    *serviceCounters
}

type sessionPin struct {
	id         string
	rank       catalog.WorkerRank
	used       int64 // unix nanos of the last booking
	prev, next *sessionPin
}

func newSessionTable(c SessionConfig, st *serviceCounters) *sessionTable {
	t := &sessionTable{max: c.MaxSessions, ttl: int64(c.IdleTTL), m: map[string]*sessionPin{}, st: st}
	if t.max == 0 {
		t.max = DefaultMaxSessions
	}
	if t.ttl == 0 {
		t.ttl = int64(DefaultSessionIdleTTL)
	}
	t.front.prev, t.front.next = &t.front, &t.front
	return t
}

// get returns the session's pin, if it has one that has not idled out.
func (t *sessionTable) get(id string, now int64) (catalog.WorkerRank, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.m[id]
	if e == nil {
		return catalog.WorkerRank{}, false
	}
	if now-e.used > t.ttl {
		t.removeLocked(e)
		t.st.sessionsExpired.Add(1)
		return catalog.WorkerRank{}, false
	}
	return e.rank, true
}

// put pins the session to rank as of now, dropping idle pins from the old
// end of the list and, when the table is full, the least recently used one.
func (t *sessionTable) put(id string, rank catalog.WorkerRank, now int64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if e := t.m[id]; e != nil {
		e.rank, e.used = rank, now
		t.unlinkLocked(e)
		t.pushLocked(e)
		return
	}
	for old := t.front.prev; old != &t.front && now-old.used > t.ttl; old = t.front.prev {
		t.removeLocked(old)
		t.st.sessionsExpired.Add(1)
	}
	if len(t.m) >= t.max {
		t.removeLocked(t.front.prev)
		t.st.sessionsEvicted.Add(1)
	}
	e := &sessionPin{id: strings.Clone(id), rank: rank, used: now}
	t.m[e.id] = e
	t.pushLocked(e)
}

func (t *sessionTable) len() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.m)
}

func (t *sessionTable) pushLocked(e *sessionPin) {
	e.prev, e.next = &t.front, t.front.next
	t.front.next.prev = e
	t.front.next = e
}

func (t *sessionTable) unlinkLocked(e *sessionPin) {
	e.prev.next, e.next.prev = e.next, e.prev
	e.prev, e.next = nil, nil
}

func (t *sessionTable) removeLocked(e *sessionPin) {
	t.unlinkLocked(e)
	delete(t.m, e.id)
}

// pinnedChoice returns the index in pool of the candidate the request's pin
// chooses, or -1 to choose by cost. all is every candidate, pool the ones
// pick may choose from (all but the busy ones, unless every one is busy).
// A hard pin is chosen from all; a soft one from pool, and only while its
// cost is within SoftSlack cold costs of the request of the cheapest in pool.
func (s *SelectionService) pinnedChoice(ev *evaluation, pool []candidate, pr *prepared) (c candidate, ok bool) {
	if !pr.pinned {
		return candidate{}, false
	}
	ri, known := ev.rs.pos[pr.pin]
	if !known {
		return candidate{}, false
	}
	find := func(cs []candidate) int {
		for i := range cs {
			if cs[i].idx == int(ri) {
				return i
			}
		}
		return -1
	}
	if s.cfg.Sessions.Mode == SessionHard {
		if i := find(ev.cands); i >= 0 {
			return ev.cands[i], true
		}
		return candidate{}, false
	}
	i := find(pool)
	if i < 0 {
		return candidate{}, false
	}
	best := math.Inf(1)
	for j := range pool {
		best = min(best, pool[j].cost)
	}
	blocks := float64(pr.isl) / float64(s.cfg.BlockSize)
	cold := pr.w.scale*blocks + blocks // Dynamo's cost on an idle rank
	if pr.w.predictive {
		idle := candidate{newBlocks: int(math.Ceil(blocks)), tokTime: 1 / pr.w.rate, queueTime: 1 / pr.w.rate}
		in := ev.in
		in.calibrated = false
		cold = predicted(&idle, &in, &pr.w) // at the configured rate
	}
	pin := pool[i].cost
	if pr.w.predictive {
		// The balance term spreads new work; a session's own requests
		// raise its rank's share, and must not push the session away.
		pin -= balance(&pool[i], &ev.in, &pr.w)
	}
	if pin > best+s.cfg.Sessions.SoftSlack*cold {
		return candidate{}, false
	}
	return pool[i], true
}
