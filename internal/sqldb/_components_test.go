package sqldb_test

import (
	"context"
	"database/sql"
	"io/fs"
	"testing"

	_ "github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/operation"
	"github.com/watermill-idempotency/idempotency/outbox"
	"github.com/watermill-idempotency/idempotency/versioned"
)

// Every component applied with goose's defaults (one goose_db_version
// table, no options) into one database: every table exists. Before, every
// component numbered from 0001, so goose applied processed's migration and
// skipped operation's (its table was silently never created).
func TestGooseDefaultsApplyEveryComponent(t *testing.T) {
	t.Parallel()
	schema := testenv.Schema(t)
	db, err := sql.Open("pgx", testenv.SchemaURL(schema))
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	ctx := context.Background()

	pfs, err := processedstore.MigrationsFS("", sqldb.PostgreSQL)
	require.NoError(t, err)
	ofs, err := operation.MigrationsFS("", sqldb.PostgreSQL)
	require.NoError(t, err)
	vfs, err := versioned.FamilyMigrationsFS("", "", sqldb.PostgreSQL)
	require.NoError(t, err)
	ob, err := outbox.New(outbox.Config{DB: idempotency.SQL(db, idempotency.PostgreSQL)}, nil)
	require.NoError(t, err)
	xfs, err := ob.MigrationsFS()
	require.NoError(t, err)
	seen := map[string]string{}
	for name, fsys := range map[string]fs.FS{"processed": pfs, "operation": ofs, "versioned": vfs, "outbox": xfs} {
		files, err := fs.Glob(fsys, "*.up.sql")
		require.NoError(t, err)
		for _, f := range files {
			v, _, _ := cut(f)
			require.NotContains(t, seen, v, "%s and %s share version %s", name, seen[v], v)
			seen[v] = name
		}
	}
	for _, fsys := range []fs.FS{pfs, ofs, vfs, xfs} { // in the bases' order
		p, err := goose.NewProvider(goose.DialectPostgres, db, fsys)
		require.NoError(t, err)
		_, err = p.Up(ctx)
		require.NoError(t, err)
	}
	for _, table := range []string{processedstore.DefaultTable, operation.DefaultTable, versioned.DefaultLatestTable, versioned.DefaultAppliedTable, outbox.DefaultTable} {
		var n int
		require.NoError(t, db.QueryRowContext(ctx, `SELECT count(*) FROM information_schema.tables WHERE table_schema = $1 AND table_name = $2`, schema, table).Scan(&n))
		require.Equal(t, 1, n, "table %s exists", table)
	}
	var eventAt int
	require.NoError(t, db.QueryRowContext(ctx, `SELECT count(*) FROM information_schema.columns WHERE table_schema = $1 AND table_name = 'processed_event' AND column_name = 'event_at'`, schema).Scan(&eventAt))
	require.Equal(t, 1, eventAt, "processed's second migration ran")
}

func cut(name string) (string, string, bool) {
	for i := 0; i < len(name); i++ {
		if name[i] == '_' {
			return name[:i], name[i+1:], true
		}
	}
	return name, "", false
}
