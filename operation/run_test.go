package operation_test

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/operation"
)

var eur100 = map[string]any{"amount": 100, "currency": "EUR"}

// Each outcome class of a call, and what the next attempt does with it. One
// runner, one key per subtest.
func TestDoOutcomes(t *testing.T) {
	t.Parallel()
	eachRunner(t, operation.Config{}, func(t *testing.T, e *runnerEnv) {
		ctx := context.Background()
		r := e.r

		get := func(t *testing.T, k operation.Key) operation.Record {
			t.Helper()
			rec, err := r.Get(ctx, k)
			require.NoError(t, err)
			return rec
		}

		t.Run("success is recorded and replayed without a call", func(t *testing.T) {
			t.Parallel()
			p, k := newProvider(), mustKey(t, "charge", "ok")
			res, err := r.Do(ctx, k, eur100, p.call("100", "EUR"))
			require.NoError(t, err)
			require.Equal(t, operation.OriginCall, res.Origin)
			again, err := r.Do(ctx, k, eur100, p.call("100", "EUR"))
			require.NoError(t, err)
			require.Equal(t, operation.OriginStored, again.Origin)
			require.Equal(t, res.Reference, again.Reference)
			require.JSONEq(t, string(res.Data), string(again.Data))
			_, calls, _ := p.counts()
			require.Equal(t, 1, calls)
			rec := get(t, k)
			require.Equal(t, operation.StateSucceeded, rec.State)
			require.Equal(t, "charge", rec.Kind)
			require.Equal(t, 1, rec.Attempts)
		})

		t.Run("a rejection is final: failed, permanent, replayed without a call", func(t *testing.T) {
			t.Parallel()
			p, k := newProvider(), mustKey(t, "charge", "declined")
			p.declines = 1
			_, err := r.Do(ctx, k, eur100, p.call("100", "EUR"))
			var failed *operation.FailedError
			require.ErrorAs(t, err, &failed)
			require.ErrorIs(t, err, operation.ErrFailed)
			require.ErrorIs(t, failed.Cause, errDeclined)
			require.True(t, inbox.IsPermanent(err))
			require.Equal(t, operation.StateFailed, get(t, k).State)
			_, err = r.Do(ctx, k, eur100, p.call("100", "EUR"))
			require.ErrorAs(t, err, &failed)
			require.Contains(t, failed.Reason, errDeclined.Error())
			_, calls, _ := p.counts()
			require.Equal(t, 1, calls)
		})

		t.Run("a transient error gives the key back: the retry calls again with it", func(t *testing.T) {
			t.Parallel()
			p, k := newProvider(), mustKey(t, "charge", "unavailable")
			p.unavailable = 1
			_, err := r.Do(ctx, k, eur100, p.call("100", "EUR"))
			require.ErrorIs(t, err, errUnavailable)
			require.True(t, inbox.IsTransient(err))
			require.False(t, inbox.IsPermanent(err))
			rec := get(t, k)
			require.Equal(t, operation.StateStarted, rec.State)
			require.Empty(t, rec.Owner, "no call in flight")
			res, err := r.Do(ctx, k, eur100, p.call("100", "EUR"))
			require.NoError(t, err)
			require.Equal(t, operation.OriginCall, res.Origin)
			require.Equal(t, []string{"charge charge:unavailable", "charge charge:unavailable"}, p.seenKeys())
			require.Equal(t, 2, get(t, k).Attempts)
		})

		t.Run("an unclassified error is uncertain, with the reference returned alongside", func(t *testing.T) {
			t.Parallel()
			k := mustKey(t, "charge", "unclassified")
			calls := 0
			call := func(context.Context, string) (operation.Result, error) {
				calls++
				return operation.Result{Reference: "req_7"}, errors.New("connection reset")
			}
			_, err := r.Do(ctx, k, eur100, call)
			var u *operation.UncertainError
			require.ErrorAs(t, err, &u)
			require.Equal(t, "req_7", u.Reference)
			require.False(t, u.Retry)
			require.True(t, inbox.IsPermanent(err))
			require.False(t, inbox.IsTransient(err))
			rec := get(t, k)
			require.Equal(t, operation.StateUncertain, rec.State)
			require.Equal(t, "req_7", rec.Reference)
			require.Contains(t, rec.Error, "connection reset")
			_, err = r.Do(ctx, k, eur100, call)
			require.ErrorAs(t, err, &u)
			require.Equal(t, 1, calls, "never called again on a guess")
			require.Equal(t, 1, get(t, k).Attempts)
		})

		t.Run("a timeout whose cause is a context deadline stays permanent without reconcile", func(t *testing.T) {
			t.Parallel()
			k := mustKey(t, "charge", "deadline")
			_, err := r.Do(ctx, k, eur100, func(context.Context, string) (operation.Result, error) {
				return operation.Result{}, operation.Timeout(context.DeadlineExceeded)
			})
			require.ErrorIs(t, err, operation.ErrUncertain)
			require.NotErrorIs(t, err, context.DeadlineExceeded, "the cause is kept out of the chain")
			require.True(t, inbox.IsPermanent(err))
			require.True(t, inbox.ShouldPoison(err))
			require.True(t, operation.NeedsReconciliation(err))
		})

		t.Run("a cancelled context before the call: not called, key given back", func(t *testing.T) {
			t.Parallel()
			p, k := newProvider(), mustKey(t, "charge", "cancelled")
			cctx, cancel := context.WithCancel(ctx)
			cancel()
			_, err := r.Do(cctx, k, eur100, p.call("100", "EUR"))
			require.Error(t, err)
			require.True(t, inbox.IsTransient(err))
			_, calls, _ := p.counts()
			require.Zero(t, calls)
		})

		t.Run("a success after the handler's context ended is still recorded", func(t *testing.T) {
			t.Parallel()
			p, k := newProvider(), mustKey(t, "charge", "late")
			cctx, cancel := context.WithCancel(ctx)
			res, err := r.Do(cctx, k, eur100, func(ctx context.Context, key string) (operation.Result, error) {
				res, err := p.call("100", "EUR")(ctx, key)
				cancel() // the handler's context ends while the answer comes back
				return res, err
			})
			require.NoError(t, err)
			require.Equal(t, operation.OriginCall, res.Origin)
			require.Equal(t, operation.StateSucceeded, get(t, k).State)
		})

		t.Run("a panic in the call leaves the record started: the next attempt is uncertain", func(t *testing.T) {
			t.Parallel()
			p, k := newProvider(), mustKey(t, "charge", "panic")
			require.Panics(t, func() {
				_, _ = r.Do(ctx, k, eur100, func(context.Context, string) (operation.Result, error) { panic("boom") })
			})
			rec := get(t, k)
			require.Equal(t, operation.StateStarted, rec.State)
			require.NotEmpty(t, rec.Owner)
			// In progress while the panicked attempt's lease runs (on
			// SQLite the lock is the process's: at once).
			var err error
			eventually(t, "the panicked attempt's lease to run out", func(o *testenv.Observed) bool {
				_, err = r.Do(ctx, k, eur100, p.call("100", "EUR"))
				var ip *operation.InProgressError
				return !errors.As(err, &ip) && o.Err("do", nil)
			})
			require.ErrorIs(t, err, operation.ErrUncertain)
			require.Equal(t, operation.StateUncertain, get(t, k).State)
			_, calls, _ := p.counts()
			require.Zero(t, calls)
		})

		t.Run("reconcile: not found calls, rejected fails, transient retries, unknown is for a person", func(t *testing.T) {
			t.Parallel()
			p := newProvider()
			uncertain := func(t *testing.T, entity string) operation.Key {
				k := mustKey(t, "charge", entity)
				_, err := r.Do(ctx, k, eur100, func(context.Context, string) (operation.Result, error) {
					return operation.Result{}, operation.Timeout(errTimeout)
				})
				require.ErrorIs(t, err, operation.ErrUncertain)
				return k
			}
			reconciler := func(err error) operation.ReconcileFunc {
				return func(context.Context, operation.Record) (operation.Result, error) { return operation.Result{}, err }
			}

			k := uncertain(t, "rec-notfound")
			res, err := r.Do(ctx, k, eur100, p.call("100", "EUR"), operation.WithReconcile(p.reconcile))
			require.NoError(t, err)
			require.Equal(t, operation.OriginCall, res.Origin)
			require.Equal(t, []string{"lookup charge:rec-notfound", "charge charge:rec-notfound"}, p.seenKeys())

			k = uncertain(t, "rec-rejected")
			_, err = r.Do(ctx, k, eur100, p.call("100", "EUR"), operation.WithReconcile(reconciler(operation.Rejected(errDeclined))))
			require.ErrorIs(t, err, operation.ErrFailed)
			require.Equal(t, operation.StateFailed, get(t, k).State)

			k = uncertain(t, "rec-transient")
			_, err = r.Do(ctx, k, eur100, p.call("100", "EUR"), operation.WithReconcile(reconciler(operation.Transient(errUnavailable))))
			var u *operation.UncertainError
			require.ErrorAs(t, err, &u)
			require.True(t, u.Retry)
			require.True(t, inbox.IsTransient(err))
			require.False(t, inbox.IsPermanent(err))
			require.Equal(t, operation.StateUncertain, get(t, k).State)

			_, err = r.Do(ctx, k, eur100, p.call("100", "EUR"), operation.WithReconcile(reconciler(errors.New("provider says: unknown"))))
			require.ErrorAs(t, err, &u)
			require.False(t, u.Retry)
			require.True(t, operation.NeedsReconciliation(err))
			require.Equal(t, 3, get(t, k).Attempts)

			_, calls, _ := p.counts()
			require.Equal(t, 1, calls, "only the not-found key was called")
		})

		t.Run("caller mistakes are permanent", func(t *testing.T) {
			t.Parallel()
			p := newProvider()
			_, err := r.Do(ctx, operation.Key{}, eur100, p.call("1", "EUR"))
			require.ErrorIs(t, err, operation.ErrInvalidKey)
			require.True(t, inbox.IsPermanent(err))
			_, err = r.Do(ctx, mustKey(t, "charge", "bad"), []byte(`{"a":1,"a":2}`), p.call("1", "EUR"))
			require.ErrorIs(t, err, operation.ErrInvalidParams)
			require.True(t, inbox.IsPermanent(err))
			_, err = r.Do(ctx, mustKey(t, "charge", "bad"), eur100, nil)
			require.True(t, inbox.IsPermanent(err))
			_, err = r.Get(ctx, mustKey(t, "charge", "never"))
			require.ErrorIs(t, err, operation.ErrNoRecord)
			_, calls, _ := p.counts()
			require.Zero(t, calls)
		})
	})
}

// The fingerprint is compared on every path that returns an existing record
// (AWS Powertools #3781, #2058, #2260): whatever the state, another request
// with the key is a conflict, nothing is called or reconciled, and the record
// is left as it was.
func TestConflictOnEveryPath(t *testing.T) {
	t.Parallel()
	eachRunner(t, operation.Config{}, func(t *testing.T, e *runnerEnv) {
		ctx := context.Background()
		r := e.r
		p := newProvider()
		eur200 := map[string]any{"amount": 200, "currency": "EUR"}

		prepare := map[string]func(k operation.Key){
			"succeeded": func(k operation.Key) {
				_, err := r.Do(ctx, k, eur100, p.call("100", "EUR"))
				require.NoError(t, err)
			},
			"failed": func(k operation.Key) {
				_, err := r.Do(ctx, k, eur100, func(context.Context, string) (operation.Result, error) {
					return operation.Result{}, operation.Rejected(errDeclined)
				})
				require.ErrorIs(t, err, operation.ErrFailed)
			},
			"uncertain": func(k operation.Key) {
				_, err := r.Do(ctx, k, eur100, func(context.Context, string) (operation.Result, error) {
					return operation.Result{}, operation.Timeout(errTimeout)
				})
				require.ErrorIs(t, err, operation.ErrUncertain)
			},
			"started by a dead attempt": func(k operation.Key) {
				require.Panics(t, func() {
					_, _ = r.Do(ctx, k, eur100, func(context.Context, string) (operation.Result, error) { panic("died") })
				})
			},
			"started, released after a transient error": func(k operation.Key) {
				_, err := r.Do(ctx, k, eur100, func(context.Context, string) (operation.Result, error) {
					return operation.Result{}, operation.Transient(errUnavailable)
				})
				require.ErrorIs(t, err, errUnavailable)
			},
		}
		i := 0
		for name, prep := range prepare {
			i++
			k := mustKey(t, "charge", "conflict", name)
			prep(k)
			before, err := r.Get(ctx, k)
			require.NoError(t, err)
			reconciled := false
			_, calls0, _ := p.counts()
			_, err = r.Do(ctx, k, eur200, p.call("200", "EUR"), operation.WithReconcile(
				func(context.Context, operation.Record) (operation.Result, error) {
					reconciled = true
					return operation.Result{}, operation.ErrNotFound
				}))
			var c *operation.ConflictError
			require.ErrorAs(t, err, &c, name)
			require.Equal(t, before.State, c.State, name)
			require.Equal(t, before.Fingerprint, c.StoredFingerprint, name)
			require.True(t, inbox.IsPermanent(err), name)
			require.False(t, reconciled, name)
			_, calls1, _ := p.counts()
			require.Equal(t, calls0, calls1, name)
			after, err := r.Get(ctx, k)
			require.NoError(t, err)
			require.Equal(t, before, after, name)
		}
		require.Equal(t, len(prepare), i)
		// Held by a live worker: see TestOperationKeyChargesOnceAcrossTimeoutsAndWorkers (conflict without waiting).
	})
}

func TestResolve(t *testing.T) {
	t.Parallel()
	eachRunner(t, operation.Config{}, func(t *testing.T, e *runnerEnv) {
		ctx := context.Background()
		r := e.r
		p := newProvider()
		timeout := func(context.Context, string) (operation.Result, error) {
			return operation.Result{}, operation.Timeout(errTimeout)
		}

		k := mustKey(t, "charge", "resolved-ok")
		_, err := r.Do(ctx, k, eur100, timeout)
		require.ErrorIs(t, err, operation.ErrUncertain)
		require.NoError(t, r.Resolve(ctx, k, operation.VerdictSucceeded(operation.Result{Reference: "ch_9", Data: []byte("x")})))
		res, err := r.Do(ctx, k, eur100, p.call("100", "EUR"))
		require.NoError(t, err)
		require.Equal(t, operation.Result{Reference: "ch_9", Data: []byte("x"), Origin: operation.OriginStored}, res)
		require.ErrorIs(t, r.Resolve(ctx, k, operation.VerdictFailed("no")), operation.ErrFinal)

		k = mustKey(t, "charge", "resolved-not-executed")
		_, err = r.Do(ctx, k, eur100, timeout)
		require.ErrorIs(t, err, operation.ErrUncertain)
		require.NoError(t, r.Resolve(ctx, k, operation.VerdictNotExecuted("not at the provider")))
		res, err = r.Do(ctx, k, eur100, p.call("100", "EUR"))
		require.NoError(t, err)
		require.Equal(t, operation.OriginCall, res.Origin)

		k = mustKey(t, "charge", "resolved-failed")
		_, err = r.Do(ctx, k, eur100, timeout)
		require.ErrorIs(t, err, operation.ErrUncertain)
		require.NoError(t, r.Resolve(ctx, k, operation.VerdictFailed("refused by the provider")))
		_, err = r.Do(ctx, k, eur100, p.call("100", "EUR"))
		var failed *operation.FailedError
		require.ErrorAs(t, err, &failed)
		require.Equal(t, "refused by the provider", failed.Reason)

		require.ErrorIs(t, r.Resolve(ctx, mustKey(t, "charge", "missing"), operation.VerdictFailed("x")), operation.ErrNoRecord)
		require.Error(t, r.Resolve(ctx, k, operation.Verdict{}))
		_, calls, _ := p.counts()
		require.Equal(t, 1, calls)
	})
}

func TestMigrateAndConfig(t *testing.T) {
	t.Parallel()
	eachRunner(t, operation.Config{Table: "ops"}, func(t *testing.T, e *runnerEnv) {
		ctx := context.Background()
		r := e.r
		require.Equal(t, "ops", r.Table())
		require.Equal(t, e.Dialect, operation.DialectOf(r))

		// Concurrent Migrate from several instances is safe; versions recorded once.
		var wg sync.WaitGroup
		errs := make(chan error, 4)
		for range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				errs <- r.Migrate(ctx)
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			require.NoError(t, err)
		}
		var n int
		require.NoError(t, e.DB.QueryRow(ctx, `SELECT count(*) FROM idempotency_migration WHERE component = 'operation:ops'`).Scan(&n))
		migrations := 1
		switch e.Dialect {
		case sqldb.SQLite:
			migrations = 2 // 0002 rewrites millisecond times in µs
		case sqldb.MySQL:
			migrations = 2 // 0002 makes the provider's texts utf8mb4, the reference LONGTEXT
		}
		require.Equal(t, migrations, n)
		switch e.Dialect {
		case sqldb.PostgreSQL:
			require.NoError(t, e.DB.QueryRow(ctx, `SELECT count(*) FROM information_schema.tables WHERE table_schema = $1 AND table_name = 'ops'`, e.Database).Scan(&n))
		case sqldb.MySQL:
			require.NoError(t, e.DB.QueryRow(ctx, `SELECT count(*) FROM information_schema.tables WHERE table_schema = ? AND table_name = 'ops'`, e.Database).Scan(&n))
		default:
			require.NoError(t, e.DB.QueryRow(ctx, `SELECT count(*) FROM sqlite_schema WHERE type = 'table' AND name = 'ops'`).Scan(&n))
		}
		require.Equal(t, 1, n)
		_, err := e.DB.Exec(ctx, `INSERT INTO ops (`+e.Quote("key")+`, kind, fingerprint, state) VALUES ('k:1', 'k', 'f', 'bogus')`)
		require.Error(t, err, "the state is checked")

		fsys, err := operation.MigrationsFS("billing.ops", e.Dialect)
		require.NoError(t, err)
		body, err := fs.ReadFile(fsys, "20001_create_operation.up.sql")
		require.NoError(t, err)
		require.Contains(t, string(body), "-- +goose Up")
		require.Contains(t, string(body), `CREATE TABLE IF NOT EXISTS `+e.Quote("billing")+`.`+e.Quote("ops"))
		_, err = operation.MigrationsFS("bad name", e.Dialect)
		require.Error(t, err)
	})
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Pool(t)
	db := testenv.SQLiteDB(t)
	for _, c := range []struct {
		cfg   operation.Config
		field string
	}{
		{operation.Config{}, "Config.DB"},
		{operation.Config{DB: idempotency.Pgx(pool), Table: "x;drop"}, "Config.Table"},
		{operation.Config{DB: idempotency.Pgx(pool), WriteTimeout: -1}, "Config.WriteTimeout"},
		{operation.Config{DB: idempotency.SQL(db, sqldb.Dialect(9))}, "Config.DB"},
	} {
		_, err := operation.NewRunner(c.cfg, nil)
		require.ErrorContains(t, err, c.field)
	}
	_, err := operation.MigrationsFS("", sqldb.Dialect(9))
	require.Error(t, err)
	for _, cfg := range []operation.Config{{DB: idempotency.Pgx(pool)}, {DB: idempotency.SQL(db, idempotency.SQLite)}} {
		r, err := operation.NewRunner(cfg, nil)
		require.NoError(t, err)
		require.Equal(t, operation.DefaultTable, r.Table())
	}
}

// The key's session lock is lost during the call (the owner's backend
// terminated: pg_terminate_backend, KILL CONNECTION; the owner's process
// lives on). A second worker that then takes the free lock finds the record
// started by an owner whose lease is live (the owner renews it during its
// call) and waits (InProgressError, transient): it never calls the provider
// while the owner's call may run, even with a reconcile function that finds
// nothing. The owner records its outcome on another connection; the second
// worker then gets the stored result (case 27.5).
func TestLostOwnership(t *testing.T) {
	t.Parallel()
	eachRunner(t, operation.Config{}, func(t *testing.T, e *runnerEnv) {
		if e.Dialect == sqldb.SQLite {
			return // no session lock to lose
		}
		ctx := context.Background()
		r := e.r
		k := mustKey(t, "charge", "lost")
		// holder is the server id of the session holding k's lock.
		holder := func() (session int64, ok bool) {
			if e.Dialect == sqldb.MySQL {
				var s *int64
				require.NoError(t, e.DB.QueryRow(ctx, `SELECT IS_USED_LOCK(CONCAT('idem-op:', SHA1(CONCAT(DATABASE(), '.', ?, ':', ?))))`,
					r.Table(), k.String()).Scan(&s))
				return derefOr(s), s != nil
			}
			id := e.pgLockID(t, k)
			err := e.DB.QueryRow(ctx, `SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted
AND classid::bigint = $1 AND objid::bigint = $2 AND objsubid = 1`, int64(id>>32), int64(id&0xFFFFFFFF)).Scan(&session)
			return session, err == nil
		}
		kill := func(session int64) {
			query := `SELECT pg_terminate_backend($1)`
			args := []any{session}
			if e.Dialect == sqldb.MySQL {
				query, args = fmt.Sprintf("KILL CONNECTION %d", session), nil
			}
			_, err := e.DB.Exec(ctx, query, args...)
			require.NoError(t, err)
		}
		notFound := func(context.Context, operation.Record) (operation.Result, error) {
			return operation.Result{}, operation.ErrNotFound
		}
		var secondCalls int
		res, err := r.Do(ctx, k, eur100, func(ctx context.Context, key string) (operation.Result, error) {
			session, ok := holder()
			require.True(t, ok, "the attempt holds the key's lock during its call")
			kill(session)
			eventually(t, "the lock to go with the session", func(o *testenv.Observed) bool { _, held := holder(); return !o.Bool("held", held) })
			// Longer than the lease: the owner's heartbeat keeps it live.
			deadline := time.Now().Add(operation.LeaseDuration() + 500*time.Millisecond)
			for time.Now().Before(deadline) {
				_, err := r.Do(ctx, k, eur100, func(context.Context, string) (operation.Result, error) {
					secondCalls++
					return operation.Result{Reference: "second"}, nil
				}, operation.WithReconcile(notFound))
				var ip *operation.InProgressError
				require.ErrorAs(t, err, &ip, "a live owner's key is in progress")
				require.True(t, middleware.IsTransient(err))
				time.Sleep(100 * time.Millisecond)
			}
			return operation.Result{Reference: "first"}, nil
		})
		require.NoError(t, err, "the owner records its outcome on another connection")
		require.Equal(t, "first", res.Reference)
		require.Zero(t, secondCalls, "the provider is called by one worker only")
		second, err := r.Do(ctx, k, eur100, func(context.Context, string) (operation.Result, error) {
			secondCalls++
			return operation.Result{}, nil
		}, operation.WithReconcile(notFound))
		require.NoError(t, err)
		require.Equal(t, operation.OriginStored, second.Origin)
		require.Zero(t, secondCalls)
		rec, err := r.Get(ctx, k)
		require.NoError(t, err)
		require.Equal(t, operation.StateSucceeded, rec.State)
		require.Equal(t, "first", rec.Reference)
		require.Equal(t, 1, rec.Attempts)
	})
}

func derefOr(p *int64) int64 {
	if p == nil {
		return 0
	}
	return *p
}

// Keys compare exactly on every dialect: no case folding, no trailing-space
// padding (MySQL's default collations do both; the key column is
// VARBINARY there).
func TestKeysCompareExactly(t *testing.T) {
	t.Parallel()
	eachRunner(t, operation.Config{}, func(t *testing.T, e *runnerEnv) {
		ctx := context.Background()
		p := newProvider()
		for _, entity := range []string{"p-1", "P-1", "p-1 "} {
			res, err := e.r.Do(ctx, mustKey(t, "charge", entity), eur100, p.call("100", "EUR"))
			require.NoError(t, err, "%q", entity)
			require.Equal(t, operation.OriginCall, res.Origin, "%q is an operation of its own", entity)
		}
		charges, calls, _ := p.counts()
		require.Equal(t, 3, charges)
		require.Equal(t, 3, calls)
	})
}

// Eight workers with one key at the same moment: one provider call; the
// others wait for it and get its recorded result.
func TestManyWorkersOneKey(t *testing.T) {
	t.Parallel()
	eachRunner(t, operation.Config{}, func(t *testing.T, e *runnerEnv) {
		ctx := context.Background()
		r := e.r
		p, k := newProvider(), mustKey(t, "charge", "many")
		start := make(chan struct{})
		origins := make(chan operation.Origin, 8)
		var wg sync.WaitGroup
		for range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				res, err := r.Do(ctx, k, eur100, p.call("100", "EUR"))
				if err != nil {
					t.Errorf("Do: %v", err)
				}
				origins <- res.Origin
			}()
		}
		close(start)
		wg.Wait()
		close(origins)
		count := map[operation.Origin]int{}
		for o := range origins {
			count[o]++
		}
		require.Equal(t, map[operation.Origin]int{operation.OriginCall: 1, operation.OriginStored: 7}, count)
		_, calls, _ := p.counts()
		require.Equal(t, 1, calls)
	})
}
