package kvevents

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
)

// errReplay reports a replay that did not complete: the replay server could not be
// reached, went silent for longer than replayIdleTimeout, or did not finish within
// replayTimeout (FeedOptions). The feed counts it (SourceStats.ReplaysFailed) and
// marks the source degraded for the batches it could not recover.
var errReplay = errors.New("kvevents: replay failed")

// replay runs one replay exchange with an engine's ROUTER: it sends ["", start] on a
// fresh DEALER socket and calls yield for every batch reply until the end marker. At
// most maxConcurrentReplays (FeedOptions) replays run at once across the feed.
func (f *Feed) replay(ctx context.Context, endpoint string, start uint64, st *counters, yield func(frame)) error {
	select {
	case f.replaySem <- struct{}{}:
	case <-ctx.Done():
		return ctx.Err()
	}
	defer func() { <-f.replaySem }()

	ctx, cancelTotal := context.WithTimeout(ctx, f.opts.replayTimeout)
	defer cancelTotal()
	sctx, cancelSock := context.WithCancel(ctx)
	defer cancelSock()

	sock := zmq4.NewDealer(sctx, f.socketOptions()...)
	defer closeSocket(sock)
	if err := sock.Dial(f.dialEndpoint(endpoint)); err != nil {
		return fmt.Errorf("%w: %s: %w", errReplay, endpoint, err)
	}
	if err := sock.Send(zmq4.NewMsgFrom([]byte{}, appendSeq(nil, start))); err != nil {
		return fmt.Errorf("%w: %s: request: %w", errReplay, endpoint, err)
	}

	// go-zeromq's Recv has no deadline: an idle timer cancels the socket's context.
	var idle atomic.Bool
	timer := time.AfterFunc(f.opts.replayIdleTimeout, func() {
		idle.Store(true)
		cancelSock()
	})
	defer timer.Stop()
	for {
		msg, err := sock.Recv()
		if err != nil {
			switch {
			case idle.Load():
				return fmt.Errorf("%w: %s: no reply for %v", errReplay, endpoint, f.opts.replayIdleTimeout)
			case ctx.Err() != nil && errors.Is(ctx.Err(), context.DeadlineExceeded):
				return fmt.Errorf("%w: %s: not finished within %v", errReplay, endpoint, f.opts.replayTimeout)
			default:
				return fmt.Errorf("%w: %s: %w", errReplay, endpoint, err)
			}
		}
		if !timer.Stop() {
			// The idle timer fired while this message arrived; the socket is done.
			return fmt.Errorf("%w: %s: no reply for %v", errReplay, endpoint, f.opts.replayIdleTimeout)
		}
		if msg.Type != zmq4.CmdMsg {
			fr, end, err := parseReplayFrames(msg.Frames)
			switch {
			case err != nil:
				st.framesSkipped.Add(1)
				f.drop("bad_replay_frames", endpoint, "error", err)
			case end:
				return nil
			default:
				yield(fr) // the idle clock is stopped while the Handler works
			}
		}
		timer.Reset(f.opts.replayIdleTimeout)
	}
}
