package outbox_test

import (
	"context"
	"os"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/outbox"
)

// The producer with the outbox: the order row and its event are written in
// one transaction, so the event exists if and only if the order does; the
// relay publishes it to the broker after the commit (at least once: the
// consumers' claims absorb the republished copies). The event id is minted
// here, by the producer (UUIDv7), never by a consumer. Needs PostgreSQL
// (not run).
func ExampleOutbox_PgxPublisher() {
	ctx := context.Background()
	logger := watermill.NewStdLogger(false, false)
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	ob, err := outbox.New(outbox.Config{DB: idempotency.Pgx(pool)}, logger)
	if err != nil {
		panic(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		panic(err)
	}

	tx, err := pool.Begin(ctx)
	if err != nil {
		panic(err)
	}
	defer tx.Rollback(ctx) // a no-op after Commit
	if _, err := tx.Exec(ctx, `INSERT INTO orders (id, status) VALUES ($1, 'placed')`, "o-42"); err != nil {
		panic(err)
	}
	msg, err := marshaler.NewMessage("order.order.placed.v1", map[string]string{"order_id": "o-42"})
	if err != nil {
		panic(err)
	}
	pub, err := ob.PgxPublisher(tx) // writes into the outbox through tx
	if err != nil {
		panic(err)
	}
	if err := pub.Publish("order.order.placed.v1", msg); err != nil {
		panic(err)
	}
	if err := tx.Commit(ctx); err != nil { // the order and its event, together
		panic(err)
	}
}
