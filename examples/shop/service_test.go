package shop_test

import (
	"context"
	"errors"
	"net"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/examples/shop"
	"github.com/watermill-idempotency/idempotency/internal/faultproxy"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/operation"
	"github.com/watermill-idempotency/idempotency/outbox"
	"github.com/watermill-idempotency/idempotency/processed"
)

// eventProduced is the event the publishing handlers of these tests produce.
const eventProduced = "test.thing.produced.v1"

// tap is a queue bound to eventProduced: what a downstream consumer gets.
var tap = shop.Consumer{Name: "tap", Bindings: []string{eventProduced}}

// runService builds cfg on b's topology and a fresh schema (processed-event
// table, and the outbox's tables when cfg.Outbox is set), runs it until the
// test ends and waits until it runs. cfg.Pool, when set, is that schema's
// pool (the outbox's handle); otherwise a fresh one.
func runService(t *testing.T, b *broker, cfg shop.ServiceConfig) *pgxpool.Pool {
	t.Helper()
	ctx := context.Background()
	pool := cfg.Pool
	if pool == nil {
		pool, _ = testenv.Pool(t)
	}
	require.NoError(t, processed.Migrate(ctx, idempotency.Pgx(pool), processed.Config{}))
	if cfg.Outbox != nil {
		require.NoError(t, cfg.Outbox.Migrate(ctx))
	}
	cfg.AMQPURL, cfg.Topology, cfg.Pool = testenv.AMQPURL(), b.topo, pool
	if cfg.Consumer.Name == "" {
		cfg.Consumer = consumer
	}
	cfg.Idempotency.Retry = middleware.RetryConfig{MaxRetries: 2, InitialInterval: 5 * time.Millisecond, MaxInterval: 20 * time.Millisecond}
	svc, err := shop.NewService(cfg)
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- svc.Run(context.Background()) }()
	t.Cleanup(func() {
		require.NoError(t, svc.Close())
		require.NoError(t, <-done)
	})
	select {
	case <-svc.Running():
	case err := <-done:
		t.Fatalf("service stopped: %v", err)
	case <-time.After(15 * time.Second):
		t.Fatal("service did not start")
	}
	return pool
}

// produceOne is a publishing handler: one message per input event, with an
// id derived from the input's, so every attempt produces the same one. Its
// first attempt fails after producing (the attempt rolls back).
func produceOne(failFirst *atomic.Bool) message.HandlerFunc {
	ns := uuid.MustParse("0f3c2a4e-5b6d-4e7f-8a9b-0c1d2e3f4a5b")
	return func(msg *message.Message) ([]*message.Message, error) {
		out, err := marshaler.NewMessageWithID(uuid.NewSHA1(ns, []byte(msg.UUID)), eventProduced, time.Now(), map[string]string{"from": msg.UUID})
		if err != nil {
			return nil, err
		}
		if failFirst.CompareAndSwap(true, false) {
			return []*message.Message{out}, errors.New("disk full")
		}
		return []*message.Message{out}, nil
	}
}

// drain takes every message out of queue.
func (b *broker) drain(queue string) []amqp091.Delivery {
	b.t.Helper()
	ch := b.channel()
	var out []amqp091.Delivery
	for {
		d, ok, err := ch.Get(queue, true)
		require.NoError(b.t, err)
		if !ok {
			return out
		}
		out = append(out, d)
	}
}

// A publishing handler with the outbox: the produced message is written in
// the attempt's transaction and relayed by the service. A failed attempt
// produces nothing, a redelivery (a duplicate) produces nothing: downstream
// receives one message per input event, with the id it was written with.
func TestPublishHandlerThroughOutbox(t *testing.T) {
	t.Parallel()
	b := newBroker(t)
	b.extra = append(b.extra, tap)
	require.NoError(t, b.topo.Declare(b.channel(), tap))
	pool, _ := testenv.Pool(t)
	ob, err := outbox.New(outbox.Config{DB: idempotency.Pgx(pool), Table: "shop_outbox"}, nil)
	require.NoError(t, err)
	var failFirst atomic.Bool
	failFirst.Store(true)
	runService(t, b, shop.ServiceConfig{
		Pool:           pool,
		PublishHandler: produceOne(&failFirst),
		PublishTopic:   eventProduced,
		Outbox:         ob,
		Relay:          outbox.RelayConfig{PollInterval: 10 * time.Millisecond, Retention: time.Hour},
	})
	id := uuid.NewString()
	publishEvent(t, b, id)
	publishEvent(t, b, id) // the producer's relay republished it

	q := b.topo.Queue(tap)
	testenv.Eventually(t, 20*time.Second, "a message in "+q, func(o *testenv.Observed) bool { return o.Int("ready", b.ready(q)) >= 1 })
	var processed int
	testenv.Eventually(t, 20*time.Second, "the event processed and acked", func(o *testenv.Observed) bool {
		require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(*) FROM processed_event`).Scan(&processed))
		return o.Int("processed", processed) == 1 && o.Int("ready(queue)", b.ready(b.topo.Queue(consumer))) == 0
	})
	got := b.drain(q) // the outbox holds one row (below): nothing else can come

	require.Len(t, got, 1)
	require.False(t, failFirst.Load(), "the first attempt failed")
	env, err := marshaler.Decode(got[0].Body, 0)
	require.NoError(t, err)
	require.Equal(t, eventProduced, env.EventName)
	require.JSONEq(t, `{"from":"`+id+`"}`, string(env.Payload))
	// One row was written and relayed (kept in the archive): the failed
	// attempt's row rolled back.
	// The relay deletes and archives the row in the transaction after the
	// broker's confirm: wait for that commit (the message may be seen first).
	testenv.Eventually(t, 10*time.Second, "the row relayed and archived, the failed attempt's row rolled back", func(o *testenv.Observed) bool {
		var pending, relayed int
		err := pool.QueryRow(context.Background(), `SELECT (SELECT count(*) FROM shop_outbox), (SELECT count(*) FROM shop_outbox_relayed)`).Scan(&pending, &relayed)
		return o.Err("err", err) && o.Int("pending", pending) == 0 && o.Int("relayed", relayed) == 1
	})
	var rows int
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(*) FROM shop_outbox_relayed`).Scan(&rows))
	require.Equal(t, 1, rows)
}

// Without an outbox the router publishes the produced message after the
// commit.
func TestPublishHandlerWithoutOutbox(t *testing.T) {
	t.Parallel()
	b := newBroker(t)
	b.extra = append(b.extra, tap)
	require.NoError(t, b.topo.Declare(b.channel(), tap))
	var failFirst atomic.Bool
	runService(t, b, shop.ServiceConfig{PublishHandler: produceOne(&failFirst), PublishTopic: eventProduced})
	publishEvent(t, b, uuid.NewString())
	q := b.topo.Queue(tap)
	testenv.Eventually(t, 20*time.Second, "one message in "+q, func(o *testenv.Observed) bool { return o.Int("ready", b.ready(q)) == 1 })
}

// With Consumer.Reconcile, an operation whose outcome is uncertain and
// needs reconciliation lands once in the consumer's reconciliation queue,
// with its key, and is acked: not retried, not dead-lettered. The chain's
// AfterPoison middleware given by the caller still runs, inside the route.
func TestReconcileQueue(t *testing.T) {
	t.Parallel()
	b := newBroker(t)
	billing := shop.Consumer{Name: "billing", Bindings: []string{shop.EventOrderPlaced}, Reconcile: true}
	b.extra = append(b.extra, billing)
	var calls, inner atomic.Int32
	runService(t, b, shop.ServiceConfig{
		Consumer: billing,
		Handler: func(*message.Message) error {
			calls.Add(1)
			return &operation.UncertainError{Key: "charge:o-1", Kind: "charge", Attempts: 1, Cause: errors.New("provider timed out")}
		},
		Idempotency: middleware.ConsumerConfig{AfterPoison: []message.HandlerMiddleware{func(h message.HandlerFunc) message.HandlerFunc {
			return func(msg *message.Message) ([]*message.Message, error) {
				inner.Add(1)
				return h(msg)
			}
		}}},
	})
	id := uuid.NewString()
	publishEvent(t, b, id)
	rq := b.topo.ReconcileQueue(billing)
	testenv.Eventually(t, 20*time.Second, "the uncertain operation routed to reconciliation", func(o *testenv.Observed) bool {
		return o.Int("ready(reconcile)", b.ready(rq)) == 1 && o.Int("ready(queue)", b.ready(b.topo.Queue(billing))) == 0
	})
	got := b.drain(rq)
	require.Len(t, got, 1)
	require.Equal(t, id, got[0].MessageId)
	require.Equal(t, "charge:o-1", got[0].Headers[operation.MetadataKey])
	require.Contains(t, got[0].Headers[operation.MetadataReason], "needs reconciliation")
	_, poisoned := got[0].Headers[wmw.ReasonForPoisonedKey]
	require.False(t, poisoned)
	require.Zero(t, b.ready(b.topo.DeadLetterQueue(billing)))
	require.EqualValues(t, 1, calls.Load(), "not retried")
	require.EqualValues(t, 1, inner.Load())
}

// SessionFromContext numbers the subscriber's connections: a delivery whose
// connection was lost before its ack comes back on the next session.
func TestSessionFromContext(t *testing.T) {
	t.Parallel()
	b := newBroker(t)
	require.NoError(t, b.topo.Declare(b.channel(), consumer))
	uri, err := amqp091.ParseURI(testenv.AMQPURL())
	require.NoError(t, err)
	proxy, err := faultproxy.Start(net.JoinHostPort(uri.Host, strconv.Itoa(uri.Port)))
	require.NoError(t, err)
	t.Cleanup(func() { _ = proxy.Close() })
	uri.Host, uri.Port = "127.0.0.1", proxy.Port()
	sub, err := b.topo.NewSubscriber(uri.String(), consumer, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	msgs, err := sub.Subscribe(context.Background(), "")
	require.NoError(t, err)

	id := uuid.NewString()
	publishEvent(t, b, id)
	next := func() *message.Message {
		select {
		case m := <-msgs:
			return m
		case <-time.After(20 * time.Second):
			t.Fatal("no delivery")
			return nil
		}
	}
	first := next()
	s1, ok := shop.SessionFromContext(first.Context())
	require.True(t, ok)
	require.EqualValues(t, 1, s1)
	proxy.Cut() // the ack cannot reach the broker
	first.Ack()
	again := next()
	again.Ack()
	require.Equal(t, id, again.UUID)
	require.True(t, marshaler.Redelivered(again))
	s2, ok := shop.SessionFromContext(again.Context())
	require.True(t, ok)
	require.Greater(t, s2, s1)
	_, ok = shop.SessionFromContext(context.Background())
	require.False(t, ok)
}
