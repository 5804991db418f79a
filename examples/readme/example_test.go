package readme_test

import (
	"context"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-idempotency/idempotency"
	idamqp "github.com/watermill-idempotency/idempotency/marshaler/amqp"
	"github.com/watermill-idempotency/idempotency/middleware"
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
	poison, err := idamqp.NewPoisonPublisher(poisonCfg, logger) // confirmed, mandatory
	if err != nil {
		return err
	}
	c, err := middleware.NewConsumer(middleware.ConsumerConfig{
		Consumer:      "stock", // the claim key's name, shared by every worker of this consumer
		DB:            idempotency.Pgx(pool),
		ReplayHorizon: 7 * 24 * time.Hour, // older events are refused; their rows may be purged
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
