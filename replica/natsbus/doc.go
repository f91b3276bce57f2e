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
//	r, err := replica.New(replica.Options{Bus: bus, ID: "epp-0", MaxMessageBytes: int(nc.MaxPayload())})
//	svc, err := selection.NewSelectionServiceBuilder(cfg).Observe(r).Build(ctx)
//	err = r.Start(svc)
//	defer nc.Close() // after r.Close
//	defer r.Close()
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
// Bus is safe for concurrent use. Each subscription's callback runs on the
// client's goroutine for that subscription, one message at a time; WatchConn
// runs one goroutine of its own, which its stop function ends and waits for.
// The Bus does not own the connection and never closes it.
package natsbus
