package selection

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
)

// book books tokens for session (no free) and returns the chosen worker.
func bookSession(t *testing.T, s *SelectionService, session string, tokens []uint32) string {
	t.Helper()
	res, err := s.SelectAndReserve(context.Background(), Request{Tokens: tokens, SessionID: session})
	require.NoError(t, err)
	return res.WorkerID
}

// Unrelated prompts of one session, kept in flight so the load spreads any
// request without a pin, all land on the session's first worker under a hard
// pin; a second session is pinned on its own.
func TestSessionHardPinsEveryRequest(t *testing.T) {
	s, _ := newTestService(t, func(c *Config) { c.Sessions.Mode = SessionHard })
	addWorkers(t, s, "a", "b", "c")
	first := bookSession(t, s, "conv-1", toks(64, 1))
	for i := range 20 {
		require.Equal(t, first, bookSession(t, s, "conv-1", toks(64, 100+i)), "request %d left the pin", i)
	}
	// The same load without a session spreads.
	seen := map[string]bool{}
	for i := range 6 {
		seen[bookSession(t, s, "", toks(64, 200+i))] = true
	}
	require.Greater(t, len(seen), 1, "without a session the requests spread")
	st := s.Stats()
	require.Equal(t, uint64(20), st.SessionHits)
	require.Zero(t, st.SessionMoves)
	require.Equal(t, 1, st.Sessions)
}

// A hard pin on a worker that stops being schedulable moves, and stays moved.
func TestSessionHardMovesOffADrainingWorker(t *testing.T) {
	s, _ := newTestService(t, func(c *Config) { c.Sessions.Mode = SessionHard })
	addWorkers(t, s, "a", "b")
	first := bookSession(t, s, "conv", toks(16, 1))
	_, err := s.Workers().SetDraining(first, true)
	require.NoError(t, err)
	moved := bookSession(t, s, "conv", toks(16, 2))
	require.NotEqual(t, first, moved)
	_, err = s.Workers().SetDraining(first, false)
	require.NoError(t, err)
	require.Equal(t, moved, bookSession(t, s, "conv", toks(16, 3)), "the pin followed the move")
	require.Equal(t, uint64(1), s.Stats().SessionMoves)
}

// A soft pin holds while its worker is within the slack of the best one and
// moves when the worker is far costlier.
func TestSessionSoftMovesWhenFarCostlier(t *testing.T) {
	s, _ := newTestService(t, nil) // soft, slack 2
	addWorkers(t, s, "a", "b")
	first := bookSession(t, s, "conv", toks(16, 1))
	// One more request of the session: the pinned worker now carries one
	// request more than the other, within the slack.
	require.Equal(t, first, bookSession(t, s, "conv", toks(16, 2)))
	// Load the pinned worker with big requests of no session.
	for i := range 8 {
		_, err := s.SelectAndReserve(context.Background(), Request{Tokens: toks(64, 50+i), Allowed: []string{first}})
		require.NoError(t, err)
	}
	moved := bookSession(t, s, "conv", toks(16, 3))
	require.NotEqual(t, first, moved, "the soft pin stayed on a worker far costlier")
	st := s.Stats()
	require.Equal(t, uint64(1), st.SessionHits)
	require.Equal(t, uint64(1), st.SessionMoves)
}

// With queueing, a soft pin on a busy worker moves; a hard one does not.
func TestSessionBusyPin(t *testing.T) {
	for _, mode := range []SessionMode{SessionSoft, SessionHard} {
		t.Run(mode.String(), func(t *testing.T) {
			s, _ := newTestService(t, func(c *Config) {
				thr := 1.0
				c.QueueThreshold = &thr
				c.Sessions.Mode, c.Sessions.SoftSlack = mode, 1e6 // cost alone never moves it
			})
			addWorkers(t, s, "a", "b")
			first := bookSession(t, s, "conv", toks(16, 1))
			// Make the pinned worker busy: more than 1 x 100 tokens of active prefill.
			_, err := s.SelectAndReserve(context.Background(), Request{Tokens: toks(120, 9), Allowed: []string{first}})
			require.NoError(t, err)
			got := bookSession(t, s, "conv", toks(16, 2))
			if mode == SessionHard {
				require.Equal(t, first, got)
			} else {
				require.NotEqual(t, first, got)
			}
		})
	}
}

// The table holds at most MaxSessions pins, dropping the least recently used,
// and a pin idle for longer than IdleTTL is gone.
func TestSessionTableBoundAndTTL(t *testing.T) {
	s, clk := newTestService(t, func(c *Config) {
		c.Sessions.Mode, c.Sessions.MaxSessions, c.Sessions.IdleTTL = SessionHard, 4, time.Minute
	})
	addWorkers(t, s, "a", "b", "c")
	pins := map[string]string{}
	for i := range 5 {
		id := string(rune('p' + i))
		pins[id] = bookSession(t, s, id, toks(16, i))
		if i == 0 {
			clk.Advance(time.Second) // p is the least recently used from here on
		}
	}
	st := s.Stats()
	require.Equal(t, 4, st.Sessions)
	require.Equal(t, uint64(1), st.SessionsEvicted)
	// q..t keep their pins; p was dropped (its next request is not a hit).
	hits := st.SessionHits
	for _, id := range []string{"q", "r", "s", "t"} {
		require.Equal(t, pins[id], bookSession(t, s, id, toks(16, 10)))
	}
	require.Equal(t, hits+4, s.Stats().SessionHits)
	bookSession(t, s, "p", toks(16, 11))
	require.Equal(t, hits+4, s.Stats().SessionHits, "an evicted pin was used")

	clk.Advance(time.Minute + time.Second)
	bookSession(t, s, "q", toks(16, 12))
	st = s.Stats()
	require.Equal(t, hits+4, st.SessionHits, "an idle pin was used")
	require.GreaterOrEqual(t, st.SessionsExpired, uint64(1))
}

func TestSessionIDBoundAndOff(t *testing.T) {
	s, _ := newTestService(t, func(c *Config) { c.Sessions.Mode = SessionHard })
	addWorkers(t, s, "a", "b")
	_, err := s.SelectAndReserve(context.Background(), Request{Tokens: toks(16, 1), SessionID: strings.Repeat("x", MaxSessionIDLen+1)})
	require.ErrorIs(t, err, ErrBadRequest)
	require.ErrorContains(t, err, "SessionID is 257 bytes")
	bookSession(t, s, strings.Repeat("x", MaxSessionIDLen), toks(16, 1))
	require.Equal(t, 1, s.Stats().Sessions)

	off, _ := newTestService(t, func(c *Config) { c.Sessions.Mode = SessionOff })
	addWorkers(t, off, "a", "b")
	for i := range 4 {
		bookSession(t, off, "conv", toks(16, i))
	}
	st := off.Stats()
	require.Zero(t, st.Sessions)
	require.Zero(t, st.SessionHits)

	for _, c := range []SessionConfig{{Mode: 7}, {MaxSessions: -1}, {IdleTTL: -1}, {SoftSlack: -1}} {
		cfg := DefaultConfig(4)
		cfg.Sessions = c
		require.ErrorIs(t, cfg.Validate(), ErrInvalidConfig, "%+v", c)
	}
	for in, want := range map[string]SessionMode{"soft": SessionSoft, " HARD": SessionHard, "off": SessionOff} {
		m, err := ParseSessionMode(in)
		require.NoError(t, err)
		require.Equal(t, want, m)
	}
	_, err = ParseSessionMode("sticky")
	require.ErrorIs(t, err, ErrInvalidConfig)
}

// A peer's booking pins its session here too, so the session's next request
// through this service lands where the peer sent it.
func TestSessionPinFromRemoteBooking(t *testing.T) {
	s, _ := newTestService(t, func(c *Config) { c.Sessions.Mode = SessionHard })
	addWorkers(t, s, "a", "b", "c")
	require.NoError(t, s.Replicas().Book("peer", BookingEvent{
		ID: "r1", Worker: catalog.WorkerRank{WorkerID: "c"}, PrivateBlocks: 1, Lease: time.Minute, Session: "conv",
	}))
	for i := range 5 {
		require.Equal(t, "c", bookSession(t, s, "conv", toks(16, i)))
	}
}
