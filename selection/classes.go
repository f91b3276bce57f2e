package selection

import (
	"fmt"
	"math"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvselect/kvselect/reservation"
)

// Fair admission: policy classes (Config.Classes). A request names its class
// (Request.Class, from a header the gateway reads, or the Classifier's
// Admission.Class); each class has a weight, a strict tier, optional limits
// and an optional deadline. docs/POLICY.md, "Fair admission", has the rules.

// Class is one policy class of fair admission.
type Class struct {
	// Name identifies the class: a token of 1 to 64 lower-case letters,
	// digits, _ and -, unique among the classes (a metric label and part of
	// a refusal's reason).
	Name string
	// Weight is the class's share of the admission queue's service while
	// several classes of its tier wait: each round of the deficit round robin
	// gives it Weight x ClassQuantum uncached prompt tokens of credit, so
	// two classes that both wait are admitted tokens in the ratio of their
	// weights. In (0, MaxClassWeight].
	Weight float64
	// Tier is the strict priority tier of the class's requests: every
	// waiting request of a higher tier is admitted before any of a lower
	// one. With classes, the class decides the tier (Request.Priority.Tier
	// is not used); Priority.Jump still orders requests without a deadline
	// within their class.
	Tier int
	// QueueLimit is the most requests of the class one model may have
	// waiting; one more is refused (ErrAdmission, RefusalReason
	// "class_queue_full:<name>"). 0: only the model's Config.QueueLimit.
	QueueLimit int
	// InFlightLimit is the most requests of the class the service holds at
	// once, from their arrival to their booking's end (waiting in a queue,
	// deciding, or booked and not yet freed, expired or dropped); one more
	// is refused at once (ErrAdmission, RefusalReason
	// "class_inflight_full:<name>"). 0: no limit.
	InFlightLimit int
	// Deadline is the default admission deadline of the class's requests:
	// a request without its own (Request.Deadline, Admission.Deadline) is
	// due Deadline after it arrives. A request still waiting in the queue
	// at its deadline is refused (ErrAdmission, RefusalReason
	// "deadline:<name>"); within a class, requests are admitted earliest
	// deadline first. 0: none.
	Deadline time.Duration
}

// Bounds of the class configuration.
const (
	// MaxClasses bounds Config.Classes.
	MaxClasses = 64
	// MaxClassWeight bounds Class.Weight.
	MaxClassWeight = 1000.0
	// ClassQuantum is the deficit round robin's credit per round of a class
	// of weight 1, in uncached prompt tokens (a request's DRR cost is its
	// uncached prompt on the worker that would serve it best, at least 1).
	ClassQuantum = 4096
)

// classProblems reports what is wrong with cfg's classes.
func classProblems(classes []Class, def string, bad func(string, ...any)) {
	if len(classes) > MaxClasses {
		bad("Classes has %d classes, want at most %d", len(classes), MaxClasses)
	}
	seen := make(map[string]bool, len(classes))
	for i, c := range classes {
		switch {
		case !validToken(c.Name):
			bad("Classes[%d].Name %q is not a token of 1 to %d lower-case letters, digits, _ or -", i, c.Name, maxSeamName)
		case seen[c.Name]:
			bad("Classes[%d].Name %q is used twice", i, c.Name)
		}
		seen[c.Name] = true
		if !(c.Weight > 0 && c.Weight <= MaxClassWeight) {
			bad("Classes[%d] (%s): Weight is %v, want a value in (0, %g]", i, c.Name, c.Weight, MaxClassWeight)
		}
		if c.QueueLimit < 0 {
			bad("Classes[%d] (%s): QueueLimit is %d, want >= 0", i, c.Name, c.QueueLimit)
		}
		if c.InFlightLimit < 0 {
			bad("Classes[%d] (%s): InFlightLimit is %d, want >= 0", i, c.Name, c.InFlightLimit)
		}
		if c.Deadline < 0 {
			bad("Classes[%d] (%s): Deadline is %v, want >= 0", i, c.Name, c.Deadline)
		}
	}
	if def != "" && !seen[def] {
		if len(classes) == 0 {
			bad("DefaultClass is %q but Classes is empty", def)
		} else {
			bad("DefaultClass %q names none of the Classes", def)
		}
	}
}

// ParseClasses parses a class list in the form the reference EPP and gateway
// read from their environment: classes separated by ";", each a name
// followed by ":" and comma-separated key=value settings (weight, tier,
// queue, inflight, deadline, a Go duration):
//
//	interactive:weight=3,tier=1,deadline=2s;batch:weight=1,queue=256,inflight=512
//
// weight defaults to 1. The first class is the default class (see
// Config.DefaultClass). "" is no class. It checks the syntax; Config.Validate
// checks the values. Errors wrap ErrInvalidConfig.
func ParseClasses(s string) ([]Class, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return nil, nil
	}
	var out []Class
	for part := range strings.SplitSeq(s, ";") {
		name, settings, _ := strings.Cut(strings.TrimSpace(part), ":")
		c := Class{Name: strings.TrimSpace(name), Weight: 1}
		for kv := range strings.SplitSeq(settings, ",") {
			kv = strings.TrimSpace(kv)
			if kv == "" {
				continue
			}
			k, v, ok := strings.Cut(kv, "=")
			if !ok {
				return nil, fmt.Errorf("%w: class %q: setting %q is not key=value", ErrInvalidConfig, c.Name, kv)
			}
			var err error
			switch k = strings.TrimSpace(k); k {
			case "weight":
				c.Weight, err = strconv.ParseFloat(v, 64)
			case "tier":
				c.Tier, err = strconv.Atoi(v)
			case "queue":
				c.QueueLimit, err = strconv.Atoi(v)
			case "inflight":
				c.InFlightLimit, err = strconv.Atoi(v)
			case "deadline":
				c.Deadline, err = time.ParseDuration(v)
			default:
				return nil, fmt.Errorf("%w: class %q: unknown setting %q (want weight, tier, queue, inflight or deadline)", ErrInvalidConfig, c.Name, k)
			}
			if err != nil {
				return nil, fmt.Errorf("%w: class %q: %s=%q: %w", ErrInvalidConfig, c.Name, k, v, err)
			}
		}
		out = append(out, c)
	}
	return out, nil
}

// ClassStats are one policy class's figures (Stats.Classes).
type ClassStats struct {
	// Waiting is how many of its requests wait in the admission queues now.
	Waiting int
	// InFlight is how many of its bookings are live now (booked, not yet
	// freed, expired or dropped).
	InFlight int
	// Admitted counts its requests booked (SelectAndReserve) or answered
	// (Select).
	Admitted uint64
	// Refused counts its requests refused by reason: RefusedClassQueueFull,
	// RefusedClassInFlightFull, RefusedDeadline (only the reasons met).
	Refused map[string]uint64
}

// classSet is a service's classes at run time; nil without classes.
type classSet struct {
	classes []classState
	byName  map[string]int32
	def     int32
	// live maps the reservation id of each live booking of a class to the
	// class, so that its end releases the class's slot.
	mu   sync.Mutex
	live map[reservation.ID]int32
}

type classState struct {
	Class
	quantum float64
	// refusal reasons, precomputed
	queueFull, inflightFull, late string
	held                          atomic.Int64 // arrived and not done (InFlightLimit counts these)
	booked                        atomic.Int64 // live bookings
	waiting                       atomic.Int64
	admitted                      atomic.Uint64
	refusedQueue                  atomic.Uint64
	refusedInflight               atomic.Uint64
	refusedLate                   atomic.Uint64
}

// newClassSet returns the run-time classes of a valid configuration, or nil.
func newClassSet(classes []Class, def string) *classSet {
	if len(classes) == 0 {
		return nil
	}
	cs := &classSet{
		classes: make([]classState, len(classes)),
		byName:  make(map[string]int32, len(classes)),
		live:    make(map[reservation.ID]int32),
	}
	for i, c := range classes {
		st := &cs.classes[i]
		st.Class, st.quantum = c, c.Weight*ClassQuantum
		st.queueFull = RefusedClassQueueFull + ":" + c.Name
		st.inflightFull = RefusedClassInFlightFull + ":" + c.Name
		st.late = RefusedDeadline + ":" + c.Name
		cs.byName[c.Name] = int32(i)
		if c.Name == def {
			cs.def = int32(i)
		}
	}
	return cs
}

// of returns the index of class name: the default class for "" and for a
// name no class has.
func (cs *classSet) of(name string) int32 {
	if i, ok := cs.byName[name]; ok {
		return i
	}
	return cs.def
}

// hold counts a request of class c in; false: the class is at its
// InFlightLimit (counted as refused).
func (cs *classSet) hold(c int32) bool {
	st := &cs.classes[c]
	if n := st.held.Add(1); st.InFlightLimit > 0 && n > int64(st.InFlightLimit) {
		st.held.Add(-1)
		st.refusedInflight.Add(1)
		return false
	}
	return true
}

// unhold releases a slot hold took for a request that was not booked.
func (cs *classSet) unhold(c int32) { cs.classes[c].held.Add(-1) }

// booked moves a held slot to the booking id, released when it ends
// (settled); select (no booking) releases it at once.
func (cs *classSet) admit(c int32, id reservation.ID, reserve bool) {
	st := &cs.classes[c]
	st.admitted.Add(1)
	if !reserve {
		st.held.Add(-1)
		return
	}
	st.booked.Add(1)
	cs.mu.Lock()
	cs.live[id] = c
	cs.mu.Unlock()
}

// settled releases the slot of booking id, if it is a class's.
func (cs *classSet) settled(id reservation.ID) {
	if cs == nil {
		return
	}
	cs.mu.Lock()
	c, ok := cs.live[id]
	delete(cs.live, id)
	cs.mu.Unlock()
	if ok {
		cs.classes[c].held.Add(-1)
		cs.classes[c].booked.Add(-1)
	}
}

// prune releases the slots of bookings the ledger no longer holds (expired,
// or dropped with their worker). O(live bookings of classes).
func (cs *classSet) prune(l *reservation.Ledger) {
	if cs == nil {
		return
	}
	cs.mu.Lock()
	defer cs.mu.Unlock()
	for id, c := range cs.live {
		if _, ok := l.Holder(id); !ok {
			delete(cs.live, id)
			cs.classes[c].held.Add(-1)
			cs.classes[c].booked.Add(-1)
		}
	}
}

// stats returns Stats.Classes.
func (cs *classSet) stats() map[string]ClassStats {
	if cs == nil {
		return nil
	}
	m := make(map[string]ClassStats, len(cs.classes))
	for i := range cs.classes {
		st := &cs.classes[i]
		var refused map[string]uint64
		for _, r := range []struct {
			reason string
			n      uint64
		}{{RefusedClassQueueFull, st.refusedQueue.Load()}, {RefusedClassInFlightFull, st.refusedInflight.Load()}, {RefusedDeadline, st.refusedLate.Load()}} {
			if r.n > 0 {
				if refused == nil {
					refused = make(map[string]uint64, 3)
				}
				refused[r.reason] = r.n
			}
		}
		m[st.Name] = ClassStats{
			Waiting: int(st.waiting.Load()), InFlight: int(st.booked.Load()),
			Admitted: st.admitted.Load(), Refused: refused,
		}
	}
	return m
}

// noDeadline is a waiter's deadline when it has none.
const noDeadline = math.MaxInt64
