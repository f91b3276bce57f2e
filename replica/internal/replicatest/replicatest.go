// Package replicatest compares what replicas under test hold, for the tests
// of package replica (over an in-memory bus) and of replica/natsbus (over a
// real NATS server): the one definition of "the replicas agree".
//
// Its comparisons only read (Loads, LocalIDs, RemoteIDs, Stats, Peers), and
// each returns "" when the replicas agree or a sentence saying where they
// differ, for a test to wait on or to assert. LastHeardUntil moves a test
// clock until a silent peer is dropped.
package replicatest

import (
	"fmt"
	"slices"
	"time"

	"github.com/kvselect/kvselect/replica"
	"github.com/kvselect/kvselect/selection"
)

// Node is one replica under test: its service and its Replicator.
type Node struct {
	Svc *selection.SelectionService
	R   *replica.Replicator
}

// Views reports how the nodes' views differ: every node's loads must be
// the same (each replica's calibrated prefill rate and slowness aside: it
// times the completions it hears itself), and every node must hold exactly each
// peer's live local bookings.
func Views(nodes ...Node) string {
	want := loads(nodes[0].Svc)
	for _, n := range nodes[1:] {
		if got := loads(n.Svc); !slices.Equal(got, want) {
			return fmt.Sprintf("loads of %s %v, of %s %v", nodes[0].R.ID(), want, n.R.ID(), got)
		}
	}
	for _, a := range nodes {
		local := a.R.LocalIDs()
		for _, b := range nodes {
			if a == b {
				continue
			}
			if got := b.R.RemoteIDs(a.R.ID()); !slices.Equal(got, local) && len(got)+len(local) > 0 {
				return fmt.Sprintf("%s holds %d bookings of %s, which has %d", b.R.ID(), len(got), a.R.ID(), len(local))
			}
		}
	}
	return ""
}

// Behind reports a node that has not applied a peer's last batch yet (or is
// taking a snapshot of it). Equal views are not enough: a node behind a
// peer's stream may hold, by chance, what the peer holds now (nothing, say)
// and go on applying the batches it has yet to see.
func Behind(nodes ...Node) string {
	for _, a := range nodes {
		st := a.R.Stats()
		for _, b := range nodes {
			if a == b {
				continue
			}
			peers := b.R.Peers()
			i := slices.IndexFunc(peers, func(p replica.Peer) bool { return p.ID == st.ID })
			if i < 0 {
				return fmt.Sprintf("%s does not follow %s yet", b.R.ID(), st.ID)
			}
			if p := peers[i]; p.Epoch != st.Epoch || p.Seq != st.Seq || p.Syncing {
				return fmt.Sprintf("%s follows %s at %d/%d (syncing %v), which is at %d/%d",
					b.R.ID(), st.ID, p.Epoch, p.Seq, p.Syncing, st.Epoch, st.Seq)
			}
		}
	}
	return ""
}

// Converged publishes what every node has pending (Flush) and reports the
// first thing that keeps the nodes from agreeing: one behind a peer's
// stream (Behind), then views that differ (Views).
func Converged(nodes ...Node) string {
	for _, n := range nodes {
		_ = n.R.Flush()
	}
	if s := Behind(nodes...); s != "" {
		return s
	}
	return Views(nodes...)
}

// loads is svc's loads without the prefill rates and recent bookings: each
// replica times what it hears itself (a peer's booking arrives, and starts
// to decay, when it is applied), so those may differ while the loads agree.
func loads(svc *selection.SelectionService) []selection.WorkerLoad {
	ls := svc.Loads("")
	for i := range ls {
		ls[i].PrefillRate, ls[i].Slowness, ls[i].RecentBookings = 0, 0, 0
	}
	return ls
}

// LastHeardUntil moves the replicas' test clock on a millisecond at a time
// (advance; at most 5 s of the wall clock) until dropped holds, and returns
// when observer last heard from peer, on that clock: a message the peer
// sent before it went silent may land late and restart its silence, so a
// test judges the drop against this. ok is false when dropped never held.
func LastHeardUntil(advance func(time.Duration) time.Time, observer *replica.Replicator, peer string, dropped func() bool) (last time.Time, ok bool) {
	deadline := time.Now().Add(5 * time.Second)
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	for time.Now().Before(deadline) {
		for _, p := range observer.Peers() {
			if p.ID == peer {
				last = p.LastHeard
			}
		}
		if dropped() {
			return last, true
		}
		advance(time.Millisecond)
		<-tick.C
	}
	return last, false
}
