package roles

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/kvselect/kvselect/internal/clocktest"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/selection"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

type fakeClock = clocktest.Clock

func newFakeClock() *fakeClock { return clocktest.New(time.Unix(1_000_000, 0)) }

// noLabel marks a test worker without any role label.
const noLabel = "\x00none"

// wk is a complete worker of block size 4 with the given role label value.
func wk(id, role string) catalog.Worker {
	w := catalog.Worker{
		ID: id, Endpoint: "10.0.0.1:8000", DPSize: 1, BlockSize: 4, MaxNumBatchedTokens: 100,
		KVEventEndpoints: map[int]string{0: "tcp://10.0.0.1:5557"}, ReplayEndpoint: "tcp://10.0.0.1:5558",
		Labels: map[string]string{"app": "vllm"},
	}
	if role != noLabel {
		w.Labels[DefaultRoleLabel] = role
	}
	return w
}

// testOptions: block size 4, a fake clock, a fixed seed per role, no sweeper,
// and KV events taken from the caller (no sockets).
func testOptions(mode TopologyMode, clk *fakeClock) RoleOptions {
	return RoleOptions{
		Mode: mode,
		Base: selection.DefaultConfig(4),
		Configure: func(r Role, b *selection.SelectionServiceBuilder) {
			b.Clock(clk.Now).Rand(rand.NewPCG(1, uint64(r)+2)).SweepInterval(-1).ExternalEvents()
		},
	}
}

func newRoles(t testing.TB, opts RoleOptions) *RoleSelectors {
	t.Helper()
	rs, err := New(context.Background(), opts)
	require.NoError(t, err)
	t.Cleanup(func() { _ = rs.Close() })
	return rs
}

func newBooker(t testing.TB, rs *RoleSelectors, opts BookerOptions) *PairBooker {
	t.Helper()
	b, err := NewPairBooker(rs, opts)
	require.NoError(t, err)
	t.Cleanup(b.Close)
	return b
}

func toks(n, seed int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(seed*100000 + i)
	}
	return out
}

// ids returns the worker ids of a role's catalog, sorted.
func ids(rs *RoleSelectors, r Role) []string {
	svc := rs.Service(r)
	if svc == nil {
		return nil
	}
	var out []string
	for _, rec := range svc.Workers().List() {
		out = append(out, rec.Worker.ID)
	}
	return out
}

// requireIdle asserts that every role's service holds no load and no booking.
func requireIdle(t testing.TB, rs *RoleSelectors) {
	t.Helper()
	for _, r := range rs.mode.Roles() {
		svc := rs.Service(r)
		for _, m := range []string{"", "m1", "m2"} {
			for _, l := range svc.Loads(m) {
				require.Zero(t, l.ActiveRequests, "%s %+v", r, l)
				require.Zero(t, l.ActivePrefillTokens, "%s %+v", r, l)
				require.Zero(t, l.ActiveBlocks, "%s %+v", r, l)
			}
		}
		require.Zero(t, svc.Stats().Ledger.Active, "%s has live bookings", r)
	}
}

func load(t testing.TB, rs *RoleSelectors, r Role, worker string) selection.WorkerLoad {
	t.Helper()
	for _, l := range rs.Service(r).Loads("") {
		if l.WorkerID == worker {
			return l
		}
	}
	require.Failf(t, "no load", "%s worker %q", r, worker)
	return selection.WorkerLoad{}
}

func pool(prefix string, n int, role string) []catalog.Worker {
	out := make([]catalog.Worker, n)
	for i := range out {
		out[i] = wk(fmt.Sprintf("%s%d", prefix, i), role)
	}
	return out
}

// empty returns the roles with no schedulable worker, in role order.
func (c Census) empty() []Role {
	var out []Role
	for _, rc := range c.Roles {
		if rc.Schedulable == 0 {
			out = append(out, rc.Role)
		}
	}
	return out
}

// readyStatus tells whether every role of the mode has a schedulable worker
// (and the selectors are not closed), and which roles have none.
type readyStatus struct {
	Ready bool
	Empty []Role
}

func (rs *RoleSelectors) ready() readyStatus {
	var st readyStatus
	for _, r := range rs.mode.Roles() {
		if !rs.services[r].Ready().Ready {
			st.Empty = append(st.Empty, r)
		}
	}
	st.Ready = len(st.Empty) == 0 && !rs.closed.Load()
	return st
}
