package middleware_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/door"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/processed"
)

// A redelivered (counted) attempt ends its crash count inside its own
// transaction just before COMMIT. When that statement meets a lock another
// session holds on the count's row (maintenance, another delivery's count)
// past LockTimeout it fails with 55P03, on its own: the attempt commits
// all the same (the count's end is left to after the commit), never
// reported as the handler's ErrTxAborted ("the handler returned nil but a
// statement of its transaction failed", an ordinary error that spends the
// retries toward a dead letter), and the event is applied once. The
// count's error was dropped and COMMIT answered ROLLBACK, blamed on the
// handler.
func TestLockOnTheCrashCountRowIsHeldNotBlamedOnTheHandler(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	effectsSchema(t, pool)
	poison := &poisonRecorder{}
	logs := &errorLog{}
	c, err := middleware.NewConsumer(middleware.ConsumerConfig{
		Consumer: "stock", DB: idempotency.Pgx(pool), LockTimeout: 50 * time.Millisecond,
		Poison: middleware.PoisonConfig{Publisher: poison, Topic: "poison"},
		Retry:  middleware.RetryConfig{InitialInterval: time.Millisecond, MaxInterval: 5 * time.Millisecond, MaxHold: time.Second},
	}, logs)
	require.NoError(t, err)

	id := uuid.Must(uuid.NewV7())
	locker, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer locker.Release()
	locked := false
	h, err := door.Wrap(c, "reserve", func(msg *message.Message) ([]*message.Message, error) {
		if !locked {
			// The attempt has counted its start: another session now
			// holds the count's row until the test releases it.
			locked = true
			_, err := locker.Exec(ctx, `BEGIN`)
			require.NoError(t, err)
			var n int
			require.NoError(t, locker.QueryRow(ctx, `SELECT started FROM processed_event_crash WHERE consumer = 'stock' AND event_id = $1 FOR KEY SHARE`, id).Scan(&n))
		}
		tx, _ := middleware.PgxTxFromContext(msg.Context())
		_, err := tx.Exec(msg.Context(), `INSERT INTO effect (event_id) VALUES ($1)`, msg.UUID)
		return nil, err
	})
	require.NoError(t, err)
	effects := func() int {
		var n int
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM effect`).Scan(&n))
		return n
	}

	_, err = h(counted(id, true))
	require.True(t, locked, "the handler ran")
	if err != nil {
		require.True(t, middleware.IsTransient(err), "a held lock is transient, not %v", err)
	}
	require.NoError(t, logs.first(func(e error) bool { return errors.Is(e, middleware.ErrTxAborted) }),
		"the consumer's own statement's failure was blamed on the handler")
	require.Empty(t, poison.reasons())

	_, rerr := locker.Exec(ctx, `ROLLBACK`)
	require.NoError(t, rerr)
	if err != nil {
		_, err = h(counted(id, true))
		require.NoError(t, err)
	}
	require.Equal(t, 1, effects(), "applied once")
	require.Empty(t, poison.reasons())
}

// A redelivered duplicate is the crash count's one read-only statement
// (no transaction, no claim). Over a direct connection that statement is
// prepared once per connection in the pool's own mode, not parsed and
// planned on every delivery in QueryExecModeExec (which a transaction
// pooler needs: it tripled the redelivered duplicate's server
// instructions, bench part 6), also in a process whose first deliveries
// are redeliveries of events another instance applied (a restart after a
// crash): no claim of its own has checked the connection yet.
func TestRedeliveredDuplicateOverADirectConnectionIsPrepared(t *testing.T) {
	t.Parallel()
	schema := testenv.Schema(t)
	ctx := context.Background()
	first := testenv.PoolOn(t, schema, 2)
	effectsSchema(t, first)
	var calls int
	instance := func(pool *pgxpool.Pool) message.HandlerFunc {
		c, err := middleware.NewConsumer(middleware.ConsumerConfig{Consumer: "stock", DB: idempotency.Pgx(pool),
			Poison: middleware.PoisonConfig{Publisher: &poisonRecorder{}, Topic: "poison"}}, nil)
		require.NoError(t, err)
		h, err := door.Wrap(c, "reserve", func(msg *message.Message) ([]*message.Message, error) {
			calls++
			tx, _ := middleware.PgxTxFromContext(msg.Context())
			_, err := tx.Exec(msg.Context(), `INSERT INTO effect (event_id) VALUES ($1)`, msg.UUID)
			return nil, err
		})
		require.NoError(t, err)
		return h
	}
	id := uuid.Must(uuid.NewV7())
	_, err := instance(first)(counted(id, false))
	require.NoError(t, err)
	pool := testenv.PoolOn(t, schema, 1) // one connection: its statements are the pool's
	h := instance(pool)
	for i := 0; i < 3; i++ {
		_, err = h(counted(id, true))
		require.NoError(t, err)
	}
	require.Equal(t, 1, calls, "applied once, the redeliveries skipped")
	var prepared int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM pg_prepared_statements WHERE name NOT LIKE 'idempotency\_%' AND statement ~ '^SELECT (event_name|NULL::text), fingerprint FROM'`).Scan(&prepared))
	require.Equal(t, 1, prepared, "the redelivered duplicate's read is a statement prepared on the connection")
}

// counted is a delivery of id marked as a redelivery (counted under the
// crash bound) when redelivered, as RabbitMQ marks it.
func counted(id uuid.UUID, redelivered bool) *message.Message {
	msg := message.NewMessage(id.String(), []byte(`{}`))
	msg.Metadata.Set(marshaler.MetadataEventName, "order.placed")
	marshaler.SetRedelivered(msg, redelivered)
	return msg
}

// Other code on the pool dropping every prepared statement (DEALLOCATE
// ALL, which pgx's statement cache does not see) between counted
// attempts over a direct connection, where the crash count's statements
// are prepared: each later counted attempt is counted once and runs its
// handler once. Each stale statement failed once in turn (26000): an
// attempt ran uncounted, an end was owed for a start never written, and an
// attempt failed at its count's end and ran its handler twice.
func TestCountedAttemptsAfterDeallocateAllAreCountedOnce(t *testing.T) {
	t.Parallel()
	schema := testenv.Schema(t)
	ctx := context.Background()
	pool := testenv.PoolOn(t, schema, 1)
	effectsSchema(t, pool)
	c, err := middleware.NewConsumer(middleware.ConsumerConfig{Consumer: "stock", DB: idempotency.Pgx(pool),
		Poison: middleware.PoisonConfig{Publisher: &poisonRecorder{}, Topic: "poison"}}, nil)
	require.NoError(t, err)
	seen := map[string][]int{} // per event, the count each run of its handler saw
	h, err := door.Wrap(c, "reserve", func(msg *message.Message) ([]*message.Message, error) {
		tx, _ := middleware.PgxTxFromContext(msg.Context())
		var n int
		err := tx.QueryRow(msg.Context(), `SELECT coalesce(sum(started), 0) FROM processed_event_crash WHERE event_id = $1`,
			pgx.QueryExecModeExec, msg.UUID).Scan(&n)
		seen[msg.UUID] = append(seen[msg.UUID], n)
		return nil, err
	})
	require.NoError(t, err)
	var got [][]int
	for i := 0; i < 6; i++ {
		id := uuid.Must(uuid.NewV7())
		_, err := h(counted(id, true))
		require.NoError(t, err)
		got = append(got, seen[id.String()])
		if i == 0 {
			_, err = pool.Exec(ctx, `DEALLOCATE ALL`)
			require.NoError(t, err)
		}
	}
	require.Equal(t, [][]int{{1}, {1}, {1}, {1}, {1}, {1}}, got, "per message, the count each run of its handler saw")
	var left int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM processed_event_crash`).Scan(&left))
	require.Zero(t, left, "every count ended")
}

// A handler that narrows its privileges with SET LOCAL ROLE (row-level
// security per tenant) to a role that may write its effects and read the
// processed table (what the commit guard needs of it) but not write the
// crash counts: a counted redelivery is applied as a first delivery is.
// The count's end, the consumer's statement, ran under the handler's role
// inside the transaction and failed with 42501, so every redelivery was
// dead-lettered (then held for ever as a configuration error).
func TestRedeliveryOfAHandlerUnderSetLocalRoleIsApplied(t *testing.T) {
	t.Parallel()
	pool, schema := testenv.Pool(t)
	ctx := context.Background()
	effectsSchema(t, pool)
	role := testenv.UniqueName("tenant")
	_, err := pool.Exec(ctx, `CREATE ROLE `+role+` NOLOGIN`)
	require.NoError(t, err)
	t.Cleanup(func() {
		_, _ = pool.Exec(context.Background(), `DROP OWNED BY `+role)
		_, _ = pool.Exec(context.Background(), `DROP ROLE `+role)
	})
	_, err = pool.Exec(ctx, `GRANT USAGE ON SCHEMA `+schema+` TO `+role+`; GRANT INSERT ON effect TO `+role+`; GRANT SELECT ON processed_event TO `+role)
	require.NoError(t, err)
	poison := &poisonRecorder{}
	c, err := middleware.NewConsumer(middleware.ConsumerConfig{
		Consumer: "stock", DB: idempotency.Pgx(pool),
		Poison: middleware.PoisonConfig{Publisher: poison, Topic: "poison"},
		Retry:  middleware.RetryConfig{InitialInterval: time.Millisecond, MaxInterval: 10 * time.Millisecond, MaxHold: 2 * time.Second},
	}, nil)
	require.NoError(t, err)
	h, err := door.Wrap(c, "reserve", func(msg *message.Message) ([]*message.Message, error) {
		tx, _ := middleware.PgxTxFromContext(msg.Context())
		if _, err := tx.Exec(msg.Context(), `SET LOCAL ROLE `+role); err != nil {
			return nil, err
		}
		_, err := tx.Exec(msg.Context(), `INSERT INTO effect (event_id) VALUES ($1)`, msg.UUID)
		return nil, err
	})
	require.NoError(t, err)
	effects := func(id uuid.UUID) int {
		var n int
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM effect WHERE event_id = $1`, id.String()).Scan(&n))
		return n
	}
	first := uuid.Must(uuid.NewV7())
	_, err = h(counted(first, false))
	require.NoError(t, err, "a first delivery")
	require.Equal(t, 1, effects(first))
	again := uuid.Must(uuid.NewV7())
	_, err = h(counted(again, true))
	require.NoError(t, err, "a redelivery")
	require.Equal(t, 1, effects(again))
	require.Empty(t, poison.reasons())
	var left int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM processed_event_crash`).Scan(&left))
	require.Zero(t, left, "its count ended after the commit")
}

// effectsSchema migrates the processed table on pool's schema and creates
// the handlers' effect table.
func effectsSchema(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	ctx := context.Background()
	require.NoError(t, processed.Migrate(ctx, idempotency.Pgx(pool), processed.Config{}))
	_, err := pool.Exec(ctx, `CREATE TABLE effect (event_id text NOT NULL)`)
	require.NoError(t, err)
}
