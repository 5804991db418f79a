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
	require.Equal(t, []string{"10001_create_processed_event.up.sql", "10002_event_at.up.sql", "10003_fingerprint.up.sql", "10004_horizon.up.sql", "10005_consumer_handlers.up.sql", "10006_crashes.up.sql", "10007_lean_claim.up.sql"}, names)

	provider, err := goose.NewProvider(goose.DialectPostgres, db, fsys)
	require.NoError(t, err)
	results, err := provider.Up(context.Background())
	require.NoError(t, err)
	require.Len(t, results, 7)

	s, err := processedstore.NewStore(processedstore.Config{})
	require.NoError(t, err)
	ok, err := s.Claim(context.Background(), sqldb.Std(db), "c", mustV7(t))
	require.NoError(t, err)
	require.True(t, ok)

	_, err = processedstore.MigrationsFS("bad-name", sqldb.PostgreSQL)
	require.Error(t, err)
}
