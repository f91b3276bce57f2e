package selection

// Reservations is the by-id side of a SelectionService's bookings, for a
// caller that carries reservation ids rather than a Booking (a pair
// booker's legs, a test with a fake clock): the same settles a Booking
// makes, addressed by id. Get it with SelectionService.Reservations; it is
// a view, safe for concurrent use, valid until Close.
type Reservations struct{ s *SelectionService }

// Reservations returns the by-id view of the service's bookings.
func (s *SelectionService) Reservations() Reservations { return Reservations{s} }

// Workers is the fleet side of a SelectionService: the workers it routes
// to, as a discovery loop or an operator changes them, and the failures a
// request path reports. Get it with SelectionService.Workers; it is a view,
// safe for concurrent use, valid until Close.
type Workers struct{ s *SelectionService }

// Workers returns the fleet view of the service.
func (s *SelectionService) Workers() Workers { return Workers{s} }

// EventPlane is the KV-event side of a SelectionService: events applied by
// hand, the feed's sources, bind listener and health, and the index
// snapshot a starting replica warms from. Get it with
// SelectionService.Events; it is a view, safe for concurrent use, valid
// until Close.
type EventPlane struct{ s *SelectionService }

// Events returns the event-plane view of the service.
func (s *SelectionService) Events() EventPlane { return EventPlane{s} }

// ReplicaPlane is what package replica needs of a SelectionService to share
// its bookings with its peers: their bookings booked and settled here, and
// the lease bound that clamps them. Get it with SelectionService.Replicas;
// it is a view, safe for concurrent use, valid until Close.
type ReplicaPlane struct{ s *SelectionService }

// Replicas returns the replica-plane view of the service.
func (s *SelectionService) Replicas() ReplicaPlane { return ReplicaPlane{s} }

// Refusals returns how many peers or messages the event feed's ZMTP
// guards refused, by reason (bad_greeting, frame_too_large, not_admitted,
// topic_refused, ...); nil without the built-in feed.
func (view EventPlane) Refusals() map[string]uint64 {
	s := view.s
	if s.feed == nil {
		return nil
	}
	return s.feed.Refused()
}
