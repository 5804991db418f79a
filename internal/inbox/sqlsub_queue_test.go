package inbox_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
)

// Joining watermill-sql's subscriber transaction with its queue schema
// (PostgreSQLQueueSchema + PostgreSQLQueueOffsetsAdapter): a session idle
// in a transaction that holds an xid, anywhere on the server, does not stop
// delivery. The DefaultPostgreSQLSchema reads only below
// pg_snapshot_xmin(pg_current_snapshot()) (ThreeDotsLabs/watermill#311): the
// same session stops it, which the control case shows. On a private server,
// so that the idle transaction holds back no one else's subscriber.
func TestSQLSubscriberJoinDeliversBehindIdleTransaction(t *testing.T) {
	t.Parallel()
	pg := testenv.StartPostgres(t)
	ctx := context.Background()

	// Another session of the server, in another schema: BEGIN, take an xid,
	// stay idle in transaction for the rest of the test.
	other := testenv.PoolAt(t, pg.URL, testenv.SchemaOn(t, pg.URL), 2)
	conn, err := other.Acquire(ctx)
	require.NoError(t, err)
	t.Cleanup(conn.Release)
	_, err = conn.Exec(ctx, `BEGIN`)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = conn.Exec(context.Background(), `ROLLBACK`) })
	_, err = conn.Exec(ctx, `CREATE TABLE idle_holder (x int); INSERT INTO idle_holder VALUES (1)`)
	require.NoError(t, err)

	run := func(t *testing.T, schema wsql.SchemaAdapter, offsets wsql.OffsetsAdapter, within time.Duration) int {
		pool := testenv.PoolAt(t, pg.URL, testenv.SchemaOn(t, pg.URL), 8)
		db := sqldb.Pgx(pool)
		beginner := wsql.BeginnerFromPgx(pool)
		store, err := processedstore.NewStore(processedstore.Config{})
		require.NoError(t, err)
		require.NoError(t, store.Migrate(ctx, db))
		_, err = db.Exec(ctx, `CREATE TABLE effect (event_id varchar(36) PRIMARY KEY)`)
		require.NoError(t, err)
		logger := watermill.NopLogger{}
		const topic = "orders"
		sub, err := wsql.NewSubscriber(beginner, wsql.SubscriberConfig{
			SchemaAdapter: schema, OffsetsAdapter: offsets, InitializeSchema: true,
			PollInterval: 20 * time.Millisecond, ResendInterval: 10 * time.Millisecond,
		}, logger)
		require.NoError(t, err)
		require.NoError(t, sub.SubscribeInitialize(topic))
		pub, err := wsql.NewPublisher(beginner, wsql.PublisherConfig{SchemaAdapter: schema}, logger)
		require.NoError(t, err)
		idem, err := inbox.NewIdempotent(inbox.Config{Beginner: inbox.NewSQLSubscriberBeginner(), Store: store, Consumer: "stock"}, logger)
		require.NoError(t, err)
		var handled atomic.Int64
		router, err := message.NewRouter(message.RouterConfig{}, logger)
		require.NoError(t, err)
		router.AddMiddleware(idem.Middleware)
		router.AddNoPublisherHandler("stock", topic, sub, func(msg *message.Message) error {
			q, ok := inbox.QuerierFromContext(msg.Context())
			require.True(t, ok)
			if _, err := q.Exec(msg.Context(), `INSERT INTO effect (event_id) VALUES ($1)`, msg.UUID); err != nil {
				return err
			}
			handled.Add(1)
			return nil
		})
		runCtx, cancel := context.WithCancel(ctx)
		t.Cleanup(cancel)
		go func() { _ = router.Run(runCtx) }()
		<-router.Running()
		t.Cleanup(func() { _ = router.Close() })

		for i := 0; i < 5; i++ { // written after the idle transaction took its xid
			m, err := marshaler.NewMessage("order.placed", map[string]int{"i": i})
			require.NoError(t, err)
			require.NoError(t, pub.Publish(topic, m))
		}
		effects := func() int {
			var n int
			require.NoError(t, db.QueryRow(ctx, `SELECT count(*) FROM effect`).Scan(&n))
			return n
		}
		deadline := time.Now().Add(within)
		for effects() < 5 && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond)
		}
		return effects()
	}

	t.Run("QueueSchemaDelivers", func(t *testing.T) {
		n := run(t, wsql.PostgreSQLQueueSchema{}, wsql.PostgreSQLQueueOffsetsAdapter{}, 30*time.Second)
		require.Equal(t, 5, n, "every message delivered, once, while a session idles in a transaction")
	})
	t.Run("DefaultSchemaStalls", func(t *testing.T) {
		n := run(t, wsql.DefaultPostgreSQLSchema{}, wsql.DefaultPostgreSQLOffsetsAdapter{}, 2*time.Second)
		require.Zero(t, n, "the trap this test guards against: the default schema delivers nothing behind the idle transaction")
	})
}
