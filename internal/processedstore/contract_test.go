package processedstore_test

import (
	"context"
	"database/sql"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// target is one dialect and driver the contract suite runs against
// (testenv.EachTarget), with the suite's own setup helpers.
type target struct {
	dialect sqldb.Dialect
	db      sqldb.Querier
	pool    sqldb.Pool
	// begin opens a transaction; end commits (true) or rolls back.
	begin func(t *testing.T) (sqldb.Querier, func(commit bool))
	// age sets every row's processed_at and event_at to now minus d (test setup).
	age func(t *testing.T, d time.Duration)
}

// eachTarget runs fn once per dialect and driver, in parallel, each on a
// fresh database: PostgreSQL through pgx and through database/sql, MariaDB,
// SQLite (testenv.EachTarget).
func eachTarget(t *testing.T, fn func(t *testing.T, tg target)) {
	testenv.EachTarget(t, func(t *testing.T, et testenv.Target) {
		tg := target{dialect: et.Dialect, db: et.DB, pool: et.Pool}
		tg.begin = func(t *testing.T) (sqldb.Querier, func(bool)) {
			tx, err := et.BeginTx(context.Background())
			require.NoError(t, err)
			// A failing test never leaves its transaction open (the pool's
			// Close would wait for it forever): roll back at cleanup.
			ended := false
			t.Cleanup(func() {
				if !ended {
					_ = tx.Rollback()
				}
			})
			return tx, func(commit bool) {
				ended = true
				if commit {
					require.NoError(t, tx.Commit())
				} else {
					require.NoError(t, tx.Rollback())
				}
			}
		}
		tg.age = func(t *testing.T, d time.Duration) {
			var query string
			var arg any
			switch et.Dialect {
			case sqldb.PostgreSQL:
				query, arg = `UPDATE processed_event SET processed_at = now() - $1::bigint * interval '1 microsecond', event_at = now() - $1::bigint * interval '1 microsecond'`, d.Microseconds()
			case sqldb.MySQL:
				query, arg = `UPDATE processed_event SET processed_at = UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND, event_at = processed_at`, d.Microseconds()
			default:
				query, arg = `UPDATE processed_event SET processed_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', ?1), event_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', ?1)`, "-"+formatSeconds(d)+" seconds"
			}
			_, err := et.DB.Exec(context.Background(), query, arg)
			require.NoError(t, err)
		}
		fn(t, tg)
	})
}

func formatSeconds(d time.Duration) string { return strconv.FormatFloat(d.Seconds(), 'f', 3, 64) }

func (tg target) store(t *testing.T) *processedstore.Store {
	t.Helper()
	s, err := processedstore.NewStore(processedstore.Config{Dialect: tg.dialect, Horizon: time.Hour})
	require.NoError(t, err)
	require.NoError(t, s.Migrate(context.Background(), tg.db))
	require.NoError(t, s.Migrate(context.Background(), tg.db), "Migrate is idempotent")
	return s
}

func TestClaimContract(t *testing.T) {
	t.Parallel()
	eachTarget(t, func(t *testing.T, tg target) {
		ctx := context.Background()
		s := tg.store(t)
		id := uuid.Must(uuid.NewV7())

		// First claim inserts, rolled back: nothing remains.
		tx, end := tg.begin(t)
		ok, err := s.Claim(ctx, tx, "stock", id)
		require.NoError(t, err)
		require.True(t, ok)
		end(false)
		done, err := s.Processed(ctx, tg.db, "stock", id)
		require.NoError(t, err)
		require.False(t, done, "a rolled back claim must vanish")

		// Claim and commit.
		tx, end = tg.begin(t)
		ok, err = s.Claim(ctx, tx, "stock", id)
		require.NoError(t, err)
		require.True(t, ok)
		end(true)
		done, err = s.Processed(ctx, tg.db, "stock", id)
		require.NoError(t, err)
		require.True(t, done)

		// Duplicate: 0 rows, no error, and the transaction stays usable
		// (no unique violation, so no aborted transaction afterwards).
		tx, end = tg.begin(t)
		ok, err = s.Claim(ctx, tx, "stock", id)
		require.NoError(t, err)
		require.False(t, ok)
		var one int
		require.NoError(t, tx.QueryRow(ctx, "SELECT 1").Scan(&one))
		end(true)

		// Another consumer claims the same event independently.
		tx, end = tg.begin(t)
		ok, err = s.Claim(ctx, tx, "shipping", id)
		require.NoError(t, err)
		require.True(t, ok)
		end(true)

		_, err = s.Claim(ctx, tg.db, "stock", uuid.Nil)
		require.ErrorIs(t, err, processedstore.ErrNilEventID)
		_, err = s.Claim(ctx, tg.db, "", id)
		require.ErrorIs(t, err, processedstore.ErrEmptyConsumer)
	})
}

// Other errors are never swallowed as "duplicate" (MySQL: no INSERT IGNORE).
func TestClaimDoesNotSwallowErrors(t *testing.T) {
	t.Parallel()
	eachTarget(t, func(t *testing.T, tg target) {
		s := tg.store(t)
		if tg.dialect == sqldb.SQLite {
			return // SQLite TEXT has no length limit to violate
		}
		tooLong := strings.Repeat("x", 300) // consumer is varchar(255) on MySQL
		tx, end := tg.begin(t)
		defer end(false)
		if tg.dialect == sqldb.PostgreSQL {
			// text has no limit either: use a table that is missing instead.
			other, err := processedstore.NewStore(processedstore.Config{Table: "missing_table", Dialect: tg.dialect})
			require.NoError(t, err)
			_, err = other.Claim(context.Background(), tx, "c", uuid.Must(uuid.NewV7()))
			require.Error(t, err)
			return
		}
		_, err := s.Claim(context.Background(), tx, tooLong, uuid.Must(uuid.NewV7()))
		require.Error(t, err, "a too-long consumer must be an error, not a silent 0 rows")
	})
}

func TestConcurrentClaimsOneWinner(t *testing.T) {
	t.Parallel()
	eachTarget(t, func(t *testing.T, tg target) {
		ctx := context.Background()
		s := tg.store(t)
		for round := 0; round < 3; round++ {
			id := uuid.Must(uuid.NewV7())
			const n = 5
			var wg sync.WaitGroup
			results := make(chan bool, n)
			start := make(chan struct{})
			for i := 0; i < n; i++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					<-start
					tx, end := tg.begin(t)
					ok, err := s.Claim(ctx, tx, "c", id)
					if err != nil {
						t.Error(err)
						end(false)
						return
					}
					end(true)
					results <- ok
				}()
			}
			close(start)
			wg.Wait()
			close(results)
			wins := 0
			for ok := range results {
				if ok {
					wins++
				}
			}
			require.Equal(t, 1, wins, "exactly one claim wins")
		}
	})
}

// The purge contract: rows older than the horizon go in bounded batches,
// rows inside stay, one purger at a time.
func TestPurgeContract(t *testing.T) {
	t.Parallel()
	eachTarget(t, func(t *testing.T, tg target) {
		ctx := context.Background()
		s := tg.store(t)
		for i := 0; i < 7; i++ {
			_, err := s.Claim(ctx, tg.db, "c", uuid.Must(uuid.NewV7()))
			require.NoError(t, err)
		}
		tg.age(t, 2*time.Hour)
		fresh := uuid.Must(uuid.NewV7())
		_, err := s.Claim(ctx, tg.db, "c", fresh)
		require.NoError(t, err)

		n, err := s.PurgeBatch(ctx, tg.db, time.Hour, 3)
		require.NoError(t, err)
		require.EqualValues(t, 3, n, "bounded by the batch size")

		inRun := make(chan struct{})
		release := make(chan struct{})
		p, err := processedstore.NewPurger(s, tg.pool, processedstore.PurgerConfig{
			Horizon: time.Hour, BatchSize: 2,
			OnPurge: func(int64, time.Time) { close(inRun); <-release },
		}, nil)
		require.NoError(t, err)
		other, err := processedstore.NewPurger(s, tg.pool, processedstore.PurgerConfig{Horizon: time.Hour}, nil)
		require.NoError(t, err)
		done := make(chan int64, 1)
		go func() {
			n, ran, err := p.PurgeNow(ctx)
			require.NoError(t, err)
			require.True(t, ran)
			done <- n
		}()
		<-inRun
		_, ran, err := other.PurgeNow(ctx)
		require.NoError(t, err)
		require.False(t, ran, "one purger at a time")
		close(release)
		require.EqualValues(t, 4, <-done)
		ok, err := s.Processed(ctx, tg.db, "c", fresh)
		require.NoError(t, err)
		require.True(t, ok, "a row inside the horizon stays")
	})
}

// On MySQL a connection that counts found rows would make a duplicate claim
// look new: Migrate refuses it.
func TestMigrateRefusesMySQLFoundRows(t *testing.T) {
	t.Parallel()
	database := testenv.MySQLDatabase(t)
	db, err := sql.Open("mysql", testenv.MySQLDatabaseDSN(database)+"&clientFoundRows=true")
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	s, err := processedstore.NewStore(processedstore.Config{Dialect: sqldb.MySQL})
	require.NoError(t, err)
	require.ErrorIs(t, s.Migrate(context.Background(), sqldb.Std(db)), sqldb.ErrMySQLFoundRows)
}

// Consumer names compare exactly on every dialect (MySQL's default
// collations would ignore case and trailing spaces).
func TestConsumerComparesExactly(t *testing.T) {
	t.Parallel()
	eachTarget(t, func(t *testing.T, tg target) {
		s := tg.store(t)
		id := uuid.Must(uuid.NewV7())
		for _, c := range []string{"stock", "Stock", "stock "} {
			ok, err := s.Claim(context.Background(), tg.db, c, id)
			require.NoError(t, err)
			require.True(t, ok, "%q is its own consumer", c)
		}
	})
}

func TestSQLiteRefusesSchemaQualifiedTable(t *testing.T) {
	t.Parallel()
	_, err := processedstore.NewStore(processedstore.Config{Dialect: sqldb.SQLite, Table: "main.inbox"})
	require.ErrorContains(t, err, "Config.Table")
}
