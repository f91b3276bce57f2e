package kvevents

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"sync"

	"github.com/kvselect/kvselect/catalog"
)

// Errors of Peers' checks. The bind listener counts the first as
// not_admitted and the others as topic_refused.
var (
	ErrNotWorker      = errors.New("kvevents: peer is at no worker's address")
	ErrTopicNotPeer   = errors.New("kvevents: topic names another worker than the sender")
	ErrTopicAmbiguous = errors.New("kvevents: topic names a host several workers share")
	ErrTopicUnknown   = errors.New("kvevents: topic names no known worker")
)

// Peers attributes what reaches a bind listener to known workers, for
// engines that dial out: a worker is known by the host, and the host:port,
// of its endpoint. Its Attribute, Admit and Peer methods are a
// BindConfig's; Add and Remove follow the catalog. The zero value is ready;
// it is safe for concurrent use (one RWMutex: reads for every new topic and
// connection, writes when a worker changes).
type Peers struct {
	mu       sync.RWMutex
	byHost   map[string]map[string]struct{} // host, and host:port -> worker ids
	endpoint map[string]string              // worker id -> its endpoint
}

// hostKeys are the keys a worker endpoint is found by from a topic: its host
// and its host:port.
func hostKeys(endpoint string) []string {
	host, _, err := net.SplitHostPort(endpoint)
	if err != nil {
		return nil
	}
	return []string{host, endpoint}
}

// Add records worker id at endpoint (host:port), replacing what id had.
func (p *Peers) Add(id, endpoint string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.removeLocked(id)
	if p.byHost == nil {
		p.byHost, p.endpoint = map[string]map[string]struct{}{}, map[string]string{}
	}
	p.endpoint[id] = endpoint
	for _, k := range hostKeys(endpoint) {
		ids := p.byHost[k]
		if ids == nil {
			ids = map[string]struct{}{}
			p.byHost[k] = ids
		}
		ids[id] = struct{}{}
	}
}

// Remove forgets worker id.
func (p *Peers) Remove(id string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.removeLocked(id)
}

func (p *Peers) removeLocked(id string) {
	ep, ok := p.endpoint[id]
	if !ok {
		return
	}
	delete(p.endpoint, id)
	for _, k := range hostKeys(ep) {
		if ids := p.byHost[k]; ids != nil {
			delete(ids, id)
			if len(ids) == 0 {
				delete(p.byHost, k)
			}
		}
	}
}

// workerLocked returns the one worker a topic kv@<host>[:port]@<model>
// names (TopicWorker). p.mu is held for reading.
func (p *Peers) workerLocked(topic string) (string, error) {
	wr, ok := TopicWorker(topic)
	if !ok {
		return "", fmt.Errorf("%w: %q", ErrTopicUnknown, topic)
	}
	ids := p.byHost[wr.WorkerID]
	switch len(ids) {
	case 0:
		return "", fmt.Errorf("%w: %q", ErrTopicUnknown, topic)
	case 1:
		for id := range ids {
			return id, nil
		}
	}
	return "", fmt.Errorf("%w: %q (%d workers)", ErrTopicAmbiguous, topic, len(ids))
}

// Attribute is the one worker (rank 0) the topic names; unknown and
// ambiguous topics are false.
func (p *Peers) Attribute(topic string) (catalog.WorkerRank, bool) {
	p.mu.RLock()
	defer p.mu.RUnlock()
	id, err := p.workerLocked(topic)
	return catalog.WorkerRank{WorkerID: id}, err == nil
}

// Admit admits a connection only from the IP address of a known worker's
// endpoint.
func (p *Peers) Admit(peer net.IP) error {
	if peer == nil {
		return ErrNotWorker
	}
	p.mu.RLock()
	defer p.mu.RUnlock()
	if len(p.byHost[peer.String()]) > 0 {
		return nil
	}
	return fmt.Errorf("%w: %s", ErrNotWorker, peer)
}

// Peer takes a message only when its topic names the worker at the
// sender's address.
func (p *Peers) Peer(peer net.IP, topic string) error {
	p.mu.RLock()
	defer p.mu.RUnlock()
	id, err := p.workerLocked(topic)
	if err != nil {
		return err
	}
	host, _, err := net.SplitHostPort(p.endpoint[id])
	if err != nil || peer == nil || !sameHost(host, peer) {
		return fmt.Errorf("%w: %q from %v", ErrTopicNotPeer, topic, peer)
	}
	return nil
}

// sameHost reports whether an endpoint's host is the IP address peer.
func sameHost(host string, peer net.IP) bool {
	ip, err := netip.ParseAddr(host)
	if err != nil {
		return false
	}
	pa, ok := netip.AddrFromSlice(peer)
	return ok && ip.Unmap() == pa.Unmap()
}

// OffsetPort adds off to the port of a tcp://host:port endpoint, as vLLM
// offsets every data-parallel rank's ports from the first rank's; other
// endpoints are returned unchanged for offset 0 and "" otherwise, as is a
// port past 65535.
func OffsetPort(ep string, off int) string {
	if ep == "" || off == 0 {
		return ep
	}
	const scheme = "tcp://"
	if len(ep) <= len(scheme) || ep[:len(scheme)] != scheme {
		return ""
	}
	host, port, err := net.SplitHostPort(ep[len(scheme):])
	if err != nil {
		return ""
	}
	n, err := strconv.Atoi(port)
	if err != nil || n+off > 65535 || n+off < 0 {
		return ""
	}
	return scheme + net.JoinHostPort(host, strconv.Itoa(n+off))
}
