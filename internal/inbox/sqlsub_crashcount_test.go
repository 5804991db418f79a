package inbox_test

import (
	"context"
	"errors"
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

// Inside watermill-sql's subscriber transaction an attempt's "commit" is
// the release of its savepoint; the subscriber commits later, with its
// batch. When that commit fails, the attempt did not die: its redelivery
// must not find it counted as a crash (docs/guarantees.md: only attempts
// that start and never end are counted). Here the subscriber's first
// commit fails (a deferred constraint trigger) and MaxCrashes is 1: the
// redelivery must run the handler and apply the effect, not be rejected
// as a crash loop.
func TestSQLSubscriberCommitFailureIsNotCountedAsACrash(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := testenv.Pool(t)
	beginner := wsql.BeginnerFromPgx(pool)
	store, err := processedstore.NewStore(processedstore.Config{})
	require.NoError(t, err)
	require.NoError(t, store.Migrate(ctx, sqldb.Pgx(pool)))
	_, err = pool.Exec(ctx, `CREATE TABLE effect (event_id varchar(36) NOT NULL);
CREATE SEQUENCE subscriber_commits;
CREATE FUNCTION fail_first_commit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	IF nextval('subscriber_commits') = 1 THEN
		RAISE EXCEPTION 'test: the subscriber''s commit fails';
	END IF;
	RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER fail_first_commit AFTER INSERT ON effect
	DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION fail_first_commit();`)
	require.NoError(t, err)
	logger := watermill.NopLogger{}
	topic := "orders"
	sub, err := wsql.NewSubscriber(beginner, wsql.SubscriberConfig{
		// The queue schema: the default one reads only below
		// pg_snapshot_xmin and stalls behind any transaction another test
		// holds open on the shared server (TestSQLSubscriberJoinDeliversBehindIdleTransaction).
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

	idem, err := inbox.NewIdempotent(inbox.Config{
		Beginner: inbox.NewSQLSubscriberBeginner(), Store: store, Consumer: "stock",
		MaxCrashes: 1, CrashQuerier: sqldb.Pgx(pool),
	}, logger)
	require.NoError(t, err)
	var calls, crashLoops atomic.Int32
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	require.NoError(t, err)
	router.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if errors.Is(err, inbox.ErrCrashLoop) {
				crashLoops.Add(1)
			}
			return out, err
		}
	}, idem.Middleware)
	router.AddNoPublisherHandler("stock", topic, sub, func(msg *message.Message) error {
		calls.Add(1)
		q, _ := inbox.QuerierFromContext(msg.Context())
		_, err := q.Exec(msg.Context(), `INSERT INTO effect (event_id) VALUES ($1)`, msg.UUID)
		return err
	})
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() { _ = router.Run(runCtx) }()
	<-router.Running()
	effects := func() int {
		var n int
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM effect`).Scan(&n))
		return n
	}
	require.Eventually(t, func() bool { return effects() == 1 || crashLoops.Load() > 0 }, 20*time.Second, 20*time.Millisecond)
	require.NoError(t, router.Close())
	require.Zero(t, crashLoops.Load(), "an attempt whose subscriber transaction failed to commit was counted as a crash")
	require.Equal(t, 1, effects())
	require.EqualValues(t, 2, calls.Load(), "the handler ran again after the failed commit")
	var left int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM processed_event_crash`).Scan(&left))
	require.Zero(t, left, "no crash count is left behind")
}
