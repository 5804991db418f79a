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
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/middleware"
)

// preparedClaimSetup is a middleware over a pool of maxConns connections in
// mode, on a fresh schema, whose handler runs inspect (if set) in the
// attempt's transaction and writes one effect row.
func preparedClaimSetup(t *testing.T, mode pgx.QueryExecMode, maxConns int32, inspect func(ctx context.Context, tx pgx.Tx) error) (*pgxpool.Pool, message.HandlerFunc) {
	return preparedClaimSetupLock(t, mode, maxConns, 0, inspect)
}

// preparedEnv is a pool of maxConns connections in mode (tweak, if set,
// changes its config) on a fresh schema, a schema-qualified store (the
// claim marks its transaction, as NewConsumer makes a table it finds
// qualified), the effect table and the pgx beginner.
func preparedEnv(t *testing.T, mode pgx.QueryExecMode, maxConns int32, tweak func(*pgxpool.Config)) lockEnv {
	t.Helper()
	ctx := context.Background()
	_, schema := testenv.Pool(t)
	cfg := testenv.PoolConfig(t, testenv.PostgresURL(), schema, maxConns)
	cfg.ConnConfig.DefaultQueryExecMode = mode
	if tweak != nil {
		tweak(cfg)
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	store, err := processedstore.NewStore(processedstore.Config{Table: schema + ".processed_event", Horizon: time.Hour})
	require.NoError(t, err)
	require.NoError(t, store.Migrate(ctx, sqldb.Pgx(pool)))
	_, err = pool.Exec(ctx, `CREATE TABLE effect (id bigserial PRIMARY KEY, event_id uuid NOT NULL, note text)`)
	require.NoError(t, err)
	b, err := inbox.NewPgxBeginner(pool, inbox.PgxBeginnerConfig{})
	require.NoError(t, err)
	return lockEnv{pool: pool, schema: schema, store: store, b: b}
}

// preparedClaimSetupLock is preparedClaimSetup with Config.LockTimeout lock.
func preparedClaimSetupLock(t *testing.T, mode pgx.QueryExecMode, maxConns int32, lock time.Duration, inspect func(ctx context.Context, tx pgx.Tx) error) (*pgxpool.Pool, message.HandlerFunc) {
	t.Helper()
	e := preparedEnv(t, mode, maxConns, nil)
	pool, store, beginner := e.pool, e.store, e.b
	m, err := inbox.NewIdempotent(inbox.Config{Beginner: beginner, Store: store, Consumer: "stock", LockTimeout: lock}, watermill.NopLogger{})
	require.NoError(t, err)
	return pool, m.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if inspect != nil {
			tx, _ := inbox.PgxTxFromContext(msg.Context())
			if err := inspect(msg.Context(), tx); err != nil {
				return nil, err
			}
		}
		// pgx's own statement cache is not the subject: the effect is
		// written as an unnamed statement.
		tx, _ := inbox.PgxTxFromContext(msg.Context())
		_, err := tx.Exec(msg.Context(), `INSERT INTO effect (event_id, note) VALUES ($1, $2)`, pgx.QueryExecModeExec, msg.UUID, "x")
		return nil, err
	})
}

func preparedClaimMsg(t *testing.T, id uuid.UUID, payload string) *message.Message {
	t.Helper()
	msg, err := marshaler.NewMessageWithID(id, "order.placed", time.Now().UTC(), []byte(payload))
	require.NoError(t, err)
	msg.SetContext(context.Background())
	return msg
}

// ourStatements counts the statements the prepared claim prepared on the
// transaction's connection, and how many times their INSERT (the claim)
// was planned, i.e. executed.
func ourStatements(ctx context.Context, tx pgx.Tx) (stmts, claims int, err error) {
	err = tx.QueryRow(ctx, `SELECT count(*), coalesce(sum(generic_plans + custom_plans) FILTER (WHERE statement LIKE 'INSERT%'), 0)
FROM pg_prepared_statements WHERE name LIKE 'idempotency\_%'`).Scan(&stmts, &claims)
	return stmts, claims, err
}

// On a pool in QueryExecModeCacheStatement the claim is sent as the
// beginner's own prepared statements (BEGIN and the claim, prepared once
// per connection; the lock timeout is the session's, set once) and each new message
// executes the prepared claim once (issue 17). In the other modes no such
// statement exists: the pgx.Batch path.
func TestPreparedClaimIsTaken(t *testing.T) {
	t.Parallel()
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeCacheDescribe, pgx.QueryExecModeSimpleProtocol} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			var stmts, claims []int
			_, h := preparedClaimSetup(t, mode, 1, func(ctx context.Context, tx pgx.Tx) error {
				s, c, err := ourStatements(ctx, tx)
				stmts, claims = append(stmts, s), append(claims, c)
				return err
			})
			for i := 0; i < 3; i++ {
				_, err := h(preparedClaimMsg(t, uuid.Must(uuid.NewV7()), `{"n":1}`))
				require.NoError(t, err)
			}
			if mode == pgx.QueryExecModeCacheStatement {
				require.Equal(t, []int{4, 4, 4}, stmts, "begin, the claim, the commit guard and COMMIT: prepared once on the one connection")
				require.Equal(t, []int{1, 2, 3}, claims, "one execution of the prepared claim per message")
				return
			}
			require.Equal(t, []int{0, 0, 0}, stmts)
		})
	}
}

// A connection that lost the prepared claim's statements (DISCARD ALL
// between attempts, as a pooler's reset does; DEALLOCATE ALL inside a
// handler, through pgx's Conn.DeallocateAll) recovers: the next attempt prepares them again and claims once
// (no loop, no error, no lost or doubled effect), duplicates are still
// recognized, and the connection ends idle outside a transaction.
func TestPreparedClaimRecoversLostStatements(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	var inHandlerDeallocate atomic.Bool
	pool, h := preparedClaimSetup(t, pgx.QueryExecModeCacheStatement, 1, func(ctx context.Context, tx pgx.Tx) error {
		if inHandlerDeallocate.Load() {
			// pgx's own reset: DEALLOCATE ALL, and pgx forgets its cache.
			return tx.Conn().DeallocateAll(ctx)
		}
		return nil
	})
	run := func(id uuid.UUID, payload string) {
		t.Helper()
		_, err := h(preparedClaimMsg(t, id, payload))
		require.NoError(t, err)
	}
	ids := []uuid.UUID{uuid.Must(uuid.NewV7()), uuid.Must(uuid.NewV7()), uuid.Must(uuid.NewV7()), uuid.Must(uuid.NewV7()), uuid.Must(uuid.NewV7())}
	run(ids[0], `{"n":0}`)

	// A pooler-like reset between attempts, on the pool's one connection;
	// pgx is then told to forget its own statement cache (not this test's
	// subject: pgx recovers from a stale cache by failing once).
	c, err := pool.Acquire(ctx)
	require.NoError(t, err)
	_, err = c.Exec(ctx, "DISCARD ALL")
	require.NoError(t, err)
	require.NoError(t, c.Conn().DeallocateAll(ctx))
	c.Release()
	run(ids[1], `{"n":1}`)
	run(ids[1], `{"n":1}`) // a duplicate

	// A handler that deallocates every statement of its connection
	// (through tx.Conn: every claimed attempt on that connection is then
	// committed with the guard's statement): the guard sent with COMMIT
	// was dropped, so that attempt fails once, transient (26000, nothing
	// committed), and the connection sends the guard unnamed from then on:
	// the redeliveries succeed although the handler deallocates again (no
	// loop).
	inHandlerDeallocate.Store(true)
	_, err = h(preparedClaimMsg(t, ids[4], `{"n":4}`))
	require.Error(t, err)
	require.True(t, inbox.IsTransient(err), "%v", err)
	run(ids[4], `{"n":4}`)
	run(ids[2], `{"n":2}`)
	inHandlerDeallocate.Store(false)
	run(ids[3], `{"n":3}`)
	run(ids[2], `{"n":2}`) // a duplicate

	var effects int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM effect`).Scan(&effects))
	require.Equal(t, 5, effects)
	var rows int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM processed_event`).Scan(&rows))
	require.Equal(t, 5, rows)
	c, err = pool.Acquire(ctx)
	require.NoError(t, err)
	defer c.Release()
	require.Equal(t, byte('I'), c.Conn().PgConn().TxStatus())
	var stmts int
	require.NoError(t, c.QueryRow(ctx, `SELECT count(*) FROM pg_prepared_statements WHERE name LIKE 'idempotency\_%'`).Scan(&stmts))
	require.Equal(t, 4, stmts, "prepared again after each loss: begin, the claim, the duplicate's read and rollback")
	var lock string
	require.NoError(t, c.QueryRow(ctx, "SHOW lock_timeout").Scan(&lock))
	require.Equal(t, "15s", lock, "the session's lock timeout, set again after DISCARD ALL reset it")
}

// The prepared claim's own parameter encoding stores what pgx's encoding
// stores: the same event time (a UUIDv4 dated by its occurred_at, to the
// microsecond; a UUIDv7 by its id, which the lean claim keeps in the id
// alone; before 2000 too), event_name and
// fingerprint, in QueryExecModeCacheStatement (prepared claim) and in the
// simple protocol (pgx.Batch path).
func TestPreparedClaimStoresTheSameRow(t *testing.T) {
	t.Parallel()
	occurred := []time.Time{
		time.Date(2026, 3, 4, 5, 6, 7, 891234567, time.UTC),
		time.Date(1999, 12, 31, 23, 59, 59, 999999999, time.FixedZone("x", 3600)),
	}
	ids := []uuid.UUID{uuid.New(), uuid.New(), uuid.Must(uuid.NewV7())}
	type row struct {
		At          time.Time
		Name        string
		Fingerprint []byte
	}
	rows := map[pgx.QueryExecMode][]row{}
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeSimpleProtocol} {
		ctx := context.Background()
		_, schema := testenv.Pool(t)
		cfg := testenv.PoolConfig(t, testenv.PostgresURL(), schema, 1)
		cfg.ConnConfig.DefaultQueryExecMode = mode
		pool, err := pgxpool.NewWithConfig(ctx, cfg)
		require.NoError(t, err)
		t.Cleanup(pool.Close)
		store, err := processedstore.NewStore(processedstore.Config{})
		require.NoError(t, err)
		require.NoError(t, store.Migrate(ctx, sqldb.Pgx(pool)))
		beginner, err := inbox.NewPgxBeginner(pool, inbox.PgxBeginnerConfig{})
		require.NoError(t, err)
		m, err := inbox.NewIdempotent(inbox.Config{Beginner: beginner, Store: store, Consumer: "stock"}, watermill.NopLogger{})
		require.NoError(t, err)
		h := m.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })
		for i, id := range ids {
			msg, err := marshaler.NewMessageWithID(id, "order.placed", occurred[i%2], []byte(`{"n":1}`))
			require.NoError(t, err)
			msg.SetContext(ctx)
			_, err = h(msg)
			require.NoError(t, err)
			var r row
			// The lean claim (prepared) writes a UUIDv7 row without
			// event_at: its time is its id's (first 48 bits, Unix ms).
			require.NoError(t, pool.QueryRow(ctx, `SELECT coalesce(event_at, to_timestamp(('x' || lpad(left(replace(event_id::text, '-', ''), 12), 16, '0'))::bit(64)::bigint / 1000.0)),
    event_name, fingerprint FROM processed_event WHERE event_id = $1`, id).Scan(&r.At, &r.Name, &r.Fingerprint))
			r.At = r.At.UTC()
			rows[mode] = append(rows[mode], r)
		}
	}
	got := rows[pgx.QueryExecModeCacheStatement]
	require.Equal(t, rows[pgx.QueryExecModeSimpleProtocol], got)
	require.Equal(t, occurred[0].Truncate(time.Microsecond), got[0].At)
	require.Equal(t, occurred[1].UTC().Truncate(time.Microsecond), got[1].At)
	v7, _ := processedstore.EventTime(ids[2], time.Time{})
	require.Equal(t, v7, got[2].At)
	require.Equal(t, processedstore.NewIdentity("order.placed", []byte(`{"n":1}`)).FingerprintBytes(), got[0].Fingerprint)
}

// Config.LockTimeout holds for the whole attempt's transaction in every
// exec mode: the handler sees it, and a handler statement that waits on a
// lock longer than it fails with 55P03. The prepared path makes it the
// session's setting, which the connection keeps after the attempt; the
// pgx.Batch path sets it with SET LOCAL, so the session's own setting is
// back once the attempt ended.
func TestLockTimeoutHoldsForTheHandler(t *testing.T) {
	t.Parallel()
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeSimpleProtocol} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			var seen string
			var waitErr error
			var pid uint32
			pool, h := preparedClaimSetupLock(t, mode, 2, 250*time.Millisecond, func(ctx context.Context, tx pgx.Tx) error {
				if err := tx.QueryRow(ctx, "SHOW lock_timeout").Scan(&seen); err != nil {
					return err
				}
				pid = tx.Conn().PgConn().PID()
				_, waitErr = tx.Exec(ctx, "LOCK TABLE effect IN EXCLUSIVE MODE")
				return nil
			})
			// Another session holds a lock the handler's statement waits on.
			other, err := pool.Acquire(ctx)
			require.NoError(t, err)
			otx, err := other.Begin(ctx)
			require.NoError(t, err)
			defer func() { _ = otx.Rollback(ctx) }()
			_, err = otx.Exec(ctx, "LOCK TABLE effect IN EXCLUSIVE MODE")
			require.NoError(t, err)

			_, err = h(preparedClaimMsg(t, uuid.Must(uuid.NewV7()), `{"n":1}`))
			require.Error(t, err) // the handler's INSERT runs in the aborted transaction
			require.Equal(t, "250ms", seen)
			var pgErr *pgconn.PgError
			require.ErrorAs(t, waitErr, &pgErr)
			require.Equal(t, "55P03", pgErr.Code)
			require.NoError(t, otx.Rollback(ctx))
			other.Release()

			after := map[uint32]string{}
			for _, c := range pool.AcquireAllIdle(ctx) {
				var s string
				require.NoError(t, c.QueryRow(ctx, "SHOW lock_timeout").Scan(&s))
				after[c.Conn().PgConn().PID()] = s
				c.Release()
			}
			want := "0"
			if mode == pgx.QueryExecModeCacheStatement {
				want = "250ms"
			}
			require.Contains(t, after, pid)
			require.Equal(t, want, after[pid], "the handler's connection after the attempt")
		})
	}
}

// A duplicate whose stored-identity read lost its prepared statement alone
// (DEALLOCATE of that one statement: the claim's statements still exist)
// is read again once, in the same attempt, and acked as a duplicate (never
// a configuration or permanent error, no failed delivery); the next
// delivery prepares the read again, and a reused event_id is still seen.
func TestPreparedDuplicateReadLostIsReadAgain(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	var calls atomic.Int32
	pool, h := preparedClaimSetup(t, pgx.QueryExecModeCacheStatement, 1, func(context.Context, pgx.Tx) error {
		calls.Add(1)
		return nil
	})
	id := uuid.Must(uuid.NewV7())
	_, err := h(preparedClaimMsg(t, id, `{"n":1}`))
	require.NoError(t, err)
	_, err = h(preparedClaimMsg(t, id, `{"n":1}`)) // prepares the read
	require.NoError(t, err)

	c, err := pool.Acquire(ctx)
	require.NoError(t, err)
	var name string
	require.NoError(t, c.QueryRow(ctx, `SELECT name FROM pg_prepared_statements WHERE name LIKE 'idempotency\_%' AND statement LIKE 'SELECT event_name%'`).Scan(&name))
	_, err = c.Exec(ctx, "DEALLOCATE "+name)
	require.NoError(t, err)
	c.Release()

	_, err = h(preparedClaimMsg(t, id, `{"n":1}`))
	require.NoError(t, err, "read again, once: a duplicate")

	_, err = h(preparedClaimMsg(t, id, `{"n":1}`))
	require.NoError(t, err)
	_, err = h(preparedClaimMsg(t, id, `{"n":2}`))
	require.ErrorIs(t, err, inbox.ErrEventIDReused)
	require.EqualValues(t, 1, calls.Load())
}

// After ALTER TABLE … TYPE on a column the duplicate's read returns, its
// prepared statement answers 0A000 ("cached plan must not change result
// type") on every connection that prepared it. It is prepared again like a
// lost statement: the duplicate is read once more and acked, never a
// configuration error (case 27.1), and later duplicates on the same
// connection are plain duplicates. The same on the pgx.Batch path of the
// other exec modes, where pgx's cache holds the statement.
func TestPreparedDuplicateReadAfterColumnTypeChange(t *testing.T) {
	t.Parallel()
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeCacheDescribe} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			var calls atomic.Int32
			pool, h := preparedClaimSetup(t, mode, 1, func(context.Context, pgx.Tx) error {
				calls.Add(1)
				return nil
			})
			id := uuid.Must(uuid.NewV7())
			for i := 0; i < 2; i++ { // applied, then a duplicate that prepares the read
				_, err := h(preparedClaimMsg(t, id, `{"n":1}`))
				require.NoError(t, err)
			}
			_, err := pool.Exec(ctx, `ALTER TABLE processed_event ALTER COLUMN event_name TYPE varchar(300)`)
			require.NoError(t, err)
			for i := 0; i < 3; i++ {
				_, err = h(preparedClaimMsg(t, id, `{"n":1}`))
				require.NoError(t, err, "duplicate %d after the column's type changed", i)
			}
			_, err = h(preparedClaimMsg(t, id, `{"n":2}`))
			require.ErrorIs(t, err, middleware.ErrEventIDReused)
			require.EqualValues(t, 1, calls.Load())
		})
	}
}

// After the prepared claim on a qualified table, a handler whose
// statements cannot end the transaction (each starts with SELECT, INSERT,
// …: txscan.go) is committed with COMMIT alone: the commit guard's
// statement is never executed (issue 25: it cost 61.7k server
// instructions a message). A statement the scan cannot prove (a semicolon
// in a literal, an argument in the simple protocol) makes that attempt's
// COMMIT guarded; a handler that
// reached the connection itself (tx.Conn) makes every later attempt on
// that connection guarded. Each effect is committed once either way.
func TestCommitGuardStatementRunsOnlyWhenAHandlerStatementMayEndTheTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	var step atomic.Int32
	var guardRuns []int
	pool, h := preparedClaimSetup(t, pgx.QueryExecModeCacheStatement, 1, func(ctx context.Context, tx pgx.Tx) error {
		var runs int
		if err := tx.QueryRow(ctx, `SELECT (SELECT coalesce(sum(generic_plans + custom_plans), 0) FROM pg_prepared_statements WHERE statement LIKE '%idempotency commit guard%')`,
			pgx.QueryExecModeSimpleProtocol).Scan(&runs); err != nil {
			return err
		}
		guardRuns = append(guardRuns, runs)
		switch step.Load() {
		case 3:
			var s string
			return tx.QueryRow(ctx, `SELECT 'a;commit'`).Scan(&s)
		case 4:
			// pgx writes the argument into the text it sends.
			var s string
			return tx.QueryRow(ctx, `SELECT $1::text`, pgx.QueryExecModeSimpleProtocol, "x").Scan(&s)
		case 6:
			_ = tx.Conn()
		}
		return nil
	})
	for i := 0; i < 8; i++ {
		step.Store(int32(i))
		_, err := h(preparedClaimMsg(t, uuid.Must(uuid.NewV7()), `{"n":1}`))
		require.NoError(t, err)
	}
	// Run counts as read in each handler, before its commit: the guard ran
	// for none of the first three, once for the fourth (its literal holds
	// a semicolon), once for the fifth (an argument in the simple
	// protocol), not for the sixth, then for the seventh (tx.Conn) and
	// every attempt after it on that connection.
	require.Equal(t, []int{0, 0, 0, 0, 1, 2, 2, 3}, guardRuns, "guard statement executions")
	var effects, runs int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM effect`).Scan(&effects))
	require.Equal(t, 8, effects, "each effect committed once")
	require.NoError(t, pool.QueryRow(ctx, `SELECT coalesce(sum(generic_plans + custom_plans), 0) FROM pg_prepared_statements WHERE statement LIKE '%idempotency commit guard%'`, pgx.QueryExecModeSimpleProtocol).Scan(&runs))
	require.Equal(t, 4, runs, "the eighth attempt, after tx.Conn on its connection, was guarded too")
}
