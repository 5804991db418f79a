package operation

import (
	"context"
	"embed"
	"fmt"
	"io/fs"
	"path"
	"strings"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

//go:embed migrations
var migrationTemplates embed.FS

// migrations returns the runner's migrations in version order, rendered for
// its table and dialect. Each is idempotent (IF NOT EXISTS), so running one
// twice is safe.
func (r *Runner) migrations() ([]sqldb.Migration, error) {
	return renderMigrations(r.dialect, r.table)
}

// MigrationsFS returns the migrations for table (DefaultTable when empty) in
// dialect as an fs.FS of files named "NNNN_name.up.sql" at its root, the
// layout golang-migrate reads; each file also starts with "-- +goose Up" so
// goose applies it as is. Use it when a migration tool, not Migrate, owns
// the schema.
func MigrationsFS(table string, dialect sqldb.Dialect) (fs.FS, error) {
	if table == "" {
		table = DefaultTable
	}
	id, err := sqldb.ParseIdent(table)
	if err != nil {
		return nil, fmt.Errorf("operation: MigrationsFS table: %w", err)
	}
	if err := dialect.Validate(); err != nil {
		return nil, fmt.Errorf("operation: MigrationsFS: %w", err)
	}
	ms, err := renderMigrations(dialect, id)
	if err != nil {
		return nil, err
	}
	return sqldb.ComponentFS(ms, sqldb.VersionBaseOperation), nil
}

func renderMigrations(dialect sqldb.Dialect, table sqldb.Ident) ([]sqldb.Migration, error) {
	// SQLite's CREATE INDEX takes the schema on the index's name and an
	// unqualified table: IndexSchema is `"schema".` (or ""), Bare the table
	// without its schema.
	q := string(dialect.QuoteChar())
	data := struct{ Table, Prefix, IndexSchema, Bare string }{
		Table:  table.Quoted(dialect.QuoteChar()),
		Prefix: table.Name(),
		Bare:   q + table.Name() + q,
	}
	if schema, _, ok := strings.Cut(table.String(), "."); ok {
		data.IndexSchema = q + schema + q + "."
	}
	ms, err := sqldb.RenderMigrations(migrationTemplates, path.Join("migrations", dialect.String()), data)
	if err != nil {
		return nil, fmt.Errorf("operation: %w", err)
	}
	return ms, nil
}

// Migrate applies the runner's migrations in version order on its DB and
// records each in the
// idempotency_migration table (component "operation:<table>"), shared with
// the other stores of the library. It is safe to run from several instances
// at once (sqldb.Migrate).
func (r *Runner) Migrate(ctx context.Context) error {
	q := r.db.Querier()
	ms, err := r.migrations()
	if err != nil {
		return err
	}
	if err := sqldb.MigrateTable(ctx, q, r.dialect, r.table, "operation:"+r.table.String(), ms); err != nil {
		return fmt.Errorf("operation: %w", err)
	}
	return nil
}
