package prommetrics

import (
	"errors"
	"fmt"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvselect/kvselect/replica"
	"github.com/kvselect/kvselect/roles"
)

// ReplicaOptions configure a ReplicaCollector.
type ReplicaOptions struct {
	// Replicators are the replicas of each role. Required: at least one,
	// none nil.
	Replicators map[roles.Role]*replica.Replicator
	// Routes lists the servers an embedded NATS server is routed to,
	// Configured the routes it was given (the peers discovery found), and
	// RefusedRoutes counts the routes it refused for a wrong or missing
	// secret (natsbus.Server's Peers, Routes and RefusedRoutes): all three
	// or none (an external NATS cluster).
	Routes, Configured func() []string
	RefusedRoutes      func() uint64
	// RefusedReplies counts the snapshot and index requests not answered
	// because their reply subject was not an inbox (natsbus.Bus's
	// RefusedReplies); nil exports no such series.
	RefusedReplies func() uint64
}

// ReplicaCollector reads each role's Replicator, and the NATS link, on
// every scrape. Create it with NewReplicaCollector and register it in the
// EPP's registry.
type ReplicaCollector struct {
	reps               map[roles.Role]*replica.Replicator
	routes, configured func() []string // nil with an external NATS cluster
	refused            func() uint64
	refusedReplies     func() uint64
}

var _ prometheus.Collector = (*ReplicaCollector)(nil)

// NewReplicaCollector returns the collector of o's replicas.
func NewReplicaCollector(o ReplicaOptions) (*ReplicaCollector, error) {
	if len(o.Replicators) == 0 {
		return nil, errors.New("prommetrics: a ReplicaCollector needs at least one Replicator")
	}
	reps := make(map[roles.Role]*replica.Replicator, len(o.Replicators))
	for r, rep := range o.Replicators {
		if rep == nil {
			return nil, fmt.Errorf("prommetrics: the %v Replicator is nil", r)
		}
		reps[r] = rep
	}
	if set := o.Routes != nil; set != (o.Configured != nil) || set != (o.RefusedRoutes != nil) {
		return nil, errors.New("prommetrics: set Routes, Configured and RefusedRoutes together, or none of them")
	}
	return &ReplicaCollector{reps: reps, routes: o.Routes, configured: o.Configured, refused: o.RefusedRoutes,
		refusedReplies: o.RefusedReplies}, nil
}

var (
	descRep = func(name, help string, extra ...string) *prometheus.Desc {
		return prometheus.NewDesc("kvselect_replica_"+name, help, append([]string{"role"}, extra...), nil)
	}
	dRepDegraded    = descRep("degraded", "1 while the NATS connection is lost: the replica routes on what it holds and resynchronises when it is back.")
	dRepSynced      = descRep("synced", "1 once the initial sync is done (readiness waits for it).")
	dRepPeers       = descRep("peers", "Peer replicas followed now.")
	dRepRemote      = descRep("remote_bookings", "Peers' bookings held in this replica's service now.")
	dRepLocal       = descRep("local_bookings", "This replica's own live bookings, shared with its peers.")
	dRepRefused     = descRep("refused_total", "Peers' ops and messages not applied, by reason (replica.RefusalReasons: not_found, unknown_id, expired, invalid, closed, malformed, stale_epoch, too_many_peers, implausible_seq, implausible_epoch, peer_full, origin_mismatch).", "reason")
	dRepBackoffs    = descRep("repair_backoffs_total", "Repairs of a peer delayed because its repairs followed each other (a stream claiming batches it never sends).")
	dRepMaxMessage  = descRep("max_message_bytes", "The bound on the messages this replica sends now: the NATS server's max_payload, read on every (re)connection.")
	dRepOverflow    = descRep("overflow_total", "Own ops dropped from the stream because the publisher fell behind (peers resynchronise by snapshot).")
	dRepDuplicates  = descRep("duplicates_total", "Peers' bookings received again while already held (a replay over a snapshot): expected.")
	dRepBatches     = descRep("published_batches_total", "Batches of own ops published (heartbeats excluded).")
	dRepOps         = descRep("published_ops_total", "Own ops published.")
	dRepPubErrors   = descRep("publish_errors_total", "Publishes the bus refused.")
	dRepReceived    = descRep("received_total", "Peers' messages received (batches and heartbeats).")
	dRepApplied     = descRep("applied_total", "Peers' ops applied.")
	dRepGaps        = descRep("gaps_total", "Sequence gaps seen in peers' streams (each repaired by a snapshot).")
	dRepSnapshots   = descRep("snapshots_taken_total", "Peers' snapshots applied.")
	dRepSnapFailed  = descRep("snapshot_failures_total", "Snapshot requests that failed (retried).")
	dRepDropped     = descRep("dropped_peers_total", "Peers whose bookings were dropped after PeerTimeout of silence.")
	dRepDisconnects = descRep("disconnects_total", "NATS connection losses.")
	dRepUnsendable  = descRep("unsendable_total", "Own bookings too large for one message, not shared.")
	dRepClashes     = descRep("id_clashes_total", "Messages from another replica using this replica's ID.")
	dRepRoutes      = prometheus.NewDesc("kvselect_replica_nats_routes", "Peer NATS servers the embedded server has a route to now.", nil, nil)
	dRouteRefused   = prometheus.NewDesc("kvselect_replica_nats_routes_refused_total", "Route connections the embedded server refused for a wrong or missing DYN_EPP_REPLICA_SYNC_SECRET.", nil, nil)
	dRepReplies     = prometheus.NewDesc("kvselect_replica_nats_refused_replies_total", "Snapshot and index requests not answered because their reply subject was not an inbox (a request that would reflect a page onto another subject).", nil, nil)
	dRepConfigured  = prometheus.NewDesc("kvselect_replica_nats_routes_configured", "Routes the embedded server is given (DYN_EPP_PEERS, or the peers DYN_EPP_PEER_SERVICE finds); more than kvselect_replica_nats_routes means peers not reached.", nil, nil)
)

// Describe sends the descriptors of every series Collect may send.
func (c *ReplicaCollector) Describe(ch chan<- *prometheus.Desc) { prometheus.DescribeByCollect(c, ch) }

// Collect reads the Replicators and the link and sends their series.
func (c *ReplicaCollector) Collect(ch chan<- prometheus.Metric) {
	if c.routes != nil {
		ch <- prometheus.MustNewConstMetric(dRepRoutes, prometheus.GaugeValue, float64(len(c.routes())))
		ch <- prometheus.MustNewConstMetric(dRepConfigured, prometheus.GaugeValue, float64(len(c.configured())))
		ch <- prometheus.MustNewConstMetric(dRouteRefused, prometheus.CounterValue, float64(c.refused()))
	}
	if c.refusedReplies != nil {
		ch <- prometheus.MustNewConstMetric(dRepReplies, prometheus.CounterValue, float64(c.refusedReplies()))
	}
	for r, rep := range c.reps {
		role := r.String()
		st := rep.Stats()
		gauge := func(d *prometheus.Desc, v float64, extra ...string) {
			ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, append([]string{role}, extra...)...)
		}
		counter := func(d *prometheus.Desc, v uint64, extra ...string) {
			ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), append([]string{role}, extra...)...)
		}
		gauge(dRepDegraded, b2f(st.Degraded))
		gauge(dRepSynced, b2f(st.Synced))
		gauge(dRepPeers, float64(st.Peers))
		gauge(dRepRemote, float64(st.RemoteBookings))
		gauge(dRepLocal, float64(st.LocalBookings))
		for _, reason := range replica.RefusalReasons() {
			counter(dRepRefused, st.Refused[reason], reason)
		}
		counter(dRepBackoffs, st.RepairBackoffs)
		gauge(dRepMaxMessage, float64(st.MaxMessageBytes))
		counter(dRepOverflow, st.Overflow)
		counter(dRepDuplicates, st.Duplicates)
		counter(dRepBatches, st.PublishedBatches)
		counter(dRepOps, st.PublishedOps)
		counter(dRepPubErrors, st.PublishErrors)
		counter(dRepReceived, st.Received)
		counter(dRepApplied, st.Applied)
		counter(dRepGaps, st.Gaps)
		counter(dRepSnapshots, st.SnapshotsTaken)
		counter(dRepSnapFailed, st.SnapshotFailures)
		counter(dRepDropped, st.DroppedPeers)
		counter(dRepDisconnects, st.Disconnects)
		counter(dRepUnsendable, st.Unsendable)
		counter(dRepClashes, st.IDClashes)
	}
}
