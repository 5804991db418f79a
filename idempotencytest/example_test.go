package idempotencytest_test

import (
	"context"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/idempotencytest"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/processed"
)

// A user's handler writes a row in the attempt's transaction; delivered
// twice, and eight times at once, it writes one row per event. (In a test,
// pass the *testing.T; the example prints what it would report.)
func ExampleDeliverTwice() {
	ctx := context.Background()
	pool, done := exampleDB(ctx, `CREATE TABLE IF NOT EXISTS points (event_id uuid NOT NULL, points int NOT NULL)`)
	defer done()

	poison := gochannel.NewGoChannel(gochannel.Config{}, nil)
	defer poison.Close()
	c, err := middleware.NewConsumer(middleware.ConsumerConfig{
		Consumer: "loyalty", // the claim key's consumer name
		DB:       idempotency.Pgx(pool),
		Poison:   middleware.PoisonConfig{Publisher: poison, Topic: "loyalty.poison"},
	}, nil)
	if err != nil {
		panic(err)
	}
	s := idempotencytest.Subject{
		Handler: idempotencytest.NoPublish(func(msg *message.Message) error {
			tx, _ := middleware.PgxTxFromContext(msg.Context())
			_, err := tx.Exec(msg.Context(), `INSERT INTO points VALUES ($1, 10)`, msg.UUID)
			return err
		}),
		Consumer: c,
		Effects: func(ctx context.Context, msg *message.Message) (int, error) {
			var n int
			err := pool.QueryRow(ctx, `SELECT count(*) FROM points WHERE event_id = $1`, msg.UUID).Scan(&n)
			return n, err
		},
	}
	t := printTB{}
	r := idempotencytest.DeliverTwice(t, s, message.NewMessage(uuid.Must(uuid.NewV7()).String(), []byte(`{}`)))
	fmt.Printf("twice: %d deliveries, %d call, %d effect\n", r.Deliveries, r.Calls, r.Effects)
	r = idempotencytest.DeliverConcurrently(t, s, message.NewMessage(uuid.Must(uuid.NewV7()).String(), []byte(`{}`)), 8)
	fmt.Printf("at once: %d deliveries, %d call, %d effect\n", r.Deliveries, r.Calls, r.Effects)
	// Output:
	// twice: 2 deliveries, 1 call, 1 effect
	// at once: 8 deliveries, 1 call, 1 effect
}

// printTB prints what a *testing.T would report.
type printTB struct{}

func (printTB) Helper()                           {}
func (printTB) Errorf(format string, args ...any) { fmt.Printf("FAIL: "+format+"\n", args...) }

var _ idempotencytest.TB = printTB{}

// exampleDB is a schema of its own for an example (examples have no
// *testing.T); done drops it.
func exampleDB(ctx context.Context, ddl string) (*pgxpool.Pool, func()) {
	admin, err := pgxpool.New(ctx, testenv.PostgresURL())
	if err != nil {
		panic(err)
	}
	schema := testenv.UniqueName("ex")
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+schema); err != nil {
		panic(err)
	}
	cfg, err := pgxpool.ParseConfig(testenv.PostgresURL())
	if err != nil {
		panic(err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		panic(err)
	}
	if err := processed.Migrate(ctx, idempotency.Pgx(pool), processed.Config{}); err != nil {
		panic(err)
	}
	if _, err := pool.Exec(ctx, ddl); err != nil {
		panic(err)
	}
	return pool, func() {
		pool.Close()
		_, _ = admin.Exec(ctx, "DROP SCHEMA "+schema+" CASCADE")
		admin.Close()
	}
}
