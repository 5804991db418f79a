package inbox

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/watermill-idempotency/idempotency/internal/wire"
	"github.com/watermill-idempotency/idempotency/marshaler"
)

// Chain defaults (ChainConfig).
const (
	DefaultMaxRetries      = 5
	DefaultInitialInterval = 100 * time.Millisecond
	DefaultMaxInterval     = 10 * time.Second
	DefaultMultiplier      = 2.0

	// DefaultMaxHold bounds how long the chain holds one delivery while its
	// attempts fail for infrastructure or configuration reasons, before it
	// gives it back to the broker (nack). It is below RabbitMQ's default
	// consumer_timeout (30 min), after which the broker would close the
	// channel itself.
	DefaultMaxHold = 25 * time.Minute

	// DefaultMaxHeaderBytes bounds each metadata value the chain adds to a
	// poisoned message (the reason, the topic, handler and subscriber names).
	DefaultMaxHeaderBytes = 4096

	// DefaultMaxCopiedHeaderBytes bounds the metadata the chain copies from
	// the failed message onto its poisoned copy (keys and values added up):
	// 64 KiB, so that the copy plus the chain's own headers (at most 4 ×
	// MaxHeaderBytes and a few short ones) fit RabbitMQ's default frame_max
	// (128 KiB: AMQP 0-9-1 sends all headers in one content-header frame).
	DefaultMaxCopiedHeaderBytes = 64 << 10
)

// Metadata keys the chain sets on a poisoned message. The Watermill keys
// (wmw.ReasonForPoisonedKey "reason_poisoned", wmw.PoisonedTopicKey,
// wmw.PoisonedHandlerKey, wmw.PoisonedSubscriberKey) are set as Watermill's
// PoisonQueue sets them; these are ours.
const (
	// MetadataPoisonClass is "permanent" (no retry could fix it) or
	// "exhausted" (an ordinary error that survived MaxRetries).
	MetadataPoisonClass = "idempotency_poison_class"
	// MetadataReasonBytes is the length in bytes of the full reason, set
	// only when reason_poisoned was truncated.
	MetadataReasonBytes = "idempotency_reason_bytes"
	// MetadataDroppedHeaders lists, comma-separated (bounded by
	// MaxHeaderBytes), the metadata keys of the failed message that were
	// not copied onto its poisoned copy because all of them together passed
	// MaxCopiedHeaderBytes (the largest values are dropped first). Set only
	// when some were dropped.
	MetadataDroppedHeaders = "idempotency_dropped_headers"
	// MetadataPoisonedAt is when the copy was poisoned (RFC 3339, UTC, the
	// process clock): `idem dlq list` shows it as the failure time.
	MetadataPoisonedAt = "idempotency_poisoned_at"
	// MetadataPoisonCount is how many times this message was poisoned,
	// this time included ("1" the first time): a copy that comes back
	// with its poison headers and fails again counts on (poisonLoop).
	// `idem dlq redrive` strips it with the other poison headers.
	MetadataPoisonCount = "idempotency_poison_count"
)

// ChainConfig configures NewChain and NewHandlerMiddleware: the recommended
// middleware chain around the idempotent middleware.
type ChainConfig struct {
	// Idempotent is the innermost middleware. Required.
	Idempotent *Idempotent

	// PoisonPublisher and PoisonTopic receive messages that cannot be
	// processed: permanent errors at once, ordinary handler errors once
	// retries are exhausted. Transient (infrastructure) and configuration
	// errors never go there. Both required. The message is acked only after
	// PoisonPublisher.Publish returned nil, so it must return nil only once
	// the broker has the message: on AMQP use the confirmed, mandatory
	// publisher of package marshaler/amqp (NewPoisonPublisher), not
	// watermill-amqp's Publisher, which reports an unroutable message as
	// published. A failed publish is retried with backoff, the delivery held.
	PoisonPublisher message.Publisher
	PoisonTopic     string

	// AfterPoison are extra middlewares placed just inside the poison
	// middleware and outside Retry, outermost first: the place for routers
	// that take some permanent errors elsewhere before the poison topic sees
	// them (operation.RouteUncertain sends uncertain external outcomes to a
	// reconciliation topic). Defaults to none.
	AfterPoison []message.HandlerMiddleware

	// MaxRetries is how many times the chain's retry re-runs an attempt that
	// failed with an ordinary error, in-process, before the message is
	// poisoned. Defaults to DefaultMaxRetries.
	MaxRetries int
	// InitialInterval, MaxInterval and Multiplier shape the exponential
	// backoff between retries, between attempts of a held delivery and
	// between poison publishes. Default to DefaultInitialInterval,
	// DefaultMaxInterval, DefaultMultiplier.
	InitialInterval time.Duration
	MaxInterval     time.Duration
	Multiplier      float64

	// MaxHold bounds how long one delivery is held (retried in place) while
	// its attempts fail with transient or configuration errors or its poison
	// publish fails; then the chain returns the error and the router nacks
	// (the broker redelivers it, and counts a delivery: a quorum queue's
	// x-delivery-limit). Holding instead of nacking is what keeps a database
	// outage from dead-lettering messages. Keep it below the broker's own
	// limit on unacknowledged deliveries: RabbitMQ's consumer_timeout
	// (default 30 min) closes the channel of a consumer that holds a
	// delivery longer; NATS JetStream redelivers after AckWait (default
	// 30 s) while the delivery is held (set AckWait above MaxHold, or accept
	// duplicate deliveries, which the claim absorbs). Defaults to
	// DefaultMaxHold; negative: hold until the message context ends
	// (shutdown).
	MaxHold time.Duration

	// MaxHeaderBytes bounds each metadata value the chain adds to a
	// poisoned message; a longer reason is cut and ends with
	// "…(truncated, N bytes)", N the full length (also in
	// MetadataReasonBytes), so a poison publish never fails for its own size
	// (RabbitMQ's frame_max, 128 KiB by default, limits all headers
	// together). Defaults to DefaultMaxHeaderBytes; minimum 64.
	MaxHeaderBytes int

	// MaxCopiedHeaderBytes bounds the failed message's metadata copied onto
	// its poisoned copy, keys and values added up; past it the largest
	// values are left out (named in MetadataDroppedHeaders), so a message
	// whose own headers are near the broker's frame limit can still be
	// poisoned: otherwise the copy, which adds the chain's headers, would be
	// refused and the delivery held forever. Defaults to
	// DefaultMaxCopiedHeaderBytes; negative: copy nothing.
	MaxCopiedHeaderBytes int
}

func (c *ChainConfig) setDefaults() {
	if c.MaxRetries == 0 {
		c.MaxRetries = DefaultMaxRetries
	}
	if c.InitialInterval == 0 {
		c.InitialInterval = DefaultInitialInterval
	}
	if c.MaxInterval == 0 {
		c.MaxInterval = DefaultMaxInterval
	}
	if c.MaxInterval < c.InitialInterval {
		c.MaxInterval = c.InitialInterval
	}
	if c.Multiplier == 0 {
		c.Multiplier = DefaultMultiplier
	}
	if c.MaxHold == 0 {
		c.MaxHold = DefaultMaxHold
	}
	if c.MaxHeaderBytes == 0 {
		c.MaxHeaderBytes = DefaultMaxHeaderBytes
	}
	if c.MaxCopiedHeaderBytes == 0 {
		c.MaxCopiedHeaderBytes = DefaultMaxCopiedHeaderBytes
	}
}

// Validate reports the first invalid field of c, naming it.
func (c ChainConfig) Validate() error {
	switch {
	case c.Idempotent == nil:
		return errors.New("middleware: ChainConfig.Idempotent is required")
	case c.PoisonPublisher == nil:
		return errors.New("middleware: ChainConfig.PoisonPublisher is required")
	case c.PoisonTopic == "":
		return errors.New("middleware: ChainConfig.PoisonTopic is required")
	case c.MaxRetries < 0:
		return fmt.Errorf("middleware: ChainConfig.MaxRetries %d: must be ≥ 0", c.MaxRetries)
	case c.Multiplier != 0 && c.Multiplier < 1:
		return fmt.Errorf("middleware: ChainConfig.Multiplier %v: must be ≥ 1", c.Multiplier)
	case c.InitialInterval < 0 || c.MaxInterval < 0:
		return errors.New("middleware: ChainConfig.InitialInterval and MaxInterval must be ≥ 0")
	case c.MaxHeaderBytes != 0 && c.MaxHeaderBytes < 64:
		return fmt.Errorf("middleware: ChainConfig.MaxHeaderBytes %d: must be ≥ 64", c.MaxHeaderBytes)
	}
	return nil
}

// NewHandlerMiddleware returns the whole recommended chain as one
// middleware, for one handler: handler.AddMiddleware(mw) on the
// *message.Handler that router.AddHandler returns. Wire it per handler, not
// with router.AddMiddleware: a router-level chain also wraps the handler
// that consumes the poison topic (the chain detects that and holds instead
// of re-poisoning, but the dead-letter handler then stalls). See NewChain
// for the layers.
func NewHandlerMiddleware(cfg ChainConfig, logger watermill.LoggerAdapter) (message.HandlerMiddleware, error) {
	chain, err := NewChain(cfg, logger)
	if err != nil {
		return nil, err
	}
	return func(h message.HandlerFunc) message.HandlerFunc {
		for i := len(chain) - 1; i >= 0; i-- {
			h = chain[i](h)
		}
		return h
	}, nil
}

// NewChain returns the recommended chain, outermost first (Watermill runs
// the first added outermost); NewHandlerMiddleware composes it into one:
//
//  1. Hold and poison (then ChainConfig.AfterPoison, if any). A permanent
//     error, or an ordinary one that survived the retries, is published to
//     PoisonTopic with its reason (bounded, MaxHeaderBytes) and the message
//     is acked, once, only after the publish returned nil; a failed publish
//     is retried with backoff. A transient or configuration error holds the
//     delivery: the attempt is re-run in place with capped backoff (logged:
//     at info with the error for transient, ERROR with what to fix for
//     configuration; Watermill's LoggerAdapter has no warn level) until it
//     succeeds, the message context ends (shutdown) or MaxHold passes; then
//     the error is returned and the router nacks. The broker never sees a
//     nack per failed attempt, so a database outage does not spend a quorum
//     queue's delivery limit. A message already poisoned (it carries the
//     poison headers, which idem dlq redrive strips) that fails again is
//     held, not re-poisoned, when it is consumed from the poison topic
//     (the chain also wraps its handler) or is back on the topic it was
//     poisoned from after a second poisoning within the last 10 minutes
//     (a dead-letter destination that routes to this consumer, where each
//     poisoning fed it back to itself; MetadataPoisonCount counts them); a
//     copy redriven with its headers that fails again is poisoned again.
//  2. Retry, restoring the message's context before each attempt
//     (Watermill issue #467), for ordinary errors only: permanent ones are
//     not retried, transient and configuration ones go out to the hold at
//     once.
//  3. Recoverer: a handler panic becomes an error (after the idempotent
//     middleware rolled back).
//  4. The idempotent middleware: each attempt in a fresh transaction.
//
// The idempotent middleware notices when it runs under a router without
// this chain and then slows failing redeliveries down (see Idempotent).
func NewChain(cfg ChainConfig, logger watermill.LoggerAdapter) ([]message.HandlerMiddleware, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.setDefaults()
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	outer := &holdPoison{cfg: cfg, logger: logger}
	chain := []message.HandlerMiddleware{outer.middleware}
	chain = append(chain, cfg.AfterPoison...)
	return append(chain, outer.retry, wmw.Recoverer, cfg.Idempotent.Middleware), nil
}

// retry re-runs an attempt that failed with an ordinary error, up to
// MaxRetries times, with the capped exponential backoff (InitialInterval,
// ·Multiplier, at most MaxInterval, ±20 % jitter), restoring the message's
// context before each attempt (Watermill issue #467); a permanent,
// transient or configuration error is returned at once. It does what
// Watermill's Retry (ResetContextOnRetry, ShouldRetry on ClassOrdinary)
// did here, logging "Error occurred, retrying" at error with retry_no,
// max_retries and wait_time, without that middleware's cost on the
// success path: two exponential backoffs, six closures and a timer per
// message (12 allocations; bench BenchmarkRouterOneWorker). When the
// message context ends, before an attempt or during a wait, it returns the
// context's cause.
//
// It runs only inside this chain's own outer layer: in a chain nested in
// another one (a router-level chain and a handler-level one), the outer
// chain retries, holds and poisons, and the inner one passes through, so
// that retries are not multiplied and holds not added up.
func (p *holdPoison) retry(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		if ctx.Value(chainKey{}) != p {
			return h(msg)
		}
		var wait *holdBackoff
		for n := 0; ; n++ {
			if ctx.Err() != nil {
				return nil, context.Cause(ctx)
			}
			msg.SetContext(ctx)
			produced, err := h(msg)
			if err == nil {
				return produced, nil
			}
			p.stall.touch()
			if n >= p.cfg.MaxRetries || ClassOf(err) != ClassOrdinary {
				return produced, err
			}
			if wait == nil {
				wait = newBackoff(p.cfg)
			}
			d := wait.next()
			p.logger.Error("Error occurred, retrying", err, watermill.LogFields{
				"retry_no": n + 1, "max_retries": p.cfg.MaxRetries, "wait_time": d})
			if !sleepCtx(ctx, d) {
				return produced, context.Cause(ctx)
			}
		}
	}
}

// ShouldPoison is the chain's poison filter: true for a permanent or
// ordinary error, false for a transient (infrastructure) or configuration
// one, which must leave the message on the broker rather than on the poison
// topic. Usable with Watermill's PoisonQueueWithFilter.
func ShouldPoison(err error) bool {
	if err == nil {
		return false
	}
	c := ClassOf(err)
	return c == ClassPermanent || c == ClassOrdinary
}

// chainKey marks a message context as running inside the chain; its value
// is the outermost chain's *holdPoison.
type chainKey struct{}

// chainCtx is the message context inside the chain: the message's own
// context with two values, chainKey (the outermost *holdPoison) and
// poisonHooksKey (the delivery's OnPoison steps), in one allocation per
// delivery (two context.WithValue and the hooks were three).
type chainCtx struct {
	context.Context
	p     *holdPoison
	hooks poisonHooks
}

func (c *chainCtx) Value(key any) any {
	switch key.(type) {
	case chainKey:
		return c.p
	case poisonHooksKey:
		return &c.hooks
	}
	return c.Context.Value(key)
}

// holdPoison is the chain's outer layer.
type holdPoison struct {
	cfg    ChainConfig
	logger watermill.LoggerAdapter
	stall  stallWatch
}

func (p *holdPoison) middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		orig := msg.Context()
		if orig.Value(chainKey{}) != nil {
			// A chain inside another chain (router-level and
			// handler-level): the outer one holds and poisons.
			return h(msg)
		}
		inner := &chainCtx{Context: orig, p: p}
		start := time.Now()
		p.stall.begin(p)
		defer p.stall.end()
		defer msg.SetContext(orig)
		returned := false
		defer func() {
			if !returned {
				p.exited(h, msg, inner, start)
			}
		}()
		msg.SetContext(inner)
		produced, err := h(msg)
		msg.SetContext(orig)
		if err != nil {
			produced, err = p.hold(h, msg, inner, start, err)
		}
		returned = true
		return produced, err
	}
}

// errGoexit is the permanent failure of an attempt whose handler ended its
// goroutine with runtime.Goexit (t.FailNow, a require assertion in a
// handler).
var errGoexit = errors.New("idempotency: the handler ended its goroutine (runtime.Goexit, as t.FailNow does): the attempt was rolled back")

// exited ends a delivery whose chain did not return: its handler called
// runtime.Goexit (the attempt was rolled back on the way out), or a panic
// outside the chain's recoverer unwinds through here (re-raised). Watermill's
// router acks or nacks only what its handler returns, so without this the
// delivery stayed unacked and the subscription stopped for good, silently.
// The delivery is dead-lettered as a permanent failure (it would call
// Goexit again at each redelivery) and acked; nacked when that fails.
func (p *holdPoison) exited(h message.HandlerFunc, msg *message.Message, inner *chainCtx, start time.Time) {
	if r := recover(); r != nil {
		panic(r)
	}
	p.logger.Error("Handler ended its goroutine (runtime.Goexit): the attempt was rolled back and the delivery is dead-lettered", errGoexit,
		watermill.LogFields{"message_uuid": msg.UUID, "topic": message.SubscribeTopicFromCtx(inner.Context)})
	if _, err := p.hold(h, msg, inner, start, Permanent(errGoexit)); err != nil {
		msg.Nack()
		return
	}
	msg.Ack()
}

// hold is the outer layer after a failed attempt: it poisons, or holds the
// delivery and re-runs the attempt in place (see NewChain). It is a
// function of its own so that the success path's stack frame stays small:
// the router runs each message on a new goroutine, whose stack is grown
// (copied) every time the chain's frames pass its size.
func (p *holdPoison) hold(h message.HandlerFunc, msg *message.Message, inner *chainCtx, start time.Time, err error) ([]*message.Message, error) {
	orig := inner.Context
	hooks := &inner.hooks
	defer msg.SetContext(orig)
	wait := newBackoff(p.cfg)
	for held := 0; ; held++ {
		if held > 0 {
			msg.SetContext(inner)
			var produced []*message.Message
			produced, err = h(msg)
			msg.SetContext(orig)
			if err == nil {
				return produced, nil
			}
		}
		p.stall.touch()
		if orig.Err() != nil {
			// The message context ended (shutdown): give it back.
			return nil, err
		}
		class := ClassOf(err)
		fields := watermill.LogFields{"message_uuid": msg.UUID, "topic": message.SubscribeTopicFromCtx(orig),
			"handler": p.cfg.Idempotent.handlerNameOf(orig), "class": class.String(), "held": held}
		if class == ClassPermanent || class == ClassOrdinary {
			if !p.poisonLoop(msg, orig) {
				herr := hooks.run(orig)
				if herr == nil {
					if perr := p.poison(msg, orig, err, class, start, wait); perr != nil {
						return nil, perr
					}
					hooks.runPoisoned(orig)
					return nil, nil
				}
				p.logger.Error("A step before poisoning failed (OnPoison): delivery held, not poisoned", herr, fields.Add(watermill.LogFields{"error": err}))
			} else if msg.Metadata.Get(wmw.ReasonForPoisonedKey) == "" {
				// Never poisoned: the handler consumes the poison topic.
				p.logger.Error("Poison topic is the topic this handler consumes: not poisoned, held", err, fields.Add(watermill.LogFields{
					"hint": fmt.Sprintf("ChainConfig.PoisonTopic %q is the topic this handler consumes: give the chain a poison topic of its own "+
						"(a dead-letter queue), and wire the chain per handler, never around the poison topic's consumer", p.cfg.PoisonTopic),
				}))
			} else if t := message.SubscribeTopicFromCtx(orig); t == "" || t == msg.Metadata.Get(wmw.PoisonedTopicKey) {
				p.logger.Error("Dead letter came back to the topic it was dead-lettered from: not re-poisoned, held", err, fields.Add(watermill.LogFields{
					"hint": "it was poisoned twice, the last time less than 10 minutes ago: the dead letters' destination routes back to this consumer " +
						"(a dead-letter queue that is the consumer's own queue, a stream or topic this consumer reads): give them a " +
						"destination it does not read; to reprocess dead letters, redrive them with idem dlq redrive, which strips their poison headers",
				}))
			} else {
				p.logger.Error("Poisoned message failed again on the poison topic's consumer: not re-poisoned, held", err, fields.Add(watermill.LogFields{
					"hint": "wire the chain per handler (middleware.NewHandlerMiddleware), not with router.AddMiddleware on a router that also consumes the poison topic",
				}))
			}
		} else if class == ClassConfiguration {
			hint := ""
			var ce *ConfigurationError
			if errors.As(err, &ce) {
				hint = ce.Hint
			}
			p.logger.Error("Configuration error: delivery held, not poisoned", err, fields.Add(watermill.LogFields{"hint": hint}))
		} else {
			p.logger.Info("Infrastructure failure: delivery held, not poisoned", fields.Add(watermill.LogFields{"error": err}))
		}
		if !p.sleep(orig, start, wait) {
			return nil, err
		}
	}
}

// poisonLoop reports whether poisoning msg would feed it back to itself:
// the handler consumes the poison topic, or msg was poisoned already (it
// carries the poison headers, which a redrive strips) and came back,
// either to a dead-letter handler wrapped by the chain or to the topic it
// was poisoned from, through a dead-letter destination that routes to this
// consumer (the consumer's own queue as its dead-letter queue: each dead
// letter was dead-lettered again, thousands of times a minute).
func (p *holdPoison) poisonLoop(msg *message.Message, ctx context.Context) bool {
	topic := message.SubscribeTopicFromCtx(ctx)
	if topic != "" && topic == p.cfg.PoisonTopic {
		return true
	}
	if msg.Metadata.Get(wmw.ReasonForPoisonedKey) == "" {
		return false
	}
	if topic != "" && topic != msg.Metadata.Get(wmw.PoisonedTopicKey) {
		return true // a dead-letter handler wrapped by the chain
	}
	// Back on the topic it was poisoned from. A redrive that kept the
	// headers (by hand, on a transport idem dlq does not serve) that
	// fails again goes back to the dead letters; a routing loop brings it
	// back again at once: held once it was poisoned twice, the last time
	// within poisonLoopWindow.
	if poisonCount(msg) < 2 {
		return false
	}
	at, err := time.Parse(time.RFC3339Nano, msg.Metadata.Get(MetadataPoisonedAt))
	return err == nil && time.Since(at) < poisonLoopWindow
}

// poisonLoopWindow is how recently a message back on the topic it was
// poisoned from must have been poisoned (a second time or more) to be held
// as a routing loop (poisonLoop) instead of poisoned again.
const poisonLoopWindow = 10 * time.Minute

// poisonCount is how many times msg was poisoned before: its
// MetadataPoisonCount, 1 for a copy poisoned by a release that set none,
// 0 without poison headers.
func poisonCount(msg *message.Message) int {
	if msg.Metadata.Get(wmw.ReasonForPoisonedKey) == "" {
		return 0
	}
	n, err := strconv.Atoi(msg.Metadata.Get(MetadataPoisonCount))
	if err != nil || n < 1 {
		return 1
	}
	return n
}

// poison publishes a copy of msg, with the reason, to the poison topic and
// returns nil (ack) once the publisher returned nil; a failed publish is
// retried with backoff while the delivery is held.
func (p *holdPoison) poison(msg *message.Message, ctx context.Context, cause error, class Class, start time.Time, wait *holdBackoff) error {
	pm := message.NewMessage(msg.UUID, msg.Payload)
	copied, dropped := boundedMetadata(msg.Metadata, p.cfg.MaxCopiedHeaderBytes)
	pm.Metadata = copied
	if len(dropped) > 0 {
		pm.Metadata.Set(MetadataDroppedHeaders, wire.Bound(strings.Join(dropped, ","), p.cfg.MaxHeaderBytes))
	}
	reason := cause.Error()
	if len(reason) > p.cfg.MaxHeaderBytes {
		pm.Metadata.Set(MetadataReasonBytes, strconv.Itoa(len(reason)))
	}
	pm.Metadata.Set(wmw.ReasonForPoisonedKey, wire.Bound(reason, p.cfg.MaxHeaderBytes))
	pm.Metadata.Set(wmw.PoisonedTopicKey, wire.Bound(message.SubscribeTopicFromCtx(ctx), p.cfg.MaxHeaderBytes))
	pm.Metadata.Set(wmw.PoisonedHandlerKey, wire.Bound(p.cfg.Idempotent.handlerNameOf(ctx), p.cfg.MaxHeaderBytes))
	pm.Metadata.Set(wmw.PoisonedSubscriberKey, wire.Bound(message.SubscriberNameFromCtx(ctx), p.cfg.MaxHeaderBytes))
	pm.Metadata.Set(MetadataPoisonedAt, time.Now().UTC().Format(time.RFC3339Nano))
	pm.Metadata.Set(MetadataPoisonCount, strconv.Itoa(poisonCount(msg)+1))
	if class == ClassPermanent {
		pm.Metadata.Set(MetadataPoisonClass, "permanent")
	} else {
		pm.Metadata.Set(MetadataPoisonClass, "exhausted")
	}
	pm.SetContext(ctx)
	poisoned := func(copyOf string) error {
		p.logger.Error("Message poisoned"+copyOf, cause, watermill.LogFields{"message_uuid": msg.UUID,
			"poison_topic": p.cfg.PoisonTopic, "class": class.String()})
		if notice, ok := ctx.Value(poisonNoticeKey{}).(func(string)); ok {
			notice(reason)
		}
		return nil
	}
	tooLargeBefore := false
	for n := 1; ; n++ {
		err := p.cfg.PoisonPublisher.Publish(p.cfg.PoisonTopic, pm)
		if err == nil {
			return poisoned("")
		}
		p.logger.Error("Poison publish failed: delivery held, retrying", err, watermill.LogFields{
			"message_uuid": msg.UUID, "poison_topic": p.cfg.PoisonTopic, "publishes": n})
		tooLarge := refusedForSize(err)
		if tooLarge && tooLargeBefore && len(pm.Payload) > 0 {
			// Refused for its size twice in a row (the original's payload
			// near the transport's limit plus the poison headers): it will
			// never fit. Published without its payload it is the dead
			// letter; refused too, the delivery is held. Any other failure
			// (an outage) only ever waits.
			if p.cfg.PoisonPublisher.Publish(p.cfg.PoisonTopic, withoutPayload(pm, err, p.cfg.MaxHeaderBytes)) == nil {
				return poisoned(" without its payload: the poison topic refused the whole copy for its size")
			}
		}
		tooLargeBefore = tooLarge
		p.stall.touch() // a failed publish is progress, logged on its own
		if !p.sleep(ctx, start, wait) {
			return &InfrastructureError{Op: "poison publish", Err: errors.Join(err, cause)}
		}
	}
}

// refusedForSize reports whether err refused a publish for the message's
// size: an error with a TooLarge() bool method that returns true, or one
// with the text the clients of the library's adapters give that refusal
// (matched as text: the core links none of them):
//   - sarama (Kafka): "Attempt to produce message larger than configured
//     Producer.MaxMessageBytes" (async_producer.go, before sending) and
//     KError 10 MESSAGE_TOO_LARGE "Message was too large";
//   - nats.go: ErrMaxPayload "maximum payload exceeded"; JetStream API
//     error 10054 "message size exceeds maximum allowed";
//   - RabbitMQ: 406 PRECONDITION_FAILED "message size … is larger than
//     configured max size" (max_message_size).
//
// Anything else, a connection refused or a timeout above all, is an
// outage of the poison topic: a wait, never a reason to drop a payload.
func refusedForSize(err error) bool {
	var t interface{ TooLarge() bool }
	if errors.As(err, &t) && t.TooLarge() {
		return true
	}
	text := err.Error()
	for _, s := range [...]string{
		"larger than configured Producer.MaxMessageBytes",
		"Message was too large",
		"maximum payload exceeded",
		"message size exceeds maximum allowed",
		"larger than configured max size",
	} {
		if strings.Contains(text, s) {
			return true
		}
	}
	return false
}

// MetadataPayloadOmitted, on a poisoned copy published without the failed
// message's payload (the poison topic refused the whole copy for its size
// twice in a row, refusedForSize: a payload near the transport's limit,
// plus the poison headers), is the payload's length in bytes and the
// refusal. The copy is flagged malformed (an empty body is no envelope):
// it records the failure, and a redrive has nothing to deliver.
const MetadataPayloadOmitted = "idempotency_payload_omitted"

// withoutPayload returns pm's copy without its payload, flagged malformed,
// with MetadataPayloadOmitted saying why.
func withoutPayload(pm *message.Message, refused error, maxHeader int) *message.Message {
	out := pm.CopyWithContext()
	out.Payload = nil
	note := strconv.Itoa(len(pm.Payload)) + " bytes; the poison topic refused the whole copy: " + refused.Error()
	out.Metadata.Set(MetadataPayloadOmitted, wire.Bound(note, maxHeader))
	if _, malformed := marshaler.Malformed(pm); !malformed {
		out.Metadata.Set(marshaler.MetadataMalformed, "true")
		out.Metadata.Set(marshaler.MetadataMalformedReason, "payload omitted from the dead letter (see "+MetadataPayloadOmitted+")")
	}
	return out
}

// sleep waits for the next backoff interval; false when the message
// context ended or the hold would pass MaxHold.
func (p *holdPoison) sleep(ctx context.Context, start time.Time, b *holdBackoff) bool {
	d := b.next()
	if p.cfg.MaxHold > 0 && time.Since(start)+d > p.cfg.MaxHold {
		return false
	}
	return sleepCtx(ctx, d)
}

// boundedMetadata copies md, leaving out the largest values until keys and
// values add up to at most budget bytes (negative: nothing). It returns the
// copy and the keys left out, sorted. The keys the adapters' encoders need
// to publish the copy (keptForEncoding: the envelope's event name and
// time, the malformed flag and its reason) are never left out: without
// them the copy is no envelope, its every publish was refused, and the
// delivery was held and redelivered for ever (3,000 short headers left
// out a 30-byte occurred_at first). The keys of the delivery received
// (wire.DeliveryScoped: the redelivered flag, the delivery count, the crash
// bound's marks) are never copied.
func boundedMetadata(md message.Metadata, budget int) (message.Metadata, []string) {
	out := make(message.Metadata, len(md))
	total := 0
	for k, v := range md {
		if wire.DeliveryScoped(k) {
			continue // this delivery's, not the copy's: the copy's consumer would take its attempts for redeliveries
		}
		out[k] = v
		total += len(k) + len(v)
	}
	if total <= budget {
		return out, nil
	}
	keys := make([]string, 0, len(md))
	for k := range md {
		if !keptForEncoding(k) && !wire.DeliveryScoped(k) {
			keys = append(keys, k)
		}
	}
	sort.Slice(keys, func(i, j int) bool {
		if len(md[keys[i]]) != len(md[keys[j]]) {
			return len(md[keys[i]]) > len(md[keys[j]])
		}
		return keys[i] < keys[j]
	})
	var dropped []string
	for _, k := range keys {
		if total <= budget && budget >= 0 {
			break
		}
		total -= len(k) + len(md[k])
		delete(out, k)
		dropped = append(dropped, k)
	}
	sort.Strings(dropped)
	return out, dropped
}

// keptForEncoding reports whether key is one an adapter's encoder needs to
// publish a message (marshaler.EncodeMessage, the malformed path).
func keptForEncoding(key string) bool {
	switch key {
	case marshaler.MetadataEventName, marshaler.MetadataOccurredAt, marshaler.MetadataMalformed, marshaler.MetadataMalformedReason:
		return true
	}
	return false
}

// holdBackoff is the capped exponential backoff of holds and poison publishes,
// with ±20 % jitter.
type holdBackoff struct {
	cur, max time.Duration
	mult     float64
}

func newBackoff(cfg ChainConfig) *holdBackoff {
	return &holdBackoff{cur: cfg.InitialInterval, max: cfg.MaxInterval, mult: cfg.Multiplier}
}

func (b *holdBackoff) next() time.Duration {
	d := b.cur
	b.cur = time.Duration(math.Min(float64(b.max), float64(b.cur)*b.mult))
	return time.Duration(float64(d) * (0.8 + 0.4*rand.Float64()))
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

type poisonNoticeKey struct{}

// WithPoisonNotice returns ctx carrying notice, which the chain calls with
// the reason once it has poisoned a message whose context is ctx (the
// publish returned nil; the delivery is then acked): the library's test
// helpers (idempotencytest) tell a poisoned delivery from an applied or
// skipped one, both of which return nil.
func WithPoisonNotice(ctx context.Context, notice func(reason string)) context.Context {
	return context.WithValue(ctx, poisonNoticeKey{}, notice)
}

// poisonHooks are the steps inner middlewares registered with OnPoison for
// one delivery, and those registered with onPoisoned.
type poisonHooks struct {
	mu    sync.Mutex
	keys  []any
	steps map[any]func(context.Context) error
	// poisoned are onPoisoned's steps, run once the poison publish
	// returned nil.
	poisoned map[any]func(context.Context)
}

// onPoisoned registers, for the message whose context is ctx, a step the
// chain runs once it has poisoned that message (the publish returned nil:
// the delivery is then acked), with the message's own context; never when
// the delivery is given back to the broker instead (a publish that failed
// until MaxHold, a shutdown). key identifies the registrant, as for
// OnPoison. It returns false, registering nothing, when ctx is not inside
// the chain.
func onPoisoned(ctx context.Context, key any, step func(context.Context)) bool {
	h, ok := ctx.Value(poisonHooksKey{}).(*poisonHooks)
	if !ok || step == nil {
		return false
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.poisoned == nil {
		h.poisoned = map[any]func(context.Context){}
	}
	h.poisoned[key] = step
	return true
}

// runPoisoned runs the onPoisoned steps.
func (h *poisonHooks) runPoisoned(ctx context.Context) {
	h.mu.Lock()
	steps := make([]func(context.Context), 0, len(h.poisoned))
	for _, step := range h.poisoned {
		steps = append(steps, step)
	}
	h.mu.Unlock()
	for _, step := range steps {
		step(context.WithoutCancel(ctx))
	}
}

type poisonHooksKey struct{}

// OnPoison registers, for the message whose context is ctx, a step the
// chain runs just before it poisons that message (after the retries, with
// the message's own context, outside any attempt's transaction): a
// middleware inside the chain uses it to record what poisoning means for
// it (versioned.LatestFilter retires the family's message, so the family
// never freezes behind it). key identifies the registrant: a later
// attempt's registration under the same key replaces the earlier one. If a
// step returns an error, the message is not poisoned: the delivery is held
// and the attempt re-run later, as for an infrastructure failure. It
// returns false, registering nothing, when ctx is not inside the chain.
func OnPoison(ctx context.Context, key any, step func(context.Context) error) bool {
	h, ok := ctx.Value(poisonHooksKey{}).(*poisonHooks)
	if !ok || step == nil {
		return false
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.steps == nil {
		h.steps = map[any]func(context.Context) error{}
	}
	if _, seen := h.steps[key]; !seen {
		h.keys = append(h.keys, key)
	}
	h.steps[key] = step
	return true
}

// run runs the registered steps in registration order; the first error
// stops it.
func (h *poisonHooks) run(ctx context.Context) error {
	h.mu.Lock()
	keys := append([]any(nil), h.keys...)
	steps := make([]func(context.Context) error, 0, len(keys))
	for _, k := range keys {
		steps = append(steps, h.steps[k])
	}
	h.mu.Unlock()
	for _, step := range steps {
		if err := step(context.WithoutCancel(ctx)); err != nil {
			return err
		}
	}
	return nil
}
