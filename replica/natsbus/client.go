package natsbus

import (
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
)

// DialOptions configure Dial and Server.Dial. The zero value is valid.
type DialOptions struct {
	// Name names the connection on the server (give it the replica ID).
	Name string
	// ReconnectWait is the pause between reconnection attempts; the client
	// never gives up. Default 250 ms.
	ReconnectWait time.Duration
	// PingInterval is how often the client pings the server: a dead link is
	// noticed within two pings. Default 5 s.
	PingInterval time.Duration
	// Logger receives the client's asynchronous errors (a slow consumer)
	// at WARN. Default: discard.
	Logger *slog.Logger
}

func (o DialOptions) natsOptions() ([]nats.Option, error) {
	if o.ReconnectWait < 0 || o.PingInterval < 0 {
		return nil, fmt.Errorf("natsbus: invalid dial options: negative ReconnectWait %v or PingInterval %v", o.ReconnectWait, o.PingInterval)
	}
	if o.ReconnectWait == 0 {
		o.ReconnectWait = 250 * time.Millisecond
	}
	if o.PingInterval == 0 {
		o.PingInterval = 5 * time.Second
	}
	log := o.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	opts := []nats.Option{
		nats.MaxReconnects(-1), // never give up: the Replicator resyncs on return
		nats.ReconnectWait(o.ReconnectWait),
		nats.PingInterval(o.PingInterval),
		nats.NoCallbacksAfterClientClose(),
		nats.ErrorHandler(func(_ *nats.Conn, sub *nats.Subscription, err error) {
			subject := ""
			if sub != nil {
				subject = sub.Subject
			}
			log.Warn("nats client error", "subject", subject, "err", err)
		}),
	}
	if o.Name != "" {
		opts = append(opts, nats.Name(o.Name))
	}
	return opts, nil
}

// Client is a NATS connection made for replicas, and the Bus over it. Unlike
// a Bus made with New, it owns its connection: Close closes it. It is safe
// for concurrent use.
type Client struct {
	nc  *nats.Conn
	bus *Bus
}

// Dial connects to the NATS servers of urls (comma-separated nats:// or
// tls:// URLs, credentials in the URL when the servers want them). When none
// answers yet, it still returns a Client, which keeps trying: the
// Replicator over it starts degraded (see replica.ConnWatcher) and
// resynchronises once connected. Errors: an invalid URL or options.
func Dial(urls string, o DialOptions) (*Client, error) {
	if err := checkURLs(urls); err != nil {
		return nil, err
	}
	opts, err := o.natsOptions()
	if err != nil {
		return nil, err
	}
	nc, err := nats.Connect(urls, append(opts, nats.RetryOnFailedConnect(true))...)
	if err != nil {
		return nil, fmt.Errorf("natsbus: connect: %w", err)
	}
	return &Client{nc: nc, bus: &Bus{nc: nc, logger: o.Logger}}, nil
}

// checkURLs validates a comma-separated list of NATS server URLs.
func checkURLs(urls string) error {
	if strings.TrimSpace(urls) == "" {
		return errors.New("natsbus: no NATS URL")
	}
	for raw := range strings.SplitSeq(urls, ",") {
		u, err := url.Parse(strings.TrimSpace(raw))
		if err != nil || u.Host == "" {
			return fmt.Errorf("natsbus: %q is not a NATS URL (nats://host:port)", raw)
		}
		switch u.Scheme {
		case "nats", "tls", "ws", "wss":
		default:
			return fmt.Errorf("natsbus: %q: scheme %q, want nats, tls, ws or wss", raw, u.Scheme)
		}
	}
	return nil
}

// Dial connects to s in process (no socket: nats.InProcessServer). Errors:
// ErrServerClosed, the client's.
func (s *Server) Dial(o DialOptions) (*Client, error) {
	s.mu.Lock()
	closed := s.closed
	s.mu.Unlock()
	if closed {
		return nil, ErrServerClosed
	}
	opts, err := o.natsOptions()
	if err != nil {
		return nil, err
	}
	auth := nats.Token(s.token)
	if s.user {
		auth = nats.UserInfo(clientUser, s.token)
	}
	nc, err := nats.Connect("", append(opts, nats.InProcessServer(s.ns), auth)...)
	if err != nil {
		return nil, fmt.Errorf("natsbus: in-process connect: %w", err)
	}
	return &Client{nc: nc, bus: &Bus{nc: nc, logger: o.Logger}}, nil
}

// Bus is the Bus over the client's connection.
func (c *Client) Bus() *Bus { return c.bus }

// MaxPayload is the server's max_payload, the bound for
// replica.Options.MaxMessageBytes; 0 until the client has connected once.
func (c *Client) MaxPayload() int { return int(c.nc.MaxPayload()) }

// Connected reports whether the connection is up.
func (c *Client) Connected() bool { return c.nc.IsConnected() }

// Close closes the connection (after the Replicators over it are closed).
// Idempotent.
func (c *Client) Close() { c.nc.Close() }
