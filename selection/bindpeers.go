package selection

import (
	"errors"
	"fmt"
	"net"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/kvindex/kvevents"
)

// Errors of the bind listener's peer checks (counted by the feed as
// not_admitted and topic_refused).
var (
	errNotWorker      = errors.New("selection: peer is at no worker's address")
	errTopicNotPeer   = errors.New("selection: topic names another worker than the sender")
	errTopicAmbiguous = errors.New("selection: topic names a host several workers share")
	errTopicUnknown   = errors.New("selection: topic names no known worker")
)

// hostKeys are the keys a worker endpoint is found by from a topic: its host and
// its host:port.
func hostKeys(endpoint string) []string {
	host, _, err := net.SplitHostPort(endpoint)
	if err != nil {
		return nil
	}
	return []string{host, endpoint}
}

// mapHostLocked records w's endpoint for topic attribution. s.mu is held.
func (s *SelectionService) mapHostLocked(w catalog.Worker) {
	for _, k := range hostKeys(w.Endpoint) {
		ids := s.byHost[k]
		if ids == nil {
			ids = map[string]struct{}{}
			s.byHost[k] = ids
		}
		ids[w.ID] = struct{}{}
	}
}

// unmapHostLocked forgets w's endpoint. s.mu is held.
func (s *SelectionService) unmapHostLocked(w catalog.Worker) {
	for _, k := range hostKeys(w.Endpoint) {
		if ids := s.byHost[k]; ids != nil {
			delete(ids, w.ID)
			if len(ids) == 0 {
				delete(s.byHost, k)
			}
		}
	}
}

// topicWorkerLocked returns the one worker a topic kv@<host>[:port]@<model>
// names. s.mu is held for reading.
func (s *SelectionService) topicWorkerLocked(topic string) (string, error) {
	wr, ok := kvevents.TopicWorker(topic)
	if !ok {
		return "", fmt.Errorf("%w: %q", errTopicUnknown, topic)
	}
	ids := s.byHost[wr.Worker]
	switch len(ids) {
	case 0:
		return "", fmt.Errorf("%w: %q", errTopicUnknown, topic)
	case 1:
		for id := range ids {
			return id, nil
		}
	}
	return "", fmt.Errorf("%w: %q (%d workers)", errTopicAmbiguous, topic, len(ids))
}

// attributeTopic is the bind listener's attribution: the one worker the topic
// names. Unknown and ambiguous topics are refused (counted by the feed).
func (s *SelectionService) attributeTopic(topic string) (catalog.WorkerRank, bool) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	id, err := s.topicWorkerLocked(topic)
	return catalog.WorkerRank{Worker: id}, err == nil
}

// admitPeer admits a connection to the bind listener only from the IP address
// of a known worker's endpoint.
func (s *SelectionService) admitPeer(peer net.IP) error {
	if peer == nil {
		return errNotWorker
	}
	s.mu.RLock()
	defer s.mu.RUnlock()
	if len(s.byHost[peer.String()]) > 0 {
		return nil
	}
	return fmt.Errorf("%w: %s", errNotWorker, peer)
}

// peerTopic takes a message only when its topic names the worker at the
// sender's address.
func (s *SelectionService) peerTopic(peer net.IP, topic string) error {
	s.mu.RLock()
	defer s.mu.RUnlock()
	id, err := s.topicWorkerLocked(topic)
	if err != nil {
		return err
	}
	rec, ok := s.cat.Get(id)
	if !ok {
		return fmt.Errorf("%w: %q", errTopicUnknown, topic)
	}
	if host, _, err := net.SplitHostPort(rec.Worker.Endpoint); err != nil || peer == nil || !sameHost(host, peer) {
		return fmt.Errorf("%w: %q from %v", errTopicNotPeer, topic, peer)
	}
	return nil
}

// sameHost reports whether an endpoint's host is the IP address peer.
func sameHost(host string, peer net.IP) bool {
	ip := net.ParseIP(host)
	return ip != nil && ip.Equal(peer)
}

// EventRefusals returns how many peers or messages the event feed's ZMTP
// guards refused, by reason (bad_greeting, frame_too_large, not_admitted,
// topic_refused, ...); nil without the built-in feed.
func (s *SelectionService) EventRefusals() map[string]uint64 {
	if s.feed == nil {
		return nil
	}
	return s.feed.Refused()
}
