package prommetrics

import (
	"errors"
	"fmt"
	"math"
	"strconv"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/kvindex/kvevents"
	"github.com/kvselect/kvselect/selection"
	"github.com/kvselect/kvselect/tokenize"
)

// ServiceOptions configure a ServiceCollector.
type ServiceOptions struct {
	// Services are the selection services by role name ("aggregated", or
	// "prefill" and "decode"); the role is every series' role label.
	// Required: at least one, none nil.
	Services map[string]*selection.SelectionService
	// Cache is the tokenizer cache whose counters are exported; nil exports
	// no kvselect_tokenizer_* series.
	Cache *tokenize.Cache
	// Model is the partition whose per-rank loads are exported.
	Model string
}

// ServiceCollector reads the selection services, their event feeds and the
// tokenizer cache on every scrape: their counters are the source of truth,
// nothing is double-counted here. Create it with NewServiceCollector and
// register it in the EPP's registry.
type ServiceCollector struct {
	services map[string]*selection.SelectionService // role -> service
	cache    *tokenize.Cache                        // may be nil
	model    string                                 // the loads' partition
}

var _ prometheus.Collector = (*ServiceCollector)(nil)

// NewServiceCollector returns the collector of o's services.
func NewServiceCollector(o ServiceOptions) (*ServiceCollector, error) {
	if len(o.Services) == 0 {
		return nil, errors.New("prommetrics: a ServiceCollector needs at least one selection service")
	}
	services := make(map[string]*selection.SelectionService, len(o.Services))
	for role, s := range o.Services {
		if s == nil {
			return nil, fmt.Errorf("prommetrics: the %q selection service is nil", role)
		}
		services[role] = s
	}
	return &ServiceCollector{services: services, cache: o.Cache, model: o.Model}, nil
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
	dLoadRate     = prometheus.NewDesc("kvselect_worker_prefill_rate_tokens_per_second", "The worker rank's calibrated prefill rate (the fit's seconds per own token times the rank's slowness, inverted), what the predictive cost prices its prompt with; 0 until the calibration is ready.", loadLabels, nil)
	dLoadSlow     = prometheus.NewDesc("kvselect_worker_slowness", "How the worker rank's token times compare with the fleet's calibrated ones (2: twice as long), learned from its own completions; 0 until they separate its speed from the overhead.", loadLabels, nil)
	dCalibration  = prometheus.NewDesc("kvselect_calibration_seconds", "The calibration of the bookings' times to first token (TTFT = overhead + queued_token x queued tokens + active_request x active requests + own_token x own tokens, each rank's tokens at its slowness), by term; residual is the fit's recent mean absolute error, own_token_error the own-token price's standard error.", []string{"role", "term"}, nil)
	dCalSamples   = prometheus.NewDesc("kvselect_calibration_samples_total", "Completed prefills the calibration has fitted.", []string{"role"}, nil)
	dCalReady     = prometheus.NewDesc("kvselect_calibration_ready", "1 while the predictive cost uses the calibration (32 completions fitted, the own-token price more than twice its standard error), 0 while it prices tokens at the configured rate.", []string{"role"}, nil)
	dFiltered     = prometheus.NewDesc("kvselect_policy_filtered_total", "Candidates a policy filter of the embedding program excluded, by filter name (selection.Filter).", []string{"role", "filter"}, nil)
	dClsRefused   = descSel("policy_classifier_refusals_total", "Requests the embedding program's Classifier refused (selection.Classifier).")
	dFullScans    = descSel("policy_full_scans_total", "Decisions on a large fleet that took the full scan because a policy filter, picker or unscoped cost term needs every candidate.")
	classLabels   = []string{"role", "class"}
	dClassWaiting = prometheus.NewDesc("kvselect_class_queue_depth", "Requests of the policy class waiting in admission queues now (fair admission, DYN_EPP_POLICY_CLASSES).", classLabels, nil)
	dClassFlight  = prometheus.NewDesc("kvselect_class_inflight", "Bookings of the policy class live now.", classLabels, nil)
	dClassAdmit   = prometheus.NewDesc("kvselect_class_admitted_total", "Requests of the policy class booked.", classLabels, nil)
	dClassRefused = prometheus.NewDesc("kvselect_class_refusals_total", "Requests of the policy class refused, by reason (class_queue_full, class_inflight_full, deadline).", append(classLabels, "reason"), nil)
	dLate         = descSel("queue_deadline_refusals_total", "Requests refused because their deadline passed while they waited in an admission queue.")
	dSpread       = descSel("decisions_spread_total", "Decisions that priced the bookings peer replicas were likely making in the same instant (a burst spread over the replicas).")
	dHeld         = descSel("decisions_held_total", "Requests of a burst that waited for the bookings of the replicas ahead of this one before they booked (DYN_EPP_REPLICA_HOLD_BURSTS).")
	dLoadRecent   = prometheus.NewDesc("kvselect_worker_recent_bookings", "Requests booked on the worker rank recently (the EPP's own and its peers'), each decaying over DYN_EPP_BALANCE_WINDOW_SECONDS: what the predictive cost's balance term compares with the mean.", loadLabels, nil)
	dLoadPress    = prometheus.NewDesc("kvselect_worker_cache_pressure", "The share (0 to 1) of the device blocks the worker rank's engine stored lately that its removals matched: how full its cache runs (0 where it never fills, and without KV events); the predictive cost's eviction term reads it.", loadLabels, nil)
	dLoadBusy     = prometheus.NewDesc("kvselect_worker_busy", "1 while the worker rank's prefill load is above the queue threshold (requests wait in kvselect_queue_depth when every eligible rank is busy); 0 without queueing.", loadLabels, nil)

	evLabels    = []string{"role", "worker", "rank"}
	dEvApplied  = prometheus.NewDesc("kvselect_kv_events_applied_total", "KV events applied to the index.", evLabels, nil)
	dEvSkipped  = prometheus.NewDesc("kvselect_kv_events_skipped_total", "KV events not applied, by reason (kvevents.SkipReason names; undecodable_batch counts whole batches).", append(evLabels, "reason"), nil)
	dFeedState  = prometheus.NewDesc("kvselect_kv_feed_state", "1 for the feed's current state (healthy, silent, mis-speaking, never-heard: silent and no batch ever arrived), 0 for the others.", append(evLabels, "state"), nil)
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

// Describe sends the descriptors of every series Collect may send.
func (c *ServiceCollector) Describe(ch chan<- *prometheus.Desc) { prometheus.DescribeByCollect(c, ch) }

// Collect reads the services and the cache and sends their series.
func (c *ServiceCollector) Collect(ch chan<- prometheus.Metric) {
	counter := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, v, labels...)
	}
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	for role, s := range c.services {
		st := s.Stats()
		counter(dSelections, float64(st.Selections), role)
		for reason, n := range st.WorkerRefusals {
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
		counter(dSpread, float64(st.Spread), role)
		counter(dHeld, float64(st.Held), role)
		for name, n := range st.Filtered {
			counter(dFiltered, float64(n), role, name)
		}
		counter(dClsRefused, float64(st.ClassifierRefusals), role)
		counter(dFullScans, float64(st.PolicyFullScans), role)
		counter(dLate, float64(st.DeadlineRefused), role)
		for class, cs := range st.Classes {
			gauge(dClassWaiting, float64(cs.Waiting), role, class)
			gauge(dClassFlight, float64(cs.InFlight), role, class)
			counter(dClassAdmit, float64(cs.Admitted), role, class)
			for _, reason := range []string{selection.RefusedClassQueueFull, selection.RefusedClassInFlightFull, selection.RefusedDeadline} {
				counter(dClassRefused, float64(cs.Refused[reason]), role, class, reason)
			}
		}
		cal := st.Calibration
		counter(dCalSamples, float64(cal.Samples), role)
		ready := 0.0
		if cal.Ready {
			ready = 1
		}
		gauge(dCalReady, ready, role)
		for _, t := range []struct {
			term string
			v    float64
		}{{"overhead", cal.Overhead}, {"queued_token", cal.QueuedToken}, {"active_request", cal.ActiveRequest}, {"own_token", cal.OwnToken}, {"own_token_error", cal.OwnTokenError}, {"residual", cal.Residual}} {
			gauge(dCalibration, t.v, role, t.term)
		}
		byLife := map[catalog.Lifecycle]int{}
		for _, r := range s.Workers().List() {
			byLife[r.Lifecycle]++
		}
		for _, l := range []catalog.Lifecycle{catalog.Incomplete, catalog.Schedulable, catalog.Draining} {
			gauge(dWorkers, float64(byLife[l]), role, l.String())
		}
		for _, l := range s.Loads(c.model) {
			lv := []string{role, l.WorkerID, strconv.Itoa(l.Rank)}
			gauge(dLoadRequests, float64(l.ActiveRequests), lv...)
			gauge(dLoadBlocks, float64(l.ActiveBlocks), lv...)
			gauge(dLoadPrefill, float64(l.ActivePrefillTokens), lv...)
			gauge(dLoadBusy, b2f(l.Busy), lv...)
			gauge(dLoadRate, l.PrefillRate, lv...)
			gauge(dLoadSlow, l.Slowness, lv...)
			gauge(dLoadRecent, l.RecentBookings, lv...)
			gauge(dLoadPress, l.CachePressure, lv...)
		}
		for _, e := range s.Events().Sources() {
			lv := []string{role, e.Worker.WorkerID, strconv.Itoa(e.Worker.Rank)}
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
		for reason, n := range s.Events().Refusals() {
			counter(dRefused, float64(n), role, reason)
		}
		for _, b := range s.Events().BindStats() {
			counter(dBindMsgs, float64(b.Received), role, b.Endpoint, "received")
			counter(dBindMsgs, float64(b.FramesSkipped), role, b.Endpoint, "frames_skipped")
			counter(dBindMsgs, float64(b.Unattributed), role, b.Endpoint, "unattributed")
		}
		for _, h := range s.Events().Health() {
			lv := []string{role, h.Worker.WorkerID, strconv.Itoa(h.Worker.Rank)}
			for _, st := range []selection.FeedState{selection.FeedHealthy, selection.FeedSilent, selection.FeedMisSpeaking, selection.FeedNeverHeard} {
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
