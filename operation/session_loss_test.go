package operation_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/crashpoint"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/operation"
)

// pgRunner is a migrated Runner on its own pool over schema, with the
// pool's extra session settings.
func pgRunner(t *testing.T, schema string, maxConns int32, settings map[string]string) (*operation.Runner, *pgxpool.Pool) {
	t.Helper()
	cfg := testenv.PoolConfig(t, testenv.PostgresURL(), schema, maxConns)
	for k, v := range settings {
		cfg.ConnConfig.RuntimeParams[k] = v
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	r, err := operation.NewRunner(operation.Config{DB: idempotency.Pgx(pool), Wait: 50 * time.Millisecond}, nil)
	require.NoError(t, err)
	require.NoError(t, r.Migrate(context.Background()))
	return r, pool
}

// lockHeld reports whether some session holds key's advisory lock.
func lockHeld(t *testing.T, admin *pgxpool.Pool, r *operation.Runner, key operation.Key) bool {
	t.Helper()
	var id int64
	ctx := context.Background()
	require.NoError(t, admin.QueryRow(ctx, `SELECT `+operation.PgLockKey, key.String(), `"`+strings.ReplaceAll(r.Table(), ".", `"."`)+`"`).Scan(&id))
	var held bool
	require.NoError(t, admin.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted
AND classid::bigint = $1 AND objid::bigint = $2 AND objsubid = 1)`, int64(uint64(id)>>32), int64(uint64(id)&0xFFFFFFFF)).Scan(&held))
	return held
}

// With idle_session_timeout on the Runner's sessions, the owner's session
// ends while its call waits on the provider, and its key lock with it. A
// second worker that then takes the lock, with a reconcile function that
// finds nothing, does not call the provider: the owner's lease is live
// (InProgressError, transient). The owner records its outcome on another
// connection; the provider is called once (case 27.5).
func TestIdleSessionTimeoutNeverCallsTwice(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	admin, schema := testenv.Pool(t)
	first, _ := pgRunner(t, schema, 2, map[string]string{"idle_session_timeout": "200ms"})
	second, _ := pgRunner(t, schema, 2, nil)
	key := mustKey(t, "charge", "idle")
	var calls atomic.Int32
	notFound := func(context.Context, operation.Record) (operation.Result, error) {
		return operation.Result{}, operation.ErrNotFound
	}
	call := func(ctx context.Context, k string) (operation.Result, error) {
		calls.Add(1)
		eventually(t, "the idle session to end and its lock with it", func(o *testenv.Observed) bool {
			return !o.Bool("held", lockHeld(t, admin, first, key))
		})
		for i := 0; i < 5; i++ {
			_, err := second.Do(ctx, key, eur100, func(context.Context, string) (operation.Result, error) {
				calls.Add(1)
				return operation.Result{Reference: "second"}, nil
			}, operation.WithReconcile(notFound))
			var ip *operation.InProgressError
			require.ErrorAs(t, err, &ip, "attempt %d of the second worker", i)
			require.True(t, middleware.IsTransient(err))
			time.Sleep(operation.LeaseDuration() / 4)
		}
		return operation.Result{Reference: "first"}, nil
	}
	res, err := first.Do(ctx, key, eur100, call)
	for i := 0; err != nil && calls.Load() == 0 && middleware.IsTransient(err) && i < 10; i++ {
		// A pooled session that idled past the timeout before this Do
		// (pgxpool pings only sessions idle over a second) fails its
		// first statement (57P05, transient, nothing called): retried,
		// as a consumer's hold retries it.
		res, err = first.Do(ctx, key, eur100, call)
	}
	require.NoError(t, err)
	require.Equal(t, "first", res.Reference)
	require.EqualValues(t, 1, calls.Load(), "the provider is called by one worker only")
}

// A worker paused after its begin (its started record committed, the
// provider not called yet) for longer than its lease, whose session is
// gone meanwhile (terminated), is taken over: the second worker finds the
// lease expired, reconciles (nothing found) and calls. When the paused
// worker resumes, its fence finds the record no longer its own and it does
// not call: one call in all (case 27.5). Not parallel: the crash-point hook
// is the process's.
func TestPausedWorkerDoesNotCallAfterTakeover(t *testing.T) {
	ctx := context.Background()
	admin, schema := testenv.Pool(t)
	first, firstPool := pgRunner(t, schema, 2, map[string]string{"application_name": "paused-worker"})
	second, _ := pgRunner(t, schema, 2, nil)
	key := mustKey(t, "charge", "paused")
	paused, resume := make(chan struct{}), make(chan struct{})
	var once, resumed sync.Once
	t.Cleanup(func() { resumed.Do(func() { close(resume) }) })
	crashpoint.Set(func(name string) {
		if name == operation.CrashAfterBegin {
			once.Do(func() {
				close(paused)
				<-resume
			})
		}
	})
	t.Cleanup(func() { crashpoint.Set(nil) })
	_ = firstPool
	var calls atomic.Int32
	done := make(chan error, 1)
	go func() {
		_, err := first.Do(ctx, key, eur100, func(context.Context, string) (operation.Result, error) {
			calls.Add(1)
			return operation.Result{Reference: "first"}, nil
		})
		done <- err
	}()
	<-paused
	crashpoint.Set(nil) // the second worker runs through
	_, err := admin.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'paused-worker'`)
	require.NoError(t, err)
	eventually(t, "the paused worker's lock to go with its session", func(o *testenv.Observed) bool {
		return !o.Bool("held", lockHeld(t, admin, first, key))
	})
	notFound := func(context.Context, operation.Record) (operation.Result, error) {
		return operation.Result{}, operation.ErrNotFound
	}
	var res operation.Result
	eventually(t, "the second worker to take over once the lease ran out", func(o *testenv.Observed) bool {
		res, err = second.Do(ctx, key, eur100, func(context.Context, string) (operation.Result, error) {
			calls.Add(1)
			return operation.Result{Reference: "second"}, nil
		}, operation.WithReconcile(notFound))
		return o.Err("do", err)
	})
	require.Equal(t, "second", res.Reference, "%+v", res)
	resumed.Do(func() { close(resume) })
	err = <-done
	require.Error(t, err, "the paused worker must not call after the takeover")
	require.True(t, middleware.IsTransient(err))
	require.EqualValues(t, 1, calls.Load(), "one call in all")
}

// A Runner that gets no connection (its pool's only connection held, as
// by a handler's transaction on the same pool) fails within its bound,
// with a transient error that names the pool and its use, instead of
// waiting forever without a log line (case 27.5).
func TestRunnerWithoutConnectionFailsWithinBound(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, schema := testenv.Pool(t)
	r, pool := pgRunner(t, schema, 1, nil)
	held, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer held.Release()
	start := time.Now()
	_, err = r.Do(ctx, mustKey(t, "charge", "starved"), eur100, func(context.Context, string) (operation.Result, error) {
		return operation.Result{}, nil
	})
	require.Error(t, err)
	require.Less(t, time.Since(start), operation.AcquireTimeout()+2*time.Second)
	require.True(t, middleware.IsTransient(err))
	require.Contains(t, err.Error(), "Config.Pool")
	require.Contains(t, err.Error(), "1 of 1 connections acquired")
}

// Behind PgBouncer in transaction pooling the key's session lock cannot
// hold: the Runner finds out (an unlock answered by a session that does not
// hold the lock it took) and refuses further calls with a configuration
// error that says why (held, never poisoned), and no key's provider is ever
// called twice meanwhile (case 27.1).
func TestRunnerRefusesBehindTransactionPooler(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	bouncer := testenv.StartPgBouncer(t, "transaction", "default_pool_size = 3")
	admin, schema := testenv.Pool(t)
	table := schema + ".operation"
	probe, err := operation.NewRunner(operation.Config{DB: idempotency.Pgx(admin), Table: table}, nil)
	require.NoError(t, err)
	require.NoError(t, probe.Migrate(ctx))
	bouncer.OtherClients(t, 4)

	pool := bouncer.PoolBehind(t, pgx.QueryExecModeExec, 2)
	r, err := operation.NewRunner(operation.Config{DB: idempotency.Pgx(pool), Table: table, Wait: 50 * time.Millisecond}, nil)
	require.NoError(t, err)
	calls := map[string]int{}
	var refused error
	for i := 0; i < 60 && refused == nil; i++ {
		k := mustKey(t, "charge", fmt.Sprint(i))
		_, err := r.Do(ctx, k, eur100, func(_ context.Context, key string) (operation.Result, error) {
			calls[key]++
			return operation.Result{Reference: key}, nil
		})
		if middleware.IsConfiguration(err) {
			refused = err
		}
	}
	require.Error(t, refused, "the Runner refuses to run behind a transaction pooler")
	require.True(t, strings.Contains(refused.Error(), "transaction pooler"), refused.Error())
	require.False(t, middleware.IsPermanent(refused))
	for k, n := range calls {
		require.Equal(t, 1, n, k)
	}
	_, err = r.Do(ctx, mustKey(t, "charge", "after"), eur100, func(context.Context, string) (operation.Result, error) {
		return operation.Result{}, errors.New("must not be called")
	})
	require.True(t, middleware.IsConfiguration(err), "and keeps refusing: %v", err)
}
