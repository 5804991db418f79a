package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/faultproxy"
	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
)

// hrevFailsafe only ends a test that would otherwise hang; it is never the
// subject of an assertion about speed.
const hrevFailsafe = 20 * time.Second

// Config.LockTimeout is "PostgreSQL's lock_timeout for the whole attempt's
// transaction". The claim's own lock on the claim table (RowExclusiveLock,
// taken by the executor before any expression of the statement, so before
// a set_config in its WHERE) must be bounded too: while another session
// holds the table (LOCK TABLE, ALTER TABLE, a partition DROP of the
// purger, a layout switch), an attempt fails with ErrInFlight after
// LockTimeout instead of waiting for as long as the other session holds
// it. The connection is warmed first, so the claim is already prepared.
func TestLockTimeoutBoundsTheClaimTableLock(t *testing.T) {
	t.Parallel()
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeSimpleProtocol} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			var schema string
			_, h := preparedClaimSetupLock(t, mode, 1, 50*time.Millisecond, func(ctx context.Context, tx pgx.Tx) error {
				return tx.QueryRow(ctx, "SELECT current_schema()").Scan(&schema)
			})
			_, err := h(preparedClaimMsg(t, uuid.Must(uuid.NewV7()), `{"n":1}`)) // prepares the claim
			require.NoError(t, err)

			claimOnHeldTableIsInFlight(t, h, pgx.Identifier{schema, "processed_event"}.Sanitize(), hrevFailsafe)
		})
	}
}

// claimOnHeldTableIsInFlight holds table (the claim table, quoted) in
// ACCESS EXCLUSIVE mode from another session and runs one new message
// through h: with the lock timeout in force the attempt fails with
// ErrInFlight; an unbounded claim waits until failsafe ends it.
func claimOnHeldTableIsInFlight(t *testing.T, h message.HandlerFunc, table string, failsafe time.Duration) {
	t.Helper()
	ctx := context.Background()
	holder, err := pgx.Connect(ctx, testenv.PostgresURL())
	require.NoError(t, err)
	defer holder.Close(ctx)
	htx, err := holder.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = htx.Rollback(ctx) }()
	_, err = htx.Exec(ctx, "LOCK TABLE "+table+" IN ACCESS EXCLUSIVE MODE")
	require.NoError(t, err)
	msg := preparedClaimMsg(t, uuid.Must(uuid.NewV7()), `{"n":9}`)
	mctx, cancel := context.WithTimeout(ctx, failsafe)
	defer cancel()
	msg.SetContext(mctx)
	start := time.Now()
	_, err = h(msg)
	require.Error(t, err)
	require.False(t, errors.Is(err, context.DeadlineExceeded),
		"the claim waited on the claim table's lock for %s (until the failsafe): lock_timeout not in force: %v", time.Since(start).Round(time.Millisecond), err)
	require.ErrorIs(t, err, inbox.ErrInFlight)
}

// hrevTracer runs fault at a chosen point of the prepared claim's batch
// (the first batch whose first statement is BEGIN after it is armed):
// "start" (statements prepared, batch not yet sent) or "after-begin"
// (BEGIN's result read, the claim's not: the server may have inserted the
// claim row).
type hrevTracer struct {
	at    string
	armed atomic.Bool
	fault func()
}

func (tr *hrevTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}
func (tr *hrevTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (tr *hrevTracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceBatchStartData) context.Context {
	if tr.at == "start" && len(d.Batch.QueuedQueries) > 0 && d.Batch.QueuedQueries[0].SQL == "begin" && tr.armed.CompareAndSwap(true, false) {
		tr.fault()
	}
	return ctx
}
func (tr *hrevTracer) TraceBatchQuery(_ context.Context, _ *pgx.Conn, d pgx.TraceBatchQueryData) {
	if tr.at == "after-begin" && d.SQL == "begin" && tr.armed.CompareAndSwap(true, false) {
		tr.fault()
	}
}
func (tr *hrevTracer) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

// The attempt's connection cut at each point of the prepared claim's one
// round trip (cold: just after the statements were prepared; warm: before
// the batch; mid-batch: after BEGIN's result, before the claim's) and a
// context cancelled before the batch: never acked as claimed on that
// attempt, never poisoned, the connection not reused in a transaction; the
// held re-run applies the event once (one effect, one claim row).
func TestPreparedClaimFaultsInItsBatch(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name, at string
		warm     bool
	}{{"cut-cold-before-batch", "start", false}, {"cut-warm-before-batch", "start", true}, {"cut-mid-batch", "after-begin", true}} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			e := newEnv(t)
			cfg := testenv.PoolConfig(t, testenv.PostgresURL(), e.schema, 2)
			proxy, err := faultproxy.Start(fmt.Sprintf("%s:%d", cfg.ConnConfig.Host, cfg.ConnConfig.Port))
			require.NoError(t, err)
			t.Cleanup(func() { _ = proxy.Close() })
			cfg.ConnConfig.Host, cfg.ConnConfig.Port = "127.0.0.1", uint16(proxy.Port())
			tr := &hrevTracer{at: c.at, fault: proxy.Cut}
			cfg.ConnConfig.Tracer = tr
			require.Equal(t, pgx.QueryExecModeCacheStatement, cfg.ConnConfig.DefaultQueryExecMode)
			pool, err := pgxpool.NewWithConfig(ctx, cfg)
			require.NoError(t, err)
			t.Cleanup(pool.Close)
			idem, err := inbox.NewIdempotent(inbox.Config{Beginner: mustBeginner(inbox.NewPgxBeginner(pool, inbox.PgxBeginnerConfig{})), Store: e.store, Consumer: "stock"}, nil)
			require.NoError(t, err)
			poison := &capture{msgs: make(chan *message.Message, 1)}
			var calls atomic.Int32
			h := chainedHold(t, idem, poison, nil, 2*time.Minute, func(msg *message.Message) ([]*message.Message, error) {
				calls.Add(1)
				q, _ := inbox.QuerierFromContext(msg.Context())
				_, err := q.Exec(msg.Context(), `INSERT INTO effect (event_id, note) VALUES ($1, $2)`, msg.UUID, "x")
				return nil, err
			})
			if c.warm {
				_, err := h(newMsg(uuid.Must(uuid.NewV7()).String()))
				require.NoError(t, err)
				calls.Store(0)
			}
			tr.armed.Store(true)
			id := uuid.Must(uuid.NewV7()).String()
			_, err = h(newMsg(id))
			require.NoError(t, err, "held and applied after the cut")
			require.False(t, tr.armed.Load(), "the fault ran")
			require.Empty(t, poison.msgs, "never poisoned")
			// Mid-batch, the claim's result may already be in the client's
			// buffer when the socket is cut: the handler then runs on the
			// dead connection once (its statement fails, rolled back).
			ran := calls.Load()
			require.True(t, ran == 1 || (c.at == "after-begin" && ran == 2), "handler calls: %d", ran)
			require.Equal(t, 1, e.effects(id))
			var rows int
			require.NoError(t, e.pool.QueryRow(ctx, `SELECT count(*) FROM processed_event WHERE event_id = $1`, id).Scan(&rows))
			require.Equal(t, 1, rows)
			_, err = h(newMsg(id))
			require.NoError(t, err)
			require.Equal(t, ran, calls.Load(), "a duplicate afterwards")
		})
	}
}

// The message's context cancelled after the statements were prepared and
// before the batch is sent: the attempt fails (never acked as claimed,
// nothing written), and the connection goes back to the pool idle, outside
// a transaction, and serves the next message.
func TestPreparedClaimContextCancelledBeforeBatch(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t)
	cfg := testenv.PoolConfig(t, testenv.PostgresURL(), e.schema, 1)
	var cancel context.CancelFunc
	tr := &hrevTracer{at: "start", fault: func() { cancel() }}
	cfg.ConnConfig.Tracer = tr
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	var calls atomic.Int32
	h := e.mw(pool, nil)(func(msg *message.Message) ([]*message.Message, error) {
		calls.Add(1)
		q, _ := inbox.QuerierFromContext(msg.Context())
		_, err := q.Exec(msg.Context(), `INSERT INTO effect (event_id, note) VALUES ($1, $2)`, msg.UUID, "x")
		return nil, err
	})
	_, err = h(newMsg(uuid.Must(uuid.NewV7()).String())) // warm
	require.NoError(t, err)
	tr.armed.Store(true)
	id := uuid.Must(uuid.NewV7()).String()
	msg := newMsg(id)
	mctx, c := context.WithCancel(ctx)
	cancel = c
	msg.SetContext(mctx)
	_, err = h(msg)
	require.Error(t, err)
	require.ErrorIs(t, err, context.Canceled)
	require.EqualValues(t, 1, calls.Load())
	require.Zero(t, e.effects(id))
	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	require.Equal(t, byte('I'), conn.Conn().PgConn().TxStatus())
	conn.Release()
	_, err = h(newMsg(id))
	require.NoError(t, err)
	require.EqualValues(t, 2, calls.Load())
	require.Equal(t, 1, e.effects(id))
}

// The prepared claim's binary event_at at the ends of the range and below
// the microsecond stores what pgx's binary (cache_describe) and text
// (simple protocol) encodings store, and that is the time truncated to the
// microsecond: year 1, a non-UTC zone that makes it 1 BC in UTC, 9999,
// 1969 with a sub-microsecond part (negative Unix time, the floor).
func TestPreparedClaimEventAtExtremes(t *testing.T) {
	t.Parallel()
	occurred := []time.Time{
		time.Date(1, 1, 1, 0, 0, 0, 1000, time.UTC), // the zero time itself is refused by the marshaler
		time.Date(1, 1, 1, 0, 0, 0, 1500, time.FixedZone("e5", 5*3600)),
		time.Date(9999, 12, 31, 23, 59, 59, 999999999, time.UTC),
		time.Date(1969, 12, 31, 23, 59, 59, 999999500, time.FixedZone("m0330", -(3*3600+1800))),
		time.Date(2000, 1, 1, 0, 0, 0, 999, time.UTC),
	}
	ids := make([]uuid.UUID, len(occurred))
	for i := range ids {
		ids[i] = uuid.New() // v4: dated by occurred_at
	}
	rows := map[pgx.QueryExecMode][]time.Time{}
	modes := []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeCacheDescribe, pgx.QueryExecModeSimpleProtocol}
	for _, mode := range modes {
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
			msg, err := marshaler.NewMessageWithID(id, "order.placed", occurred[i], []byte(`{"n":1}`))
			require.NoError(t, err)
			msg.SetContext(ctx)
			_, err = h(msg)
			require.NoError(t, err, "%s %v", mode, occurred[i])
			var at time.Time
			// Read back in binary on every pool: only the writing differs.
			require.NoError(t, pool.QueryRow(ctx, `SELECT event_at FROM processed_event WHERE event_id = $1`, pgx.QueryExecModeCacheDescribe, id).Scan(&at))
			rows[mode] = append(rows[mode], at.UTC())
		}
	}
	for i, o := range occurred {
		require.Equal(t, o.UTC().Truncate(time.Microsecond), rows[pgx.QueryExecModeCacheStatement][i], "prepared: %v", o)
	}
	require.Equal(t, rows[pgx.QueryExecModeCacheDescribe], rows[pgx.QueryExecModeCacheStatement])
	require.Equal(t, rows[pgx.QueryExecModeSimpleProtocol], rows[pgx.QueryExecModeCacheStatement])
}

// Two Idempotent middlewares on one pool connection, with different
// tables, consumers, layouts (plain; partitioned, whose non-v7 ids are
// routed to its side table) and lock timeouts, alternate: the prepared
// statements cached per connection are keyed by their text, so each claim
// lands in its own store (never the other's table), each duplicate is
// recognized by its own store, and a payload change is caught by each.
func TestTwoMiddlewaresOnOneConnectionKeepTheirOwnStores(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, schema := testenv.Pool(t)
	cfg := testenv.PoolConfig(t, testenv.PostgresURL(), schema, 1)
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	storeA, err := processedstore.NewStore(processedstore.Config{Table: "pe_a"})
	require.NoError(t, err)
	storeB, err := processedstore.NewStore(processedstore.Config{Table: "pe_b", Layout: processedstore.LayoutPartitioned, Horizon: 2 * time.Hour})
	require.NoError(t, err)
	require.NoError(t, storeA.Migrate(ctx, sqldb.Pgx(pool)))
	require.NoError(t, storeB.Migrate(ctx, sqldb.Pgx(pool)))
	beginner, err := inbox.NewPgxBeginner(pool, inbox.PgxBeginnerConfig{})
	require.NoError(t, err)
	var calls [2]atomic.Int32
	var hs [2]message.HandlerFunc
	for i, c := range []inbox.Config{
		{Beginner: beginner, Store: storeA, Consumer: "a", LockTimeout: 50 * time.Millisecond},
		{Beginner: beginner, Store: storeB, Consumer: "b", LockTimeout: 70 * time.Millisecond},
	} {
		m, err := inbox.NewIdempotent(c, watermill.NopLogger{})
		require.NoError(t, err)
		i := i
		hs[i] = m.Middleware(func(*message.Message) ([]*message.Message, error) {
			calls[i].Add(1)
			return nil, nil
		})
	}
	stores := [2]*processedstore.Store{storeA, storeB}
	consumers := [2]string{"a", "b"}
	var ids []uuid.UUID
	for round := 0; round < 2; round++ {
		for _, id := range []uuid.UUID{uuid.Must(uuid.NewV7()), uuid.New()} {
			ids = append(ids, id)
			for i := range hs {
				_, err := hs[i](preparedClaimMsg(t, id, `{"n":1}`))
				require.NoError(t, err)
			}
		}
	}
	require.EqualValues(t, len(ids), calls[0].Load())
	require.EqualValues(t, len(ids), calls[1].Load())
	for _, id := range ids {
		for i := range stores {
			for j := range consumers {
				got, err := stores[i].StoredIdentity(ctx, sqldb.Pgx(pool), consumers[j], id)
				require.NoError(t, err)
				require.Equal(t, i == j, got.Found, "store %d consumer %s id v%d", i, consumers[j], id.Version())
			}
		}
		for i := range hs {
			_, err := hs[i](preparedClaimMsg(t, id, `{"n":1}`))
			require.NoError(t, err, "duplicate")
			_, err = hs[i](preparedClaimMsg(t, id, `{"n":2}`))
			require.Error(t, err, "a payload change is caught")
		}
	}
	require.EqualValues(t, len(ids), calls[0].Load())
	require.EqualValues(t, len(ids), calls[1].Load())
	var n int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM pg_prepared_statements WHERE name LIKE 'idempotency\_%'`).Scan(&n))
	require.Greater(t, n, 0, "the prepared path was taken")
}

// Session commands a handler may run inside the attempt's transaction on
// the prepared path, where Config.LockTimeout is the session's lock_timeout
// set once per connection: RESET ALL and SET SESSION lock_timeout (both
// kept after commit, as PostgreSQL does) make the next claim on that
// connection set it again, so the next attempt still runs its claim and
// handler under Config.LockTimeout; between attempts the session keeps it
// (documented on Config.LockTimeout).
func TestLockTimeoutSurvivesHandlerSessionCommands(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	var step atomic.Int32
	var seen []string
	pool, h := preparedClaimSetupLock(t, pgx.QueryExecModeCacheStatement, 1, 40*time.Millisecond, func(ctx context.Context, tx pgx.Tx) error {
		var s string
		if err := tx.QueryRow(ctx, "SHOW lock_timeout").Scan(&s); err != nil {
			return err
		}
		seen = append(seen, s)
		switch step.Load() {
		case 1:
			_, err := tx.Exec(ctx, "RESET ALL")
			return err
		case 2:
			_, err := tx.Exec(ctx, "SET SESSION lock_timeout = '7s'")
			return err
		case 3:
			b := &pgx.Batch{}
			b.Queue("select 1")
			b.Queue("Reset Lock_Timeout")
			return tx.SendBatch(ctx, b).Close()
		}
		return nil
	})
	show := func() string {
		c, err := pool.Acquire(ctx)
		require.NoError(t, err)
		defer c.Release()
		var s string
		require.NoError(t, c.QueryRow(ctx, "SHOW lock_timeout").Scan(&s))
		return s
	}
	want := []string{"40ms", "0", "7s", "0", "40ms"}
	for i := int32(0); i < 5; i++ {
		step.Store(i)
		_, err := h(preparedClaimMsg(t, uuid.Must(uuid.NewV7()), `{"n":1}`))
		require.NoError(t, err)
		require.Equal(t, want[i], show(), "the session's lock_timeout after attempt %d", i)
	}
	require.Equal(t, []string{"40ms", "40ms", "40ms", "40ms", "40ms"}, seen)
}

// A row claimed with payload verification off (no event_name, NULL
// fingerprint: the 3-parameter prepared claim) and met again by a verifying
// middleware of the same consumer on the same connection: the prepared
// duplicate read returns the NULL fingerprint in binary as nil, so it is a
// plain duplicate (acked, handler not run), whatever the payload; and the
// other way round a verified row is met by the unverifying claim as a
// duplicate.
func TestPreparedReadOfNullFingerprintIsPlainDuplicate(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, schema := testenv.Pool(t)
	cfg := testenv.PoolConfig(t, testenv.PostgresURL(), schema, 1)
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	store, err := processedstore.NewStore(processedstore.Config{})
	require.NoError(t, err)
	require.NoError(t, store.Migrate(ctx, sqldb.Pgx(pool)))
	beginner, err := inbox.NewPgxBeginner(pool, inbox.PgxBeginnerConfig{})
	require.NoError(t, err)
	var calls atomic.Int32
	mk := func(off bool) message.HandlerFunc {
		m, err := inbox.NewIdempotent(inbox.Config{Beginner: beginner, Store: store, Consumer: "stock", DisablePayloadVerification: off}, watermill.NopLogger{})
		require.NoError(t, err)
		return m.Middleware(func(*message.Message) ([]*message.Message, error) { calls.Add(1); return nil, nil })
	}
	plain, verified := mk(true), mk(false)
	id := uuid.Must(uuid.NewV7())
	_, err = plain(preparedClaimMsg(t, id, `{"n":1}`))
	require.NoError(t, err)
	var fpNull bool
	require.NoError(t, pool.QueryRow(ctx, `SELECT fingerprint IS NULL FROM processed_event WHERE event_id = $1`, id).Scan(&fpNull))
	require.True(t, fpNull)
	for i := 0; i < 2; i++ { // the second time on the prepared read
		_, err = verified(preparedClaimMsg(t, id, `{"n":2}`))
		require.NoError(t, err, "a row without fingerprint is a plain duplicate")
	}
	id2 := uuid.Must(uuid.NewV7())
	_, err = verified(preparedClaimMsg(t, id2, `{"n":1}`))
	require.NoError(t, err)
	_, err = plain(preparedClaimMsg(t, id2, `{"n":2}`))
	require.NoError(t, err)
	require.EqualValues(t, 2, calls.Load())
	var n int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM pg_prepared_statements WHERE name LIKE 'idempotency\_%' AND statement LIKE 'SELECT%'`).Scan(&n))
	require.Equal(t, 1, n, "the duplicate read was prepared")
}

// A claim table whose consumer column is a domain over text (and whose
// event_name is varchar): the prepared statement's parameter types are not
// the encoded ones for the domain, so the claim falls back to the pgx.Batch
// path, and claims, duplicates and payload changes behave as everywhere.
// The table altered to the domain after the claim was prepared on the
// connection (the statement keeps its text parameter, PostgreSQL
// re-plans it) behaves the same.
func TestPreparedClaimOnDomainColumns(t *testing.T) {
	t.Parallel()
	for _, after := range []bool{false, true} {
		t.Run(fmt.Sprintf("altered-after-prepare=%v", after), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			var calls atomic.Int32
			pool, h := preparedClaimSetup(t, pgx.QueryExecModeCacheStatement, 1, func(context.Context, pgx.Tx) error {
				calls.Add(1)
				return nil
			})
			alter := func() {
				_, err := pool.Exec(ctx, `CREATE DOMAIN consumer_name AS text CHECK (VALUE <> '');
ALTER TABLE processed_event ALTER COLUMN consumer TYPE consumer_name, ALTER COLUMN event_name TYPE varchar(300)`, pgx.QueryExecModeSimpleProtocol)
				require.NoError(t, err)
			}
			if !after {
				alter()
			}
			first := uuid.Must(uuid.NewV7())
			_, err := h(preparedClaimMsg(t, first, `{"n":1}`))
			require.NoError(t, err)
			if after {
				alter()
			}
			for i := 0; i < 2; i++ {
				id := uuid.Must(uuid.NewV7())
				_, err := h(preparedClaimMsg(t, id, `{"n":1}`))
				require.NoError(t, err)
				_, err = h(preparedClaimMsg(t, id, `{"n":1}`))
				require.NoError(t, err, "duplicate")
				_, err = h(preparedClaimMsg(t, id, `{"n":2}`))
				require.Error(t, err, "payload change")
			}
			_, err = h(preparedClaimMsg(t, first, `{"n":1}`))
			require.NoError(t, err)
			require.EqualValues(t, 3, calls.Load())
		})
	}
}

// DISCARD ALL on a connection between attempts (as a pooler's reset or a
// user's code on the pool does) drops the claim's statements and resets
// the session's lock_timeout: the next attempt's batch fails (26000,
// nothing claimed), is rolled back, the statements are prepared and the
// session's lock timeout set again, and the batch is resent once; every
// message is applied once, under the lock timeout.
func TestDiscardAllBetweenAttemptsSetsTheLockTimeoutAgain(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	var seen []string
	pool, h := preparedClaimSetupLock(t, pgx.QueryExecModeCacheStatement, 1, 30*time.Millisecond, func(ctx context.Context, tx pgx.Tx) error {
		var s string
		if err := tx.QueryRow(ctx, "SHOW lock_timeout").Scan(&s); err != nil {
			return err
		}
		seen = append(seen, s)
		return nil
	})
	var ids []uuid.UUID
	for i := 0; i < 3; i++ {
		c, err := pool.Acquire(ctx)
		require.NoError(t, err)
		_, err = c.Exec(ctx, "DISCARD ALL")
		require.NoError(t, err)
		require.NoError(t, c.Conn().DeallocateAll(ctx)) // pgx's own cache is not the subject
		var s string
		require.NoError(t, c.QueryRow(ctx, "SHOW lock_timeout").Scan(&s))
		require.Equal(t, "0", s)
		c.Release()
		id := uuid.Must(uuid.NewV7())
		ids = append(ids, id)
		_, err = h(preparedClaimMsg(t, id, `{"n":1}`))
		require.NoError(t, err, "message %d", i)
	}
	require.Equal(t, []string{"30ms", "30ms", "30ms"}, seen)
	for _, id := range ids {
		var effects, claims int
		require.NoError(t, pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM effect WHERE event_id = $1), (SELECT count(*) FROM processed_event WHERE event_id = $1)`, id).Scan(&effects, &claims))
		require.Equal(t, 1, effects)
		require.Equal(t, 1, claims)
	}
}
