package inbox_test

// The lock timeout on the pgx claim path (pgxclaim.go, beginner.go): it
// bounds the claim in every exec mode and on a fresh connection, a
// consumer without one gives the session its own value back, and its range
// is PostgreSQL's.

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// "a consumer with a negative LockTimeout on that pool puts the session's
// earlier value back" (Config.LockTimeout, docs/databases.md). The pool's
// one session starts with lock_timeout = 5s. Consumer a (60ms) runs once or
// twice, its handler running a statement that names lock_timeout or
// "reset" (the next claim then sets the session's value again), or other
// code on the pool dropping the prepared statements between its attempts;
// consumer b (LockTimeout < 0) then runs: it, and the session after it,
// must be back under the session's own 5s.
func TestNegativeLockTimeoutPutsTheSessionsOwnValueBack(t *testing.T) {
	t.Parallel()
	for name, c := range map[string]struct {
		stmt, between string
		runsA         int
	}{
		"handler runs SHOW lock_timeout, a once":              {stmt: "SHOW lock_timeout", runsA: 1},
		"handler runs SHOW lock_timeout, a twice":             {stmt: "SHOW lock_timeout", runsA: 2},
		"handler reads a column named reset_at, a once":       {stmt: "SELECT 1 AS reset_at", runsA: 1},
		"handler reads a column named reset_at, a twice":      {stmt: "SELECT 1 AS reset_at", runsA: 2},
		"DEALLOCATE ALL on the pool between a's two attempts": {stmt: "SELECT 1", between: "DEALLOCATE ALL", runsA: 2},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			e := lockSetup(t, 1, func(c *pgxpool.Config) { c.ConnConfig.RuntimeParams["lock_timeout"] = "5s" })
			var seenB string
			hA := e.consumer(t, "a", 60*time.Millisecond, func(ctx context.Context, tx pgx.Tx) error {
				_, err := tx.Exec(ctx, c.stmt)
				return err
			})
			hB := e.consumer(t, "b", -1, func(ctx context.Context, tx pgx.Tx) error {
				var err error
				seenB, err = lockTimeoutOf(ctx, tx)
				return err
			})
			for i := 0; i < c.runsA; i++ {
				if i == 1 && c.between != "" {
					_, err := e.pool.Exec(context.Background(), c.between)
					require.NoError(t, err)
				}
				_, err := hA(preparedClaimMsg(t, uuid.Must(uuid.NewV7()), `{"n":1}`))
				require.NoError(t, err)
			}
			_, err := hB(preparedClaimMsg(t, uuid.Must(uuid.NewV7()), `{"n":2}`))
			require.NoError(t, err)
			assert.Equal(t, "5s", seenB, "consumer b (LockTimeout < 0) runs under the session's own lock_timeout")
			assert.Equal(t, "5s", e.show(t), "the pool's sessions keep their configured lock_timeout")
		})
	}
}

// A LockTimeout above a minute (30 days, "wait as long as it takes", past
// PostgreSQL's range; 10 minutes, past the purger's 5-minute slack for a
// claim that waits) is refused when the consumer is built, naming the
// field; the longest one accepted is applied.
func TestLockTimeoutBeyondAMinuteIsRefusedAtConstruction(t *testing.T) {
	t.Parallel()
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeExec} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			e := preparedEnv(t, mode, 1, nil)
			_, err := inbox.NewIdempotent(inbox.Config{Beginner: e.b, Store: e.store, Consumer: "stock", LockTimeout: 30 * 24 * time.Hour}, watermill.NopLogger{})
			require.ErrorContains(t, err, "Config.LockTimeout")
			_, err = inbox.NewIdempotent(inbox.Config{Beginner: e.b, Store: e.store, Consumer: "stock", LockTimeout: 10 * time.Minute}, watermill.NopLogger{})
			require.ErrorContains(t, err, "Config.LockTimeout")
			m, err := inbox.NewIdempotent(inbox.Config{Beginner: e.b, Store: e.store, Consumer: "stock", LockTimeout: time.Minute}, watermill.NopLogger{})
			require.NoError(t, err)
			h := m.Middleware(func(msg *message.Message) ([]*message.Message, error) { return nil, nil })
			_, err = h(preparedClaimMsg(t, uuid.Must(uuid.NewV7()), `{"n":1}`))
			require.NoError(t, err, "an attempt under the longest lock timeout accepted")
		})
	}
}

// Many consumers (names of different lengths, with and without payload
// verification and lock timeout) share one pool; every message is
// delivered three times from concurrent workers. Each (consumer, event)
// is applied exactly once and its stored row is the claim's own: the
// batches built per connection from the encoded BEGIN carry each
// attempt's own claim.
func TestManyConsumersOnOnePoolApplyEachEventOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := preparedEnv(t, pgx.QueryExecModeCacheStatement, 3, nil)
	type consumer struct {
		name string
		lock time.Duration
		noV  bool
	}
	consumers := []consumer{
		{name: "a", lock: 50 * time.Millisecond},
		{name: "billing-service-with-a-rather-long-consumer-name-" + uuid.NewString(), lock: -1},
		{name: "stock", lock: 2 * time.Second, noV: true},
		{name: "shipping", lock: -1, noV: true},
	}
	hs := make([]message.HandlerFunc, len(consumers))
	for i, c := range consumers {
		m, err := inbox.NewIdempotent(inbox.Config{Beginner: e.b, Store: e.store, Consumer: c.name, LockTimeout: c.lock, DisablePayloadVerification: c.noV}, watermill.NopLogger{})
		require.NoError(t, err)
		name := c.name
		hs[i] = m.Middleware(func(msg *message.Message) ([]*message.Message, error) {
			tx, _ := inbox.PgxTxFromContext(msg.Context())
			_, err := tx.Exec(msg.Context(), `INSERT INTO effect (event_id, note) VALUES ($1, $2)`, msg.UUID, name)
			return nil, err
		})
	}
	const events = 60
	ids := make([]uuid.UUID, events)
	for i := range ids {
		ids[i] = uuid.Must(uuid.NewV7())
	}
	var wg sync.WaitGroup
	errs := make(chan error, 1024)
	for w := 0; w < 6; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			for i := 0; i < events; i++ {
				id := ids[(i+w*7)%events]
				h := hs[(i+w)%len(hs)]
				payload := fmt.Sprintf(`{"n":%d,"pad":"%s"}`, i, strings.Repeat("x", (i*37)%300))
				_, err := h(preparedClaimMsg(t, id, payload))
				if err != nil && !inbox.IsTransient(err) {
					errs <- err
				}
			}
		}(w)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		// payload mismatches between deliveries are expected (the pad
		// differs): only conflicts may fail
		if !inbox.IsPermanent(err) {
			t.Errorf("unexpected error: %v", err)
		}
	}
	rows, err := e.pool.Query(ctx, `SELECT note, event_id, count(*) FROM effect GROUP BY 1, 2 HAVING count(*) > 1`)
	require.NoError(t, err)
	defer rows.Close()
	for rows.Next() {
		var note string
		var id uuid.UUID
		var n int
		require.NoError(t, rows.Scan(&note, &id, &n))
		t.Errorf("consumer %s applied %s %d times", note, id, n)
	}
	require.NoError(t, rows.Err())
	var orphan int
	require.NoError(t, e.pool.QueryRow(ctx, `SELECT count(*) FROM effect f WHERE NOT EXISTS (SELECT 1 FROM processed_event p WHERE p.consumer = f.note AND p.event_id = f.event_id)`).Scan(&orphan))
	require.Zero(t, orphan, "every effect has its own claim row")
}

// Config.LockTimeout "bounds the wait … on the claim table's lock" in
// every exec mode ("in every other mode and driver it is SET LOCAL
// lock_timeout before the claim, in the claim's round trip"). While
// another session holds the claim table, an attempt fails with
// ErrInFlight after the lock timeout, whether or not the connection has
// described or prepared the claim before: in QueryExecModeDescribeExec
// (which transaction pooling before PgBouncer 1.21 needs) every attempt,
// in QueryExecModeCacheDescribe the first on a connection.
func TestClaimTableLockIsBoundedInEveryExecMode(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		mode pgx.QueryExecMode
		warm bool
	}{
		{pgx.QueryExecModeDescribeExec, true},
		{pgx.QueryExecModeCacheDescribe, false},
		{pgx.QueryExecModeExec, false},
	} {
		t.Run(fmt.Sprintf("%s/warm=%v", c.mode, c.warm), func(t *testing.T) {
			t.Parallel()
			var schema string
			pool, h := preparedClaimSetupLock(t, c.mode, 1, 50*time.Millisecond, func(ctx context.Context, tx pgx.Tx) error {
				return tx.QueryRow(ctx, "SELECT current_schema()").Scan(&schema)
			})
			_, err := h(preparedClaimMsg(t, uuid.Must(uuid.NewV7()), `{"n":1}`))
			require.NoError(t, err)
			if !c.warm {
				pool.Reset() // a fresh connection: nothing described or prepared yet
			}
			claimOnHeldTableIsInFlight(t, h, pgx.Identifier{schema, "processed_event"}.Sanitize(), hrevFailsafe)
		})
	}
}

// Behind a pooler the lock timeout is a SET LOCAL in the claim's round
// trip (docs/databases.md); it must bound the claim's wait for the claim
// table on the first claim of a fresh connection too, before the claim's
// statements exist on it.
func TestFirstClaimBehindAPoolerIsBounded(t *testing.T) {
	t.Parallel()
	for _, p := range []struct {
		name  string
		start func(t *testing.T) *testenv.PgBouncer
	}{
		{"1.18-session", func(t *testing.T) *testenv.PgBouncer { return testenv.StartPgBouncer(t, "session") }},
		{"1.18-transaction", func(t *testing.T) *testenv.PgBouncer {
			return testenv.StartPgBouncer(t, "transaction", "default_pool_size = 1")
		}},
	} {
		t.Run(p.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			admin, schema := testenv.Pool(t)
			pool := p.start(t).PoolBehind(t, pgx.QueryExecModeCacheStatement, 1)
			store, err := processedstore.NewStore(processedstore.Config{Table: schema + ".processed_event", Horizon: time.Hour})
			require.NoError(t, err)
			require.NoError(t, store.Migrate(ctx, sqldb.Pgx(admin)))
			b, err := inbox.NewPgxBeginner(pool, inbox.PgxBeginnerConfig{})
			require.NoError(t, err)
			idem, err := inbox.NewIdempotent(inbox.Config{Beginner: b, Store: store, Consumer: "stock", LockTimeout: 60 * time.Millisecond}, watermill.NopLogger{})
			require.NoError(t, err)
			h := idem.Middleware(func(msg *message.Message) ([]*message.Message, error) { return nil, nil })
			claimOnHeldTableIsInFlight(t, h, pgx.Identifier{schema, "processed_event"}.Sanitize(), hrevFailsafe)
			_, err = h(preparedClaimMsg(t, uuid.Must(uuid.NewV7()), `{"n":1}`))
			require.NoError(t, err)
		})
	}
}

// Over a direct connection in pgx's default mode, the first claim of a
// fresh connection on a store whose claim is not the lean one (the
// partitioned layout, whose purger drops partitions) is bounded by the
// lock timeout too.
func TestFirstClaimOnThePartitionedLayoutIsBounded(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, schema := testenv.Pool(t)
	pool := testenv.PoolOn(t, schema, 1)
	store, err := processedstore.NewStore(processedstore.Config{Table: schema + ".processed_event", Horizon: time.Hour, Layout: processedstore.LayoutPartitioned})
	require.NoError(t, err)
	require.NoError(t, store.Migrate(ctx, sqldb.Pgx(pool)))
	b, err := inbox.NewPgxBeginner(pool, inbox.PgxBeginnerConfig{})
	require.NoError(t, err)
	idem, err := inbox.NewIdempotent(inbox.Config{Beginner: b, Store: store, Consumer: "stock", LockTimeout: 60 * time.Millisecond}, watermill.NopLogger{})
	require.NoError(t, err)
	h := idem.Middleware(func(msg *message.Message) ([]*message.Message, error) { return nil, nil })
	pool.Reset()
	claimOnHeldTableIsInFlight(t, h, pgx.Identifier{schema, "processed_event"}.Sanitize(), hrevFailsafe)
	_, err = h(preparedClaimMsg(t, uuid.Must(uuid.NewV7()), `{"n":1}`))
	require.NoError(t, err)
}
