package main

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	idemamqp "github.com/watermill-idempotency/idempotency/marshaler/amqp"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/processed"
)

// The README's quick start wires its consumer on amqp.NewDurableTopicConfig
// (an "events" topic exchange, a "stock.events" queue bound with the routing
// key "order.placed") and its dead-letter queue with idamqp.DeclareDeadLetter.
// operations.md: `dlq redrive QUEUE --all` copies each dead letter "back to
// the origin queue (x-first-death-queue, else topic_poisoned)", and `dlq
// list` shows that origin queue. On this layout the origin it finds is the
// routing key "order.placed", which names no queue: every dead letter is
// left ("queue \"order.placed\" does not exist", exit 4), so the README's
// consumer cannot be redriven without the operator knowing --to.
func TestDLQRedriveReadmeTopicLayout(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := testenv.Pool(t)
	db := idempotency.Pgx(pool)
	if err := processed.Migrate(ctx, db, processed.Config{}); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE effect (event_id uuid NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	prefix := testenv.UniqueName("idem_readme") + "."
	exchange, queue, dlq := prefix+"events", prefix+"stock.events", prefix+"stock.events.dlq"
	conn, err := amqp091.Dial(testenv.AMQPURL())
	if err != nil {
		t.Fatalf("RabbitMQ at %s unreachable: %v", testenv.AMQPURL(), err)
	}
	t.Cleanup(func() {
		for _, q := range []string{queue, dlq} {
			if ch, err := conn.Channel(); err == nil {
				_, _ = ch.QueueDelete(q, false, false, false)
				_ = ch.Close()
			}
		}
		for _, x := range []string{exchange, dlq} {
			if ch, err := conn.Channel(); err == nil {
				_ = ch.ExchangeDelete(x, false, false)
				_ = ch.Close()
			}
		}
		_ = conn.Close()
	})

	// The README's consumer, its handler failing permanently until fixed.
	logger := watermill.NopLogger{}
	subCfg := wamqp.NewDurableTopicConfig(testenv.AMQPURL(), exchange, queue)
	subCfg.Marshaler = idemamqp.Marshaler{}
	sub, err := wamqp.NewSubscriber(subCfg, logger)
	if err != nil {
		t.Fatal(err)
	}
	dl := idemamqp.DeadLetterConfig{Subscriber: subCfg, Topic: dlq, Quorum: true}
	poisonCfg, err := idemamqp.DeclareDeadLetter(dl)
	if err != nil {
		t.Fatal(err)
	}
	poison, err := idemamqp.NewConfirmedPublisher(poisonCfg, logger)
	if err != nil {
		t.Fatal(err)
	}
	c, err := middleware.NewConsumer(middleware.ConsumerConfig{
		Consumer: testConsumer, DB: db,
		Poison: middleware.PoisonConfig{Publisher: poison, Topic: dl.PoisonTopic()},
		Retry:  middleware.RetryConfig{InitialInterval: time.Millisecond, MaxInterval: 5 * time.Millisecond},
	}, logger)
	if err != nil {
		t.Fatal(err)
	}
	var buggy atomic.Bool
	buggy.Store(true)
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.AddConsumerHandler(router, "reserve_stock", "order.placed", sub, func(msg *message.Message) error {
		if buggy.Load() {
			return middleware.Permanent(errors.New("stock: unknown product sku-42"))
		}
		tx, _ := middleware.PgxTxFromContext(msg.Context())
		_, err := tx.Exec(msg.Context(), `INSERT INTO effect (event_id) VALUES ($1)`, msg.UUID)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { defer close(done); _ = router.Run(ctx) }()
	<-router.Running()
	t.Cleanup(func() { _ = router.Close(); <-done; _ = poison.Close() })

	// The README's relay publisher: the events exchange, the event name as topic.
	pub, err := idemamqp.NewConfirmedPublisher(idemamqp.ConfirmedPublisherConfig{URL: testenv.AMQPURL(), Exchange: exchange}, logger)
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	msg, err := marshaler.NewMessage("order.placed", map[string]any{"id": "o-1"})
	if err != nil {
		t.Fatal(err)
	}
	if err := pub.Publish("order.placed", msg); err != nil {
		t.Fatal(err)
	}
	depth := func(q string) int {
		n, err := queueDepth(conn, q)
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	eventually(t, "the dead letter", func() bool { return depth(dlq) == 1 })
	buggy.Store(false) // the bug is fixed: redrive

	r := idem(t, schema, "dlq", "redrive", dlq, "--all")
	wantCode(t, r, exitOK)
	eventually(t, "the redriven event applied", func() bool {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM effect WHERE event_id = $1`, msg.UUID).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n == 1 && depth(dlq) == 0
	})
}
