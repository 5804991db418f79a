package operation_test

import (
	"context"
	"database/sql"
	"path/filepath"
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/operation"
	"github.com/watermill-idempotency/idempotency/processed"
	"github.com/watermill-idempotency/idempotency/sqldb"
)

// openSQLite opens path with a short busy_timeout (200 ms), so that a Runner
// waiting for the handler's write lock fails fast instead of after 10 s.
func openSQLite(t *testing.T, path string) *sql.DB {
	t.Helper()
	db, err := sql.Open("sqlite", "file:"+path+"?_pragma=busy_timeout(200)&_pragma=journal_mode(WAL)&_txlock=immediate")
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	return db
}

// TestD15_SQLiteRunnerOnHandlersFileRefused (issue 11 D.15): on SQLite, a
// Runner whose database is the file of the handler's idempotent transaction
// cannot commit its started record while that transaction holds the file's
// write lock. Do refuses it at once with a permanent error wrapping
// ErrSharedSQLiteFile that says what to do, without calling the provider
// (before: SQLITE_BUSY after busy_timeout, transient, retried forever). A
// Runner on a file of its own works inside the same handler.
func TestD15_SQLiteRunnerOnHandlersFileRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dir := t.TempDir()
	service := filepath.Join(dir, "service.db")
	db := openSQLite(t, service)
	store, err := processed.NewStore(processed.Config{Dialect: sqldb.SQLite})
	require.NoError(t, err)
	require.NoError(t, store.Migrate(ctx, sqldb.Std(db)))

	shared, err := operation.NewRunner(operation.Config{DB: openSQLite(t, service), Dialect: sqldb.SQLite}, nil)
	require.NoError(t, err)
	require.NoError(t, shared.Migrate(ctx, sqldb.Std(db)))
	sameHandle, err := operation.NewRunner(operation.Config{DB: db, Dialect: sqldb.SQLite}, nil)
	require.NoError(t, err)
	opsDB := openSQLite(t, filepath.Join(dir, "operations.db"))
	own, err := operation.NewRunner(operation.Config{DB: opsDB, Dialect: sqldb.SQLite}, nil)
	require.NoError(t, err)
	require.NoError(t, own.Migrate(ctx, sqldb.Std(opsDB)))

	for name, tc := range map[string]struct {
		runner *operation.Runner
		shared bool
	}{
		"other-handle-same-file": {shared, true},
		"same-handle":            {sameHandle, true},
		"own-file":               {own, false},
	} {
		t.Run(name, func(t *testing.T) {
			idem, err := middleware.NewIdempotent(middleware.Config{
				Beginner: mustStdBeginner(t, db), Store: store, Consumer: "billing-" + name,
			}, nil)
			require.NoError(t, err)
			var calls atomic.Int32
			var doErr error
			h := idem.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				key, err := operation.NewKey("charge", msg.UUID)
				if err != nil {
					return nil, err
				}
				_, doErr = tc.runner.Do(msg.Context(), key, map[string]string{"amount": "10"}, func(context.Context, string) (operation.Result, error) {
					calls.Add(1)
					return operation.Result{Reference: "ch_1"}, nil
				})
				return nil, doErr
			})
			m, err := marshaler.NewMessage("order.placed", map[string]string{})
			require.NoError(t, err)
			_, err = h(m)
			if !tc.shared {
				require.NoError(t, err)
				require.Equal(t, int32(1), calls.Load())
				return
			}
			require.ErrorIs(t, doErr, operation.ErrSharedSQLiteFile)
			require.ErrorContains(t, doErr, "operation.Config.DB")
			require.True(t, middleware.IsPermanent(err), "refused for good, not retried forever: %v", err)
			require.False(t, middleware.IsTransient(err))
			require.Zero(t, calls.Load(), "the provider is never called")
		})
	}
}

func mustStdBeginner(t *testing.T, db *sql.DB) middleware.TxBeginner {
	t.Helper()
	b, err := middleware.NewStdBeginner(db)
	require.NoError(t, err)
	return b
}
