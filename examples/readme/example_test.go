package readme_test

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	idamqp "github.com/watermill-idempotency/idempotency/marshaler/amqp"
)

// README:begin

// runStock consumes "order.order.placed.v1" events: each one reserves stock
// once, in the transaction that records the event as processed.
func runStock(ctx context.Context, amqpURL, databaseURL string, logger watermill.LoggerAdapter) error {
	pool, err := pgxpool.New(ctx, databaseURL)
	if err != nil {
		return err
	}
	defer pool.Close()
	// Table processed_event; events older than the replay horizon (by the
	// database clock) are refused, so its Purger may delete their rows.
	store, err := processedstore.NewStore(processedstore.Config{Horizon: 7 * 24 * time.Hour})
	if err != nil {
		return err
	}
	if err := store.Migrate(ctx, sqldb.Pgx(pool)); err != nil { // or processedstore.MigrationsFS with goose / golang-migrate
		return err
	}
	beginner, err := inbox.NewPgxBeginner(pool, inbox.PgxBeginnerConfig{}) // BEGIN + claim in one round trip
	if err != nil {
		return err
	}
	idem, err := inbox.NewIdempotent(inbox.Config{
		Consumer: "stock", // required: the claim key's consumer name, shared by competing workers
		Beginner: beginner,
		Store:    store,
	}, logger)
	if err != nil {
		return err
	}

	// The consumer's durable quorum queue "stock.events", bound to the topic
	// exchange "events" by event name; the envelope marshaler.
	subCfg := amqp.NewDurableTopicConfig(amqpURL, "events", "stock.events")
	subCfg.Exchange.Durable = true
	subCfg.Queue.Arguments = amqp091.Table{"x-queue-type": "quorum"}
	subCfg.Marshaler = idamqp.Marshaler{}
	subscriber, err := amqp.NewSubscriber(subCfg, logger)
	if err != nil {
		return err
	}
	// The dead-letter queue, declared before anything is poisoned, on an
	// exchange of its own: never SubscribeInitialize(dlq) on subCfg, which
	// binds stock.events itself to the poison topic, so poisoned messages
	// come straight back. The poison publisher waits for the broker's
	// confirm and reports a message routed nowhere (mandatory).
	dl := idamqp.DeadLetterConfig{Subscriber: subCfg, Topic: "stock.events.dlq", Quorum: true}
	poisonCfg, err := idamqp.DeclareDeadLetter(dl)
	if err != nil {
		return err
	}
	poison, err := idamqp.NewPoisonPublisher(poisonCfg, logger)
	if err != nil {
		return err
	}
	defer poison.Close()

	// Poison → Retry → Recoverer → Idempotent, in that order (first added = outermost):
	//  - Poison outside Retry: only what survived the retries (or is permanent) is poisoned;
	//  - Retry outside the transaction: every attempt gets a fresh transaction;
	//  - Recoverer outside Idempotent: the middleware rolls back before the panic becomes an error.
	chain, err := inbox.NewHandlerMiddleware(inbox.ChainConfig{ // the whole chain, one middleware
		Idempotent:      idem,
		PoisonPublisher: poison,
		PoisonTopic:     dl.PoisonTopic(),
	}, logger)
	if err != nil {
		return err
	}
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		return err
	}
	router.AddConsumerHandler("reserve_stock", "order.order.placed.v1", subscriber, func(msg *message.Message) error {
		var order struct {
			OrderID string `json:"order_id"`
		}
		if err := json.Unmarshal(msg.Payload, &order); err != nil {
			return inbox.Permanent(err) // poisoned at once, never retried
		}
		tx, ok := inbox.PgxTxFromContext(msg.Context()) // the attempt's transaction: write effects here
		if !ok {
			return errors.New("reserve_stock: no transaction (and no deduplication): add the chain with AddMiddleware(chain)")
		}
		_, err := tx.Exec(msg.Context(), `INSERT INTO reservation (order_id) VALUES ($1)`, order.OrderID)
		return err // error → rollback, retried; nil → commit, ack
	}).AddMiddleware(chain) // per handler, not router.AddMiddleware
	return router.Run(ctx)
}

// README:end

// The README's snippet: a stock consumer on PostgreSQL and RabbitMQ.
// Compiled by go test, not run (it consumes until ctx ends).
func Example() {
	logger := watermill.NewStdLogger(false, false)
	if err := runStock(context.Background(), os.Getenv("AMQP_URL"), os.Getenv("DATABASE_URL"), logger); err != nil {
		logger.Error("stock consumer stopped", err, nil)
	}
}
