// Command amqpservice is the smallest service a user builds with this
// library on RabbitMQ: a Watermill router consuming through the AMQP
// adapter, handlers working in the attempt's pgx transaction. It is not
// run; scripts/check-modules.sh measures its module graph (what the core
// and one adapter weigh in a user's go.mod) and builds it.
package main

import (
	"context"
	"errors"
	"log"
	"os"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	idamqp "github.com/watermill-idempotency/idempotency/marshaler/amqp"
	"github.com/watermill-idempotency/idempotency/middleware"
)

func main() {
	ctx := context.Background()
	logger := watermill.NewSlogLogger(nil)
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	cfg := amqp.NewDurableQueueConfig(os.Getenv("AMQP_URL"))
	cfg.Marshaler = idamqp.Marshaler{}
	sub, err := amqp.NewSubscriber(cfg, logger)
	if err != nil {
		log.Fatal(err)
	}
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		log.Fatal(err)
	}
	router.AddConsumerHandler("reserve_stock", "order.placed", sub, func(msg *message.Message) error {
		tx, ok := middleware.PgxTxFromContext(msg.Context())
		if !ok {
			return errors.New("no attempt transaction: the consumer middleware is not attached")
		}
		_, err := tx.Exec(msg.Context(), `INSERT INTO reservation (event_id) VALUES ($1)`, msg.UUID)
		return err
	})
	if err := router.Run(ctx); err != nil {
		log.Fatal(err)
	}
}
