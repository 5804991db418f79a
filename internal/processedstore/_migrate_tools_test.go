package processedstore_test

import (
	"context"
	"database/sql"
	"io/fs"
	"testing"

	"github.com/pressly/goose/v3"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// The exported migrations are applied as is by goose (and have the
// NNNN_name.up.sql layout golang-migrate reads); the resulting table works
// with the store.
func TestMigrationsFSWithGoose(t *testing.T) {
	t.Parallel()
	schema := testenv.Schema(t)
	db, err := sql.Open("pgx", testenv.SchemaURL(schema))
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })

	fsys, err := processedstore.MigrationsFS("", sqldb.PostgreSQL)
	require.NoError(t, err)
	names, err := fs.Glob(fsys, "*.up.sql")
	require.NoError(t, err)
	require.Equal(t, []string{"10001_create_processed_event.up.sql", "10002_event_at.up.sql", "10003_fingerprint.up.sql", "10004_horizon.up.sql", "10005_consumer_handlers.up.sql", "10006_crashes.up.sql", "10007_lean_claim.up.sql", "10008_v7_table.up.sql", "10009_running.up.sql"}, names)

	provider, err := goose.NewProvider(goose.DialectPostgres, db, fsys)
	require.NoError(t, err)
	results, err := provider.Up(context.Background())
	require.NoError(t, err)
	require.Len(t, results, 9)

	s, err := processedstore.NewStore(processedstore.Config{})
	require.NoError(t, err)
	id := mustV7(t)
	ok, err := s.Claim(context.Background(), sqldb.Std(db), "c", id)
	require.NoError(t, err)
	require.True(t, ok)
	// Migrate after the tool (as MigrationsFS says): it copies the table's
	// UUIDv7 rows into processed_event_v7 and marks it ready.
	require.NoError(t, s.Migrate(context.Background(), sqldb.Std(db)))
	var copied, ready int
	require.NoError(t, db.QueryRow(`SELECT (SELECT count(*) FROM processed_event_v7 WHERE event_id = $1), (SELECT count(*) FROM processed_event_v7_ready)`, id).Scan(&copied, &ready))
	require.Equal(t, 1, copied)
	require.Equal(t, 1, ready)

	_, err = processedstore.MigrationsFS("bad-name", sqldb.PostgreSQL)
	require.Error(t, err)
}
