package kvevents

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"math/rand/v2"
	"net"
	"strconv"
	"strings"
	"time"

	"github.com/go-zeromq/zmq4"
)

// discardLog silences go-zeromq's own logger; the feed reports through its counters
// and FeedOptions.Logger.
var discardLog = log.New(io.Discard, "", 0)

// socketOptions are the go-zeromq options of every socket the feed opens: a single
// dial attempt (the feed runs its own backoff loop), a bounded TCP connect time and no
// library logging.
func (f *Feed) socketOptions() []zmq4.Option {
	return []zmq4.Option{
		zmq4.WithDialerMaxRetries(0),
		zmq4.WithDialerTimeout(f.opts.dialTimeout),
		zmq4.WithLogger(discardLog),
	}
}

// closeSocket closes a go-zeromq socket and lets its connection readers finish.
// go-zeromq's per-connection reader goroutine hands each message to a small buffered
// channel without watching the socket's context; one that is blocked on a full channel
// when the socket closes would never exit. Receiving after Close frees the channel: the
// socket's context is cancelled, so Recv returns at once, either a leftover message or
// the context error (chosen at random by select when both are ready). A run of
// consecutive context errors means the channel is empty.
func closeSocket(s zmq4.Socket) {
	_ = s.Close()
	const quietRuns = 64
	for misses := 0; misses < quietRuns; {
		_, err := s.Recv()
		if err != nil && (errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)) {
			misses++
			continue
		}
		misses = 0
	}
}

// backoff yields exponentially growing delays between min and max with jitter in
// [d/2, d], so that many sources losing the same network do not redial in lockstep.
type backoff struct {
	min, max, cur time.Duration
}

func (f *Feed) newBackoff() *backoff {
	return &backoff{min: f.opts.ReconnectMin, max: f.opts.ReconnectMax}
}

func (b *backoff) reset() { b.cur = 0 }

func (b *backoff) next() time.Duration {
	switch {
	case b.cur == 0:
		b.cur = b.min
	case b.cur < b.max:
		b.cur = min(2*b.cur, b.max)
	}
	half := b.cur / 2
	if half <= 0 {
		return b.cur
	}
	return half + rand.N(b.cur-half+1)
}

// sleep waits for d or until ctx is done; it reports whether the full delay elapsed.
func (f *Feed) sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

func (f *Feed) logf(format string, args ...any) {
	if f.opts.Logger != nil {
		f.opts.Logger.Info(fmt.Sprintf(format, args...))
	}
}

// debugf is logf at debug level, for repeats of a condition already reported.
func (f *Feed) debugf(format string, args ...any) {
	if f.opts.Logger != nil {
		f.opts.Logger.Debug(fmt.Sprintf(format, args...))
	}
}

// validateEndpoint checks a ZeroMQ endpoint the feed will use: "tcp://host:port" or
// "ipc://path". A dial endpoint needs a concrete host and a port in 1-65535; a bind
// endpoint may use "*" or an empty host (all interfaces) and port 0 (any free port).
func validateEndpoint(ep string, bind bool) error {
	scheme, addr, ok := strings.Cut(ep, "://")
	if !ok {
		return fmt.Errorf("%q: want tcp://host:port or ipc://path", ep)
	}
	switch scheme {
	case "ipc":
		if addr == "" {
			return fmt.Errorf("%q: empty ipc path", ep)
		}
		return nil
	case "tcp":
	default:
		return fmt.Errorf("%q: unsupported transport %q (want tcp or ipc)", ep, scheme)
	}
	host, portStr, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("%q: %w", ep, err)
	}
	port, err := strconv.ParseUint(portStr, 10, 16)
	if err != nil {
		return fmt.Errorf("%q: bad port %q", ep, portStr)
	}
	if bind {
		return nil
	}
	if host == "" || host == "*" {
		return fmt.Errorf("%q: a dial endpoint needs a host", ep)
	}
	if port == 0 {
		return fmt.Errorf("%q: a dial endpoint needs a port in 1-65535", ep)
	}
	return nil
}

// joinErrs is errors.Join that returns a plain nil for no errors.
func joinErrs(errs []error) error {
	if len(errs) == 0 {
		return nil
	}
	return errors.Join(errs...)
}
