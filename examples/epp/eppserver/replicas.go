package eppserver

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"

	"github.com/kvselect/kvselect/examples/epp/discovery"
	"github.com/kvselect/kvselect/replica"
	"github.com/kvselect/kvselect/replica/natsbus"
	"github.com/kvselect/kvselect/roles"
	"github.com/kvselect/kvselect/selection"
)

// replication is what the EPP runs to share its active load with its peers
// (docs/REPLICAS.md): the NATS link, an embedded server (mode a:
// DYN_EPP_PEER_SERVICE or DYN_EPP_PEERS) or a client of an existing cluster
// (mode b: DYN_EPP_NATS_URL), and one Replicator per role of the topology,
// each on its own subject over the one link.
//
// Order: openReplication (the link) before build makes the services,
// newReplicators before roles.New (each role's builder observes its
// Replicator), start once discovery has registered the workers, readiness
// once every Replicator is synced. Closing: closeReplicators before the
// services close, closeLink after them.
type replication struct {
	logger *slog.Logger
	id     string
	srv    *natsbus.Server // mode a; nil in mode b
	cl     *natsbus.Client

	reps      map[roles.Role]*replica.Replicator
	started   chan struct{} // closed once every Replicator is started
	startOnce sync.Once
}

// openReplication opens the NATS link the configuration names; nil, nil
// when it names none. A nil logger discards.
func openReplication(cfg *Config, logger *slog.Logger) (*replication, error) {
	if !cfg.replicated() {
		return nil, nil
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	id, err := cfg.replicaID(os.Hostname)
	if err != nil {
		return nil, err
	}
	rp := &replication{logger: logger, id: id, started: make(chan struct{})}
	dial := natsbus.DialOptions{Name: id, Logger: logger}
	if cfg.NATSURL != "" {
		rp.cl, err = natsbus.Dial(cfg.NATSURL, dial)
		if err != nil {
			return nil, err
		}
		if !rp.cl.Connected() {
			logger.Warn("NATS not reachable yet; the replicas start degraded and resynchronise once connected", "url", redactURL(cfg.NATSURL))
		}
		logger.Info("replica sync over NATS", "replica", id, "url", redactURL(cfg.NATSURL))
		return rp, nil
	}
	// On POD_IP when known: the server then tells its peers that address,
	// not every address of the host.
	addr := net.JoinHostPort(cfg.PodIP, strconv.Itoa(cfg.SyncPort))
	if cfg.SyncSecret == "" {
		logger.Warn("replica sync without DYN_EPP_REPLICA_SYNC_SECRET: any host that reaches the sync port can join the mesh and publish bookings; set a secret, or keep the port behind a NetworkPolicy",
			"addr", addr)
	}
	// This process's client publishes only on its own replicas' streams
	// (every role's subject), so nothing it sends can speak for a peer.
	var subjects []string
	for _, r := range []roles.Role{roles.Aggregated, roles.Prefill, roles.Decode} {
		subjects = append(subjects, replicaSubject(cfg, r))
	}
	rp.srv, err = natsbus.StartServer(natsbus.ServerOptions{Name: id, ClusterAddr: addr, Routes: cfg.Peers, RouteSecret: cfg.SyncSecret,
		ClientPermissions: natsbus.ReplicaPermissions(id, subjects...), Logger: logger})
	if err != nil {
		return nil, fmt.Errorf("replica sync server on %s: %w", addr, err)
	}
	rp.cl, err = rp.srv.Dial(dial)
	if err != nil {
		rp.srv.Close()
		return nil, err
	}
	logger.Info("replica sync listening", "replica", id, "addr", rp.srv.ClusterAddr().String(), "routes", len(cfg.Peers))
	return rp, nil
}

// redactURL drops the credentials of NATS URLs for the log.
func redactURL(urls string) string {
	var out []string
	for u := range strings.SplitSeq(urls, ",") {
		u = strings.TrimSpace(u)
		if at := strings.LastIndexByte(u, '@'); at >= 0 {
			if scheme := strings.Index(u, "://"); scheme >= 0 && scheme < at {
				u = u[:scheme+3] + "***@" + u[at+1:]
			}
		}
		out = append(out, u)
	}
	return strings.Join(out, ",")
}

// replicaSubject is the subject of one role's replicas: namespace, pool and
// role, so that pools sharing a NATS cluster never mix ("_" for a part that
// is not set; dots, which DNS names may hold, become "_", which they may
// not).
func replicaSubject(cfg *Config, r roles.Role) string {
	tok := func(s string) string {
		if s == "" {
			return "_"
		}
		return strings.ReplaceAll(s, ".", "_")
	}
	return replica.DefaultSubject + "." + tok(cfg.Namespace) + "." + tok(cfg.PoolName) + "." + r.String()
}

// newReplicators makes one Replicator per role of mode.
func (rp *replication) newReplicators(cfg *Config, mode roles.TopologyMode) error {
	rp.reps = map[roles.Role]*replica.Replicator{}
	for _, r := range mode.Roles() {
		rep, err := replica.New(replica.Options{
			// MaxMessageBytes left 0: the bound follows the server's
			// max_payload, read on every (re)connection.
			Bus: rp.cl.Bus(), ID: rp.id, Subject: replicaSubject(cfg, r), Logger: rp.logger.With("role", r.String()),
			HoldBursts: cfg.HoldBursts, // the router waits (router.hold)
		})
		if err != nil {
			return err
		}
		rp.reps[r] = rep
	}
	return nil
}

// observe attaches role r's Replicator to its service's builder.
func (rp *replication) observe(r roles.Role, b *selection.SelectionServiceBuilder) {
	if rep := rp.reps[r]; rep != nil {
		b.Observe(rep)
	}
}

// start starts every Replicator on its role's service, once: discovery has
// registered the workers by then, so peers' bookings find them. Later calls
// do nothing.
func (rp *replication) start(rs *roles.RoleSelectors) {
	rp.startOnce.Do(func() {
		for r, rep := range rp.reps {
			if err := rep.Start(rs.Service(r)); err != nil {
				rp.logger.Error("replica start", "role", r.String(), "err", err)
			}
		}
		close(rp.started)
	})
}

// waitSynced waits until start has run and every Replicator has made its
// initial sync (bounded by replica.Options.SyncTimeout), or ctx ends.
func (rp *replication) waitSynced(ctx context.Context) error {
	select {
	case <-rp.started:
	case <-ctx.Done():
		return ctx.Err()
	}
	for _, rep := range rp.reps {
		if err := rep.WaitSynced(ctx); err != nil {
			return err
		}
	}
	return nil
}

// followPeers routes the embedded server to the peers discovery finds,
// until ctx ends or discovery fails (the peer Service is missing or may not
// be read).
func (rp *replication) followPeers(ctx context.Context, peers *discovery.Peers) error {
	return peers.Run(ctx, func(set []string) {
		if err := rp.srv.SetRoutes(set); err != nil {
			rp.logger.Warn("replica routes not updated", "err", err)
		}
	})
}

// closeReplicators closes every Replicator (before the services close).
func (rp *replication) closeReplicators() {
	for _, rep := range rp.reps {
		_ = rep.Close()
	}
}

// closeLink closes the connection, then the embedded server (after the
// Replicators and the services).
func (rp *replication) closeLink() {
	rp.cl.Close()
	if rp.srv != nil {
		rp.srv.Close()
	}
}

// readyWhenSynced marks the EPP ready once discovery has synced and every
// Replicator has made its initial sync; it returns when ctx ends or once
// ready.
func (e *EPP) readyWhenSynced(ctx context.Context) error {
	if err := e.rep.waitSynced(ctx); err != nil {
		if errors.Is(err, replica.ErrClosed) || ctx.Err() != nil {
			return nil
		}
		return err
	}
	e.server.SetReady(true)
	if ctx.Err() != nil { // shutting down meanwhile
		e.server.SetReady(false)
		return nil
	}
	peers := 0
	for _, rep := range e.rep.reps {
		peers = max(peers, len(rep.Peers()))
	}
	e.logger.Info("discovery synced; serving", "replica", e.rep.id, "replica_peers", peers)
	return nil
}
