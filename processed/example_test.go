package processed_test

import (
	"context"
	"os"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/processed"
)

// The table's schema and its purge: the purger deletes by the horizon the
// table keeps (recorded by its consumers, changed with SetReplayHorizon).
func ExampleNewPurger() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	db := idempotency.Pgx(pool)
	if err := processed.Migrate(ctx, db, processed.Config{}); err != nil {
		panic(err)
	}
	if err := processed.SetReplayHorizon(ctx, db, processed.DefaultTable, 7*24*time.Hour); err != nil {
		panic(err)
	}
	purger, err := processed.NewPurger(processed.PurgerConfig{DB: db, Interval: time.Minute}, nil)
	if err != nil {
		panic(err)
	}
	if err := purger.Start(ctx); err != nil {
		panic(err)
	}
	defer purger.Stop()
}
