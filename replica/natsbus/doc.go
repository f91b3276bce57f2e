// Package natsbus carries kvselect's replica traffic over NATS: Bus
// implements replica.Bus (core publish/subscribe for the booking stream,
// request/reply for snapshots) and replica.ConnWatcher (the connection's
// losses and returns) over one *nats.Conn.
//
// It is a module of its own (github.com/kvselect/kvselect/replica/natsbus),
// so NATS never enters the module graph of a program that imports only the
// core packages.
//
//	nc, err := nats.Connect(url,
//		nats.Name("epp-0"),
//		nats.MaxReconnects(-1),                   // never give up: the replica resyncs on return
//		nats.ReconnectWait(250*time.Millisecond),
//		nats.PingInterval(5*time.Second),         // notice a dead link within a few pings
//	)
//	bus, err := natsbus.New(nc)
//	r, err := replica.New(replica.Options{Bus: bus, ID: "epp-0"}) // the message bound follows nc's max_payload
//	svc, err := selection.NewSelectionServiceBuilder(cfg).Observe(r).Build(ctx)
//	err = r.Start(svc)
//	defer nc.Close() // after r.Close
//	defer r.Close()
//
// # Embedded server
//
// StartServer runs a nats-server in the process (core NATS only, no
// JetStream), so that replicas need no NATS deployment of their own: each
// replica embeds one, and the servers cluster through routes (the route
// listener, ServerOptions.ClusterAddr, port 9092 by default) to the peers
// that discovery finds. Server.SetRoutes changes the routes while the server
// runs (a hot reload of cluster.routes: added routes are solicited, removed
// ones torn down, the listener stays; see
// https://docs.nats.io/reference/config/cluster/routes). NATS completes the
// mesh by itself: a server routed to one member of a cluster learns the
// others from it. The server's client listener is on loopback only and asks
// every client for a random token of the server's (Server.ClientURL carries
// it), so no other process on the host can publish into the cluster;
// Server.Dial connects in process, without a socket. With
// ServerOptions.RouteSecret every route must present the shared secret, and
// a route without it is refused (logged by both servers); without one, any
// host that reaches the route port may join, so keep it behind a network
// policy. ServerOptions.ClientPermissions (ReplicaPermissions) limits what
// the server's own clients may publish and subscribe to, so that a
// replica's client publishes batches only on its own stream. Bus.Respond
// answers a request only on an inbox reply subject, so a request naming
// another subject as its reply cannot make a replica publish there.
// Bus.MaxPayload is the server's max_payload as learnt on the last
// connection; a Replicator re-reads it at Start and on every reconnection
// (replica.PayloadLimiter), so MaxMessageBytes can be left 0:
//
//	srv, err := natsbus.StartServer(natsbus.ServerOptions{Name: "epp-0", ClusterAddr: podIP + ":9092", Routes: peers,
//		ClientPermissions: natsbus.ReplicaPermissions("epp-0", replica.DefaultSubject)})
//	cl, err := srv.Dial(natsbus.DialOptions{Name: "epp-0"})
//	r, err := replica.New(replica.Options{Bus: cl.Bus(), ID: "epp-0"})
//	...
//	err = srv.SetRoutes(newPeers) // discovery saw peers come and go
//	...
//	r.Close(); cl.Close(); srv.Close() // in this order
//
// Dial connects to an existing NATS cluster instead, with the options
// below; a Client owns its connection and closes it.
//
// Core NATS is at-most-once: a message lost to a slow consumer (the client
// drops what a subscription cannot take, see nats.Subscription.SetPendingLimits)
// or to a reconnection is a sequence gap, which the Replicator repairs with a
// snapshot. JetStream is not needed. While disconnected, the client buffers
// publishes (nats.ReconnectBufSize) and sends them when it is back; the
// Replicator resynchronises anyway.
//
// # Concurrency
//
// Bus, Client and Server are safe for concurrent use. Each subscription's
// callback runs on the client's goroutine for that subscription, one message
// at a time; WatchConn runs one goroutine of its own, which its stop function
// ends and waits for. A Bus made with New does not own its connection and
// never closes it; a Client's Close closes its own. A Server owns the
// nats-server's goroutines: Close shuts it down and waits for them, and
// SetRoutes calls are serialised.
//
// # Invariants
//
//   - A Server listens for clients on loopback only, never on another
//     interface; its routes are exactly the last list given to SetRoutes
//     (or ServerOptions.Routes), sorted, without duplicates.
//   - StartServer returns a server whose listeners are up, or an error and
//     nothing running: a listener that cannot open (a port in use) is an
//     error, never the process exiting (the server's Fatalf is adapted).
//   - NATS is imported by this module only.
package natsbus
