package middleware_test

import (
	"context"
	"os"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/processed"
)

// A consumer wired from the pool to the router: the handler writes its
// effect through the attempt's transaction, which also holds the claim.
func ExampleNewConsumer() {
	ctx := context.Background()
	logger := watermill.NewStdLogger(false, false)
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	db := idempotency.Pgx(pool)
	if err := processed.Migrate(ctx, db, processed.Config{}); err != nil {
		panic(err)
	}
	broker := gochannel.NewGoChannel(gochannel.Config{}, logger) // your transport's subscriber and poison publisher
	c, err := middleware.NewConsumer(middleware.ConsumerConfig{
		Consumer:      "stock",
		DB:            db,
		ReplayHorizon: 7 * 24 * time.Hour,
		Poison:        middleware.PoisonConfig{Publisher: broker, Topic: "stock.poison"},
	}, logger)
	if err != nil {
		panic(err)
	}
	router := message.NewDefaultRouter(logger)
	_, err = c.AddConsumerHandler(router, "reserve_stock", "order.placed", broker, func(msg *message.Message) error {
		tx, _ := middleware.PgxTxFromContext(msg.Context())
		_, err := tx.Exec(msg.Context(), `INSERT INTO reservation (order_json) VALUES ($1)`, msg.Payload)
		return err
	})
	if err != nil {
		panic(err)
	}
	_ = router.Run(ctx)
}
