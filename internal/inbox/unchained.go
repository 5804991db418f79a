package inbox

import (
	"context"
	"errors"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
)

// UnchainedFailureDelay is how long the idempotent middleware waits before
// returning a permanent or ordinary failure when it runs under a Watermill
// router but outside the chain (NewChain, NewHandlerMiddleware): the router
// would nack the message and the broker redeliver it at once, forever, for
// a malformed message. The wait bounds that loop to one redelivery per
// second per consumer; an ERROR log says how to wire the chain.
const UnchainedFailureDelay = time.Second

// errNoChain is the error of the first-delivery log line of unchained.
var errNoChain = errors.New("idempotency: the idempotent middleware runs under a router outside the chain " +
	"(a PoisonQueue or Retry inside it would commit a failed attempt or apply an effect twice)")

// unchainedHint is the hint of every "runs without the chain" log line.
const unchainedHint = "wrap each handler with middleware.NewHandlerMiddleware (the whole chain, in its order) " +
	"and add no other Retry, Recoverer or PoisonQueue around the idempotent middleware"

// unchained runs attempt for a delivery that reached the middleware under a
// router but outside the chain. No layer of ours is outside it, so the
// layers that are (if any) are Watermill's or the user's: a PoisonQueue
// there would dead-letter a database outage, a Retry would spend its budget
// on it, and a bare router would nack it into a hot loop that a quorum
// queue's x-delivery-limit counts (README "What it guarantees"). So the
// middleware holds what the chain holds: a transient or configuration
// failure is retried here, in place, with the chain's default capped
// backoff, until an attempt ends otherwise, the message context ends
// (shutdown) or DefaultMaxHold passes. A permanent or ordinary failure is
// returned after UnchainedFailureDelay, for whatever is outside. Every
// failed attempt is logged at ERROR with the hint to wire the chain.
func (m *Idempotent) unchained(attempt message.HandlerFunc, msg *message.Message) ([]*message.Message, error) {
	ctx := msg.Context()
	if _, seen := m.unchainedSeen.LoadOrStore(message.HandlerNameFromCtx(ctx), true); !seen {
		// Once per handler, whatever the outcome: a chain in another order
		// (a PoisonQueue or Retry inside this middleware) fails silently
		// on success paths, so say it at the first delivery.
		m.logger.Error("Idempotent middleware runs without the chain", errNoChain, watermill.LogFields{
			"handler": message.HandlerNameFromCtx(ctx), "hint": unchainedHint,
		})
	}
	cfg := ChainConfig{}
	cfg.setDefaults()
	wait := newBackoff(cfg)
	start := time.Now()
	for held := 0; ; held++ {
		produced, err := attempt(msg)
		msg.SetContext(ctx)
		if err == nil {
			return produced, nil
		}
		class := ClassOf(err)
		m.logger.Error("Idempotent middleware runs without the chain", err, watermill.LogFields{
			"message_uuid": msg.UUID, "handler": message.HandlerNameFromCtx(ctx),
			"class": class.String(), "held": held, "hint": unchainedHint,
		})
		if class != ClassTransient && class != ClassConfiguration {
			sleepCtx(ctx, UnchainedFailureDelay)
			return nil, err
		}
		d := wait.next()
		if ctx.Err() != nil || time.Since(start)+d > DefaultMaxHold || !sleepCtx(ctx, d) {
			return nil, err
		}
	}
}

// sleepCtx waits d or until ctx ends; false when ctx ended.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
