package inbox_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/faultproxy"
	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	amqppoison "github.com/watermill-idempotency/idempotency/marshaler/amqp"
)

func (r *rabbit) subscriber() message.Subscriber {
	r.t.Helper()
	sub, err := amqp.NewSubscriber(r.cfg, watermill.NopLogger{})
	require.NoError(r.t, err)
	return sub
}

func (r *rabbit) poisonPublisher() *amqppoison.ConfirmedPublisher {
	r.t.Helper()
	p, err := amqppoison.NewConfirmedPublisher(amqppoison.ConfirmedPublisherConfig{URL: testenv.AMQPURL()}, nil)
	require.NoError(r.t, err)
	r.t.Cleanup(func() { _ = p.Close() })
	return p
}

func (r *rabbit) publishRaw(body string) {
	r.t.Helper()
	require.NoError(r.t, r.ch.PublishWithContext(context.Background(), "", r.queue, false, false, amqp091.Publishing{Body: []byte(body)}))
}

// TestPoisonReasonLargerThanTheFrameIsTruncated (N03) — a poison reason larger than the broker's frame (200 kB): the
// message reaches the poison queue once with its reason truncated (saying
// so), the original is acked, the handler ran once, the broker closed no
// connection, nothing loops. With watermill-amqp's own publisher (whose
// connection the broker closed before) and with the confirmed one.
func TestPoisonReasonLargerThanTheFrameIsTruncated(t *testing.T) {
	t.Parallel()
	for _, name := range []string{"watermill-amqp publisher", "confirmed poison publisher"} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			r := newRabbit(t)
			var poisonPub message.Publisher
			closed := make(chan *amqp091.Error, 1)
			if name == "watermill-amqp publisher" {
				p, err := amqp.NewPublisher(r.cfg, watermill.NopLogger{})
				require.NoError(t, err)
				t.Cleanup(func() { _ = p.Close() })
				p.Connection().NotifyClose(closed)
				poisonPub = p
			} else {
				poisonPub = r.poisonPublisher()
			}
			mw, err := inbox.NewHandlerMiddleware(inbox.ChainConfig{
				Idempotent: e.idempotent(e.pool), PoisonPublisher: poisonPub, PoisonTopic: r.dlq,
				MaxRetries: 2, InitialInterval: 10 * time.Millisecond, MaxInterval: 100 * time.Millisecond,
			}, nil)
			require.NoError(t, err)
			huge := strings.Repeat("x", 200_000)
			var calls atomic.Int32
			runRouter(t, func(router *message.Router) {
				router.AddNoPublisherHandler("stock", r.queue, r.subscriber(), func(msg *message.Message) error {
					calls.Add(1)
					return inbox.Permanent(fmt.Errorf("order rejected: %s", huge))
				}).AddMiddleware(mw)
			})
			ids := r.publishEvents(1)
			require.Eventually(t, func() bool { return r.depth(r.dlq) == 1 && r.depth(r.queue) == 0 }, 30*time.Second, 20*time.Millisecond)
			d, ok, err := r.ch.Get(r.dlq, true)
			require.NoError(t, err)
			require.True(t, ok)
			require.Equal(t, ids[0], d.MessageId)
			reason, _ := d.Headers[wmw.ReasonForPoisonedKey].(string)
			require.LessOrEqual(t, len(reason), inbox.DefaultMaxHeaderBytes)
			full := len("order rejected: ") + len(huge)
			require.True(t, strings.HasSuffix(reason, fmt.Sprintf("…(truncated, %d bytes)", full)), reason[len(reason)-40:])
			require.True(t, strings.HasPrefix(reason, "order rejected: xxx"))
			require.Equal(t, fmt.Sprint(full), d.Headers[inbox.MetadataReasonBytes])
			require.Equal(t, "permanent", d.Headers[inbox.MetadataPoisonClass])
			require.EqualValues(t, 1, calls.Load(), "the handler ran once: no loop")
			require.Zero(t, r.depth(r.dlq), "poisoned once")
			select {
			case err := <-closed:
				t.Fatalf("the broker closed the poison publisher's connection: %v", err)
			default:
			}
		})
	}
}

// C.11: the dead-letter queue is missing, so the poison publish is returned
// (mandatory): the original is held, not acked, and the publish retried
// with backoff (the handler is not re-run) until the queue exists; then the
// message is poisoned once and acked.
func TestPoisonPublishRetriedUntilRoutable(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	r := newRabbit(t)
	_, err := r.ch.QueueDelete(r.dlq, false, false, false)
	require.NoError(t, err)
	counting := &countingPublisher{Publisher: r.poisonPublisher()}
	mw, err := inbox.NewHandlerMiddleware(inbox.ChainConfig{
		Idempotent: e.idempotent(e.pool), PoisonPublisher: counting, PoisonTopic: r.dlq,
		InitialInterval: 20 * time.Millisecond, MaxInterval: 100 * time.Millisecond,
	}, nil)
	require.NoError(t, err)
	var calls atomic.Int32
	runRouter(t, func(router *message.Router) {
		router.AddNoPublisherHandler("stock", r.queue, r.subscriber(), func(msg *message.Message) error {
			calls.Add(1)
			return inbox.Permanent(fmt.Errorf("unknown order"))
		}).AddMiddleware(mw)
	})
	r.publishEvents(1)
	require.Eventually(t, func() bool { return counting.failed.Load() >= 3 }, 30*time.Second, 10*time.Millisecond)
	require.Equal(t, 0, r.depth(r.queue), "the delivery is held by the consumer (unacked, not ready)")
	purge := func() int {
		n, err := r.ch.QueuePurge(r.queue, false)
		require.NoError(t, err)
		return n
	}
	require.Zero(t, purge(), "still unacked: not back on the queue, not acked")
	_, err = r.ch.QueueDeclare(r.dlq, true, false, false, false, nil)
	require.NoError(t, err)
	require.Eventually(t, func() bool { return r.depth(r.dlq) == 1 }, 30*time.Second, 10*time.Millisecond)
	require.EqualValues(t, 1, calls.Load(), "the publish is retried, not the handler")
	for _, gap := range counting.gaps() {
		require.GreaterOrEqual(t, gap, 10*time.Millisecond, "backoff between publishes, never hot")
	}
}

type countingPublisher struct {
	message.Publisher
	failed atomic.Int32
	mu     sync.Mutex
	times  []time.Time
}

func (c *countingPublisher) Publish(topic string, msgs ...*message.Message) error {
	err := c.Publisher.Publish(topic, msgs...)
	if err != nil {
		c.failed.Add(1)
	}
	c.mu.Lock()
	c.times = append(c.times, time.Now())
	c.mu.Unlock()
	return err
}

func (c *countingPublisher) gaps() []time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	var g []time.Duration
	for i := 1; i < len(c.times); i++ {
		g = append(g, c.times[i].Sub(c.times[i-1]))
	}
	return g
}

// TestOutageLongerThanTheDeliveryLimitIsNotDeadLettered (N10) — a database outage longer than the queue's delivery limit: a
// quorum queue with x-delivery-limit 3, the recommended chain (MaxRetries
// 2), the consumer's PostgreSQL refused by a proxy for 25 s (the case's
// length); one message published at the start. It is not dead-lettered
// during the outage (the delivery is held, not nacked per failed attempt):
// the broker delivers it exactly once, the chain logs the hold at info
// repeatedly (the outage really hit the attempts), nothing at error, the
// DLQ stays at 0 while sampled and at the end, and the message is applied
// once after recovery. Without the hold, each delivery fails within ≈ 0.3 s
// and the fourth nack dead-letters it.
func TestOutageLongerThanTheDeliveryLimitIsNotDeadLettered(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	r := newRabbit(t)
	_, err := r.ch.QueueDelete(r.queue, false, false, false)
	require.NoError(t, err)
	args := amqp091.Table{"x-queue-type": "quorum", "x-delivery-limit": int32(3),
		"x-dead-letter-exchange": "", "x-dead-letter-routing-key": r.dlq}
	_, err = r.ch.QueueDeclare(r.queue, true, false, false, false, args)
	require.NoError(t, err, "quorum queues need RabbitMQ ≥ 3.8")
	r.cfg.Queue.Arguments = args

	cfg := testenv.PoolConfig(t, testenv.PostgresURL(), e.schema, 2)
	proxy, err := faultproxy.Start(fmt.Sprintf("%s:%d", cfg.ConnConfig.Host, cfg.ConnConfig.Port))
	require.NoError(t, err)
	defer proxy.Close()
	cfg.ConnConfig.Host, cfg.ConnConfig.Port = "127.0.0.1", uint16(proxy.Port())
	proxied, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	defer proxied.Close()

	logger := &captureLogger{}
	mw, err := inbox.NewHandlerMiddleware(inbox.ChainConfig{
		Idempotent: e.idempotent(proxied), PoisonPublisher: r.poisonPublisher(), PoisonTopic: r.dlq,
		MaxRetries: 2, MaxInterval: 500 * time.Millisecond,
	}, logger)
	require.NoError(t, err)
	var calls, deliveries atomic.Int32
	countDeliveries := func(h message.HandlerFunc) message.HandlerFunc { // outside the chain: once per broker delivery
		return func(msg *message.Message) ([]*message.Message, error) {
			deliveries.Add(1)
			return h(msg)
		}
	}
	held := func() int { return len(logger.at("info", "Infrastructure failure: delivery held, not poisoned")) }
	const outage = 25 * time.Second
	proxy.Refuse(time.Hour) // ended by Restore after the sampling below
	end := time.Now().Add(outage)
	runRouter(t, func(router *message.Router) {
		router.AddNoPublisherHandler("stock", r.queue, r.subscriber(), func(msg *message.Message) error {
			calls.Add(1)
			return writeEffect(msg, "reserved")
		}).AddMiddleware(countDeliveries, mw)
	})
	ids := r.publishEvents(1)
	for time.Now().Before(end) {
		require.Zero(t, r.depth(r.dlq), "dead-lettered by the broker during the outage")
		time.Sleep(200 * time.Millisecond) // sampling cadence, not a wait for work
	}
	heldDuringOutage := held()
	require.GreaterOrEqual(t, heldDuringOutage, 3, "the outage hit the attempts, which were held in place")
	require.Zero(t, calls.Load(), "no handler call without the database")
	proxy.Restore()
	require.Eventually(t, func() bool { return e.effects(ids[0]) == 1 }, 30*time.Second, 20*time.Millisecond)
	require.Eventually(t, func() bool { return r.depth(r.queue) == 0 }, 10*time.Second, 20*time.Millisecond)
	require.Zero(t, r.depth(r.dlq), "DLQ 0")
	require.Equal(t, 1, e.processed(ids[0]))
	require.EqualValues(t, 1, calls.Load())
	require.EqualValues(t, 1, deliveries.Load(), "delivered once by the broker: held, never nacked back")
	require.Empty(t, logger.at("error", ""), "an outage is logged at info, not error")
}
