package shop_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/examples/shop"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/outbox"
	"github.com/watermill-idempotency/idempotency/processed"
)

var consumer = shop.Consumer{Name: "stock", Bindings: []string{shop.EventOrderPlaced}}

func TestNames(t *testing.T) {
	t.Parallel()
	var prod shop.Topology
	require.Equal(t, "events", prod.ExchangeName())
	require.Equal(t, "stock.events", prod.Queue(consumer))
	require.Equal(t, "stock.events.dlx", prod.DeadLetterExchange(consumer))
	require.Equal(t, "stock.events.dlq", prod.DeadLetterQueue(consumer))
	test := shop.Topology{Prefix: "t_1.", Exchange: "ev"}
	require.Equal(t, "t_1.ev", test.ExchangeName())
	require.Equal(t, "t_1.stock.events.dlq", test.DeadLetterQueue(consumer))
	require.Equal(t, "t_1.stock.events.reconcile", test.ReconcileQueue(consumer))

	require.NoError(t, prod.Validate(consumer))
	require.ErrorContains(t, prod.Validate(shop.Consumer{Bindings: []string{"x"}}), "Consumer.Name")
	require.ErrorContains(t, prod.Validate(shop.Consumer{Name: "a b", Bindings: []string{"x"}}), "Consumer.Name")
	require.ErrorContains(t, prod.Validate(shop.Consumer{Name: "a"}), "Bindings")
	require.ErrorContains(t, shop.Topology{Prefix: "bad prefix "}.Validate(), "Topology.Prefix")
	require.ErrorContains(t, shop.Topology{Prefetch: -1}.Validate(), "Topology.Prefetch")
}

func TestValidateQuantity(t *testing.T) {
	t.Parallel()
	for _, ok := range []string{"2", "2.000", "0.25", "123456789.123"} {
		require.NoError(t, shop.ValidateQuantity(ok), ok)
	}
	for _, bad := range []string{"", "0", "0.000", "-1", "1e3", "2.0001", " 2", "2.", ".5", "1234567890"} {
		require.ErrorIs(t, shop.ValidateQuantity(bad), shop.ErrBadQuantity, bad)
	}
}

// broker is one test's topology on the real RabbitMQ.
type broker struct {
	t     *testing.T
	topo  shop.Topology
	conn  *amqp091.Connection
	extra []shop.Consumer // deleted with consumer when the test ends
}

func newBroker(t *testing.T) *broker {
	t.Helper()
	conn, err := amqp091.Dial(testenv.AMQPURL())
	require.NoError(t, err, "RabbitMQ at %s unreachable", testenv.AMQPURL())
	b := &broker{t: t, conn: conn, topo: shop.Topology{Prefix: testenv.UniqueName("shop") + ".", Prefetch: 2}}
	t.Cleanup(func() {
		if ch, err := conn.Channel(); err == nil {
			_ = b.topo.Delete(ch, append([]shop.Consumer{consumer}, b.extra...)...)
		}
		_ = conn.Close()
	})
	return b
}

func (b *broker) channel() *amqp091.Channel {
	b.t.Helper()
	ch, err := b.conn.Channel()
	require.NoError(b.t, err)
	b.t.Cleanup(func() { _ = ch.Close() })
	return ch
}

func (b *broker) ready(queue string) int {
	b.t.Helper()
	q, err := b.channel().QueueDeclarePassive(queue, true, false, false, false, nil)
	require.NoError(b.t, err)
	return q.Messages
}

func (b *broker) publish(key string, body []byte) {
	b.t.Helper()
	ch := b.channel()
	require.NoError(b.t, ch.Confirm(false))
	c, err := ch.PublishWithDeferredConfirmWithContext(context.Background(), b.topo.ExchangeName(), key, false, false, amqp091.Publishing{Body: body})
	require.NoError(b.t, err)
	ok, err := c.WaitContext(context.Background())
	require.NoError(b.t, err)
	require.True(b.t, ok)
}

// Declare makes durable quorum queues with a dead-letter exchange and queue
// of their own, routes by event name, and is idempotent.
func TestDeclare(t *testing.T) {
	t.Parallel()
	b := newBroker(t)
	require.NoError(t, b.topo.Declare(b.channel(), consumer))
	require.NoError(t, b.topo.Declare(b.channel(), consumer), "idempotent")

	// The queue is a quorum queue: declaring it classic is refused.
	_, err := b.channel().QueueDeclare(b.topo.Queue(consumer), true, false, false, false, amqp091.Table{"x-queue-type": "classic"})
	var amqpErr *amqp091.Error
	require.ErrorAs(t, err, &amqpErr)
	require.Equal(t, amqp091.PreconditionFailed, amqpErr.Code)

	b.publish(shop.EventOrderPlaced, []byte("bound"))
	b.publish("other.event", []byte("unbound"))
	require.Equal(t, 1, b.ready(b.topo.Queue(consumer)))

	// A message the consumer rejects without requeue is dead-lettered by
	// the broker to the consumer's dead-letter queue.
	ch := b.channel()
	d, ok, err := ch.Get(b.topo.Queue(consumer), false)
	require.NoError(t, err)
	require.True(t, ok)
	require.NoError(t, d.Reject(false))
	testenv.Eventually(t, 5*time.Second, "one message dead-lettered", func(o *testenv.Observed) bool {
		return o.Int("ready(dlq)", b.ready(b.topo.DeadLetterQueue(consumer))) == 1
	})
}

// service starts a consumer service with handler h on a fresh schema.
func startService(t *testing.T, b *broker, h message.NoPublishHandlerFunc, mw ...message.HandlerMiddleware) *shop.Service {
	t.Helper()
	pool, _ := testenv.Pool(t)
	require.NoError(t, processed.Migrate(context.Background(), idempotency.Pgx(pool), processed.Config{}))
	svc, err := shop.NewService(shop.ServiceConfig{
		AMQPURL:    testenv.AMQPURL(),
		Topology:   b.topo,
		Consumer:   consumer,
		Pool:       pool,
		Handler:    h,
		Middleware: mw,
		Idempotency: middleware.ConsumerConfig{
			Retry: middleware.RetryConfig{MaxRetries: 2, InitialInterval: 5 * time.Millisecond, MaxInterval: 20 * time.Millisecond},
		},
	})
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- svc.Run(context.Background()) }()
	t.Cleanup(func() { _ = svc.Close(); <-done })
	select {
	case <-svc.Running():
	case <-time.After(15 * time.Second):
		t.Fatal("service did not start")
	}
	return svc
}

func publishEvent(t *testing.T, b *broker, id string) {
	t.Helper()
	pub, err := wamqp.NewPublisher(b.topo.PublisherConfig(testenv.AMQPURL()), watermill.NopLogger{})
	require.NoError(t, err)
	defer pub.Close()
	msg, err := marshaler.NewMessageWithID(uuid.MustParse(id), shop.EventOrderPlaced, time.Now(), map[string]string{"id": id})
	require.NoError(t, err)
	require.NoError(t, pub.Publish(shop.EventOrderPlaced, msg))
}

// The chain's poison publisher lands a permanent failure, and a failure
// that outlived the retries, in the consumer's dead-letter queue once each,
// with the reason; a transient failure is held and retried in place (never
// requeued, so it spends no delivery limit) and is never poisoned.
func TestPoisonAndTransient(t *testing.T) {
	t.Parallel()
	b := newBroker(t)
	permanentID, buggyID, transientID := uuid.NewString(), uuid.NewString(), uuid.NewString()
	var mu sync.Mutex
	attempts := map[string]int{}
	redelivered := map[string]bool{}
	var transientDone atomic.Bool
	h := func(msg *message.Message) error {
		mu.Lock()
		attempts[msg.UUID]++
		n := attempts[msg.UUID]
		if marshaler.Redelivered(msg) {
			redelivered[msg.UUID] = true
		}
		mu.Unlock()
		switch msg.UUID {
		case permanentID:
			return middleware.Permanent(errors.New("cannot reserve: unknown sku"))
		case buggyID:
			return errors.New("bug")
		case transientID:
			if n <= 4 { // more than MaxRetries+1: held in place, not requeued
				return middleware.Transient(errors.New("database unavailable"))
			}
			transientDone.Store(true)
		}
		return nil
	}
	startService(t, b, h)
	for _, id := range []string{permanentID, buggyID, transientID} {
		publishEvent(t, b, id)
	}
	dlq := b.topo.DeadLetterQueue(consumer)
	testenv.Eventually(t, 20*time.Second, "the transient one done and two dead-lettered", func(o *testenv.Observed) bool {
		return o.Bool("transientDone", transientDone.Load()) && o.Int("ready(dlq)", b.ready(dlq)) == 2
	})

	mu.Lock()
	require.Equal(t, 1, attempts[permanentID], "a permanent error is not retried")
	require.Equal(t, 3, attempts[buggyID], "1 + MaxRetries attempts")
	require.Equal(t, 5, attempts[transientID])
	require.False(t, redelivered[transientID], "the transient failure was held, not given back to the broker")
	mu.Unlock()

	ch := b.channel()
	reasons := map[string]string{}
	for {
		d, ok, err := ch.Get(dlq, true)
		require.NoError(t, err)
		if !ok {
			break
		}
		reason, _ := d.Headers[wmw.ReasonForPoisonedKey].(string)
		reasons[d.MessageId] = reason
	}
	require.Len(t, reasons, 2)
	require.Contains(t, reasons[permanentID], "unknown sku")
	require.Contains(t, reasons[buggyID], "bug")
	require.Equal(t, 0, b.ready(b.topo.Queue(consumer)))
}

// Close waits for the delivery in flight and acks it: a graceful shutdown
// gives no completed work back to the broker.
func TestCloseAcksInFlight(t *testing.T) {
	t.Parallel()
	b := newBroker(t)
	entered, release := make(chan struct{}), make(chan struct{})
	var calls atomic.Int32
	svc := startService(t, b, func(msg *message.Message) error {
		if calls.Add(1) == 1 {
			close(entered)
			<-release
		}
		return nil
	})
	publishEvent(t, b, uuid.NewString())
	<-entered
	closed := make(chan error, 1)
	go func() { closed <- svc.Close() }()
	close(release)
	require.NoError(t, <-closed)
	require.Equal(t, 0, b.ready(b.topo.Queue(consumer)), "acked, not requeued")
	require.EqualValues(t, 1, calls.Load())
}

func TestNewServiceValidates(t *testing.T) {
	t.Parallel()
	_, err := shop.NewService(shop.ServiceConfig{})
	require.ErrorContains(t, err, "AMQPURL")
	_, err = shop.NewService(shop.ServiceConfig{AMQPURL: "amqp://x"})
	require.ErrorContains(t, err, "Pool")

	pool, _ := testenv.Pool(t)
	noop := func(*message.Message) error { return nil }
	pub := func(*message.Message) ([]*message.Message, error) { return nil, nil }
	ob, err := outbox.New(outbox.Config{DB: idempotency.Pgx(pool)}, nil)
	require.NoError(t, err)
	for field, cfg := range map[string]shop.ServiceConfig{
		"Handler or PublishHandler": {},
		"set one, not both":         {Handler: noop, PublishHandler: pub, PublishTopic: "x"},
		"PublishTopic is required":  {PublishHandler: pub},
		"only for PublishHandler":   {Handler: noop, PublishTopic: "x"},
		"Idempotency.Outbox":        {Handler: noop, Idempotency: middleware.ConsumerConfig{Outbox: ob}},
		"Idempotency.Poison":        {Handler: noop, Idempotency: middleware.ConsumerConfig{Poison: middleware.PoisonConfig{Topic: "x"}}},
		"Workers":                   {Handler: noop, Workers: -1},
		"Consumer.Name":             {Handler: noop, Consumer: shop.Consumer{Bindings: []string{"x"}}},
	} {
		cfg.AMQPURL, cfg.Pool = "amqp://x", pool
		if cfg.Consumer.Bindings == nil {
			cfg.Consumer = consumer
		}
		_, err := shop.NewService(cfg)
		require.ErrorContains(t, err, field)
	}
}
