package operation_test

import (
	"context"
	"database/sql"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/operation"
)

// openSQLite opens path with a short busy_timeout (200 ms), so that a Runner
// waiting for the handler's write lock fails fast instead of after 10 s.
func openSQLite(t *testing.T, path string) *sql.DB {
	t.Helper()
	testenv.RequireDriver(t, "sqlite") // skips in the core's plain run (no SQLite driver), see testenv
	db, err := sql.Open("sqlite", "file:"+path+"?_pragma=busy_timeout(200)&_pragma=journal_mode(WAL)&_txlock=immediate")
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	return db
}

// TestSQLiteRunnerOnHandlersFileRefused (issue 11 D.15): on SQLite, a
// Runner whose database is the file of the handler's idempotent transaction
// cannot commit its started record while that transaction holds the file's
// write lock. Do refuses it at once with a permanent error wrapping
// ErrSharedSQLiteFile that says what to do, without calling the provider
// (before: SQLITE_BUSY after busy_timeout, transient, retried forever), for
// a wiring the constructors cannot see: the caller's own transaction bound
// with sqldb.ContextWithTx (TestSQLiteSharedFileRefusedAtConstruction
// covers the middleware). A Runner on a file of its own works inside the
// same transaction.
func TestSQLiteRunnerOnHandlersFileRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dir := t.TempDir()
	service := filepath.Join(dir, "service.db")
	db := openSQLite(t, service)

	shared, err := operation.NewRunner(operation.Config{DB: idempotency.SQL(openSQLite(t, service), idempotency.SQLite)}, nil)
	require.NoError(t, err)
	require.NoError(t, shared.Migrate(ctx))
	sameHandle, err := operation.NewRunner(operation.Config{DB: idempotency.SQL(db, idempotency.SQLite)}, nil)
	require.NoError(t, err)
	opsDB := openSQLite(t, filepath.Join(dir, "operations.db"))
	own, err := operation.NewRunner(operation.Config{DB: idempotency.SQL(opsDB, idempotency.SQLite)}, nil)
	require.NoError(t, err)
	require.NoError(t, own.Migrate(ctx))

	for name, tc := range map[string]struct {
		runner *operation.Runner
		shared bool
	}{
		"other-handle-same-file": {shared, true},
		"same-handle":            {sameHandle, true},
		"own-file":               {own, false},
	} {
		t.Run(name, func(t *testing.T) {
			tx, err := db.BeginTx(ctx, nil)
			require.NoError(t, err)
			defer func() { _ = tx.Rollback() }()
			_, err = tx.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS handler_effect (x int)`)
			require.NoError(t, err) // the caller's transaction holds the write lock
			var calls atomic.Int32
			key, err := operation.NewKey("charge", name)
			require.NoError(t, err)
			_, doErr := tc.runner.Do(sqldb.ContextWithTx(ctx, sqldb.Std(tx)), key, map[string]string{"amount": "10"}, func(context.Context, string) (operation.Result, error) {
				calls.Add(1)
				return operation.Result{Reference: "ch_1"}, nil
			})
			if !tc.shared {
				require.NoError(t, doErr)
				require.Equal(t, int32(1), calls.Load())
				return
			}
			require.ErrorIs(t, doErr, operation.ErrSharedSQLiteFile)
			require.ErrorContains(t, doErr, "operation.Config.DB")
			require.True(t, inbox.IsPermanent(doErr), "refused for good, not retried forever: %v", doErr)
			require.False(t, inbox.IsTransient(doErr))
			require.Zero(t, calls.Load(), "the provider is never called")
		})
	}
}

// TestSQLiteSharedFileRefusedAtConstruction (item 1, D.15): the wiring
// "operation.Runner and the idempotent middleware on one SQLite file" cannot
// be built: whichever of NewRunner and NewIdempotent comes second fails,
// wrapping ErrSharedSQLiteFile and saying to give operation.Config.DB a file
// of its own, whatever the path's spelling (another handle, a symlink). On
// the old code both constructors succeeded and every Do inside the handler
// was refused at run time (the message poisoned). A Runner on a file of its
// own, built in either order, works inside the handler's transaction: the
// provider is called once, the record and the effect committed.
func TestSQLiteSharedFileRefusedAtConstruction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	newStore := func(t *testing.T, db *sql.DB) *processedstore.Store {
		store, err := processedstore.NewStore(processedstore.Config{Dialect: sqldb.SQLite})
		require.NoError(t, err)
		require.NoError(t, store.Migrate(ctx, sqldb.Std(db)))
		return store
	}
	newIdem := func(db *sql.DB, store *processedstore.Store) (*inbox.Idempotent, error) {
		return inbox.NewIdempotent(inbox.Config{Beginner: mustStdBeginner(t, db), Store: store, Consumer: "billing"}, nil)
	}
	refused := func(t *testing.T, err error, field string) {
		t.Helper()
		require.ErrorIs(t, err, operation.ErrSharedSQLiteFile)
		require.ErrorIs(t, err, sqldb.ErrSharedSQLiteFile)
		require.ErrorContains(t, err, field)
		require.ErrorContains(t, err, "operation.Config.DB")
		require.ErrorContains(t, err, "file of its own")
	}

	t.Run("middleware-first", func(t *testing.T) {
		t.Parallel()
		service := filepath.Join(t.TempDir(), "service.db")
		db := openSQLite(t, service)
		_, err := newIdem(db, newStore(t, db))
		require.NoError(t, err)
		_, err = operation.NewRunner(operation.Config{DB: idempotency.SQL(openSQLite(t, service), idempotency.SQLite)}, nil)
		refused(t, err, "Config.DB")
		_, err = operation.NewRunner(operation.Config{DB: idempotency.SQL(db, idempotency.SQLite)}, nil)
		refused(t, err, "Config.DB")
	})
	t.Run("runner-first", func(t *testing.T) {
		t.Parallel()
		service := filepath.Join(t.TempDir(), "service.db")
		db := openSQLite(t, service)
		store := newStore(t, db)
		_, err := operation.NewRunner(operation.Config{DB: idempotency.SQL(openSQLite(t, service), idempotency.SQLite)}, nil)
		require.NoError(t, err)
		_, err = newIdem(db, store)
		refused(t, err, "Config.Beginner")
	})
	t.Run("symlinked-path", func(t *testing.T) {
		t.Parallel()
		dir := t.TempDir()
		service := filepath.Join(dir, "service.db")
		db := openSQLite(t, service)
		_, err := newIdem(db, newStore(t, db))
		require.NoError(t, err)
		link := filepath.Join(dir, "alias.db")
		require.NoError(t, os.Symlink(service, link))
		_, err = operation.NewRunner(operation.Config{DB: idempotency.SQL(openSQLite(t, link), idempotency.SQLite)}, nil)
		refused(t, err, "Config.DB")
	})
	for _, order := range []string{"own-file-middleware-first", "own-file-runner-first"} {
		t.Run(order, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			db := openSQLite(t, filepath.Join(dir, "service.db"))
			store := newStore(t, db)
			_, err := db.Exec(`CREATE TABLE charge (event_id text, reference text)`)
			require.NoError(t, err)
			opsDB := openSQLite(t, filepath.Join(dir, "service-operations.db"))
			var idem *inbox.Idempotent
			var runner *operation.Runner
			if order == "own-file-middleware-first" {
				idem, err = newIdem(db, store)
				require.NoError(t, err)
			}
			runner, err = operation.NewRunner(operation.Config{DB: idempotency.SQL(opsDB, idempotency.SQLite)}, nil)
			require.NoError(t, err)
			require.NoError(t, runner.Migrate(ctx))
			if idem == nil {
				idem, err = newIdem(db, store)
				require.NoError(t, err)
			}
			var calls atomic.Int32
			h := idem.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				key, err := operation.NewKey("charge", msg.UUID)
				if err != nil {
					return nil, err
				}
				res, err := runner.Do(msg.Context(), key, map[string]string{"amount": "10"}, func(context.Context, string) (operation.Result, error) {
					calls.Add(1)
					return operation.Result{Reference: "ch_1"}, nil
				})
				if err != nil {
					return nil, err
				}
				tx, _ := inbox.SQLTxFromContext(msg.Context())
				_, err = tx.ExecContext(msg.Context(), `INSERT INTO charge VALUES (?, ?)`, msg.UUID, res.Reference)
				return nil, err
			})
			m, err := marshaler.NewMessage("order.placed", map[string]string{})
			require.NoError(t, err)
			_, err = h(m)
			require.NoError(t, err)
			_, err = h(m) // a redelivery: a duplicate, nothing called
			require.NoError(t, err)
			require.EqualValues(t, 1, calls.Load())
			var n int
			require.NoError(t, db.QueryRow(`SELECT count(*) FROM charge WHERE reference = 'ch_1'`).Scan(&n))
			require.Equal(t, 1, n)
			rec, err := runner.Get(ctx, mustKey(t, "charge", m.UUID))
			require.NoError(t, err)
			require.Equal(t, operation.StateSucceeded, rec.State)
		})
	}
}

func mustStdBeginner(t *testing.T, db *sql.DB) inbox.TxBeginner {
	t.Helper()
	b, err := inbox.NewStdBeginner(db)
	require.NoError(t, err)
	return b
}

// On SQLite the key's lock belongs to the process, per table and key: two
// Runners of one process whose Table names the same table of one file in
// another spelling ("main.operation", "OPERATION": SQLite's names ignore
// case and an unqualified name is main's) share it. While one calls the
// provider, the other gets InProgressError and calls nothing; the first
// records its outcome. (The lock was named after the spelling: the other
// Runner took the key, found it started by an attempt it took for dead
// — SQLite has no lease — reconciled, found nothing yet and called again,
// and the first attempt's success went unrecorded, ownership lost.)
func TestSQLiteKeyLockIsPerTableWhateverItsSpelling(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "operations.db")
	first, err := operation.NewRunner(operation.Config{DB: idempotency.SQL(openSQLite(t, path), idempotency.SQLite)}, nil)
	require.NoError(t, err)
	require.NoError(t, first.Migrate(ctx))
	for _, table := range []string{"main.operation", "OPERATION", "Main.Operation"} {
		t.Run(table, func(t *testing.T) {
			other, err := operation.NewRunner(operation.Config{DB: idempotency.SQL(openSQLite(t, path), idempotency.SQLite), Table: table}, nil)
			require.NoError(t, err)
			k := operation.MustKey("charge", table)
			var calls atomic.Int32
			entered, release := make(chan struct{}), make(chan struct{})
			done := make(chan error, 1)
			go func() {
				_, err := first.Do(ctx, k, eur100, func(context.Context, string) (operation.Result, error) {
					calls.Add(1)
					close(entered)
					<-release
					return operation.Result{Reference: "ch_1"}, nil
				})
				done <- err
			}()
			<-entered
			notFound := func(context.Context, operation.Record) (operation.Result, error) {
				return operation.Result{}, operation.ErrNotFound // the provider has not finished the first call
			}
			_, err = other.Do(ctx, k, eur100, func(context.Context, string) (operation.Result, error) {
				calls.Add(1)
				return operation.Result{Reference: "ch_2"}, nil
			}, operation.WithReconcile(notFound), operation.WithWait(0))
			close(release)
			require.ErrorIs(t, err, operation.ErrInProgress)
			require.NoError(t, <-done, "the first attempt records its outcome")
			require.EqualValues(t, 1, calls.Load(), "one call per key")
			res, err := other.Do(ctx, k, eur100, func(context.Context, string) (operation.Result, error) {
				calls.Add(1)
				return operation.Result{}, nil
			})
			require.NoError(t, err)
			require.Equal(t, operation.OriginStored, res.Origin)
			require.Equal(t, "ch_1", res.Reference)
		})
	}
}
