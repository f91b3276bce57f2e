package natsbus_test

import (
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/replica/natsbus"
	"github.com/kvselect/kvselect/reservation"
)

// clusterTimeout bounds every wait for routes to form or to go.
const clusterTimeout = 10 * time.Second

// startEmbedded starts an embedded server named name, its route listener on
// a free loopback port, routed to routes; it is closed when the test ends.
func startEmbedded(t testing.TB, name string, routes ...string) *natsbus.Server {
	t.Helper()
	s, err := natsbus.StartServer(natsbus.ServerOptions{Name: name, ClusterAddr: "127.0.0.1:0", Routes: routes})
	require.NoError(t, err)
	t.Cleanup(s.Close)
	return s
}

func routeOf(s *natsbus.Server) string { return s.ClusterAddr().String() }

// dial connects to s in process; the client is closed when the test ends.
func dial(t testing.TB, s *natsbus.Server, name string) *natsbus.Client {
	t.Helper()
	c, err := s.Dial(natsbus.DialOptions{Name: name})
	require.NoError(t, err)
	t.Cleanup(c.Close)
	return c
}

// requirePeers waits until each server has a route to exactly want[i]
// other servers, by name.
func requirePeers(t testing.TB, servers []*natsbus.Server, want ...[]string) {
	t.Helper()
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		for i, s := range servers {
			assert.Equal(c, want[i], s.Peers(), "server %d's peers", i)
		}
	}, clusterTimeout, 5*time.Millisecond)
}

// reaches publishes on from until every subscriber of subject on tos has a
// message (subscription interest crosses a route asynchronously, so the
// first publishes may find no interest yet).
func reaches(t testing.TB, subject string, from *natsbus.Client, tos ...*natsbus.Client) {
	t.Helper()
	var mu sync.Mutex
	got := make([]int, len(tos))
	for i, c := range tos {
		unsub, err := c.Bus().Subscribe(subject, func(string, []byte) { mu.Lock(); got[i]++; mu.Unlock() })
		require.NoError(t, err)
		t.Cleanup(unsub)
		require.NoError(t, c.Bus().Conn().Flush())
	}
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		assert.NoError(c, from.Bus().Publish(subject, []byte("hello")))
		mu.Lock()
		defer mu.Unlock()
		for i, n := range got {
			assert.Positive(c, n, "messages on %s at subscriber %d", subject, i)
		}
	}, clusterTimeout, 5*time.Millisecond)
}

// Three servers clustered through routes (b and c each route to a; NATS
// completes the mesh): a message published on any reaches subscribers on the
// other two, and a Replicator per server shares its bookings with the
// others, whose views end equal entry by entry.
func TestServersCluster(t *testing.T) {
	a := startEmbedded(t, "a")
	b := startEmbedded(t, "b", routeOf(a))
	c := startEmbedded(t, "c", "nats-route://"+routeOf(a))
	servers := []*natsbus.Server{a, b, c}
	requirePeers(t, servers, []string{"b", "c"}, []string{"a", "c"}, []string{"a", "b"})
	require.Equal(t, []string{routeOf(a)}, c.Routes())
	require.Equal(t, "127.0.0.1", clientHost(t, a), "the client listener is on loopback")

	ca, cb, cc := dial(t, a, "ca"), dial(t, b, "cb"), dial(t, c, "cc")
	require.Equal(t, natsbus.DefaultMaxPayload, ca.MaxPayload())
	require.True(t, ca.Connected())
	reaches(t, "t.a", ca, cb, cc)
	reaches(t, "t.c", cc, ca, cb)

	var nodes []*node
	for i, s := range servers {
		id := fmt.Sprintf("r%d", i)
		cl, err := s.Dial(natsbus.DialOptions{Name: id})
		require.NoError(t, err)
		nodes = append(nodes, newNodeOn(t, cl.Bus().Conn(), id, nil, nil))
	}
	rng := rand.New(rand.NewPCG(3, 3))
	var held [3][]reservation.ID
	for i := range 60 {
		held[i%3] = append(held[i%3], nodes[i%3].book(t, rng, 1+rng.IntN(8)))
	}
	requireConverged(t, clusterTimeout, nodes...)
	for _, n := range nodes {
		require.Equal(t, 60, activeRequests(n), "every replica carries all three replicas' bookings")
	}
	for i, ids := range held {
		for _, id := range ids {
			nodes[i].free(t, id)
		}
	}
	requireConverged(t, clusterTimeout, nodes...)
	for _, n := range nodes {
		require.Zero(t, activeRequests(n))
	}
}

// SetRoutes adds a route to a server running alone and removes it again:
// the route forms on both sides, then goes on both sides and is not
// re-established; invalid routes are refused and nothing changes.
func TestServerSetRoutes(t *testing.T) {
	a := startEmbedded(t, "a")
	b := startEmbedded(t, "b")
	servers := []*natsbus.Server{a, b}
	requirePeers(t, servers, nil, nil)

	require.NoError(t, b.SetRoutes([]string{routeOf(a), routeOf(a)}))
	require.Equal(t, []string{routeOf(a)}, b.Routes(), "duplicates collapse")
	requirePeers(t, servers, []string{"b"}, []string{"a"})
	reaches(t, "t.b", dial(t, b, "cb"), dial(t, a, "ca"))
	require.NoError(t, b.SetRoutes([]string{routeOf(a)}), "the same routes again: no reload")

	for _, bad := range [][]string{{"no-port"}, {"host:0"}, {":4222"}, {"nats://" + routeOf(a)}, {"nats-route://u:p@" + routeOf(a)}} {
		require.ErrorIs(t, b.SetRoutes(bad), natsbus.ErrInvalidServerOptions, "%q", bad)
	}
	require.Equal(t, []string{routeOf(a)}, b.Routes())

	require.NoError(t, b.SetRoutes(nil))
	require.Empty(t, b.Routes())
	requirePeers(t, servers, nil, nil)
	// A removed route is not solicited again: add a third server routed to
	// a and b, and the mesh holds all three only once b routes again.
	c := startEmbedded(t, "c", routeOf(a))
	requirePeers(t, []*natsbus.Server{a, c}, []string{"c"}, []string{"a"})
	require.NoError(t, b.SetRoutes([]string{routeOf(c)}))
	requirePeers(t, []*natsbus.Server{a, b, c}, []string{"b", "c"}, []string{"a", "c"}, []string{"a", "b"})

	b.Close()
	require.ErrorIs(t, b.SetRoutes(nil), natsbus.ErrServerClosed)
	_, err := b.Dial(natsbus.DialOptions{})
	require.ErrorIs(t, err, natsbus.ErrServerClosed)
	requirePeers(t, []*natsbus.Server{a, c}, []string{"c"}, []string{"a"})
}

func TestStartServerInvalid(t *testing.T) {
	for _, o := range []natsbus.ServerOptions{
		{ClusterAddr: "127.0.0.1"},
		{ClusterAddr: "127.0.0.1:70000"},
		{ClientAddr: "0.0.0.0:0"},
		{ClientAddr: "10.1.2.3:4222"},
		{MaxPayload: 100},
		{MaxPayload: 64 << 20},
		{ClusterName: "a.b"},
		{Name: "two words"},
		{Routes: []string{"x"}},
		{StartTimeout: -time.Second},
	} {
		_, err := natsbus.StartServer(o)
		require.ErrorIs(t, err, natsbus.ErrInvalidServerOptions, "%+v", o)
	}
	_, err := natsbus.StartServer(natsbus.ServerOptions{ClusterAddr: "bad", MaxPayload: 1})
	require.ErrorContains(t, err, "ClusterAddr")
	require.ErrorContains(t, err, "MaxPayload", "every problem is named")
}

// A route port in use fails StartServer at once with the listener's error
// (the server's Fatalf), instead of ending the process.
func TestStartServerPortInUse(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	start := time.Now()
	_, err = natsbus.StartServer(natsbus.ServerOptions{ClusterAddr: l.Addr().String()})
	require.Error(t, err)
	require.Contains(t, strings.ToLower(err.Error()), "address already in use")
	require.Less(t, time.Since(start), natsbus.DefaultStartTimeout/2, "failed fast")
}

// Dial reaches a server through its loopback client listener, as an EPP
// reaches an external NATS cluster; bad URLs are refused.
func TestDial(t *testing.T) {
	s, err := natsbus.StartServer(natsbus.ServerOptions{ClusterAddr: "127.0.0.1:0", ClientAddr: "127.0.0.1:0", MaxPayload: 64 << 10})
	require.NoError(t, err)
	defer s.Close()
	require.Equal(t, "127.0.0.1", clientHost(t, s))
	// The listener asks every client for the server's token, which ClientURL
	// carries: another process on the host cannot publish into the cluster.
	u, err := url.Parse(s.ClientURL())
	require.NoError(t, err)
	u.User = nil
	_, err = nats.Connect(u.String())
	require.ErrorIs(t, err, nats.ErrAuthorization)
	u.User = url.User("wrong-token")
	_, err = nats.Connect(u.String())
	require.ErrorIs(t, err, nats.ErrAuthorization)
	c, err := natsbus.Dial(s.ClientURL(), natsbus.DialOptions{Name: "ext"})
	require.NoError(t, err)
	defer c.Close()
	require.Eventually(t, c.Connected, clusterTimeout, 5*time.Millisecond)
	require.Equal(t, 64<<10, c.MaxPayload())
	reaches(t, "t.ext", c, dial(t, s, "in"))
	for _, bad := range []string{"", "localhost:4222", "http://h:1", "nats://"} {
		_, err := natsbus.Dial(bad, natsbus.DialOptions{})
		require.Error(t, err, "%q", bad)
	}
	_, err = natsbus.Dial(s.ClientURL(), natsbus.DialOptions{PingInterval: -1})
	require.Error(t, err)
}

// clientHost is the host of s's client listener.
func clientHost(t *testing.T, s *natsbus.Server) string {
	t.Helper()
	u, err := url.Parse(s.ClientURL())
	require.NoError(t, err)
	return u.Hostname()
}

// logged is an slog handler that keeps every message.
type logged struct {
	mu   sync.Mutex
	msgs []string
}

func (l *logged) Enabled(context.Context, slog.Level) bool { return true }
func (l *logged) Handle(_ context.Context, r slog.Record) error {
	l.mu.Lock()
	l.msgs = append(l.msgs, r.Message)
	l.mu.Unlock()
	return nil
}
func (l *logged) WithAttrs([]slog.Attr) slog.Handler { return l }
func (l *logged) WithGroup(string) slog.Handler      { return l }

func (l *logged) has(sub string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, m := range l.msgs {
		if strings.Contains(strings.ToLower(m), sub) {
			return true
		}
	}
	return false
}

// With a route secret, servers that share it cluster and a server with
// another one is refused, both ways.
func TestRouteSecret(t *testing.T) {
	const secret = "0123456789abcdef-route"
	start := func(name, secret string, h slog.Handler, routes ...string) *natsbus.Server {
		o := natsbus.ServerOptions{Name: name, ClusterAddr: "127.0.0.1:0", Routes: routes, RouteSecret: secret}
		if h != nil {
			o.Logger = slog.New(h)
		}
		s, err := natsbus.StartServer(o)
		require.NoError(t, err)
		t.Cleanup(s.Close)
		return s
	}
	aLog := &logged{}
	a := start("a", secret, aLog)
	b := start("b", secret, nil, routeOf(a))
	requirePeers(t, []*natsbus.Server{a, b}, []string{"b"}, []string{"a"})

	cLog := &logged{}
	c := start("c", "another-secret-0123", cLog, routeOf(a))
	require.Eventually(t, func() bool { return aLog.has("authentication failure") && cLog.has("authorization violation") }, clusterTimeout, 5*time.Millisecond,
		"a refuses c's route")
	dLog := &logged{}
	open := start("d", "", dLog, routeOf(a))
	require.Eventually(t, func() bool { return dLog.has("authorization violation") }, clusterTimeout, 5*time.Millisecond,
		"a refuses a route without a secret")
	// A refused route is listed for the moment of its handshake; between
	// the refused servers' retries the cluster is a and b alone.
	requirePeers(t, []*natsbus.Server{a, b, c, open}, []string{"b"}, []string{"a"}, nil, nil)
	require.GreaterOrEqual(t, a.RefusedRoutes(), uint64(2), "c's and d's routes counted")
	require.True(t, aLog.has("route refused: wrong or missing route secret"))
	require.Zero(t, b.RefusedRoutes())

	_, err := natsbus.StartServer(natsbus.ServerOptions{ClusterAddr: "127.0.0.1:0", RouteSecret: "short"})
	require.ErrorIs(t, err, natsbus.ErrInvalidServerOptions)
	require.ErrorContains(t, err, "RouteSecret")
}

func (l *logged) snapshot() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.msgs...)
}

// With ReplicaPermissions, a replica's client publishes only on its own
// stream: a batch on another replica's subject is dropped by its server and
// never reaches a peer, while its own arrive.
func TestReplicaPermissions(t *testing.T) {
	const subj = "kvselect.replica.t"
	start := func(name string, routes ...string) *natsbus.Server {
		s, err := natsbus.StartServer(natsbus.ServerOptions{Name: name, ClusterAddr: "127.0.0.1:0", Routes: routes,
			ClientPermissions: natsbus.ReplicaPermissions(name, subj)})
		require.NoError(t, err)
		t.Cleanup(s.Close)
		return s
	}
	sa := start("a")
	sb := start("b", routeOf(sa))
	requirePeers(t, []*natsbus.Server{sa, sb}, []string{"b"}, []string{"a"})
	ca, cb := dial(t, sa, "a"), dial(t, sb, "b")
	reaches(t, subj+".ops.a", ca, cb)

	got := make(chan string, 16)
	unsub, err := cb.Bus().Subscribe(subj+".ops.*", func(subject string, _ []byte) { got <- subject })
	require.NoError(t, err)
	t.Cleanup(unsub)
	require.NoError(t, cb.Bus().Conn().Flush())
	require.NoError(t, ca.Bus().Publish(subj+".ops.b", []byte("forged"))) // refused by a's server
	require.NoError(t, ca.Bus().Publish(subj+".ops.a", []byte("own")))
	require.NoError(t, ca.Bus().Conn().Flush())
	select {
	case s := <-got:
		require.Equal(t, subj+".ops.a", s, "the forged one never arrives, and order holds")
	case <-time.After(clusterTimeout):
		t.Fatal("own batch never arrived")
	}
	// b may not subscribe to a's services.
	_, err = cb.Bus().Conn().SubscribeSync(subj + ".snapshot.a")
	if err == nil {
		err = cb.Bus().Conn().Flush()
		if err == nil {
			err = cb.Bus().Conn().LastError()
		}
	}
	require.Error(t, err)
}

// A snapshot request whose reply subject is not an inbox (here the booking
// stream, which would reflect a page to every replica) is not answered.
func TestRespondOnlyToInboxes(t *testing.T) {
	srv := startEmbedded(t, "s")
	cl, att := dial(t, srv, "replica"), dial(t, srv, "attacker")
	var served atomic.Int64
	stop, err := cl.Bus().Respond("t.snapshot.replica", func([]byte) []byte { served.Add(1); return []byte("page") })
	require.NoError(t, err)
	t.Cleanup(stop)
	require.NoError(t, cl.Bus().Conn().Flush())

	require.NoError(t, att.Bus().Conn().PublishRequest("t.snapshot.replica", "t.ops.replica", []byte("req")))
	require.NoError(t, att.Bus().Conn().Flush())
	require.Eventually(t, func() bool { return cl.Bus().RefusedReplies() == 1 }, clusterTimeout, time.Millisecond)
	require.Zero(t, served.Load())

	// A real request still gets its answer.
	resp, err := att.Bus().Request(t.Context(), "t.snapshot.replica", []byte("req"))
	require.NoError(t, err)
	require.Equal(t, "page", string(resp))
	require.Equal(t, natsbus.DefaultMaxPayload, cl.Bus().MaxPayload())
}
