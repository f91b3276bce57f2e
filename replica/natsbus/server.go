package natsbus

import (
	"crypto/rand"
	"crypto/subtle"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
)

// Defaults and bounds of ServerOptions.
const (
	// DefaultClusterPort is the port of the route listener (the EPP's
	// DYN_EPP_REPLICA_SYNC_PORT).
	DefaultClusterPort = 9092
	// DefaultClusterName names the cluster the replicas' servers form.
	DefaultClusterName = "kvselect"
	// DefaultMaxPayload is the largest message the server accepts, NATS's
	// own default.
	DefaultMaxPayload = 1 << 20
	// MinMaxPayload and MaxMaxPayload bound ServerOptions.MaxPayload: the
	// replica's smallest message, and the size above which NATS itself
	// warns.
	MinMaxPayload = 4 << 10
	MaxMaxPayload = 8 << 20
	// MaxRoutes bounds the routes of one server.
	MaxRoutes = 1024
	// MinRouteSecret is the shortest ServerOptions.RouteSecret accepted.
	MinRouteSecret = 16
	// routeUser is the user name routes authenticate as (RouteSecret is its
	// password).
	routeUser = "kvselect-route"
	// clientUser is the user clients authenticate as with
	// ClientPermissions (the random token is its password).
	clientUser = "kvselect-replica"
	// DefaultStartTimeout bounds StartServer's wait for the listeners.
	DefaultStartTimeout = 10 * time.Second
)

// ErrInvalidServerOptions is StartServer's (and SetRoutes') error for
// options that cannot work; the message names every problem.
var ErrInvalidServerOptions = errors.New("natsbus: invalid server options")

// ServerOptions configure StartServer. The zero value is a server with a
// route listener on every IPv4 interface at DefaultClusterPort, a client
// listener on a free loopback port and no routes. StartServer copies the options; it never changes the
// caller's value.
type ServerOptions struct {
	// Name is the server's name in the cluster (server_name): give each
	// replica's server its replica ID. Default: the server's generated ID.
	Name string
	// ClusterName names the cluster; servers with another name refuse the
	// route. Default DefaultClusterName.
	ClusterName string
	// ClusterAddr is host:port of the route listener, the address peers'
	// routes reach. An empty host listens on every IPv4 interface (use "::"
	// for IPv6); port 0 picks a free port (tests: read it back with
	// ClusterAddr). Default ":9092".
	ClusterAddr string
	// Routes are the peers' route listeners, host:port or
	// nats-route://host:port; SetRoutes replaces them later. At most
	// MaxRoutes. Default none.
	Routes []string
	// ClientAddr is host:port of the client listener, on a loopback
	// address. Default "127.0.0.1:0" (a free port): clients in the process
	// connect through Dial, without a socket, but nats-server starts its
	// routes only once its client listener is up (with no client listener,
	// Options.DontListen, it never starts them), so there is always one,
	// on loopback.
	ClientAddr string
	// MaxPayload bounds every message (max_payload); keep the Replicator's
	// MaxMessageBytes at or below it (Client.MaxPayload reads it). Default
	// DefaultMaxPayload; between MinMaxPayload and MaxMaxPayload.
	MaxPayload int
	// StartTimeout bounds StartServer's wait for the listeners. Default
	// DefaultStartTimeout.
	StartTimeout time.Duration
	// RouteSecret, when set, is the shared secret every route must present:
	// the server refuses a route without it, and its own routes present it.
	// Give every replica the same one (the EPP's
	// DYN_EPP_REPLICA_SYNC_SECRET, from a Kubernetes Secret). At least
	// MinRouteSecret bytes, printable ASCII without spaces. Default none:
	// any host that reaches the route port may join the cluster, so keep it
	// behind a NetworkPolicy.
	RouteSecret string
	// ClientPermissions, when set, are what the server's clients (this
	// process's replicas, through Dial or ClientURL) may publish and
	// subscribe to; see ReplicaPermissions. The server drops and logs
	// anything else. Default: no limit.
	ClientPermissions *Permissions
	// Logger receives the server's log (notices at INFO, warnings, errors;
	// debug and trace are off). Default: discard.
	Logger *slog.Logger
}

// Permissions are NATS subject permissions (wildcards allowed): the subjects
// a client may publish to and subscribe to.
type Permissions struct {
	Publish, Subscribe []string
}

// ReplicaPermissions are the permissions of the client of replica id for
// the replica subjects given (replica.Options.Subject of each of its
// Replicators): it publishes batches only on its own stream, requests to
// its peers' snapshot and index services and answers to inboxes; it reads
// every replica's stream, its own services and its inbox. With them, a
// client cannot publish as another replica: each replica's stream subject
// names it, and a batch naming another is refused by every receiver.
func ReplicaPermissions(id string, subjects ...string) *Permissions {
	p := &Permissions{Publish: []string{nats.InboxPrefix + ">"}, Subscribe: []string{nats.InboxPrefix + ">"}}
	for _, s := range subjects {
		p.Publish = append(p.Publish, s+".ops."+id, s+".snapshot.*", s+".index.*")
		p.Subscribe = append(p.Subscribe, s+".ops.*", s+".snapshot."+id, s+".index."+id)
	}
	return p
}

// Server is an embedded nats-server (github.com/nats-io/nats-server/v2) for
// replicas: no JetStream, core NATS only, clustered with its peers' servers
// through routes (NATS forms the full mesh from any connected set of
// routes, telling each server of the others).
//
// A Server is safe for concurrent use. The nats-server's goroutines belong
// to it: Close stops them and waits.
type Server struct {
	ns  *server.Server
	log *serverLog

	secret string     // RouteSecret
	token  string     // the client listeners' token, random per server
	user   bool       // clients log in as clientUser, token their password
	auth   *routeAuth // nil without a RouteSecret

	mu     sync.Mutex // serialises SetRoutes; guards base and routes
	base   *server.Options
	routes []string
	closed bool
}

// parseHostPort checks host:port; port may be 0 when zero is set.
func parseHostPort(s string, zero bool) (string, int, error) {
	host, p, err := net.SplitHostPort(s)
	if err != nil {
		return "", 0, fmt.Errorf("%q is not host:port", s)
	}
	port, err := strconv.Atoi(p)
	lo := 1
	if zero {
		lo = 0
	}
	if err != nil || port < lo || port > 65535 {
		return "", 0, fmt.Errorf("%q: port not in %d..65535", s, lo)
	}
	return host, port, nil
}

// routeURLs turns routes (host:port or nats-route://host:port) into the
// server's URLs, sorted and without duplicates, each presenting secret when
// set.
func routeURLs(routes []string, secret string) ([]*url.URL, []string, error) {
	if len(routes) > MaxRoutes {
		return nil, nil, fmt.Errorf("%d routes, at most %d", len(routes), MaxRoutes)
	}
	var probs []string
	norm := make([]string, 0, len(routes))
	for _, r := range routes {
		hp := strings.TrimSpace(r)
		if strings.Contains(hp, "://") {
			u, err := url.Parse(hp)
			if err != nil || u.Scheme != "nats-route" || u.User != nil || (u.Path != "" && u.Path != "/") || u.RawQuery != "" {
				probs = append(probs, fmt.Sprintf("route %q: want host:port or nats-route://host:port", r))
				continue
			}
			hp = u.Host
		}
		host, _, err := parseHostPort(hp, false)
		if err == nil && host == "" {
			err = fmt.Errorf("%q has no host", hp)
		}
		if err != nil {
			probs = append(probs, "route "+err.Error())
			continue
		}
		norm = append(norm, hp)
	}
	if len(probs) > 0 {
		return nil, nil, errors.New(strings.Join(probs, "; "))
	}
	slices.Sort(norm)
	norm = slices.Compact(norm)
	urls := make([]*url.URL, len(norm))
	for i, hp := range norm {
		urls[i] = &url.URL{Scheme: "nats-route", Host: hp}
		if secret != "" {
			urls[i].User = url.UserPassword(routeUser, secret)
		}
	}
	return urls, norm, nil
}

// natsOptions validates o and returns the nats-server options it means.
func (o ServerOptions) natsOptions() (*server.Options, []string, error) {
	var probs []string
	bad := func(format string, args ...any) { probs = append(probs, fmt.Sprintf(format, args...)) }
	if o.ClusterName == "" {
		o.ClusterName = DefaultClusterName
	} else if strings.ContainsAny(o.ClusterName, " \t\r\n.*>") {
		bad("ClusterName %q: no spaces, dots or wildcards", o.ClusterName)
	}
	if strings.ContainsAny(o.Name, " \t\r\n") {
		bad("Name %q: no spaces", o.Name)
	}
	if o.ClusterAddr == "" {
		o.ClusterAddr = ":" + strconv.Itoa(DefaultClusterPort)
	}
	chost, cport, err := parseHostPort(o.ClusterAddr, true)
	if err != nil {
		bad("ClusterAddr %v", err)
	}
	if cport == 0 {
		cport = server.RANDOM_PORT
	}
	if chost == "" {
		chost = "0.0.0.0"
	}
	if o.RouteSecret != "" && (len(o.RouteSecret) < MinRouteSecret || strings.IndexFunc(o.RouteSecret, func(r rune) bool { return r <= ' ' || r > '~' }) >= 0) {
		bad("RouteSecret: want at least %d bytes of printable ASCII without spaces", MinRouteSecret)
	}
	urls, routes, err := routeURLs(o.Routes, o.RouteSecret)
	if err != nil {
		bad("Routes: %v", err)
	}
	opts := &server.Options{
		ServerName: o.Name, NoLog: false, NoSigs: true, JetStream: false,
		Cluster: server.ClusterOpts{Name: o.ClusterName, Host: chost, Port: cport, NoAdvertise: true},
		Routes:  urls,
		// Clients (the replicas of this process) present a token no other
		// process knows: the loopback listener is not a way in.
		Authorization: randomToken(),
	}
	if p := o.ClientPermissions; p != nil {
		// Permissions belong to a user: the token becomes its password.
		opts.Users = []*server.User{{Username: clientUser, Password: opts.Authorization, Permissions: &server.Permissions{
			Publish:   &server.SubjectPermission{Allow: slices.Clone(p.Publish)},
			Subscribe: &server.SubjectPermission{Allow: slices.Clone(p.Subscribe)},
		}}}
		opts.Authorization = ""
	}
	if o.RouteSecret != "" {
		// The user and password make the server ask routes for credentials;
		// routeAuth checks them, counts and logs each refusal.
		opts.Cluster.Username, opts.Cluster.Password = routeUser, o.RouteSecret
	}
	if o.ClientAddr == "" {
		o.ClientAddr = "127.0.0.1:0"
	}
	host, port, err := parseHostPort(o.ClientAddr, true)
	if err == nil && !loopback(host) {
		err = fmt.Errorf("%q is not a loopback address", o.ClientAddr)
	}
	if err != nil {
		bad("ClientAddr %v", err)
	}
	if port == 0 {
		port = server.RANDOM_PORT
	}
	opts.Host, opts.Port = host, port
	switch {
	case o.MaxPayload == 0:
		opts.MaxPayload = DefaultMaxPayload
	case o.MaxPayload < MinMaxPayload || o.MaxPayload > MaxMaxPayload:
		bad("MaxPayload %d: want %d to %d", o.MaxPayload, MinMaxPayload, MaxMaxPayload)
	default:
		opts.MaxPayload = int32(o.MaxPayload)
	}
	if o.StartTimeout < 0 {
		bad("StartTimeout %v is negative", o.StartTimeout)
	}
	if len(probs) > 0 {
		return nil, nil, fmt.Errorf("%w: %s", ErrInvalidServerOptions, strings.Join(probs, "; "))
	}
	return opts, routes, nil
}

func loopback(host string) bool {
	if host == "localhost" {
		return true
	}
	a, err := netip.ParseAddr(host)
	return err == nil && a.IsLoopback()
}

// StartServer validates o, starts the server and returns once its listeners
// are up (the route listener and the loopback client listener), or fails: ErrInvalidServerOptions, or the listener's error (a port
// in use). On error nothing is left running.
func StartServer(o ServerOptions) (*Server, error) {
	opts, routes, err := o.natsOptions()
	if err != nil {
		return nil, err
	}
	logger := o.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	timeout := o.StartTimeout
	if timeout == 0 {
		timeout = DefaultStartTimeout
	}
	var auth *routeAuth
	if o.RouteSecret != "" {
		auth = &routeAuth{user: routeUser, secret: o.RouteSecret, log: logger}
		opts.CustomRouterAuthentication = auth
	}
	ns, err := server.NewServer(opts.Clone())
	if err != nil {
		return nil, fmt.Errorf("natsbus: %w", err)
	}
	sl := &serverLog{log: logger.With("component", "nats-server")}
	ns.SetLoggerV2(sl, false, false, false)
	token := opts.Authorization
	if len(opts.Users) > 0 {
		token = opts.Users[0].Password
	}
	s := &Server{ns: ns, log: sl, base: opts, routes: routes, secret: o.RouteSecret, token: token, auth: auth, user: len(opts.Users) > 0}
	ns.Start()
	if err := s.waitReady(timeout); err != nil {
		ns.Shutdown()
		ns.WaitForShutdown()
		return nil, err
	}
	return s, nil
}

// waitReady polls until the listeners are up, a listener failed (the
// server reports it through Fatalf) or timeout passed.
func (s *Server) waitReady(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for {
		if err := s.log.fatal(); err != nil {
			return fmt.Errorf("natsbus: server: %w", err)
		}
		if s.ns.ClusterAddr() != nil && s.ns.ReadyForConnections(time.Millisecond) {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("natsbus: server not ready after %v", timeout)
		}
		<-tick.C
	}
}

// ClusterAddr is the route listener's address (the port it picked for port
// 0).
func (s *Server) ClusterAddr() *net.TCPAddr { return s.ns.ClusterAddr() }

// ClientURL is the loopback client listener's URL, with the token it asks
// of every client (nats://token@host:port): a secret, not for logs.
func (s *Server) ClientURL() string {
	u, err := url.Parse(s.ns.ClientURL())
	if err != nil {
		return s.ns.ClientURL()
	}
	u.User = url.User(s.token)
	if s.user {
		u.User = url.UserPassword(clientUser, s.token)
	}
	return u.String()
}

// randomToken returns 32 random hex digits.
func randomToken() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// Routes returns the configured routes, sorted (host:port).
func (s *Server) Routes() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.routes)
}

// SetRoutes replaces the configured routes (host:port or
// nats-route://host:port): the server solicits the added ones and closes
// the removed ones, without restarting its listener (a nats-server hot
// reload of cluster.routes; see https://docs.nats.io/reference/config/cluster/routes,
// "Routes are diffed on reload: added ones are solicited and removed ones
// torn down"). A route NATS learned from a peer (the mesh) stays until its
// connection ends. Errors: ErrInvalidServerOptions, the reload's error, or
// ErrServerClosed.
func (s *Server) SetRoutes(routes []string) error {
	urls, norm, err := routeURLs(routes, s.secret)
	if err != nil {
		return fmt.Errorf("%w: %v", ErrInvalidServerOptions, err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return ErrServerClosed
	}
	if slices.Equal(norm, s.routes) {
		return nil
	}
	next := s.base.Clone()
	next.Routes = urls
	// ReloadOptions takes ownership of its argument: it gets a clone, and
	// base keeps the options as they are now.
	if err := s.ns.ReloadOptions(next.Clone()); err != nil {
		return fmt.Errorf("natsbus: reloading routes: %w", err)
	}
	s.base, s.routes = next, norm
	return nil
}

// ErrServerClosed is returned by SetRoutes and Dial after Close.
var ErrServerClosed = errors.New("natsbus: server closed")

// Peers returns the names of the servers this one has a route to, sorted
// (several pooled connections to one server count once).
func (s *Server) Peers() []string {
	rz, err := s.ns.Routez(nil)
	if err != nil {
		return nil
	}
	var names []string
	for _, r := range rz.Routes {
		name := r.RemoteName
		if name == "" {
			name = r.RemoteID
		}
		names = append(names, name)
	}
	slices.Sort(names)
	return slices.Compact(names)
}

// Close shuts the server down (its routes and clients are closed) and waits
// for its goroutines. Idempotent.
func (s *Server) Close() {
	s.mu.Lock()
	s.closed = true
	s.mu.Unlock()
	s.ns.Shutdown()
	s.ns.WaitForShutdown()
}

// serverLog adapts slog to the nats-server's Logger. A Fatalf (a listener
// that could not open) is logged at ERROR and kept: StartServer fails with
// it instead of the process exiting.
type serverLog struct {
	log *slog.Logger
	mu  sync.Mutex
	err error
}

var _ server.Logger = (*serverLog)(nil)

func (l *serverLog) fatal() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.err
}

func (l *serverLog) Noticef(format string, v ...any) { l.log.Info(fmt.Sprintf(format, v...)) }
func (l *serverLog) Warnf(format string, v ...any)   { l.log.Warn(fmt.Sprintf(format, v...)) }
func (l *serverLog) Errorf(format string, v ...any)  { l.log.Error(fmt.Sprintf(format, v...)) }
func (l *serverLog) Debugf(format string, v ...any)  { l.log.Debug(fmt.Sprintf(format, v...)) }
func (l *serverLog) Tracef(format string, v ...any)  { l.log.Debug(fmt.Sprintf(format, v...)) }

func (l *serverLog) Fatalf(format string, v ...any) {
	msg := fmt.Sprintf(format, v...)
	l.log.Error(msg)
	l.mu.Lock()
	if l.err == nil {
		l.err = errors.New(msg)
	}
	l.mu.Unlock()
}

// RefusedRoutes counts the route connections refused for a missing or wrong
// RouteSecret (0 without one).
func (s *Server) RefusedRoutes() uint64 {
	if s.auth == nil {
		return 0
	}
	return s.auth.refused.Load()
}

// routeAuth checks a route's credentials against the secret in constant
// time, and counts and logs (WARN, at most one a second) each refusal.
type routeAuth struct {
	user, secret string
	log          *slog.Logger
	refused      atomic.Uint64
	lastLog      atomic.Int64 // unix nanos of the last refusal logged
}

var _ server.Authentication = (*routeAuth)(nil)

func (a *routeAuth) Check(c server.ClientAuthentication) bool {
	o := c.GetOpts()
	userOK := subtle.ConstantTimeCompare([]byte(o.Username), []byte(a.user)) == 1
	passOK := subtle.ConstantTimeCompare([]byte(o.Password), []byte(a.secret)) == 1
	if userOK && passOK {
		return true
	}
	n := a.refused.Add(1)
	now := time.Now().UnixNano()
	if last := a.lastLog.Load(); now-last >= int64(time.Second) && a.lastLog.CompareAndSwap(last, now) {
		a.log.Warn("natsbus: route refused: wrong or missing route secret", "remote", c.RemoteAddress().String(), "refused", n)
	}
	return false
}
