package kvevents

import (
	"net"
	"strings"
	"sync"
	"time"

	"github.com/kvselect/kvselect/kvindex/kvevents/internal/zmtpguard"
)

// guardLimits are the ZMTP guard's limits for this feed's connections.
func (f *Feed) guardLimits() zmtpguard.Limits {
	return zmtpguard.Limits{
		MaxFrame:         f.opts.maxFrameBytes,
		HandshakeTimeout: f.opts.handshakeTimeout,
		MaxConns:         f.opts.maxPeers,
	}
}

// dialEndpoint maps a validated tcp:// endpoint to the guarded transport;
// others (ipc://) are dialed as they are.
func (f *Feed) dialEndpoint(ep string) string {
	if strings.HasPrefix(ep, "tcp://") {
		return f.guard.Endpoint(ep)
	}
	return ep
}

// refusalWarnInterval is the least time between two log lines for one reason.
const refusalWarnInterval = time.Minute

// refused is the guards' Policy.Refused (they count): warn at most once a
// minute per reason.
func (f *Feed) refused(r zmtpguard.Reason, remote net.Addr, err error) {
	peer := ""
	if remote != nil {
		peer = remote.String()
	}
	f.notice("refused:"+r.String(), "kvevents: refused a ZMQ peer (further ones for this reason are only counted for a minute)",
		"reason", r.String(), "peer", peer, "error", err)
}

// notices limits the feed's warnings about dropped messages to one per kind a
// minute.
type notices struct {
	mu   sync.Mutex
	last map[string]time.Time
}

// drop logs, at most once a minute per kind, that messages of kind were
// dropped (they are counted in Stats or BindStats either way).
func (f *Feed) drop(kind, where string, args ...any) {
	f.notice(kind, "kvevents: dropped a message (further ones of this kind are only counted for a minute)",
		append([]any{"kind", kind, "at", where}, args...)...)
}

// notice logs msg as a warning, at most once a minute per kind.
func (f *Feed) notice(kind, msg string, args ...any) {
	if f.opts.Logger == nil {
		return
	}
	now := time.Now()
	f.notices.mu.Lock()
	if f.notices.last == nil {
		f.notices.last = map[string]time.Time{}
	}
	warn := now.Sub(f.notices.last[kind]) >= refusalWarnInterval
	if warn {
		f.notices.last[kind] = now
	}
	f.notices.mu.Unlock()
	if warn {
		f.opts.Logger.Warn(msg, args...)
	}
}

// Refused returns how many connections or messages the feed's ZMTP guards
// refused, by reason name (see the guard's reasons: bad_greeting,
// frame_too_large, not_admitted, topic_refused, ...); only non-zero ones.
func (f *Feed) Refused() map[string]uint64 {
	guards := []*zmtpguard.Transport{f.guard}
	f.mu.Lock()
	for _, b := range f.binds {
		if b.guard != nil {
			guards = append(guards, b.guard)
		}
	}
	f.mu.Unlock()
	out := map[string]uint64{}
	for _, g := range guards {
		for r, n := range g.Stats().Refused {
			out[r.String()] += n
		}
	}
	return out
}
