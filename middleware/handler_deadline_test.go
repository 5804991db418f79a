package middleware_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/door"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/processed"
)

// docs/consumer.md: a bare context.DeadlineExceeded a handler returns from
// its own dependencies is ordinary: "retried MaxRetries times in process
// (a fresh transaction each), then poisoned". A handler that bounds a
// statement of the attempt's transaction with a context of its own makes
// pgx (and database/sql's drivers) close the connection when the deadline
// cancels it; the consumer's ROLLBACK, or its COMMIT when the handler went
// on, then fails, and that failure was taken for the database's
// (transient): the delivery was held, nacked and redelivered forever,
// never poisoned. Here the deadline fires on every attempt: the delivery
// must be poisoned after 1 + MaxRetries attempts.
func TestHandlersOwnStatementDeadlineIsRetriedThenPoisoned(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	require.NoError(t, processed.Migrate(ctx, idempotency.Pgx(pool), processed.Config{}))
	db := stdlib.OpenDBFromPool(pool)
	t.Cleanup(func() { _ = db.Close() })

	exec := map[string]func(msg *message.Message, ctx context.Context) error{
		"pgx": func(msg *message.Message, ctx context.Context) error {
			tx, _ := middleware.PgxTxFromContext(msg.Context())
			_, err := tx.Exec(ctx, `SELECT pg_sleep(1)`)
			return err
		},
		"database/sql": func(msg *message.Message, ctx context.Context) error {
			tx, _ := middleware.SQLTxFromContext(msg.Context())
			_, err := tx.ExecContext(ctx, `SELECT pg_sleep(1)`)
			return err
		},
	}
	for _, name := range []string{"pgx", "database/sql"} {
		for _, ignored := range []bool{false, true} {
			if ignored && name == "database/sql" {
				continue // the handler's *sql.Tx is the driver's: its statements are not seen
			}
			t.Run(name+map[bool]string{false: "/returned", true: "/ignored"}[ignored], func(t *testing.T) {
				h := idempotency.Pgx(pool)
				if name == "database/sql" {
					h = idempotency.SQL(db, idempotency.PostgreSQL)
				}
				poison := &poisonRecorder{}
				c, err := middleware.NewConsumer(middleware.ConsumerConfig{
					Consumer: "deadline_" + uuid.NewString()[:8], DB: h,
					Poison: middleware.PoisonConfig{Publisher: poison, Topic: "poison"},
					Retry:  middleware.RetryConfig{InitialInterval: time.Millisecond, MaxInterval: 5 * time.Millisecond, MaxHold: 3 * time.Second},
				}, nil)
				require.NoError(t, err)
				var calls atomic.Int32
				handler, err := door.Wrap(c, "deadline", func(msg *message.Message) ([]*message.Message, error) {
					calls.Add(1)
					sctx, cancel := context.WithTimeout(msg.Context(), 50*time.Millisecond)
					defer cancel()
					err := exec[name](msg, sctx)
					if ignored {
						return nil, nil // best effort: the handler goes on
					}
					return nil, err
				})
				require.NoError(t, err)
				msg := message.NewMessage(uuid.Must(uuid.NewV7()).String(), []byte(`{}`))
				msg.Metadata.Set(marshaler.MetadataEventName, "order.placed")
				_, err = handler(msg)
				require.NoError(t, err, "the delivery was held and given back, not poisoned")
				require.Len(t, poison.reasons(), 1, "not poisoned once")
				require.Equal(t, int32(1+middleware.DefaultMaxRetries), calls.Load(), "not retried MaxRetries times")
			})
		}
	}
}
