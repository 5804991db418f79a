package inbox_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
)

// roundTrips counts what a pool sends: each statement outside a batch and
// each batch is one round trip.
type roundTrips struct{ n atomic.Int32 }

func (r *roundTrips) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	r.n.Add(1)
	return ctx
}
func (r *roundTrips) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (r *roundTrips) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	r.n.Add(1)
	return ctx
}
func (r *roundTrips) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (r *roundTrips) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData)     {}

// A duplicate costs two round trips with payload verification and the
// replay window on: BEGIN and the checked claim (which also returns the
// verdict and the stored identity) in one, the ROLLBACK in the other; no
// Verdict or StoredIdentity statement of its own (issue 17). A new event
// costs the batch, the handler's statement and the COMMIT. A reused id is
// still refused as a conflict on that path.
func TestDuplicateCostsTwoRoundTrips(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, schema := testenv.Pool(t)
	rt := &roundTrips{}
	cfg := testenv.PoolConfig(t, testenv.PostgresURL(), schema, 2)
	cfg.ConnConfig.Tracer = rt
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	store, err := processedstore.NewStore(processedstore.Config{Horizon: time.Hour})
	require.NoError(t, err)
	require.NoError(t, store.Migrate(ctx, sqldb.Pgx(pool)))
	_, err = pool.Exec(ctx, `CREATE TABLE effect (id bigserial PRIMARY KEY, event_id uuid NOT NULL, note text)`)
	require.NoError(t, err)
	beginner, err := inbox.NewPgxBeginner(pool, inbox.PgxBeginnerConfig{})
	require.NoError(t, err)
	m, err := inbox.NewIdempotent(inbox.Config{Beginner: beginner, Store: store, Consumer: "stock"}, watermill.NopLogger{})
	require.NoError(t, err)
	var calls atomic.Int32
	h := m.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		calls.Add(1)
		return nil, writeEffect(msg, "x")
	})
	msgOf := func(id uuid.UUID, payload string) *message.Message {
		msg, err := marshaler.NewMessageWithID(id, "order.placed", time.Now().UTC(), []byte(payload))
		require.NoError(t, err)
		msg.SetContext(ctx)
		return msg
	}
	// The connection's first claimed attempt resolves and prepares the
	// commit guard (once per beginner and connection).
	_, err = h(msgOf(uuid.Must(uuid.NewV7()), `{"n":0}`))
	require.NoError(t, err)
	calls.Store(0)
	id := uuid.Must(uuid.NewV7())
	rt.n.Store(0)
	_, err = h(msgOf(id, `{"n":1}`))
	require.NoError(t, err)
	require.EqualValues(t, 3, rt.n.Load(), "new event: BEGIN+claim batch, the handler's INSERT, the commit guard+COMMIT batch")

	rt.n.Store(0)
	_, err = h(msgOf(id, `{"n":1}`))
	require.NoError(t, err)
	require.EqualValues(t, 2, rt.n.Load(), "duplicate: BEGIN+checked claim batch, ROLLBACK")
	require.EqualValues(t, 1, calls.Load())

	rt.n.Store(0)
	_, err = h(msgOf(id, `{"n":2}`))
	require.ErrorIs(t, err, inbox.ErrEventIDReused)
	require.EqualValues(t, 2, rt.n.Load(), "conflict: the same two round trips")
	require.EqualValues(t, 1, calls.Load())
}

// The duplicate's read runs after the claim, as a statement of its own, so
// it sees a row committed by a concurrent claim the claim waited on: a
// second delivery under the same id with another payload, arriving while
// the first is in flight, waits, then is refused as a conflict (not acked
// as a plain duplicate); with the same payload it is a duplicate.
func TestConcurrentDuplicateIsVerified(t *testing.T) {
	t.Parallel()
	for _, payload := range []string{`{"n":1}`, `{"n":2}`} {
		t.Run(payload, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			e := newEnv(t)
			poolA := testenv.PoolOn(t, e.schema, 2)
			poolB := testenv.PoolOn(t, e.schema, 1) // one connection: B's pid is known
			var pidB atomic.Int32
			var calls atomic.Int32
			handler := func(msg *message.Message) ([]*message.Message, error) {
				calls.Add(1)
				if err := writeEffect(msg, "x"); err != nil {
					return nil, err
				}
				// Commit only once B's claim waits on this row.
				testenv.Eventually(t, 30*time.Second, "B waits on A's claim", func(o *testenv.Observed) bool {
					var n int
					err := e.pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE pid = $1 AND wait_event_type = 'Lock'`, pidB.Load()).Scan(&n)
					return o.Int("waiting", n) > 0 && err == nil
				})
				return nil, nil
			}
			hA := e.mw(poolA, nil)(handler)
			hB := e.mw(poolB, nil)(handler)
			id := uuid.Must(uuid.NewV7())
			msgOf := func(p string) *message.Message {
				msg, err := marshaler.NewMessageWithID(id, "order.placed", time.Now().UTC(), []byte(p))
				require.NoError(t, err)
				msg.SetContext(ctx)
				return msg
			}
			errA := make(chan error, 1)
			go func() { _, err := hA(msgOf(`{"n":1}`)); errA <- err }()
			testenv.Eventually(t, 30*time.Second, "A claimed", func(o *testenv.Observed) bool { return o.Int("calls", int(calls.Load())) == 1 })
			conn, err := poolB.Acquire(ctx)
			require.NoError(t, err)
			pidB.Store(int32(conn.Conn().PgConn().PID()))
			conn.Release()
			_, errB := hB(msgOf(payload))
			require.NoError(t, <-errA)
			if payload == `{"n":1}` {
				require.NoError(t, errB, "the same event: a duplicate")
			} else {
				require.ErrorIs(t, errB, inbox.ErrEventIDReused, "another event under the same id, seen although committed while B waited")
			}
			require.EqualValues(t, 1, calls.Load())
		})
	}
}

// Every pgx query-exec mode works on the pipelined beginner, the duplicate's
// read-and-rollback batch included: prepared statements (the default),
// describe/exec without a statement cache (what pgbouncer's transaction mode
// needs) and the simple protocol (parameters interpolated by pgx, one
// multi-statement query per batch). A new event is applied once, its
// redelivery is a duplicate, another payload under its id a conflict.
func TestPipelinedBeginnerEveryExecMode(t *testing.T) {
	t.Parallel()
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeCacheDescribe,
		pgx.QueryExecModeDescribeExec, pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			_, schema := testenv.Pool(t)
			cfg := testenv.PoolConfig(t, testenv.PostgresURL(), schema, 2)
			cfg.ConnConfig.DefaultQueryExecMode = mode
			pool, err := pgxpool.NewWithConfig(ctx, cfg)
			require.NoError(t, err)
			t.Cleanup(pool.Close)
			store, err := processedstore.NewStore(processedstore.Config{Horizon: time.Hour})
			require.NoError(t, err)
			require.NoError(t, store.Migrate(ctx, sqldb.Pgx(pool)))
			_, err = pool.Exec(ctx, `CREATE TABLE effect (id bigserial PRIMARY KEY, event_id uuid NOT NULL, note text)`)
			require.NoError(t, err)
			beginner, err := inbox.NewPgxBeginner(pool, inbox.PgxBeginnerConfig{})
			require.NoError(t, err)
			m, err := inbox.NewIdempotent(inbox.Config{Beginner: beginner, Store: store, Consumer: "stock"}, watermill.NopLogger{})
			require.NoError(t, err)
			var calls atomic.Int32
			h := m.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				calls.Add(1)
				return nil, writeEffect(msg, "x")
			})
			id := uuid.Must(uuid.NewV7())
			msgOf := func(p string) *message.Message {
				msg, err := marshaler.NewMessageWithID(id, "order.placed", time.Now().UTC(), []byte(p))
				require.NoError(t, err)
				msg.SetContext(ctx)
				return msg
			}
			for i := 0; i < 3; i++ {
				_, err = h(msgOf(`{"n":1}`))
				require.NoError(t, err)
			}
			_, err = h(msgOf(`{"n":2}`))
			require.ErrorIs(t, err, inbox.ErrEventIDReused)
			require.EqualValues(t, 1, calls.Load())
			var effects int
			require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM effect`).Scan(&effects))
			require.Equal(t, 1, effects)
			// Every connection is back in the pool, idle, outside a transaction.
			for _, c := range pool.AcquireAllIdle(ctx) {
				require.Equal(t, byte('I'), c.Conn().PgConn().TxStatus())
				c.Release()
			}
		})
	}
}
