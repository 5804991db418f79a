package shop

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	amqp091 "github.com/rabbitmq/amqp091-go"

	amqpmarshaler "github.com/watermill-idempotency/idempotency/marshaler/amqp"
)

// ChannelBroker is the shop's embedded broker, for running the examples in
// one process with nothing installed (the demo's default): Watermill's
// in-process pub/sub (GoChannel) plays the events exchange, the topic being
// the event name, and each declared consumer gets an in-memory queue bound
// to its event names, with the at-least-once behaviour of a RabbitMQ queue:
//
//   - Publish returns once every bound queue holds the message (a publisher
//     confirm); a message no queue binds is dropped, as by an exchange.
//   - Messages travel as the AMQP publishing amqpmarshaler.Marshaler makes of them and
//     are decoded by amqpmarshaler.Marshaler on delivery, so a malformed body
//     (PublishRaw) reaches the consumer flagged, exactly as from RabbitMQ.
//   - A nacked delivery is requeued and delivered again with
//     redelivered=true. Cut loses the acks of the deliveries in flight, as a
//     broken connection does: they are delivered again, redelivered=true, on
//     a new session (SessionFromContext).
//   - Each consumer has a dead-letter list (its PoisonPublisher) and, with
//     Consumer.Reconcile, a reconciliation list.
//
// Everything lives in memory and is gone when the process ends: it is a
// stand-in for a broker in examples and tests, not a durable queue.
type ChannelBroker struct {
	pubsub *gochannel.GoChannel
	logger watermill.LoggerAdapter
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu     sync.Mutex
	queues map[string]*memQueue
}

// NewChannelBroker returns an empty broker. A nil logger is
// watermill.NopLogger. Close it at the end.
func NewChannelBroker(logger watermill.LoggerAdapter) *ChannelBroker {
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	ctx, cancel := context.WithCancel(context.Background())
	return &ChannelBroker{
		pubsub: gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, logger),
		logger: logger,
		ctx:    ctx,
		cancel: cancel,
		queues: map[string]*memQueue{},
	}
}

var _ Transport = (*ChannelBroker)(nil)

// Declare creates, idempotently, each consumer's queue and binds it to the
// consumer's event names. Declare consumers before publishing to them.
func (b *ChannelBroker) Declare(consumers ...Consumer) error {
	if err := (Topology{}).Validate(consumers...); err != nil {
		return err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, c := range consumers {
		if _, ok := b.queues[c.Name]; ok {
			continue
		}
		q := newMemQueue()
		b.queues[c.Name] = q
		for _, topic := range c.Bindings {
			msgs, err := b.pubsub.Subscribe(b.ctx, topic)
			if err != nil {
				return fmt.Errorf("shop: bind %s to %s: %w", c.Name, topic, err)
			}
			b.wg.Add(1)
			go func() {
				defer b.wg.Done()
				for m := range msgs {
					q.push(&queuedMessage{wire: m.Copy()})
					m.Ack()
				}
			}()
		}
	}
	return nil
}

func (b *ChannelBroker) queue(c Consumer) (*memQueue, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	q, ok := b.queues[c.Name]
	if !ok {
		return nil, fmt.Errorf("shop: consumer %q not declared on the channel broker", c.Name)
	}
	return q, nil
}

// Close stops every subscription and drops the queues' contents.
func (b *ChannelBroker) Close() error {
	b.cancel()
	err := b.pubsub.Close()
	b.wg.Wait()
	b.mu.Lock()
	for _, q := range b.queues {
		q.close()
	}
	b.mu.Unlock()
	return err
}

// Publisher returns a publisher of events: the Watermill topic is the event
// name, the message goes through amqpmarshaler.Marshaler as it would to RabbitMQ.
func (b *ChannelBroker) Publisher() message.Publisher { return channelPublisher{b} }

type channelPublisher struct{ b *ChannelBroker }

func (p channelPublisher) Publish(topic string, msgs ...*message.Message) error {
	for _, m := range msgs {
		pub, err := amqpmarshaler.Marshaler{}.Marshal(m)
		if err != nil {
			return err
		}
		if err := p.b.publish(topic, pub.MessageId, pub.Body, pub.Headers); err != nil {
			return err
		}
	}
	return nil
}

func (p channelPublisher) Close() error { return nil }

func (b *ChannelBroker) publish(topic, id string, body []byte, headers amqp091.Table) error {
	if id == "" {
		id = watermill.NewUUID()
	}
	wire := message.NewMessage(id, body)
	for k, v := range headers {
		if s, ok := v.(string); ok {
			wire.Metadata.Set(k, s)
		}
	}
	return b.pubsub.Publish(topic, wire)
}

// PublishRaw publishes body as it is, with the message id, to the event
// name topic: how the demo sends malformed messages.
func (b *ChannelBroker) PublishRaw(topic, messageID string, body []byte) error {
	return b.publish(topic, messageID, body, nil)
}

// Cut loses the ack of every delivery of c's queue in flight, as a broken
// connection does: each is delivered again (redelivered=true) on a new
// session once the consumer has finished with it.
func (b *ChannelBroker) Cut(c Consumer) {
	if q, err := b.queue(c); err == nil {
		q.cut()
	}
}

// Queued is the number of messages of c's queue not yet acked: ready or in
// flight.
func (b *ChannelBroker) Queued(c Consumer) (int, error) {
	q, err := b.queue(c)
	if err != nil {
		return 0, err
	}
	return q.pending(), nil
}

// DeadLetter is one message on a consumer's dead-letter list.
type DeadLetter struct {
	// MessageID is the AMQP message id it would carry (the event id, or the
	// id a malformed message was published with).
	MessageID string
	// Headers are its AMQP headers (reason_poisoned among them).
	Headers map[string]string
}

// DrainDeadLetters takes every message off c's dead-letter list.
func (b *ChannelBroker) DrainDeadLetters(c Consumer) ([]DeadLetter, error) {
	q, err := b.queue(c)
	if err != nil {
		return nil, err
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	out := q.dead
	q.dead = nil
	return out, nil
}

// Reconciling is the number of messages on c's reconciliation list.
func (b *ChannelBroker) Reconciling(c Consumer) (int, error) {
	q, err := b.queue(c)
	if err != nil {
		return 0, err
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.reconcile, nil
}

// Subscriber returns a subscriber of c's queue (Transport).
func (b *ChannelBroker) Subscriber(c Consumer, _ watermill.LoggerAdapter) (message.Subscriber, error) {
	q, err := b.queue(c)
	if err != nil {
		return nil, err
	}
	return &channelSubscriber{q: q, closing: make(chan struct{})}, nil
}

// EventsPublisher is Publisher (Transport).
func (b *ChannelBroker) EventsPublisher(watermill.LoggerAdapter) (message.Publisher, error) {
	return b.Publisher(), nil
}

// PoisonPublisher puts messages on c's dead-letter list (Transport).
func (b *ChannelBroker) PoisonPublisher(c Consumer, _ watermill.LoggerAdapter) (message.Publisher, string, error) {
	q, err := b.queue(c)
	if err != nil {
		return nil, "", err
	}
	return listPublisher{q: q}, (Topology{}).DeadLetterQueue(c), nil
}

// ReconcilePublisher puts messages on c's reconciliation list (Transport).
func (b *ChannelBroker) ReconcilePublisher(c Consumer, _ watermill.LoggerAdapter) (message.Publisher, string, error) {
	q, err := b.queue(c)
	if err != nil {
		return nil, "", err
	}
	return listPublisher{q: q, reconcile: true}, (Topology{}).ReconcileQueue(c), nil
}

type listPublisher struct {
	q         *memQueue
	reconcile bool
}

func (p listPublisher) Publish(_ string, msgs ...*message.Message) error {
	for _, m := range msgs {
		pub, err := amqpmarshaler.Marshaler{}.Marshal(m)
		if err != nil {
			return err
		}
		h := make(map[string]string, len(pub.Headers))
		for k, v := range pub.Headers {
			if s, ok := v.(string); ok {
				h[k] = s
			}
		}
		p.q.mu.Lock()
		if p.reconcile {
			p.q.reconcile++
		} else {
			p.q.dead = append(p.q.dead, DeadLetter{MessageID: pub.MessageId, Headers: h})
		}
		p.q.mu.Unlock()
	}
	return nil
}

func (p listPublisher) Close() error { return nil }

// queuedMessage is one message of a queue, as it travels (publishing id,
// body and string headers in a Watermill message).
type queuedMessage struct {
	wire        *message.Message
	redelivered bool
}

// memQueue is one consumer's queue.
type memQueue struct {
	mu        sync.Mutex
	ready     []*queuedMessage
	unacked   int
	session   uint64 // bumped by cut: deliveries of an older session lose their ack
	dead      []DeadLetter
	reconcile int
	notify    chan struct{}
	closed    chan struct{}
	closeOnce sync.Once
}

func newMemQueue() *memQueue {
	return &memQueue{session: 1, notify: make(chan struct{}, 1), closed: make(chan struct{})}
}

func (q *memQueue) push(m *queuedMessage) {
	q.mu.Lock()
	q.ready = append(q.ready, m)
	q.mu.Unlock()
	select {
	case q.notify <- struct{}{}:
	default:
	}
}

// pop takes the next ready message, waiting for one; nil when stop or the
// queue closes first.
func (q *memQueue) pop(stop <-chan struct{}, done <-chan struct{}) (*queuedMessage, uint64) {
	for {
		q.mu.Lock()
		if len(q.ready) > 0 {
			m := q.ready[0]
			q.ready = q.ready[1:]
			q.unacked++
			s := q.session
			more := len(q.ready) > 0
			q.mu.Unlock()
			if more { // let another subscription take the next one
				select {
				case q.notify <- struct{}{}:
				default:
				}
			}
			return m, s
		}
		q.mu.Unlock()
		select {
		case <-q.notify:
		case <-stop:
			return nil, 0
		case <-done:
			return nil, 0
		case <-q.closed:
			return nil, 0
		}
	}
}

// settle ends a delivery of session: acked, it leaves the queue unless the
// session was cut since (the ack is lost); otherwise it is requeued.
func (q *memQueue) settle(m *queuedMessage, session uint64, acked bool) {
	q.mu.Lock()
	q.unacked--
	if acked && q.session == session {
		q.mu.Unlock()
		return
	}
	q.mu.Unlock()
	q.push(&queuedMessage{wire: m.wire, redelivered: true})
}

func (q *memQueue) cut() {
	q.mu.Lock()
	q.session++
	q.mu.Unlock()
}

func (q *memQueue) pending() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.ready) + q.unacked
}

func (q *memQueue) close() { q.closeOnce.Do(func() { close(q.closed) }) }

// channelSubscriber hands out a memQueue's messages, one at a time per
// subscription, decoded by amqpmarshaler.Marshaler, and settles them on the router's
// verdict.
type channelSubscriber struct {
	q         *memQueue
	closing   chan struct{}
	closeOnce sync.Once
	wg        sync.WaitGroup
}

func (s *channelSubscriber) Subscribe(ctx context.Context, _ string) (<-chan *message.Message, error) {
	select {
	case <-s.closing:
		return nil, errors.New("shop: subscriber closed")
	default:
	}
	out := make(chan *message.Message)
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		defer close(out)
		for {
			m, session := s.q.pop(s.closing, ctx.Done())
			if m == nil {
				return
			}
			if !s.deliver(ctx, m, session, out) {
				return
			}
		}
	}()
	return out, nil
}

// deliver hands m to the router and waits for its verdict; false means stop.
func (s *channelSubscriber) deliver(ctx context.Context, m *queuedMessage, session uint64, out chan<- *message.Message) bool {
	headers := amqp091.Table{}
	for k, v := range m.wire.Metadata {
		headers[k] = v
	}
	msg, _ := amqpmarshaler.Marshaler{}.Unmarshal(amqp091.Delivery{
		MessageId: m.wire.UUID, Body: m.wire.Payload, Headers: headers, Redelivered: m.redelivered,
	})
	// As Subscriber: the message context keeps ctx's values, not its
	// cancellation, so a closing router lets the handler commit.
	msgCtx, cancel := context.WithCancel(context.WithValue(context.WithoutCancel(ctx), sessionKey{}, session))
	defer cancel()
	msg.SetContext(msgCtx)
	select {
	case out <- msg:
	case <-s.closing:
		s.q.settle(m, session, false)
		return false
	case <-ctx.Done():
		s.q.settle(m, session, false)
		return false
	}
	var drain <-chan time.Time
	closing := s.closing
	for {
		select {
		case <-msg.Acked():
			s.q.settle(m, session, true)
			return true
		case <-msg.Nacked():
			s.q.settle(m, session, false)
			return true
		case <-closing:
			closing = nil
			drain = time.After(drainTimeout)
		case <-drain:
			cancel()
			s.q.settle(m, session, false)
			return false
		}
	}
}

func (s *channelSubscriber) Close() error {
	s.closeOnce.Do(func() { close(s.closing) })
	s.wg.Wait()
	return nil
}
