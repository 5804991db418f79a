package jetstream

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"

	"github.com/watermill-idempotency/idempotency/marshaler"
)

// Defaults of [SubscriberConfig].
const (
	// AckWaitDefault bounds how long the messages of a killed consumer wait
	// before JetStream redelivers them.
	AckWaitDefault = 30 * time.Second
	// MaxHoldDefault is how long one delivery may be held by its handler:
	// above the consumer's own hold (middleware.DefaultMaxHold, 25 min),
	// so the consumer gives a held delivery back (a nack: redelivered at
	// once) before the subscriber stops its in-progress acks, and until
	// then JetStream redelivers it nowhere.
	MaxHoldDefault = 30 * time.Minute
	// MaxAckPendingDefault is the consumer's MaxAckPending.
	MaxAckPendingDefault = 1000
	// CloseTimeoutDefault bounds Close's wait for deliveries in flight.
	CloseTimeoutDefault = 30 * time.Second
	// WatchIntervalDefault is how often the durable consumer is checked.
	WatchIntervalDefault = 5 * time.Second
)

// SubscriberConfig configures [NewSubscriber], the recommended JetStream
// subscriber: push subscriptions bound to a durable consumer that this
// package creates when missing (nats.go deletes a durable it created itself
// when the subscription is unsubscribed, which watermill-nats' Close does),
// each delivery acked only after the attempt's outcome.
type SubscriberConfig struct {
	// URL of the NATS server. Required.
	URL string
	// NatsOptions are passed to nats.Connect.
	NatsOptions []nats.Option
	// Stream is the JetStream stream the subscribed topic is stored in. It
	// must exist (streams are provisioned by operators, not by consumers)
	// with limits or work-queue retention: Subscribe refuses interest
	// retention, under which a deleted durable takes its unacked messages
	// with it. Required.
	Stream string
	// Durable names the durable consumer, also its deliver group: every
	// process of one service uses the same name and shares the deliveries.
	// It is created at Subscribe when missing (AckExplicit, MaxDeliver
	// unlimited, deliver-all) and is never deleted by this package. An
	// existing consumer must be a push consumer with explicit acks, this
	// deliver group, the subscribed topic as filter, an AckWait no longer
	// than AckWait and no MaxDeliver (past it JetStream would drop an event
	// held through an outage). Required.
	Durable string
	// AckWait is the consumer's ack deadline: the messages of a consumer
	// killed mid-delivery are redelivered AckWait after their last delivery
	// or progress ack. Defaults to AckWaitDefault; at least one second.
	AckWait time.Duration
	// MaxHold is how long one delivery may stay with its handler (a slow
	// handler, the middleware's retries and hold). While it is held the
	// subscriber sends an in-progress ack every AckWait/3, so a long hold
	// needs no long AckWait; past MaxHold the delivery is given up (not
	// acked) and JetStream redelivers it AckWait later, to a subscription
	// that may take it while the first copy is still held. Defaults to
	// MaxHoldDefault; at least AckWait. Keep it above the consumer's
	// Retry.MaxHold.
	MaxHold time.Duration
	// MaxAckPending is the consumer's bound on deliveries awaiting an ack.
	// Defaults to MaxAckPendingDefault.
	MaxAckPending int
	// SubscribersCount is the number of concurrent subscriptions, each in
	// the deliver group (deliveries of one subscription are handed over one
	// at a time). Defaults to 1.
	SubscribersCount int
	// CloseTimeout bounds Close's wait for deliveries in flight; those still
	// held are not acked and come back AckWait later. Defaults to
	// CloseTimeoutDefault.
	CloseTimeout time.Duration
	// WatchInterval is how often the durable consumer is looked up. A
	// consumer deleted under a running subscriber is recreated from its last
	// known ack floor and consumption resumes; one recreated by someone else
	// with another deliver subject (jsm.go#101: the subscription would
	// silently receive nothing), or one changed in place so that Subscribe
	// would refuse it (a MaxDeliver, a longer AckWait), ends the
	// subscription: its channel closes.
	// Both are logged as errors and counted ([Subscriber.ConsumerLosses],
	// OnConsumerLost). Defaults to WatchIntervalDefault.
	WatchInterval time.Duration
	// OnConsumerLost, when set, is called (from the watch goroutine) each
	// time the durable consumer is found deleted or recreated.
	OnConsumerLost func(ConsumerLost)
	// Decoder decodes received bodies (see [Marshaler]).
	Decoder marshaler.Decoder
}

// ConsumerLost describes a durable consumer found deleted or replaced.
type ConsumerLost struct {
	Stream, Durable string
	// Recreated is true when another consumer of that name was found
	// (created by someone else), false when none was.
	Recreated bool
	// Resumed is true when consumption continues: the consumer was recreated
	// by the subscriber, or the replacement delivers to the same subject.
	Resumed bool
	// Err is the reason the subscription ended when Resumed is false.
	Err error
}

// ErrConsumerLost is the reason a subscription ends when its durable
// consumer was replaced or changed under it into one it cannot keep
// receiving from.
var ErrConsumerLost = errors.New("jetstream: durable consumer deleted, replaced or changed under the subscriber")

func (c SubscriberConfig) withDefaults() SubscriberConfig {
	if c.AckWait == 0 {
		c.AckWait = AckWaitDefault
	}
	if c.MaxHold == 0 {
		c.MaxHold = max(MaxHoldDefault, c.AckWait)
	}
	if c.MaxAckPending == 0 {
		c.MaxAckPending = MaxAckPendingDefault
	}
	if c.SubscribersCount == 0 {
		c.SubscribersCount = 1
	}
	if c.CloseTimeout == 0 {
		c.CloseTimeout = CloseTimeoutDefault
	}
	if c.WatchInterval == 0 {
		c.WatchInterval = WatchIntervalDefault
	}
	return c
}

// Validate reports the first invalid field of c (after defaults).
func (c SubscriberConfig) Validate() error {
	switch {
	case c.URL == "":
		return errors.New("jetstream: SubscriberConfig.URL is required")
	case c.Stream == "":
		return errors.New("jetstream: SubscriberConfig.Stream is required")
	case c.Durable == "":
		return errors.New("jetstream: SubscriberConfig.Durable is required")
	case c.AckWait < time.Second:
		return fmt.Errorf("jetstream: SubscriberConfig.AckWait %s is below 1s", c.AckWait)
	case c.MaxHold < c.AckWait:
		return fmt.Errorf("jetstream: SubscriberConfig.MaxHold %s is below AckWait %s", c.MaxHold, c.AckWait)
	case c.MaxAckPending < 0:
		return errors.New("jetstream: SubscriberConfig.MaxAckPending is negative")
	case c.SubscribersCount < 0:
		return errors.New("jetstream: SubscriberConfig.SubscribersCount is negative")
	case c.CloseTimeout < 0:
		return errors.New("jetstream: SubscriberConfig.CloseTimeout is negative")
	case c.WatchInterval < 0:
		return errors.New("jetstream: SubscriberConfig.WatchInterval is negative")
	}
	return nil
}

// Subscriber is the recommended JetStream subscriber (see
// [SubscriberConfig]). It subscribes to one topic (the consumer's filter
// subject).
//
// It runs its own push subscriptions on nats.go rather than watermill-nats'
// Subscriber, whose loop it otherwise follows: watermill-nats v2.1.3 closes a
// subscription's channel while nats.go callbacks may still be sending on it
// (a data race, and a send on a closed channel when Subscribe's context ends
// as a delivery arrives), and without nats.ManualAck nats.go acks each
// delivery when that callback returns (on Close, on its AckWaitTimeout, on
// an Unmarshal error), before the handler finished. Here a delivery is
// acked (synchronously) on the message's Ack, nacked on its Nack, kept alive
// by in-progress acks in between, and left unacked otherwise; the channel is
// closed only after every callback returned.
type Subscriber struct {
	cfg    SubscriberConfig
	logger watermill.LoggerAdapter
	nc     *nats.Conn
	js     nats.JetStreamContext
	m      Marshaler

	losses atomic.Uint64
	// onLookUp, set by tests before Subscribe, gets the ack floor the watch
	// knows after each look-up.
	onLookUp func(ackFloor uint64)

	mu     sync.Mutex
	closed bool
	sub    *subscription // nil before Subscribe
	done   chan struct{} // closed by Close: stops the watch
	wg     sync.WaitGroup
}

var _ message.Subscriber = (*Subscriber)(nil)

// NewSubscriber connects to cfg.URL and returns the subscriber. A nil logger
// is watermill.NopLogger.
func NewSubscriber(cfg SubscriberConfig, logger watermill.LoggerAdapter) (*Subscriber, error) {
	cfg = cfg.withDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	nc, js, err := connect(cfg.URL, cfg.NatsOptions)
	if err != nil {
		return nil, err
	}
	return &Subscriber{cfg: cfg, logger: logger, nc: nc, js: js, m: Marshaler{Decoder: cfg.Decoder}, done: make(chan struct{})}, nil
}

// ConsumerLosses is the number of times the durable consumer was found
// deleted or replaced under this subscriber.
func (s *Subscriber) ConsumerLosses() uint64 { return s.losses.Load() }

// Subscribe creates the durable consumer when missing (or checks the
// existing one) and subscribes to topic through it: SubscribersCount
// subscriptions bound to it (nats.Bind: never deleted by their
// Unsubscribe) in its deliver group, with manual acks. The channel closes
// when ctx ends, on Close, or when the consumer was replaced under the
// subscriber. It may be called once.
func (s *Subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, errors.New("jetstream: subscriber closed")
	}
	if s.sub != nil {
		return nil, errors.New("jetstream: Subscriber subscribes to one topic; use one Subscriber (and Durable) per topic")
	}
	ci, err := s.ensureConsumer(topic)
	if err != nil {
		return nil, err
	}
	sub := &subscription{
		s: s, ctx: ctx, out: make(chan *message.Message),
		stop: make(chan struct{}), abandon: make(chan struct{}), ended: make(chan struct{}),
		fields: watermill.LogFields{"stream": s.cfg.Stream, "durable": s.cfg.Durable, "topic": topic},
	}
	for range s.cfg.SubscribersCount {
		ns, err := s.js.QueueSubscribe(topic, s.cfg.Durable, sub.handle, nats.Bind(s.cfg.Stream, s.cfg.Durable), nats.ManualAck())
		if err != nil {
			sub.end(0)
			return nil, fmt.Errorf("jetstream: subscribe to %q: %w", topic, err)
		}
		sub.subs = append(sub.subs, ns)
	}
	s.sub = sub
	s.wg.Add(2)
	go func() {
		defer s.wg.Done()
		select {
		case <-ctx.Done():
			sub.end(0)
		case <-sub.ended:
		}
	}()
	go func() {
		defer s.wg.Done()
		s.watch(ctx, sub, topic, ci)
	}()
	return sub.out, nil
}

// subscription is one Subscribe's nats.go subscriptions and channel.
type subscription struct {
	s      *Subscriber
	ctx    context.Context
	subs   []*nats.Subscription
	out    chan *message.Message
	fields watermill.LogFields

	mu       sync.Mutex
	stopping bool
	inFlight sync.WaitGroup // callbacks; Add under mu while !stopping

	stop    chan struct{} // closed first by end: no new delivery reaches out
	abandon chan struct{} // closed by end when its wait is over: unacked deliveries are left
	endOnce sync.Once
	ended   chan struct{} // closed once out is closed
}

// end stops the subscription: no new deliveries, wait (at most wait) for
// the ones with handlers to be acked or nacked, leave the rest unacked,
// close the channel. Safe to call several times and concurrently.
func (sub *subscription) end(wait time.Duration) {
	sub.endOnce.Do(func() {
		sub.mu.Lock()
		sub.stopping = true
		sub.mu.Unlock()
		close(sub.stop)
		for _, ns := range sub.subs {
			// Bound: the consumer is kept. A closed connection has dropped
			// the subscription already.
			if err := ns.Unsubscribe(); err != nil && !errors.Is(err, nats.ErrConnectionClosed) {
				sub.s.logger.Error("JetStream unsubscribe failed", err, sub.fields)
			}
		}
		finished := make(chan struct{})
		go func() { sub.inFlight.Wait(); close(finished) }()
		select {
		case <-finished:
		case <-time.After(wait):
			close(sub.abandon)
			<-finished
		}
		close(sub.out)
		close(sub.ended)
	})
	<-sub.ended
}

// handle is the nats.go callback of one delivery: it hands the message to
// the channel and settles the delivery with the message's outcome.
func (sub *subscription) handle(nm *nats.Msg) {
	sub.mu.Lock()
	if sub.stopping {
		sub.mu.Unlock()
		return // not acked: redelivered after AckWait
	}
	sub.inFlight.Add(1)
	sub.mu.Unlock()
	defer sub.inFlight.Done()

	s := sub.s
	msg, _ := s.m.Unmarshal(nm) // never fails
	fields := sub.fields.Add(watermill.LogFields{"message_uuid": msg.UUID})
	ctx, cancel := context.WithCancel(sub.ctx)
	defer cancel()
	msg.SetContext(ctx)

	select {
	case sub.out <- msg:
	case <-sub.stop:
		return
	case <-ctx.Done():
		return
	}
	tick := time.NewTicker(s.cfg.AckWait / 3)
	defer tick.Stop()
	hold := time.NewTimer(s.cfg.MaxHold)
	defer hold.Stop()
	for {
		select {
		case <-msg.Acked():
			if err := nm.AckSync(); err != nil {
				s.logger.Error("JetStream ack failed; the delivery comes back", err, fields)
			}
			return
		case <-msg.Nacked():
			if err := nm.Nak(); err != nil {
				s.logger.Error("JetStream nak failed; the delivery comes back after AckWait", err, fields)
			}
			return
		case <-tick.C:
			if err := nm.InProgress(); err != nil {
				s.logger.Info("JetStream in-progress ack failed", fields.Add(watermill.LogFields{"err": err}))
				if errors.Is(err, nats.ErrConnectionClosed) {
					return // no ack can be sent any more
				}
			}
		case <-hold.C:
			s.logger.Error("JetStream delivery held past MaxHold, left unacked", nil, fields.Add(watermill.LogFields{"max_hold": s.cfg.MaxHold}))
			return
		case <-sub.abandon:
			return
		case <-ctx.Done():
			return
		}
	}
}

func (s *Subscriber) consumerConfig(topic, deliverSubject string) *nats.ConsumerConfig {
	return &nats.ConsumerConfig{
		Durable:        s.cfg.Durable,
		DeliverSubject: deliverSubject,
		DeliverGroup:   s.cfg.Durable,
		FilterSubject:  topic,
		DeliverPolicy:  nats.DeliverAllPolicy,
		AckPolicy:      nats.AckExplicitPolicy,
		AckWait:        s.cfg.AckWait,
		MaxDeliver:     -1, // the middleware's poison path bounds attempts
		MaxAckPending:  s.cfg.MaxAckPending,
	}
}

// ensureConsumer returns the durable consumer, created when missing. A
// stream with interest retention is refused: when its last consumer goes
// away the server drops every message no consumer is interested in, so a
// durable deleted under the subscriber would take its unacked deliveries
// with it and the watch would recreate it with nothing to deliver. Limits
// and work-queue streams keep a message until it ages out or is acked.
func (s *Subscriber) ensureConsumer(topic string) (*nats.ConsumerInfo, error) {
	si, err := s.js.StreamInfo(s.cfg.Stream)
	if err != nil {
		return nil, fmt.Errorf("jetstream: stream %q: %w", s.cfg.Stream, err)
	}
	if si.Config.Retention == nats.InterestPolicy {
		return nil, fmt.Errorf("jetstream: stream %q has interest retention: a durable consumer deleted under the subscriber would take its unacked messages with it; use limits or work-queue retention", s.cfg.Stream)
	}
	ci, err := s.js.ConsumerInfo(s.cfg.Stream, s.cfg.Durable)
	if errors.Is(err, nats.ErrConsumerNotFound) {
		ci, err = s.js.AddConsumer(s.cfg.Stream, s.consumerConfig(topic, s.deliverSubject()))
	}
	if err != nil {
		return nil, fmt.Errorf("jetstream: durable consumer %q of stream %q: %w", s.cfg.Durable, s.cfg.Stream, err)
	}
	if err := s.checkConsumer(ci, topic); err != nil {
		return nil, err
	}
	return ci, nil
}

// deliverSubject is the push subject of a consumer this package creates.
func (s *Subscriber) deliverSubject() string {
	return "_idem.deliver." + s.cfg.Stream + "." + s.cfg.Durable
}

func (s *Subscriber) checkConsumer(ci *nats.ConsumerInfo, topic string) error {
	c := ci.Config
	bad := func(what string) error {
		return fmt.Errorf("jetstream: durable consumer %q of stream %q: %s", s.cfg.Durable, s.cfg.Stream, what)
	}
	switch {
	case c.DeliverSubject == "":
		return bad("is a pull consumer; a push consumer is needed")
	case c.AckPolicy != nats.AckExplicitPolicy:
		return bad("AckPolicy " + c.AckPolicy.String() + "; AckExplicit is needed")
	case c.DeliverGroup != s.cfg.Durable:
		return bad(fmt.Sprintf("DeliverGroup %q; %q is needed", c.DeliverGroup, s.cfg.Durable))
	case c.FilterSubject != topic:
		return bad(fmt.Sprintf("FilterSubject %q; the topic %q is needed", c.FilterSubject, topic))
	case c.AckWait > s.cfg.AckWait:
		return bad(fmt.Sprintf("AckWait %s exceeds the configured %s", c.AckWait, s.cfg.AckWait))
	case c.MaxDeliver > 0:
		// Past MaxDeliver JetStream stops delivering a message and only
		// publishes an advisory: an event held through an outage (each
		// hold that ends in a nack spends a delivery) or one whose
		// deliveries crash the process would be neither applied nor
		// dead-lettered. The consumer's poison path bounds attempts.
		return bad(fmt.Sprintf("MaxDeliver %d; unlimited (-1) is needed: past it JetStream drops the event without a trace, and the consumer's poison path bounds attempts", c.MaxDeliver))
	}
	return nil
}

// watch looks the durable consumer up every WatchInterval until the
// subscription ends. ci is the consumer the subscription is bound to.
func (s *Subscriber) watch(ctx context.Context, sub *subscription, topic string, ci *nats.ConsumerInfo) {
	fields := watermill.LogFields{"stream": s.cfg.Stream, "durable": s.cfg.Durable}
	deliver, created, ackFloor := ci.Config.DeliverSubject, ci.Created, ci.AckFloor.Stream
	t := time.NewTicker(s.cfg.WatchInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-s.done:
			return
		case <-sub.ended:
			return
		case <-t.C:
		}
		cur, err := s.js.ConsumerInfo(s.cfg.Stream, s.cfg.Durable)
		switch {
		case errors.Is(err, nats.ErrConsumerNotFound):
			cfg := s.consumerConfig(topic, deliver)
			if ackFloor > 0 {
				cfg.DeliverPolicy, cfg.OptStartSeq = nats.DeliverByStartSequencePolicy, ackFloor+1
			}
			cur, err = s.js.AddConsumer(s.cfg.Stream, cfg)
			if err != nil {
				// Someone else may have recreated it meanwhile: the next
				// look-up tells.
				s.logger.Error("JetStream durable consumer deleted; recreating it failed", err, fields)
				continue
			}
			s.lost(ConsumerLost{Stream: s.cfg.Stream, Durable: s.cfg.Durable, Resumed: true}, fields.Add(watermill.LogFields{"start_seq": ackFloor + 1}))
			created = cur.Created
		case err != nil:
			s.logger.Info("JetStream durable consumer look-up failed", fields.Add(watermill.LogFields{"err": err}))
			continue
		case !cur.Created.Equal(created):
			created = cur.Created
			misfit := s.checkConsumer(cur, topic)
			if cur.Config.DeliverSubject == deliver && misfit == nil {
				s.lost(ConsumerLost{Stream: s.cfg.Stream, Durable: s.cfg.Durable, Recreated: true, Resumed: true}, fields)
				break
			}
			if misfit == nil {
				misfit = fmt.Errorf("replaced by one delivering to %q (was %q)", cur.Config.DeliverSubject, deliver)
			}
			s.endLost(sub, true, misfit, fields)
			return
		default:
			// Changed in place (UpdateConsumer keeps Created): a
			// MaxDeliver or a longer AckWait set under the subscriber is
			// the misfit Subscribe refuses.
			if misfit := s.checkConsumer(cur, topic); misfit != nil {
				s.endLost(sub, false, fmt.Errorf("changed in place: %w", misfit), fields)
				return
			}
		}
		ackFloor = max(ackFloor, cur.AckFloor.Stream)
		if s.onLookUp != nil {
			s.onLookUp(ackFloor)
		}
	}
}

// endLost reports the durable consumer lost for reason (recreated by
// someone else, or changed in place) and ends the subscription; the
// deliveries in hand may still be acked.
func (s *Subscriber) endLost(sub *subscription, recreated bool, reason error, fields watermill.LogFields) {
	s.lost(ConsumerLost{Stream: s.cfg.Stream, Durable: s.cfg.Durable, Recreated: recreated, Err: fmt.Errorf("%w: %w", ErrConsumerLost, reason)}, fields)
	go sub.end(s.cfg.CloseTimeout)
}

func (s *Subscriber) lost(l ConsumerLost, fields watermill.LogFields) {
	s.losses.Add(1)
	fields = fields.Add(watermill.LogFields{"recreated_by_other": l.Recreated, "resumed": l.Resumed})
	err := l.Err
	if err == nil {
		err = ErrConsumerLost
	}
	s.logger.Error("JetStream durable consumer deleted or replaced under the subscriber", err, fields)
	if s.cfg.OnConsumerLost != nil {
		s.cfg.OnConsumerLost(l)
	}
}

// Close ends the subscription: no new deliveries; those with handlers get
// CloseTimeout to be acked or nacked, the others are left unacked
// (JetStream redelivers them AckWait later); the durable consumer is kept.
func (s *Subscriber) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	sub := s.sub
	s.mu.Unlock()
	if sub != nil {
		sub.end(s.cfg.CloseTimeout)
	}
	close(s.done)
	s.wg.Wait()
	s.nc.Close()
	return nil
}
