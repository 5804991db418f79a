package middleware_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	idempotency "github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/processed"
)

// TestJoinedHandlerEndingTheSubscribersTransactionBySQLIsPoisonedAsHandlerEndedTx:
// with JoinSQLSubscriber, a handler that runs COMMIT or ROLLBACK on
// watermill-sql's subscriber transaction fails the attempt as permanent
// (reason handler_ended_tx, poisoned once), as on every other beginner,
// and no effect is committed: its COMMIT fails on the attempt's running
// row (on the old code the claim committed, the RELEASE failed with
// 25P01, the attempt was retried and acked as a duplicate).
func TestJoinedHandlerEndingTheSubscribersTransactionBySQLIsPoisonedAsHandlerEndedTx(t *testing.T) {
	for _, stmt := range []string{"COMMIT", "ROLLBACK"} {
		t.Run(stmt, func(t *testing.T) {
			ctx := context.Background()
			pool, _ := testenv.Pool(t)
			db := idempotency.Pgx(pool)
			require.NoError(t, processed.Migrate(ctx, db, processed.Config{}))
			_, err := pool.Exec(ctx, `CREATE TABLE effect (event_id text NOT NULL, note text)`)
			require.NoError(t, err)
			var logger watermill.LoggerAdapter = watermill.NopLogger{}
			if testing.Verbose() {
				logger = watermill.NewStdLogger(false, false)
			}
			beginner := wsql.BeginnerFromPgx(pool)
			sub, err := queueSubscriber(beginner, nil, logger)
			require.NoError(t, err)
			require.NoError(t, sub.SubscribeInitialize("orders"))
			pub, err := wsql.NewPublisher(beginner, wsql.PublisherConfig{SchemaAdapter: wsql.PostgreSQLQueueSchema{}}, logger)
			require.NoError(t, err)
			poison := newGoChannel()
			t.Cleanup(func() { _ = poison.Close() })
			dl, err := poison.Subscribe(ctx, "poison")
			require.NoError(t, err)
			c, err := middleware.NewConsumer(middleware.ConsumerConfig{
				Consumer: "stock", DB: db, JoinSQLSubscriber: true,
				Poison: middleware.PoisonConfig{Publisher: poison, Topic: "poison"},
				Retry:  middleware.RetryConfig{InitialInterval: time.Millisecond, MaxInterval: 5 * time.Millisecond, MaxHold: 3 * time.Second},
			}, logger)
			require.NoError(t, err)
			r, err := message.NewRouter(message.RouterConfig{}, logger)
			require.NoError(t, err)
			var calls atomic.Int32
			_, err = c.AddConsumerHandler(r, "reserve", "orders", sub, func(msg *message.Message) error {
				calls.Add(1)
				tx, _ := middleware.PgxTxFromContext(msg.Context())
				if _, err := tx.Exec(msg.Context(), `INSERT INTO effect VALUES ($1, 'x')`, msg.UUID); err != nil {
					return err
				}
				_, err := tx.Exec(msg.Context(), stmt)
				return err
			})
			require.NoError(t, err)
			runRouter(t, r)
			m, err := newEventErr()
			require.NoError(t, err)
			require.NoError(t, pub.Publish("orders", m))
			var reason string
			select {
			case d := <-dl:
				reason = d.Metadata.Get("reason_poisoned")
				d.Ack()
			case <-time.After(30 * time.Second):
				t.Fatal("nothing was dead-lettered")
			}
			require.Contains(t, reason, "ended the attempt's transaction", "poisoned as handler_ended_tx")
			var n int
			require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM effect`).Scan(&n))
			require.Zero(t, n, "the handler's effect is not committed")
			require.EqualValues(t, 1, calls.Load(), "the handler ran once")
		})
	}
}
