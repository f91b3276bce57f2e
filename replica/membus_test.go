package replica_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/kvselect/kvselect/replica"
)

// hub is an in-memory broker: every member's Publish delivers synchronously
// to the subscribers of the subject (so one publisher's order holds), and
// Request calls the responder inline. Members can be cut off, lose publishes
// or block them, for the failure tests.
type hub struct {
	mu    sync.RWMutex
	subs  map[string][]*hubSub
	resps map[string][]*hubSub
}

type hubSub struct {
	m       *member
	fn      func(string, []byte)
	respond func([]byte) []byte
	dead    atomic.Bool
}

// member is one replica's connection to the hub: a replica.Bus and a
// replica.ConnWatcher.
type member struct {
	h    *hub
	down atomic.Bool // cut off: publishes and requests fail, nothing arrives
	// drop, when it returns true, loses that publish (as if it never
	// arrived; Publish still succeeds).
	drop atomic.Pointer[func(data []byte) bool]
	// gate, when set, makes Publish of a batch with ops wait until it is
	// closed (heartbeats, batches without ops, pass).
	gate atomic.Pointer[chan struct{}]

	wmu   sync.Mutex
	watch func(bool)
}

var (
	errDown         = errors.New("hub: member is down")
	errNoResponders = errors.New("hub: no responders")
)

func newHub() *hub { return &hub{subs: map[string][]*hubSub{}, resps: map[string][]*hubSub{}} }

func (h *hub) member() *member { return &member{h: h} }

var (
	_ replica.Bus         = (*member)(nil)
	_ replica.ConnWatcher = (*member)(nil)
)

func (m *member) Publish(subject string, data []byte) error {
	if g := m.gate.Load(); g != nil {
		if _, _, ops, ok := batchHeader(data); ok && ops > 0 {
			<-*g
		}
	}
	if m.down.Load() {
		return errDown
	}
	if d := m.drop.Load(); d != nil && (*d)(data) {
		return nil
	}
	m.h.mu.RLock()
	subs := append([]*hubSub(nil), m.h.subs[subject]...)
	if i := strings.LastIndexByte(subject, '.'); i >= 0 {
		subs = append(subs, m.h.subs[subject[:i]+".*"]...)
	}
	m.h.mu.RUnlock()
	for _, s := range subs {
		if !s.dead.Load() && !s.m.down.Load() {
			s.fn(subject, data)
		}
	}
	return nil
}

// Subscribe takes a literal subject or one ending in the token "*".
func (m *member) Subscribe(subject string, fn func(string, []byte)) (func(), error) {
	s := &hubSub{m: m, fn: fn}
	m.h.mu.Lock()
	m.h.subs[subject] = append(m.h.subs[subject], s)
	m.h.mu.Unlock()
	return func() {
		s.dead.Store(true)
		m.h.mu.Lock()
		defer m.h.mu.Unlock()
		list := m.h.subs[subject]
		for i, x := range list {
			if x == s {
				m.h.subs[subject] = append(list[:i:i], list[i+1:]...)
				break
			}
		}
	}, nil
}

func (m *member) Request(ctx context.Context, subject string, data []byte) ([]byte, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if m.down.Load() {
		return nil, errDown
	}
	m.h.mu.RLock()
	var s *hubSub
	for _, x := range m.h.resps[subject] {
		if !x.dead.Load() && !x.m.down.Load() {
			s = x
			break
		}
	}
	m.h.mu.RUnlock()
	if s == nil {
		return nil, errNoResponders
	}
	resp := s.respond(data)
	if resp == nil {
		return nil, errNoResponders
	}
	return resp, nil
}

func (m *member) Respond(subject string, fn func([]byte) []byte) (func(), error) {
	s := &hubSub{m: m, respond: fn}
	m.h.mu.Lock()
	m.h.resps[subject] = append(m.h.resps[subject], s)
	m.h.mu.Unlock()
	return func() {
		s.dead.Store(true)
		m.h.mu.Lock()
		defer m.h.mu.Unlock()
		list := m.h.resps[subject]
		for i, x := range list {
			if x == s {
				m.h.resps[subject] = append(list[:i:i], list[i+1:]...)
				break
			}
		}
		if len(m.h.resps[subject]) == 0 {
			delete(m.h.resps, subject)
		}
	}, nil
}

func (m *member) WatchConn(fn func(bool)) (func(), error) {
	m.wmu.Lock()
	m.watch = fn
	m.wmu.Unlock()
	return func() {
		m.wmu.Lock()
		m.watch = nil
		m.wmu.Unlock()
	}, nil
}

// setDown cuts the member off (true) or brings it back, and tells its
// watcher.
func (m *member) setDown(down bool) {
	m.down.Store(down)
	m.wmu.Lock()
	fn := m.watch
	m.wmu.Unlock()
	if fn != nil {
		fn(!down)
	}
}

// hold makes Publish of a batch with ops wait until the returned function
// is called, or the test ends. Heartbeats pass: a publisher caught sending
// one when the hold began goes on to take the next ops into a batch and
// waits there, which is what the tests hold it for.
func (m *member) hold(t testing.TB) (release func()) {
	g := make(chan struct{})
	m.gate.Store(&g)
	var once sync.Once
	release = func() {
		once.Do(func() {
			m.gate.Store(nil)
			close(g)
		})
	}
	t.Cleanup(release) // a test that fails while holding must not hang its Close
	return release
}

// dropIf loses the publishes for which f returns true.
func (m *member) dropIf(f func(data []byte) bool) { m.drop.Store(&f) }
