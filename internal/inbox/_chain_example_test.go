package inbox_test

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	_ "modernc.org/sqlite" // database/sql driver "sqlite"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/marshaler"
)

// outcomes is a Recorder handing each attempt's outcome to the example.
type outcomes chan inbox.Outcome

func (o outcomes) RecordOutcome(obs inbox.Observation) { o <- obs.Outcome }

// A consumer with the chain (poison, retry, recoverer, idempotent): the
// same event delivered twice reserves stock once. The claim and the effect
// share one transaction, here on an SQLite file and Watermill's in-process
// broker, so the example runs anywhere; with PostgreSQL use
// NewPgxBeginner and PgxTxFromContext, with RabbitMQ watermill-amqp and
// marshaler/amqp.Marshaler (the README's snippet).
func ExampleNewHandlerMiddleware() {
	ctx := context.Background()
	logger := watermill.NopLogger{}
	dir, _ := os.MkdirTemp("", "chain-example")
	defer os.RemoveAll(dir)
	db, err := sql.Open("sqlite", "file:"+filepath.Join(dir, "stock.db")+"?_pragma=busy_timeout(10000)&_pragma=journal_mode(WAL)&_txlock=immediate")
	if err != nil {
		panic(err)
	}
	defer db.Close()
	store, err := processedstore.NewStore(processedstore.Config{Dialect: sqldb.SQLite, Horizon: 7 * 24 * time.Hour})
	if err != nil {
		panic(err)
	}
	if err := store.Migrate(ctx, sqldb.Std(db)); err != nil {
		panic(err)
	}
	if _, err := db.Exec(`CREATE TABLE reservation (event_id TEXT NOT NULL)`); err != nil {
		panic(err)
	}

	beginner, err := inbox.NewStdBeginner(db)
	if err != nil {
		panic(err)
	}
	seen := make(outcomes, 2)
	idem, err := inbox.NewIdempotent(inbox.Config{
		Consumer: "stock",
		Beginner: beginner,
		Store:    store,
		Recorder: seen,
	}, logger)
	if err != nil {
		panic(err)
	}
	broker := gochannel.NewGoChannel(gochannel.Config{}, logger)
	chain, err := inbox.NewHandlerMiddleware(inbox.ChainConfig{
		Idempotent:      idem,
		PoisonPublisher: broker,
		PoisonTopic:     "stock.dlq",
	}, logger)
	if err != nil {
		panic(err)
	}
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		panic(err)
	}
	router.AddConsumerHandler("reserve_stock", "order.placed", broker, func(msg *message.Message) error {
		tx, _ := inbox.SQLTxFromContext(msg.Context()) // the attempt's transaction
		_, err := tx.ExecContext(msg.Context(), `INSERT INTO reservation (event_id) VALUES (?)`, msg.UUID)
		return err
	}).AddMiddleware(chain) // per handler: the chain does not wrap a dead-letter handler
	go func() { _ = router.Run(ctx) }()
	defer router.Close()
	<-router.Running()

	msg, err := marshaler.NewMessage("order.placed", map[string]string{"order_id": "o-42"})
	if err != nil {
		panic(err)
	}
	for range 2 { // the broker delivers it twice
		if err := broker.Publish("order.placed", msg.Copy()); err != nil {
			panic(err)
		}
		fmt.Println(<-seen)
	}
	var n int
	_ = db.QueryRow(`SELECT count(*) FROM reservation`).Scan(&n)
	fmt.Println("reservations:", n)
	// Output:
	// processed
	// duplicate
	// reservations: 1
}
