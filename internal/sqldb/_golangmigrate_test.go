package sqldb_test

import (
	"context"
	"database/sql"
	"errors"
	"io/fs"
	"testing"

	"github.com/golang-migrate/migrate/v4"
	pgxmigrate "github.com/golang-migrate/migrate/v4/database/pgx/v5"
	"github.com/golang-migrate/migrate/v4/source/iofs"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/operation"
	"github.com/watermill-idempotency/idempotency/outbox"
	"github.com/watermill-idempotency/idempotency/versioned"
)

// golang-migrate (the real library, v4, its pgx/v5 driver and iofs source
// over the components' exported file systems) applying every component into
// one database. golang-migrate keeps one version per migrations table, so
// each component gets its own table (x-migrations-table, here
// pgxmigrate.Config.MigrationsTable); one shared table does not work (the
// second component finds a version its files do not have), which the test
// shows too, as README says.
func TestGolangMigrateAppliesEveryComponent(t *testing.T) {
	t.Parallel()
	schema := testenv.Schema(t)
	db, err := sql.Open("pgx", testenv.SchemaURL(schema))
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	ctx := context.Background()
	dbSchema := schema

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

	up := func(name string, fsys fs.FS, table string) error {
		src, err := iofs.New(fsys, ".")
		require.NoError(t, err)
		drv, err := pgxmigrate.WithInstance(ownDB(t, dbSchema), &pgxmigrate.Config{MigrationsTable: table})
		require.NoError(t, err)
		m, err := migrate.NewWithInstance("iofs", src, "pgx5", drv)
		require.NoError(t, err)
		defer func() { _, _ = m.Close() }()
		if err := m.Up(); err != nil && !errors.Is(err, migrate.ErrNoChange) {
			return err
		}
		return nil
	}
	components := []struct {
		name string
		fsys fs.FS
	}{{"processed", pfs}, {"operation", ofs}, {"versioned", vfs}, {"outbox", xfs}}
	for _, c := range components {
		require.NoError(t, up(c.name, c.fsys, c.name+"_schema_migrations"), c.name)
		require.NoError(t, up(c.name, c.fsys, c.name+"_schema_migrations"), "%s again: no change", c.name)
	}
	for _, table := range []string{processedstore.DefaultTable, operation.DefaultTable, versioned.DefaultLatestTable, versioned.DefaultAppliedTable, outbox.DefaultTable} {
		var n int
		require.NoError(t, db.QueryRowContext(ctx, `SELECT count(*) FROM information_schema.tables WHERE table_schema = $1 AND table_name = $2`, schema, table).Scan(&n))
		require.Equal(t, 1, n, "table %s exists", table)
	}
	var version int
	require.NoError(t, db.QueryRowContext(ctx, `SELECT version FROM processed_schema_migrations`).Scan(&version))
	files, err := fs.Glob(pfs, "*.up.sql")
	require.NoError(t, err)
	require.Equal(t, sqldb.VersionBaseProcessed+len(files), version, "every processed migration applied")
	// The stores accept what golang-migrate made.
	s, err := processedstore.NewStore(processedstore.Config{})
	require.NoError(t, err)
	require.NoError(t, s.Migrate(ctx, sqldb.Std(db)), "Migrate after golang-migrate finds everything in place")

	// One shared migrations table: the second component fails.
	schema2 := testenv.Schema(t)
	db2, err := sql.Open("pgx", testenv.SchemaURL(schema2))
	require.NoError(t, err)
	t.Cleanup(func() { _ = db2.Close() })
	db, dbSchema = db2, schema2
	require.NoError(t, up("processed", pfs, "schema_migrations"))
	require.Error(t, up("operation", ofs, "schema_migrations"), "golang-migrate keeps one version per table: a table per component is needed")
}

// The upgrade README gives golang-migrate users of the old numbering
// (every component from 0001): `migrate force 1000N` (N: the version they
// were at), then `up`. Checked for a table at the old version 1 and at the
// old version 3 (the last): after force and up, every migration is in
// place and none ran twice.
func TestGolangMigrateUpgradeFromOldNumbering(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	old, err := processedstore.NewStore(processedstore.Config{})
	require.NoError(t, err)
	ms, err := old.Migrations()
	require.NoError(t, err)
	for _, at := range []int{1, len(ms)} {
		schema := testenv.Schema(t)
		db, err := sql.Open("pgx", testenv.SchemaURL(schema))
		require.NoError(t, err)
		t.Cleanup(func() { _ = db.Close() })
		open := func(fsys fs.FS) *migrate.Migrate {
			src, err := iofs.New(fsys, ".")
			require.NoError(t, err)
			drv, err := pgxmigrate.WithInstance(ownDB(t, schema), &pgxmigrate.Config{})
			require.NoError(t, err)
			m, err := migrate.NewWithInstance("iofs", src, "pgx5", drv)
			require.NoError(t, err)
			t.Cleanup(func() { _, _ = m.Close() })
			return m
		}
		// The old release: its migrations numbered 0001…, applied up to at.
		require.NoError(t, open(sqldb.MigrationsFS(ms)).Migrate(uint(at)))
		var cols int
		require.NoError(t, db.QueryRowContext(ctx, `SELECT count(*) FROM information_schema.columns WHERE table_schema = $1 AND table_name = 'processed_event'`, schema).Scan(&cols))

		pfs, err := processedstore.MigrationsFS("", sqldb.PostgreSQL)
		require.NoError(t, err)
		m := open(pfs)
		require.NoError(t, m.Force(sqldb.VersionBaseProcessed+at))
		if err := m.Up(); err != nil && !errors.Is(err, migrate.ErrNoChange) {
			require.NoError(t, err)
		}
		v, dirty, err := m.Version()
		require.NoError(t, err)
		require.False(t, dirty)
		require.EqualValues(t, sqldb.VersionBaseProcessed+len(ms), v)
		for _, col := range []string{"event_at", "fingerprint"} {
			var n int
			require.NoError(t, db.QueryRowContext(ctx, `SELECT count(*) FROM information_schema.columns WHERE table_schema = $1 AND table_name = 'processed_event' AND column_name = $2`, schema, col).Scan(&n))
			require.Equal(t, 1, n, "column %s after the upgrade from version %d", col, at)
		}
	}
}

// ownDB is a database/sql handle of its own for one golang-migrate instance
// (its Close closes the handle it was given).
func ownDB(t *testing.T, schema string) *sql.DB {
	db, err := sql.Open("pgx", testenv.SchemaURL(schema))
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	return db
}
