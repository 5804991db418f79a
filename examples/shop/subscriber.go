package shop

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"

	amqpmarshaler "github.com/watermill-idempotency/idempotency/marshaler/amqp"
)

// Subscriber is a Watermill subscriber of one consumer's quorum queue. It
// follows watermill-amqp's subscriber contract (one delivery at a time per
// subscription, ack on msg.Ack, nack with requeue on msg.Nack) and differs
// where that one is unsafe for us:
//
//   - Each Subscribe owns its connection and channel, and reconnects after
//     any failure with its own backoff, without shared mutable state:
//     watermill-amqp v3's reconnection reassigns a channel field that other
//     goroutines read without synchronisation (ThreeDotsLabs/watermill#693),
//     which the race detector reports as soon as a connection breaks.
//   - A delivery the marshaler cannot decode (an error from Unmarshal, which
//     amqpmarshaler.Marshaler never returns) is rejected without requeue, so the broker
//     dead-letters it to the consumer's dead-letter exchange with x-death;
//     watermill-amqp nacks it with requeue, a hot loop.
//   - Close, and the cancellation of Subscribe's context (the router cancels
//     it when it starts closing), wait for the delivery in flight to be acked
//     or nacked (at most 30 s) before the channel is closed, and the message
//     context does not inherit that cancellation: a graceful shutdown lets
//     the handler and its COMMIT finish and acks the work, instead of handing
//     it back to the broker for a redelivery (what watermill-amqp does).
//
// When the connection breaks, every unacked delivery (the one in flight
// included) is requeued by the broker and delivered again with
// redelivered=true: the ack of a committed delivery can be lost, which is
// the at-least-once window the consumer's claim closes.
type Subscriber struct {
	url      string
	topology Topology
	consumer Consumer
	unmarsh  wamqp.Marshaler
	logger   watermill.LoggerAdapter
	name     string

	sessions atomic.Uint64 // connections made, for SessionFromContext

	closeOnce sync.Once
	closing   chan struct{}
	wg        sync.WaitGroup
}

type sessionKey struct{}

// SessionFromContext returns, from the context of a message a Subscriber
// delivered, the number of the AMQP connection (session) it arrived on:
// 1, 2, … per Subscriber, a new one on every connection and reconnection.
// Two deliveries of one message on different sessions mean that the first
// connection was lost before its ack reached the broker (the broker then
// redelivers); on one session, that the message was requeued (a nack).
func SessionFromContext(ctx context.Context) (uint64, bool) {
	n, ok := ctx.Value(sessionKey{}).(uint64)
	return n, ok
}

var _ message.Subscriber = (*Subscriber)(nil)

// NewSubscriber returns c's subscriber on the broker at amqpURL, with
// amqpmarshaler.Marshaler and the topology t (declared on every (re)connection). A nil
// logger is watermill.NopLogger. It does not connect: Subscribe does.
func (t Topology) NewSubscriber(amqpURL string, c Consumer, logger watermill.LoggerAdapter) (*Subscriber, error) {
	if err := t.Validate(c); err != nil {
		return nil, err
	}
	if amqpURL == "" {
		return nil, errors.New("shop: NewSubscriber: empty AMQP URL")
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	return &Subscriber{
		url:      amqpURL,
		topology: t.withDefaults(),
		consumer: c,
		unmarsh:  amqpmarshaler.Marshaler{},
		logger:   logger.With(watermill.LogFields{"queue": t.Queue(c)}),
		name:     c.Name + "-subscriber",
		closing:  make(chan struct{}),
	}, nil
}

// Subscribe connects, declares the consumer's topology, and returns the
// channel of its queue's messages (the topic is ignored: the queue is
// Topology.Queue(consumer)). The first connection is made before it returns,
// so a broker that is down or a topology conflict is reported here; later
// failures are retried with backoff (Topology.Reconnect). The channel is
// closed when ctx is done or Close has finished.
func (s *Subscriber) Subscribe(ctx context.Context, _ string) (<-chan *message.Message, error) {
	select {
	case <-s.closing:
		return nil, errors.New("shop: subscriber closed")
	default:
	}
	sess, err := s.connect()
	if err != nil {
		return nil, err
	}
	out := make(chan *message.Message)
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		defer close(out)
		s.run(ctx, sess, out)
	}()
	return out, nil
}

// Close stops every subscription: no new delivery is handed out, the one in
// flight is waited for (acked or nacked), the connections are closed and the
// message channels are closed. Safe to call twice.
func (s *Subscriber) Close() error {
	s.closeOnce.Do(func() { close(s.closing) })
	s.wg.Wait()
	return nil
}

type session struct {
	id         uint64
	conn       *amqp091.Connection
	deliveries <-chan amqp091.Delivery
}

func (s *Subscriber) connect() (*session, error) {
	conn, err := amqp091.DialConfig(s.url, amqp091.Config{
		Heartbeat:  10 * time.Second,
		Locale:     "en_US",
		Properties: amqp091.Table{"connection_name": s.name},
	})
	if err != nil {
		return nil, fmt.Errorf("shop: connect %s: %w", s.name, err)
	}
	ch, err := conn.Channel()
	if err == nil {
		err = s.topology.Declare(ch, s.consumer)
	}
	if err == nil && s.topology.Prefetch > 0 {
		err = ch.Qos(s.topology.Prefetch, 0, false)
	}
	var deliveries <-chan amqp091.Delivery
	if err == nil {
		deliveries, err = ch.Consume(s.topology.Queue(s.consumer), "", false, false, false, false, nil)
	}
	if err != nil {
		_ = conn.Close()
		return nil, fmt.Errorf("shop: subscribe %s: %w", s.topology.Queue(s.consumer), err)
	}
	return &session{id: s.sessions.Add(1), conn: conn, deliveries: deliveries}, nil
}

func (s *Subscriber) run(ctx context.Context, sess *session, out chan<- *message.Message) {
	backoff := s.topology.Reconnect.BackoffInitialInterval
	for {
		s.consume(ctx, sess, out)
		_ = sess.conn.Close()
		for {
			select {
			case <-s.closing:
				return
			case <-ctx.Done():
				return
			case <-time.After(backoff):
			}
			var err error
			sess, err = s.connect()
			if err == nil {
				backoff = s.topology.Reconnect.BackoffInitialInterval
				s.logger.Info("Reconnected to AMQP", nil)
				break
			}
			s.logger.Error("Cannot reconnect to AMQP, retrying", err, watermill.LogFields{"backoff": backoff})
			backoff = time.Duration(float64(backoff) * s.topology.Reconnect.BackoffMultiplier)
			if backoff > s.topology.Reconnect.BackoffMaxInterval {
				backoff = s.topology.Reconnect.BackoffMaxInterval
			}
		}
	}
}

// consume hands deliveries out one at a time until the connection breaks,
// ctx is done or the subscriber closes.
func (s *Subscriber) consume(ctx context.Context, sess *session, out chan<- *message.Message) {
	for {
		select { // closing first: do not take another delivery
		case <-s.closing:
			return
		default:
		}
		var d amqp091.Delivery
		var ok bool
		select {
		case d, ok = <-sess.deliveries:
			if !ok {
				s.logger.Info("AMQP channel closed, reconnecting", nil)
				return
			}
		case <-s.closing:
			return
		case <-ctx.Done():
			return
		}
		if !s.handle(ctx, sess.id, d, out) {
			return
		}
	}
}

// drainTimeout bounds how long a closing subscription waits for the verdict
// on the delivery in flight before it gives the delivery back (nack).
const drainTimeout = 30 * time.Second

// handle hands one delivery to the router and settles it; false means stop
// consuming on this session (closing, or the ack/nack could not be sent).
func (s *Subscriber) handle(ctx context.Context, session uint64, d amqp091.Delivery, out chan<- *message.Message) bool {
	msg, err := s.unmarsh.Unmarshal(d)
	if err != nil {
		s.logger.Error("Cannot unmarshal delivery, rejecting it to the dead-letter exchange", err, nil)
		return d.Reject(false) == nil
	}
	// The message context keeps ctx's values but not its cancellation: the
	// router cancels ctx as soon as it starts closing, and a handler (and the
	// consumer attempt's COMMIT) cut short there would turn completed
	// work into a redelivery. The router bounds the wait (CloseTimeout).
	msgCtx, cancel := context.WithCancel(context.WithValue(context.WithoutCancel(ctx), sessionKey{}, session))
	defer cancel()
	msg.SetContext(msgCtx)

	select {
	case out <- msg:
	case <-s.closing:
		_ = d.Nack(false, true)
		return false
	case <-ctx.Done():
		_ = d.Nack(false, true)
		return false
	}
	// The delivery is in flight: wait for the router's verdict, also while
	// closing, so that completed work is acked.
	var drain <-chan time.Time
	stopping := func() <-chan struct{} {
		if drain != nil {
			return nil
		}
		return ctx.Done()
	}
	closing := s.closing
	for {
		select {
		case <-msg.Acked():
			if err := d.Ack(false); err != nil {
				s.logger.Info("Ack not sent (connection lost); the broker redelivers", watermill.LogFields{"message_uuid": msg.UUID, "err": err})
				return false
			}
			return true
		case <-msg.Nacked():
			if err := d.Nack(false, true); err != nil {
				s.logger.Info("Nack not sent (connection lost); the broker redelivers", watermill.LogFields{"message_uuid": msg.UUID, "err": err})
				return false
			}
			return true
		case <-stopping():
			drain = time.After(drainTimeout)
		case <-closing:
			closing = nil
			if drain == nil {
				drain = time.After(drainTimeout)
			}
		case <-drain:
			s.logger.Info("No verdict on the delivery in flight after the drain timeout; giving it back", watermill.LogFields{"message_uuid": msg.UUID})
			cancel()
			_ = d.Nack(false, true)
			return false
		}
	}
}
