package inbox_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
)

// A consumer of the previous release joined to watermill-sql's subscriber
// transaction (REPEATABLE READ, as both of watermill-sql's PostgreSQL
// schemas begin it) claims a UUIDv7 event in the table after a process of
// this release registered the consumer's name, with a snapshot taken
// before that registration. The migration's trigger, which reads
// processed_event_consumer in that snapshot, does not skip the copy: its
// registration of the name meets the committed one and fails the claim
// (40001), which is delivered again. The event is a duplicate for this
// release's pgx consumer of the same name.
func TestV7ClaimInRepeatableReadSubscriberTxDuringRegistrationIsSeenByTheNewRelease(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := testenv.Pool(t)
	table := schema + ".processed_event"
	previous, err := processedstore.NewStore(processedstore.Config{Table: table, Horizon: time.Hour})
	require.NoError(t, err)
	require.NoError(t, previous.Migrate(ctx, sqldb.Pgx(pool))) // migration 0008, processed_event_v7 ready
	// The previous release knows no processed_event_v7: it never
	// registers a name, and claims and reads in the table.
	require.NoError(t, previous.CheckLean(ctx, sqldb.Pgx(pool), ""))
	sqlSubscriberClaimThenNewRelease(t, pool, table, previous, func() {})
}

// The same during the migration itself: a consumer of the previous
// release (the table at migration 0007) that has claimed before, so
// processed.Migrate registers its name (fillV7), is joined to a
// subscriber transaction whose snapshot predates that registration, and
// claims after the migration's copy.
func TestV7ClaimInRepeatableReadSubscriberTxDuringMigrateIsSeenByTheNewRelease(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := testenv.Pool(t)
	table := schema + ".processed_event"
	previous, err := processedstore.NewStore(processedstore.Config{Table: table, Horizon: time.Hour})
	require.NoError(t, err)
	ms, err := previous.Migrations()
	require.NoError(t, err)
	require.Len(t, ms, 8)
	require.NoError(t, sqldb.Migrate(ctx, sqldb.Pgx(pool), sqldb.PostgreSQL, "processed:"+previous.Table().String(), ms[:7]))
	require.NoError(t, previous.CheckLean(ctx, sqldb.Pgx(pool), "stock"))
	// The consumer has claimed before: Migrate registers its name.
	ok, err := previous.Claim(ctx, sqldb.Pgx(pool), "stock", uuid.Must(uuid.NewV7()))
	require.NoError(t, err)
	require.True(t, ok)
	sqlSubscriberClaimThenNewRelease(t, pool, table, previous, func() {
		require.NoError(t, previous.Migrate(ctx, sqldb.Pgx(pool)))
	})
}

// sqlSubscriberClaimThenNewRelease delivers one UUIDv7 event to a
// consumer "stock" of the previous release (store previous) joined to
// watermill-sql's subscriber transaction, holding it (after the
// subscriber's read of the queue, before the claim) while during runs
// and this release's consumer of the same name starts; then delivers the
// event to this release's pgx consumer, and checks it was applied once.
func sqlSubscriberClaimThenNewRelease(t *testing.T, pool *pgxpool.Pool, table string, previous *processedstore.Store, during func()) {
	t.Helper()
	ctx := context.Background()
	_, err := pool.Exec(ctx, `CREATE TABLE effect (id bigserial PRIMARY KEY, event_id uuid NOT NULL, note text)`)
	require.NoError(t, err)

	logger := watermill.NopLogger{}
	beginner := wsql.BeginnerFromPgx(pool)
	const topic = "orders"
	// The failed first attempt's delivery is not acked: it comes back
	// when its ack deadline (watermill-sql's default: 30 s) passes.
	ackDeadline := time.Second
	sub, err := wsql.NewSubscriber(beginner, wsql.SubscriberConfig{
		SchemaAdapter: wsql.PostgreSQLQueueSchema{}, OffsetsAdapter: wsql.PostgreSQLQueueOffsetsAdapter{}, InitializeSchema: true,
		PollInterval: 20 * time.Millisecond, ResendInterval: 10 * time.Millisecond, AckDeadline: &ackDeadline,
	}, logger)
	require.NoError(t, err)
	require.NoError(t, sub.SubscribeInitialize(topic))
	pub, err := wsql.NewPublisher(beginner, wsql.PublisherConfig{SchemaAdapter: wsql.PostgreSQLQueueSchema{}}, logger)
	require.NoError(t, err)
	const payload = `{"n":1}`
	id := uuid.Must(uuid.NewV7())
	m, err := marshaler.NewMessageWithID(id, "order.placed", time.Now().UTC(), []byte(payload))
	require.NoError(t, err)
	require.NoError(t, pub.Publish(topic, m))

	prevIdem, err := inbox.NewIdempotent(inbox.Config{Beginner: inbox.NewSQLSubscriberBeginner(), Store: previous, Consumer: "stock"}, logger)
	require.NoError(t, err)
	entered, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	require.NoError(t, err)
	// Outside the claim, inside the subscriber's transaction (its snapshot
	// taken by the read of the queue): hold the first delivery.
	router.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			once.Do(func() { close(entered); <-release })
			return h(msg)
		}
	}, prevIdem.Middleware)
	router.AddNoPublisherHandler("stock", topic, sub, func(msg *message.Message) error {
		q, _ := inbox.QuerierFromContext(msg.Context())
		_, err := q.Exec(msg.Context(), `INSERT INTO effect (event_id, note) VALUES ($1, 'previous')`, msg.UUID)
		return err
	})
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() { _ = router.Run(runCtx) }()
	<-router.Running()
	<-entered

	during()
	// This release's consumer of the same name starts (NewConsumer's
	// CheckLean): it registers "stock" and copies its claims.
	current, err := processedstore.NewStore(processedstore.Config{Table: table, Horizon: time.Hour})
	require.NoError(t, err)
	require.NoError(t, current.CheckLean(ctx, sqldb.Pgx(pool), "stock"))
	p, ok := current.ClaimParamsAt("stock", id, time.Time{}, nil)
	require.True(t, ok)
	require.NotZero(t, p.ConsumerID, "this release claims UUIDv7 events in processed_event_v7")

	close(release)
	effects := func() int {
		var n int
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM effect`).Scan(&n))
		return n
	}
	// A hang guard, not a speed check.
	require.Eventually(t, func() bool { return effects() == 1 }, 2*time.Minute, 20*time.Millisecond, "the previous release applied the event")
	require.NoError(t, router.Close())
	var inV7 bool
	require.NoError(t, pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM processed_event_v7 WHERE event_id = $1)`, id).Scan(&inV7))
	t.Logf("the previous release's claim is in processed_event_v7: %v", inV7)

	// A copy of the event reaches this release's pgx consumer.
	next := releaseHandler(t, pool, current, "current")
	require.NoError(t, next(id, payload))
	var notes []string
	rows, err := pool.Query(ctx, `SELECT note FROM effect ORDER BY id`)
	require.NoError(t, err)
	for rows.Next() {
		var n string
		require.NoError(t, rows.Scan(&n))
		notes = append(notes, n)
	}
	require.NoError(t, rows.Err())
	require.Equal(t, []string{"previous"}, notes, "the event is applied once")
}
