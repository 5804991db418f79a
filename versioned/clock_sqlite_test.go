package versioned_test

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/versioned"
)

// On SQLite the family store's clock is the process clock in microseconds
// (the database is in-process): over 200 advances of one family's latest
// record and of a consumer's applied record, the stored updated_at is
// never earlier than a Go clock read just before the write nor later than
// one read just after, and it has microsecond resolution. SQLite's
// strftime('now') has milliseconds and read earlier than the Go clock
// read before it. A purge with a 1 h horizon then keeps every row (their
// updated_at is the process clock's, not an hour old).
func TestSQLiteFamilyTimesAreTheProcessClock(t *testing.T) {
	t.Parallel()
	tg := testenv.NewTarget(t, testenv.TargetSQLite, 2)
	ctx := context.Background()
	s, err := versioned.NewFamilyStore(versioned.FamilyStoreConfig{Dialect: sqldb.SQLite})
	require.NoError(t, err)
	require.NoError(t, s.Migrate(ctx, tg.Handle()))
	f := versioned.Family{Kind: "order", ID: "o-1"}
	subMillisecond := 0
	check := func(i int, table string, before, after time.Time) {
		var updated sqldb.Time
		require.NoError(t, tg.DB.QueryRow(ctx, `SELECT updated_at FROM `+table+` WHERE family_id = ?`, f.ID).Scan(&updated))
		require.GreaterOrEqual(t, updated.T.UnixMicro(), before.UnixMicro(), "write %d: %s.updated_at stored before the Go clock read just before it", i, table)
		require.LessOrEqual(t, updated.T.UnixMicro(), after.UnixMicro(), "write %d: %s.updated_at stored after the Go clock read just after it", i, table)
		if updated.T.UnixMicro()%1000 != 0 {
			subMillisecond++
		}
	}
	for i := 1; i <= 100; i++ {
		pos := versioned.SeqPosition(int64(i), uuid.New())
		before := time.Now()
		moved, err := s.Advance(ctx, tg.DB, f, pos)
		require.NoError(t, err)
		require.True(t, moved)
		check(i, "family_latest", before, time.Now())

		before = time.Now()
		recorded, err := s.RecordApplied(ctx, tg.DB, "c", f, pos)
		require.NoError(t, err)
		require.True(t, recorded)
		check(i, "family_applied", before, time.Now())
	}
	require.Greater(t, subMillisecond, 100, "microsecond resolution")
	n, err := s.PurgeBatch(ctx, tg.DB, time.Hour, 100)
	require.NoError(t, err)
	require.Zero(t, n, "rows written now are not an hour old")
}
