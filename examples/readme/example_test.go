package readme_test

import (
	"context"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/marshaler"
	idamqp "github.com/watermill-idempotency/idempotency/marshaler/amqp"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/outbox"
)

// README:begin
func runStock(ctx context.Context, pool *pgxpool.Pool, amqpURL string, logger watermill.LoggerAdapter) error {
	subCfg := amqp.NewDurableTopicConfig(amqpURL, "events", "stock.events")
	subCfg.Marshaler = idamqp.Marshaler{} // the JSON envelope; a malformed body is flagged, never an error
	sub, err := amqp.NewSubscriber(subCfg, logger)
	if err != nil {
		return err
	}
	dl := idamqp.DeadLetterConfig{Subscriber: subCfg, Topic: "stock.events.dlq", Quorum: true}
	poisonCfg, err := idamqp.DeclareDeadLetter(dl) // a dead-letter queue of its own
	if err != nil {
		return err
	}
	poison, err := idamqp.NewConfirmedPublisher(poisonCfg, logger) // confirmed, mandatory
	if err != nil {
		return err
	}
	c, err := middleware.NewConsumer(middleware.ConsumerConfig{
		Consumer:      "stock", // the claim key's name, shared by every worker of this consumer
		DB:            idempotency.Pgx(pool),
		ReplayHorizon: 7 * 24 * time.Hour, // older events are refused; processed.Purger deletes their rows
		Poison:        middleware.PoisonConfig{Publisher: poison, Topic: dl.PoisonTopic()},
	}, logger)
	if err != nil {
		return err
	}
	router := message.NewDefaultRouter(logger)
	if _, err := c.AddConsumerHandler(router, "reserve_stock", "order.placed", sub, func(msg *message.Message) error {
		tx, _ := middleware.PgxTxFromContext(msg.Context()) // the attempt's transaction, claim included
		_, err := tx.Exec(msg.Context(), `INSERT INTO reservation (order_json) VALUES ($1)`, msg.Payload)
		return err // nil: commit, ack; error: rollback, retry, then poison
	}); err != nil {
		return err
	}
	return router.Run(ctx)
}

// README:end

var _ = runStock

// README:producer:begin
func placeOrder(ctx context.Context, pool *pgxpool.Pool, ob *outbox.Outbox, id string, total int) error {
	tx, err := pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx) // a no-op after Commit
	if _, err := tx.Exec(ctx, `INSERT INTO orders (id, total) VALUES ($1, $2)`, id, total); err != nil {
		return err
	}
	pub, err := ob.PgxPublisher(tx)
	if err != nil {
		return err
	}
	msg, err := marshaler.NewMessage("order.placed", map[string]any{"id": id, "total": total}) // event_id: a UUIDv7
	if err != nil {
		return err
	}
	if err := pub.Publish("order.placed", msg); err != nil { // stored iff tx commits
		return err
	}
	return tx.Commit(ctx)
}

// runRelay publishes what committed; one per service. ob is
// outbox.New(outbox.Config{DB: idempotency.Pgx(pool)}, logger), its tables
// made once with ob.Migrate(ctx).
func runRelay(ctx context.Context, ob *outbox.Outbox, amqpURL string, logger watermill.LoggerAdapter) error {
	// Confirmed and mandatory: a row whose topic no queue is bound to yet
	// stays in the outbox, holding back only its topic's later rows, never
	// dead-lettered, logged with its topic until a queue is bound
	// (watermill-amqp's publisher would drop it).
	pub, err := idamqp.NewConfirmedPublisher(idamqp.ConfirmedPublisherConfig{URL: amqpURL, Exchange: "events"}, logger)
	if err != nil {
		return err
	}
	relay, err := ob.NewRelay(pub, outbox.RelayConfig{})
	if err != nil {
		return err
	}
	return relay.Run(ctx)
}

// README:producer:end

var _, _ = placeOrder, runRelay
