package processedstore_test

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// Upgrade from the previous release's schema, on every dialect: a table
// made by migration 1 alone (no event_at), with rows claimed by the old
// statement and the old bookkeeping. Migrate adds event_at in place; the
// old rows stay duplicates and are dated no earlier than the upgrade, so
// none is purged before one horizon has passed since; new claims work;
// Migrate again runs nothing (each version is applied once).
func TestUpgradeFromPreviousSchema(t *testing.T) {
	t.Parallel()
	eachTarget(t, func(t *testing.T, tg target) {
		ctx := context.Background()
		s, err := processedstore.NewStore(processedstore.Config{Dialect: tg.dialect, Horizon: time.Hour})
		require.NoError(t, err)
		ms, err := s.Migrations()
		require.NoError(t, err)
		require.Greater(t, len(ms), 1)
		// The previous release: migration 1, old claims (no event_at).
		require.NoError(t, sqldb.Migrate(ctx, tg.db, tg.dialect, "processed:"+s.Table().String(), ms[:1]))
		old := uuid.New()
		oldClaim := map[sqldb.Dialect]string{
			sqldb.PostgreSQL: `INSERT INTO processed_event (consumer, event_id) VALUES ($1, $2)`,
			sqldb.MySQL:      `INSERT INTO processed_event (consumer, event_id) VALUES (?, ?)`,
			sqldb.SQLite:     `INSERT INTO processed_event (consumer, event_id) VALUES (?, ?)`,
		}[tg.dialect]
		var idArg any = old
		if tg.dialect != sqldb.PostgreSQL {
			idArg = old[:]
		} else {
			idArg = old.String()
		}
		_, err = tg.db.Exec(ctx, oldClaim, "c", idArg)
		require.NoError(t, err)

		require.NoError(t, s.Migrate(ctx, tg.db))
		require.NoError(t, s.Migrate(ctx, tg.db), "applied versions are skipped")

		ok, err := s.ClaimAt(ctx, tg.db, "c", old, time.Now().Add(-10*time.Minute))
		require.NoError(t, err)
		require.False(t, ok, "an old row is still a duplicate")
		ok, err = s.Claim(ctx, tg.db, "c", uuid.Must(uuid.NewV7()))
		require.NoError(t, err)
		require.True(t, ok)
		n, err := s.PurgeBatch(ctx, tg.db, time.Hour, 100)
		require.NoError(t, err)
		require.Zero(t, n, "old rows are dated at the upgrade: not purged before one horizon")
	})
}

// The bookkeeping lives next to the table: a table in another schema than
// the connection's search_path records its versions in that schema's
// idempotency_migration, not in the search_path's (before: always there,
// in practice public).
func TestMigrationsRecordedNextToTable(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Pool(t)
	other := testenv.Schema(t)
	ctx := context.Background()
	s, err := processedstore.NewStore(processedstore.Config{Table: other + ".inbox", Horizon: time.Hour})
	require.NoError(t, err)
	require.NoError(t, s.Migrate(ctx, sqldb.Pgx(pool)))
	var n int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM `+other+`.idempotency_migration WHERE component = $1`, "processed:"+other+".inbox").Scan(&n))
	require.Equal(t, 9, n)
	var local *string
	require.NoError(t, pool.QueryRow(ctx, `SELECT to_regclass('idempotency_migration')::text`).Scan(&local))
	require.Nil(t, local, "nothing recorded in the search_path's schema")
}
