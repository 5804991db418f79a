package inbox_test

import (
	"context"
	"errors"
	"sync"
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

// Joining watermill-sql's subscriber transaction: a batch where one message
// fails, then succeeds on redelivery (in the same subscriber transaction):
// one effect each, no claim left behind by the failed attempt.
func TestSQLSubscriberJoinsTransactionWithSavepoints(t *testing.T) {
	t.Parallel()
	type backend struct {
		beginner wsql.Beginner
		schema   wsql.SchemaAdapter
		offsets  wsql.OffsetsAdapter
		dialect  sqldb.Dialect
		db       sqldb.Querier
		insert   string
	}
	backends := map[string]func(t *testing.T) backend{
		// The queue schema: the default one reads only below
		// pg_snapshot_xmin and stalls behind any transaction left open on
		// the shared server (TestSQLSubscriberJoinDeliversBehindIdleTransaction).
		"postgres-pgx": func(t *testing.T) backend {
			pool, _ := testenv.Pool(t)
			return backend{wsql.BeginnerFromPgx(pool), wsql.PostgreSQLQueueSchema{}, wsql.PostgreSQLQueueOffsetsAdapter{},
				sqldb.PostgreSQL, sqldb.Pgx(pool), `INSERT INTO effect (event_id, note) VALUES ($1, $2)`}
		},
		"mariadb": func(t *testing.T) backend {
			db := testenv.MySQLDB(t)
			return backend{wsql.BeginnerFromStdSQL(db), wsql.DefaultMySQLSchema{}, wsql.DefaultMySQLOffsetsAdapter{},
				sqldb.MySQL, sqldb.Std(db), `INSERT INTO effect (event_id, note) VALUES (?, ?)`}
		},
	}
	for name, open := range backends {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			b := open(t)
			store, err := processedstore.NewStore(processedstore.Config{Dialect: b.dialect})
			require.NoError(t, err)
			require.NoError(t, store.Migrate(ctx, b.db))
			_, err = b.db.Exec(ctx, `CREATE TABLE effect (event_id varchar(36) NOT NULL, note varchar(100))`)
			require.NoError(t, err)

			logger := watermill.NopLogger{}
			topic := "orders"
			sub, err := wsql.NewSubscriber(b.beginner, wsql.SubscriberConfig{
				SchemaAdapter: b.schema, OffsetsAdapter: b.offsets, InitializeSchema: true,
				PollInterval: 20 * time.Millisecond, ResendInterval: 10 * time.Millisecond,
			}, logger)
			require.NoError(t, err)
			require.NoError(t, sub.SubscribeInitialize(topic))
			pub, err := wsql.NewPublisher(b.beginner, wsql.PublisherConfig{SchemaAdapter: b.schema}, logger)
			require.NoError(t, err)
			var ids []string
			var batch []*message.Message
			for i := 0; i < 5; i++ {
				m, err := marshaler.NewMessage("order.placed", map[string]int{"i": i})
				require.NoError(t, err)
				ids = append(ids, m.UUID)
				batch = append(batch, m)
			}
			require.NoError(t, pub.Publish(topic, batch...)) // one batch for the subscriber

			idem, err := inbox.NewIdempotent(inbox.Config{
				Beginner: inbox.NewSQLSubscriberBeginner(),
				Store:    store, Consumer: "stock",
			}, logger)
			require.NoError(t, err)
			var mu sync.Mutex
			calls := map[string]int{}
			router, err := message.NewRouter(message.RouterConfig{}, logger)
			require.NoError(t, err)
			router.AddMiddleware(idem.Middleware)
			router.AddNoPublisherHandler("stock", topic, sub, func(msg *message.Message) error {
				mu.Lock()
				calls[msg.UUID]++
				n := calls[msg.UUID]
				mu.Unlock()
				q, ok := inbox.QuerierFromContext(msg.Context())
				require.True(t, ok)
				note := "x"
				if msg.UUID == ids[2] && n == 1 {
					note = "failed-attempt"
				}
				if _, err := q.Exec(msg.Context(), b.insert, msg.UUID, note); err != nil {
					return err
				}
				if msg.UUID == ids[2] && n == 1 {
					return errors.New("the third message fails once")
				}
				return nil
			})
			runCtx, cancel := context.WithCancel(ctx)
			defer cancel()
			go func() { _ = router.Run(runCtx) }()
			<-router.Running()
			effects := func() int {
				var n int
				require.NoError(t, b.db.QueryRow(ctx, `SELECT count(*) FROM effect`).Scan(&n))
				return n
			}
			require.Eventually(t, func() bool { return effects() == 5 }, 30*time.Second, 20*time.Millisecond)
			require.NoError(t, router.Close())
			mu.Lock()
			require.Equal(t, 2, calls[ids[2]], "the failed message is redelivered once")
			mu.Unlock()
			var dup int
			require.NoError(t, b.db.QueryRow(ctx, `SELECT count(*) FROM (SELECT event_id FROM effect GROUP BY event_id HAVING count(*) > 1) d`).Scan(&dup))
			require.Zero(t, dup, "one effect each")
			var leaked int
			require.NoError(t, b.db.QueryRow(ctx, `SELECT count(*) FROM effect WHERE note = 'failed-attempt'`).Scan(&leaked))
			require.Zero(t, leaked, "the failed attempt's write must roll back to its savepoint")
			var claims int
			require.NoError(t, b.db.QueryRow(ctx, `SELECT count(*) FROM processed_event`).Scan(&claims))
			require.Equal(t, 5, claims)
		})
	}
}

func TestSQLSubscriberBeginnerOutsideSubscriber(t *testing.T) {
	t.Parallel()
	idem, err := inbox.NewIdempotent(inbox.Config{Beginner: inbox.NewSQLSubscriberBeginner(), Consumer: "c"}, nil)
	require.NoError(t, err)
	_, err = idem.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })(newMsg(E1))
	require.ErrorIs(t, err, inbox.ErrNoSubscriberTx)
	require.True(t, inbox.IsConfiguration(err), "a wiring error is held, never poisoned")
	require.False(t, inbox.ShouldPoison(err))
}

// A handler inside watermill-sql's subscriber transaction that rolls back
// to the attempt's savepoint (ROLLBACK TO SAVEPOINT idempotency_msg) undoes
// the claim: the attempt fails (handler_ended_tx) instead of acking the
// message with no claim, and the redelivery applies it once (case 27.4).
func TestSQLSubscriberHandlerRollingBackToOurSavepointIsNotAcked(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := testenv.Pool(t)
	beginner := wsql.BeginnerFromPgx(pool)
	store, err := processedstore.NewStore(processedstore.Config{})
	require.NoError(t, err)
	require.NoError(t, store.Migrate(ctx, sqldb.Pgx(pool)))
	_, err = pool.Exec(ctx, `CREATE TABLE effect (event_id varchar(36) NOT NULL, note varchar(100))`)
	require.NoError(t, err)
	logger := watermill.NopLogger{}
	topic := "orders"
	sub, err := wsql.NewSubscriber(beginner, wsql.SubscriberConfig{
		// The queue schema: the default one stalls behind any transaction
		// another test holds open on the shared server.
		SchemaAdapter: wsql.PostgreSQLQueueSchema{}, OffsetsAdapter: wsql.PostgreSQLQueueOffsetsAdapter{}, InitializeSchema: true,
		PollInterval: 20 * time.Millisecond, ResendInterval: 10 * time.Millisecond,
	}, logger)
	require.NoError(t, err)
	require.NoError(t, sub.SubscribeInitialize(topic))
	pub, err := wsql.NewPublisher(beginner, wsql.PublisherConfig{SchemaAdapter: wsql.PostgreSQLQueueSchema{}}, logger)
	require.NoError(t, err)
	m, err := marshaler.NewMessage("order.placed", map[string]int{"i": 1})
	require.NoError(t, err)
	require.NoError(t, pub.Publish(topic, m))

	idem, err := inbox.NewIdempotent(inbox.Config{Beginner: inbox.NewSQLSubscriberBeginner(), Store: store, Consumer: "stock"}, logger)
	require.NoError(t, err)
	var calls atomic.Int32
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	require.NoError(t, err)
	router.AddMiddleware(idem.Middleware)
	router.AddNoPublisherHandler("stock", topic, sub, func(msg *message.Message) error {
		n := calls.Add(1)
		q, _ := inbox.QuerierFromContext(msg.Context())
		if _, err := q.Exec(msg.Context(), `INSERT INTO effect (event_id, note) VALUES ($1, 'x')`, msg.UUID); err != nil {
			return err
		}
		if n == 1 {
			_, err := q.Exec(msg.Context(), `ROLLBACK TO SAVEPOINT idempotency_msg`)
			return err
		}
		return nil
	})
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() { _ = router.Run(runCtx) }()
	<-router.Running()
	claims := func() int {
		var n int
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM processed_event`).Scan(&n))
		return n
	}
	// A hang guard, not a speed check: it ends as soon as the claim is
	// there (about a second; once over 30 s in a loaded CI run).
	require.Eventually(t, func() bool { return claims() == 1 }, 2*time.Minute, 20*time.Millisecond, "the message is claimed")
	require.NoError(t, router.Close())
	require.EqualValues(t, 2, calls.Load(), "the attempt that undid its claim is not acked: redelivered once")
	var effects int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM effect`).Scan(&effects))
	require.Equal(t, 1, effects)
}
