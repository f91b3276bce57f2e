package main

import (
	"math"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/examples/epp/extproc"
	"github.com/kvselect/kvselect/kvindex/kvevents"
	"github.com/kvselect/kvselect/lifecycle"
	"github.com/kvselect/kvselect/replica"
	"github.com/kvselect/kvselect/roles"
	"github.com/kvselect/kvselect/selection"
	"github.com/kvselect/kvselect/tokenize"
)

// serverMetrics backs the ext_proc server's Recorder with Prometheus.
type serverMetrics struct {
	requests *prometheus.CounterVec
	pick     prometheus.Histogram
	mismatch prometheus.Counter
	inflight prometheus.Gauge
}

var _ extproc.Recorder = (*serverMetrics)(nil)

func newServerMetrics(reg prometheus.Registerer) *serverMetrics {
	m := &serverMetrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvselect_epp_requests_total", Help: "Requests by outcome status (200 routed, else the immediate response; 0 stream ended first).",
		}, []string{"status"}),
		pick: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "kvselect_epp_pick_duration_seconds", Help: "Time to tokenize and select, per request.",
			Buckets: prometheus.ExponentialBuckets(50e-6, 2, 16),
		}),
		mismatch: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvselect_epp_served_endpoint_mismatch_total", Help: "Responses served by another endpoint than the one picked.",
		}),
		inflight: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvselect_epp_inflight_requests", Help: "Requests between headers and routing decision.",
		}),
	}
	reg.MustRegister(m.requests, m.pick, m.mismatch, m.inflight)
	return m
}

func (m *serverMetrics) Outcome(status int)          { m.requests.WithLabelValues(strconv.Itoa(status)).Inc() }
func (m *serverMetrics) PickLatency(d time.Duration) { m.pick.Observe(d.Seconds()) }
func (m *serverMetrics) ServedMismatch()             { m.mismatch.Inc() }
func (m *serverMetrics) Inflight(n int)              { m.inflight.Set(float64(n)) }

// statsCollector reads the selection services, the tokenizer cache and the event
// feed on every scrape: their counters are the source of truth, nothing is
// double-counted here.
type statsCollector struct {
	services func() map[string]*selection.SelectionService // role -> service
	cache    *tokenize.Cache                               // may be nil
	model    string                                        // the loads' partition
}

var (
	descSel = func(name, help string) *prometheus.Desc {
		return prometheus.NewDesc("kvselect_"+name, help, []string{"role"}, nil)
	}
	dSelections = descSel("selections_total", "Workers picked.")
	dBookings   = descSel("bookings_total", "Reservations booked.")
	dFrees      = descSel("frees_total", "Reservations freed by the caller.")
	dExpired    = descSel("reservations_expired_total", "Reservations released by lease expiry (orphans).")
	dDropped    = descSel("reservations_dropped_total", "Reservations released because their worker was removed.")
	dActive     = descSel("reservations_active", "Reservations currently booked.")
	dQueued     = descSel("queue_waits_total", "Requests that waited for capacity.")
	dQueueRej   = descSel("queue_rejections_total", "Requests refused because the queue was full.")
	dWaiting    = descSel("queue_depth", "Requests waiting in admission queues now.")
	dRejected   = descSel("selection_errors_total", "Select calls that failed.")
	dRetries    = descSel("selection_retries_total", "Decisions made again because a concurrent booking reached the chosen worker first.")
	dChosen     = descSel("overlap_chosen_blocks_total", "Device blocks the chosen worker already held, summed over decisions.")
	dBest       = descSel("overlap_best_blocks_total", "Best device overlap any eligible worker had, summed over decisions.")
	dReqBlocks  = descSel("request_blocks_total", "Complete blocks of routed requests.")
	dWorkers    = prometheus.NewDesc("kvselect_workers", "Workers by role and lifecycle.", []string{"role", "lifecycle"}, nil)

	loadLabels    = []string{"role", "worker", "rank"}
	dLoadRequests = prometheus.NewDesc("kvselect_worker_active_requests", "Requests booked on the worker rank now, the EPP's own and its peers' (replicas).", loadLabels, nil)
	dLoadBlocks   = prometheus.NewDesc("kvselect_worker_active_blocks", "Active KV blocks booked on the worker rank now (decode load).", loadLabels, nil)
	dLoadPrefill  = prometheus.NewDesc("kvselect_worker_active_prefill_tokens", "Prefill tokens booked on the worker rank and not prefilled yet.", loadLabels, nil)
	dLoadRate     = prometheus.NewDesc("kvselect_worker_prefill_rate_tokens_per_second", "The worker rank's observed prefill rate (completed prefill tokens over the time it was busy with them), what the predictive cost divides by; 0 until 4 prefills have completed there.", loadLabels, nil)
	dLoadRecent   = prometheus.NewDesc("kvselect_worker_recent_bookings", "Requests booked on the worker rank recently (the EPP's own and its peers'), each decaying over DYN_EPP_BALANCE_WINDOW_SECONDS: what the predictive cost's balance term compares with the mean.", loadLabels, nil)
	dLoadBusy     = prometheus.NewDesc("kvselect_worker_busy", "1 while the worker rank's prefill load is above the queue threshold (requests wait in kvselect_queue_depth when every eligible rank is busy); 0 without queueing.", loadLabels, nil)

	evLabels    = []string{"role", "worker", "rank"}
	dEvApplied  = prometheus.NewDesc("kvselect_kv_events_applied_total", "KV events applied to the index.", evLabels, nil)
	dEvSkipped  = prometheus.NewDesc("kvselect_kv_events_skipped_total", "KV events not applied, by reason (kvevents.SkipReason names; undecodable_batch counts whole batches).", append(evLabels, "reason"), nil)
	dFeedState  = prometheus.NewDesc("kvselect_kv_feed_state", "1 for the feed's current state (healthy, silent, mis-speaking), 0 for the others.", append(evLabels, "state"), nil)
	dFeedTrust  = prometheus.NewDesc("kvselect_kv_feed_trusted", "1 while the worker rank is routed on its KV events, 0 while on its own bookings (feed not trusted).", evLabels, nil)
	dParity     = prometheus.NewDesc("kvselect_kv_token_parity", "Mean share of sampled requests' router blocks the engine then reported holding (1: router and engine tokenise alike).", evLabels, nil)
	dParityN    = prometheus.NewDesc("kvselect_kv_token_parity_samples_total", "Bookings judged by the token-parity check.", evLabels, nil)
	dEvBatches  = prometheus.NewDesc("kvselect_kv_event_batches_total", "KV event batches received live.", evLabels, nil)
	dEvGaps     = prometheus.NewDesc("kvselect_kv_event_gaps_total", "Sequence gaps detected.", evLabels, nil)
	dEvReplays  = prometheus.NewDesc("kvselect_kv_event_replays_total", "Replays by result.", append(evLabels, "result"), nil)
	dEvRestarts = prometheus.NewDesc("kvselect_kv_event_restarts_total", "Engine restarts detected (sequence went back).", evLabels, nil)
	dEvOverflow = prometheus.NewDesc("kvselect_kv_event_overflows_total", "Queue overflows (source cleared and resynchronised).", evLabels, nil)
	dEvDegraded = prometheus.NewDesc("kvselect_kv_event_source_degraded", "1 when batches of the source are known to be missing.", evLabels, nil)
	dEvFrames   = prometheus.NewDesc("kvselect_kv_event_frames_skipped_total", "Messages with a bad frame layout (live or replayed), dropped.", evLabels, nil)
	dEvLost     = prometheus.NewDesc("kvselect_kv_event_batches_lost_total", "Batches known to be missing and not recovered by a replay.", evLabels, nil)
	dEvStale    = prometheus.NewDesc("kvselect_kv_event_batches_stale_total", "Batches dropped because their seq was already applied.", evLabels, nil)
	dEvSuspect  = prometheus.NewDesc("kvselect_kv_event_batches_suspect_total", "Live batches dropped for a seq far beyond the watermark.", evLabels, nil)
	dEvJumps    = prometheus.NewDesc("kvselect_kv_event_jumps_total", "Confirmed sequence jumps (source reset).", evLabels, nil)
	dEvDropped  = prometheus.NewDesc("kvselect_kv_event_batches_dropped_total", "Batches discarded by queue overflows.", evLabels, nil)
	dEvReconn   = prometheus.NewDesc("kvselect_kv_event_reconnects_total", "SUB reconnections after the first connection.", evLabels, nil)
	dEvConn     = prometheus.NewDesc("kvselect_kv_event_source_connected", "1 while the source's SUB socket is connected (or its bind listener serves).", evLabels, nil)
	dRefused    = prometheus.NewDesc("kvselect_kv_event_peers_refused_total", "ZMQ connections or messages the ZMTP guard refused, by reason (bad_greeting, frame_too_large, not_admitted, topic_refused, ...).", []string{"role", "reason"}, nil)
	dWorkerRef  = prometheus.NewDesc("kvselect_workers_refused_total", "Workers discovery offered that the service refused, by reason (too_many_ranks: past the service's bound on data-parallel ranks; invalid).", []string{"role", "reason"}, nil)
	dBindMsgs   = prometheus.NewDesc("kvselect_kv_bind_messages_total", "Messages reaching the bind listener, by result (received, frames_skipped, unattributed).", []string{"role", "endpoint", "result"}, nil)

	dTokHits      = prometheus.NewDesc("kvselect_tokenizer_cache_hits_total", "Tokenizer cache hits.", nil, nil)
	dTokMisses    = prometheus.NewDesc("kvselect_tokenizer_cache_misses_total", "Tokenizer cache misses.", nil, nil)
	dTokCoalesced = prometheus.NewDesc("kvselect_tokenizer_coalesced_total", "Tokenizer calls shared with an identical in-flight call.", nil, nil)
	dTokErrors    = prometheus.NewDesc("kvselect_tokenizer_errors_total", "Tokenizer errors by kind.", []string{"kind"}, nil)
	dTokLatency   = prometheus.NewDesc("kvselect_tokenizer_upstream_seconds", "Tokenizer upstream call latency.", nil, nil)
)

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

func (c *statsCollector) Describe(ch chan<- *prometheus.Desc) { prometheus.DescribeByCollect(c, ch) }

func (c *statsCollector) Collect(ch chan<- prometheus.Metric) {
	counter := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, v, labels...)
	}
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	for role, s := range c.services() {
		st := s.Stats()
		counter(dSelections, float64(st.Selections), role)
		for reason, n := range s.WorkerRefusals() {
			counter(dWorkerRef, float64(n), role, reason)
		}
		counter(dBookings, float64(st.Bookings), role)
		counter(dFrees, float64(st.Frees), role)
		counter(dExpired, float64(st.Expired), role)
		counter(dDropped, float64(st.Dropped), role)
		gauge(dActive, float64(st.Ledger.Active), role)
		counter(dQueued, float64(st.Queued), role)
		counter(dQueueRej, float64(st.QueueRejected), role)
		gauge(dWaiting, float64(st.Waiting), role)
		counter(dRejected, float64(st.Rejected), role)
		counter(dRetries, float64(st.Retries), role)
		counter(dChosen, float64(st.ChosenOverlapBlocks), role)
		counter(dBest, float64(st.BestOverlapBlocks), role)
		counter(dReqBlocks, float64(st.RequestBlocks), role)
		byLife := map[catalog.Lifecycle]int{}
		for _, r := range s.Workers() {
			byLife[r.Lifecycle]++
		}
		for _, l := range []catalog.Lifecycle{catalog.Incomplete, catalog.Schedulable, catalog.Draining} {
			gauge(dWorkers, float64(byLife[l]), role, l.String())
		}
		for _, l := range s.Loads(c.model) {
			lv := []string{role, l.Worker, strconv.Itoa(l.Rank)}
			gauge(dLoadRequests, float64(l.ActiveRequests), lv...)
			gauge(dLoadBlocks, float64(l.ActiveBlocks), lv...)
			gauge(dLoadPrefill, float64(l.ActivePrefillTokens), lv...)
			gauge(dLoadBusy, b2f(l.Busy), lv...)
			gauge(dLoadRate, l.PrefillRate, lv...)
			gauge(dLoadRecent, l.RecentBookings, lv...)
		}
		for _, e := range s.EventStats() {
			lv := []string{role, e.Worker.Worker, strconv.Itoa(e.Worker.Rank)}
			counter(dEvApplied, float64(e.Handler.EventsApplied), lv...)
			for r, n := range e.Handler.Skipped {
				counter(dEvSkipped, float64(n), append(lv, kvevents.SkipReason(r).String())...)
			}
			counter(dEvSkipped, float64(e.Handler.DecodeErrors), append(lv, "undecodable_batch")...)
			counter(dEvBatches, float64(e.Received), lv...)
			counter(dEvGaps, float64(e.Gaps), lv...)
			counter(dEvReplays, float64(e.ReplaysOK), append(lv, "ok")...)
			counter(dEvReplays, float64(e.ReplaysFailed), append(lv, "failed")...)
			counter(dEvRestarts, float64(e.Restarts), lv...)
			counter(dEvOverflow, float64(e.Overflows), lv...)
			d := 0.0
			if e.Degraded {
				d = 1
			}
			gauge(dEvDegraded, d, lv...)
			counter(dEvFrames, float64(e.FramesSkipped), lv...)
			counter(dEvLost, float64(e.LostBatches), lv...)
			counter(dEvStale, float64(e.Stale), lv...)
			counter(dEvSuspect, float64(e.Suspect), lv...)
			counter(dEvJumps, float64(e.Jumps), lv...)
			counter(dEvDropped, float64(e.Dropped), lv...)
			counter(dEvReconn, float64(e.Reconnects), lv...)
			gauge(dEvConn, b2f(e.Connected), lv...)
		}
		for reason, n := range s.EventRefusals() {
			counter(dRefused, float64(n), role, reason)
		}
		for _, b := range s.EventBindStats() {
			counter(dBindMsgs, float64(b.Received), role, b.Endpoint, "received")
			counter(dBindMsgs, float64(b.FramesSkipped), role, b.Endpoint, "frames_skipped")
			counter(dBindMsgs, float64(b.Unattributed), role, b.Endpoint, "unattributed")
		}
		for _, h := range s.FeedHealth() {
			lv := []string{role, h.Worker.Worker, strconv.Itoa(h.Worker.Rank)}
			for _, st := range []selection.FeedState{selection.FeedHealthy, selection.FeedSilent, selection.FeedMisSpeaking} {
				gauge(dFeedState, b2f(h.State == st), append(lv, st.String())...)
			}
			gauge(dFeedTrust, b2f(h.Trusted), lv...)
			if !math.IsNaN(h.Parity) {
				gauge(dParity, h.Parity, lv...)
			}
			counter(dParityN, float64(h.ParitySamples), lv...)
		}
	}
	if c.cache != nil {
		st := c.cache.Stats()
		counter(dTokHits, float64(st.Hits))
		counter(dTokMisses, float64(st.Misses))
		counter(dTokCoalesced, float64(st.Coalesced))
		for kind, v := range map[string]uint64{
			"bad_request": st.Errors.BadRequest, "unavailable": st.Errors.Unavailable, "timeout": st.Errors.Timeout,
			"upstream": st.Errors.Upstream, "canceled": st.Errors.Canceled, "other": st.Errors.Other,
		} {
			counter(dTokErrors, float64(v), kind)
		}
		bounds := tokenize.LatencyBounds()
		buckets := make(map[float64]uint64, len(bounds))
		var cum uint64
		for i, b := range bounds {
			cum += st.Latency.Buckets[i]
			buckets[b.Seconds()] = cum
		}
		ch <- prometheus.MustNewConstHistogram(dTokLatency, st.Latency.Count, st.Latency.Sum.Seconds(), buckets)
	}
}

// replicaCollector reads each role's Replicator on every scrape.
type replicaCollector struct {
	reps map[roles.Role]*replica.Replicator
	// routes lists the servers the embedded NATS server is routed to, and
	// configured the routes it was given (the peers discovery found), and
	// refused counts the routes refused for a wrong or missing secret; nil
	// with an external NATS cluster.
	routes, configured func() []string
	refused            func() uint64
	// refusedReplies counts the snapshot and index requests not answered
	// because their reply subject was not an inbox (natsbus.Bus).
	refusedReplies func() uint64
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

func (c *replicaCollector) Describe(ch chan<- *prometheus.Desc) { prometheus.DescribeByCollect(c, ch) }

func (c *replicaCollector) Collect(ch chan<- prometheus.Metric) {
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

// routerMetrics counts what the router does after a pick: bookings moved to
// the worker that served (or freed), lease renewals. A nil *routerMetrics
// records nothing.
type routerMetrics struct {
	rebookings *prometheus.CounterVec
	failed     *prometheus.CounterVec
	renewed    prometheus.Counter
	stalled    prometheus.Counter
	chunks     prometheus.Counter
}

// Results of a rebooking (kvselect_epp_rebookings_total's result label).
const (
	rebookMoved = "moved" // the booking moved to the served worker
	rebookFreed = "freed" // the served endpoint is no schedulable worker of the role: booking freed
)

func newRouterMetrics(reg prometheus.Registerer) *routerMetrics {
	m := &routerMetrics{
		rebookings: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvselect_epp_rebookings_total",
			Help: "Responses served by another endpoint than the one picked, by what became of their booking (moved to the served worker, or freed when that is no schedulable worker of the destination role).",
		}, []string{"result"}),
		failed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvselect_epp_workers_marked_failed_total",
			Help: "Workers reported failed to the selection service (left out of the picks for DYN_EPP_FAILURE_EJECTION_SECS): a 5xx response (status), or a response served by one of the pick's fallbacks (fallback).",
		}, []string{"cause"}),
		renewed: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvselect_epp_lease_renewals_total", Help: "Plan leases renewed because their response was starting or flowing.",
		}),
		stalled: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvselect_epp_lease_renewal_stalls_total", Help: "Renewal ticks skipped because the plan's response sent nothing since the last tick (a stalled stream expires at its lease).",
		}),
		chunks: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvselect_epp_response_chunks_total", Help: "Response body chunks the EPP followed (ext_proc response body messages with bytes): the progress lease renewal reads, and output growth's input.",
		}),
	}
	for _, r := range []string{rebookMoved, rebookFreed} {
		m.rebookings.WithLabelValues(r) // exported at 0 from the start
	}
	for _, c := range []lifecycle.Cause{lifecycle.CauseStatus, lifecycle.CauseFallback} { // the EPP sees no upstream error: Envoy answers 503
		m.failed.WithLabelValues(c.String())
	}
	reg.MustRegister(m.rebookings, m.failed, m.renewed, m.stalled, m.chunks)
	return m
}

func (m *routerMetrics) markedFailed(cause string) {
	if m != nil {
		m.failed.WithLabelValues(cause).Inc()
	}
}

func (m *routerMetrics) chunk() {
	if m != nil {
		m.chunks.Inc()
	}
}

func (m *routerMetrics) rebooked(result string) {
	if m != nil {
		m.rebookings.WithLabelValues(result).Inc()
	}
}

func (m *routerMetrics) renewals(renewed, stalled int) {
	if m != nil {
		m.renewed.Add(float64(renewed))
		m.stalled.Add(float64(stalled))
	}
}

// decisionMetrics backs each role's selection.Recorder with Prometheus
// histograms of every decision: how much of the best overlap the chosen rank
// had, how much cheaper it was than the next candidate, and how often it
// was decided again.
type decisionMetrics struct {
	overlap *prometheus.HistogramVec
	margin  *prometheus.HistogramVec // Dynamo's cost, in blocks
	marginS *prometheus.HistogramVec // the predictive cost, in seconds
	retries *prometheus.HistogramVec
}

func newDecisionMetrics(reg prometheus.Registerer) *decisionMetrics {
	m := &decisionMetrics{
		overlap: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "kvselect_decision_overlap_ratio",
			Help:    "Device overlap of the chosen rank over the best overlap any eligible rank had (1: the best prefix was taken), per decision with a best overlap above 0.",
			Buckets: []float64{0, 0.25, 0.5, 0.75, 0.9, 0.99, 1},
		}, []string{"role"}),
		margin: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "kvselect_decision_cost_margin_blocks",
			Help:    "How much cheaper, in cost units (KV-block equivalents), the chosen rank was than the next-cheapest candidate, under Dynamo's cost (DYN_EPP_COST=dynamo, or auto on a large model; 0: alone or tied; negative: chosen by a session pin or a temperature draw).",
			Buckets: []float64{-64, -8, -1, 0, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256},
		}, []string{"role"}),
		marginS: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "kvselect_decision_cost_margin_seconds",
			Help:    "How much cheaper, in predicted seconds, the chosen rank was than the next-cheapest candidate, under the predictive cost (DYN_EPP_COST=predictive, or auto on a model it predicts for; 0: alone or tied; negative: chosen by a session pin or a temperature draw).",
			Buckets: []float64{-1, -0.1, -0.01, 0, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5},
		}, []string{"role"}),
		retries: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "kvselect_decision_retries",
			Help:    "Times a decision was made again because a concurrent booking reached the chosen rank first (_sum: all retries).",
			Buckets: []float64{0, 1, 2, 4, 8},
		}, []string{"role"}),
	}
	reg.MustRegister(m.overlap, m.margin, m.marginS, m.retries)
	return m
}

// forRole returns the Recorder of one role's service, which observes each
// decision's margin in the histogram of its unit (Decision.Predicted).
func (m *decisionMetrics) forRole(role string) selection.Recorder {
	return roleRecorder{overlap: m.overlap.WithLabelValues(role), margin: m.margin.WithLabelValues(role),
		seconds: m.marginS.WithLabelValues(role), retries: m.retries.WithLabelValues(role)}
}

type roleRecorder struct {
	overlap, margin, seconds, retries prometheus.Observer
}

func (r roleRecorder) Selected(_ string, d selection.Decision) {
	if d.BestOverlapBlocks > 0 {
		r.overlap.Observe(float64(d.ChosenOverlapBlocks) / float64(d.BestOverlapBlocks))
	}
	if d.Predicted {
		r.seconds.Observe(d.Margin)
	} else {
		r.margin.Observe(d.Margin)
	}
	r.retries.Observe(float64(d.Retries))
}

// Rejected records nothing: kvselect_selection_errors_total counts them.
func (roleRecorder) Rejected(string, error) {}
