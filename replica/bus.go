package replica

import "context"

// Bus is the message transport a Replicator runs on: publish/subscribe for the
// booking stream and request/reply for snapshots. Package replica/natsbus
// implements it over NATS; any broker with the same two patterns will do.
//
// Subjects are dot-separated tokens. A subscription's subject may end in the
// token "*", which matches any one last token (as in NATS): a replica
// publishes its batches on its own subject, Subject+".ops."+ID, and
// subscribes to Subject+".ops.*". fn is given the subject each message was
// published on, so a replica knows which replica's subject a batch came on
// (a broker that lets each replica publish only on its own subject, as NATS
// permissions do, thereby makes forging another replica's batches
// impossible).
//
// The Replicator relies on these properties:
//
//   - Messages one Bus publishes on a subject reach each subscriber in the
//     order they were published (they may be lost, not reordered).
//   - Publish does not keep data after it returns; fn and the responder's
//     function must not keep their argument after they return (the Replicator
//     copies what it keeps).
//   - fn may be called from any goroutine, and concurrently for messages of
//     different publishers; the Replicator serialises what it needs itself.
//   - After unsubscribe or stop returns, the function is no longer called
//     (a call already running may still finish: the Replicator guards itself).
//
// Request returns the responder's answer, or an error when there is none (no
// responder, ctx done, the connection gone). A responder that returns nil
// sends no answer.
type Bus interface {
	Publish(subject string, data []byte) error
	Subscribe(subject string, fn func(subject string, data []byte)) (unsubscribe func(), err error)
	Request(ctx context.Context, subject string, data []byte) ([]byte, error)
	Respond(subject string, fn func(req []byte) []byte) (stop func(), err error)
}

// ConnWatcher is implemented by a Bus that knows when its connection to the
// broker is lost and when it is back. The Replicator watches it when its Bus
// has it: while disconnected it serves locally and reports itself degraded
// (Stats.Degraded); on reconnection it resynchronises with every peer.
//
// fn(false) reports a lost connection, fn(true) a restored one; repeated
// reports of the same state are harmless. After stop returns, fn is no longer
// called.
type ConnWatcher interface {
	WatchConn(fn func(connected bool)) (stop func(), err error)
}
