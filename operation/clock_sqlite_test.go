package operation_test

import (
	"context"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/operation"
)

// On SQLite the Runner's clock is the process clock in microseconds (the
// database is in-process): over 200 operations, the stored created_at,
// updated_at and finished_at are never earlier than a Go clock read just
// before Do nor later than one read just after, and they have microsecond
// resolution. SQLite's strftime('now') has milliseconds and read earlier
// than the Go clock read before it.
func TestSQLiteOperationTimesAreTheProcessClock(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := openSQLite(t, filepath.Join(t.TempDir(), "operations.db"))
	r, err := operation.NewRunner(operation.Config{DB: idempotency.SQL(db, idempotency.SQLite)}, nil)
	require.NoError(t, err)
	require.NoError(t, r.Migrate(ctx))
	subMillisecond := 0
	for i := 0; i < 200; i++ {
		key := operation.MustKey("charge", fmt.Sprint(i))
		before := time.Now()
		_, err := r.Do(ctx, key, map[string]int{"amount": i}, func(context.Context, string) (operation.Result, error) {
			return operation.Result{Reference: "ch"}, nil
		})
		require.NoError(t, err)
		after := time.Now()
		var created, updated, finished sqldb.Time
		require.NoError(t, db.QueryRowContext(ctx, `SELECT created_at, updated_at, finished_at FROM operation WHERE "key" = ?`, key.String()).Scan(&created, &updated, &finished))
		for name, got := range map[string]time.Time{"created_at": created.T, "updated_at": updated.T, "finished_at": finished.T} {
			require.GreaterOrEqual(t, got.UnixMicro(), before.UnixMicro(), "operation %d: %s stored before the Go clock read just before Do", i, name)
			require.LessOrEqual(t, got.UnixMicro(), after.UnixMicro(), "operation %d: %s stored after the Go clock read just after Do", i, name)
		}
		require.False(t, updated.T.Before(created.T), "operation %d: updated before created", i)
		if updated.T.UnixMicro()%1000 != 0 {
			subMillisecond++
		}
	}
	require.Greater(t, subMillisecond, 100, "microsecond resolution")
}
