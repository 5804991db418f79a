package processed

import (
	"context"
	"embed"
	"fmt"
	"io/fs"

	"github.com/watermill-idempotency/idempotency/sqldb"
)

//go:embed migrations
var migrationTemplates embed.FS

// Migration is one versioned schema change of the store, rendered for its table.
type Migration = sqldb.Migration

// Migrations returns the store's migrations in version order, rendered for its
// table and dialect. Each one is idempotent (IF NOT EXISTS).
func (s *Store) Migrations() ([]Migration, error) {
	return renderMigrations(s.dialect, s.table)
}

// MigrationsFS returns the migrations for table (DefaultTable when empty) as an
// fs.FS of files named "NNNN_name.up.sql" at its root, the layout
// golang-migrate reads; each file also carries a "-- +goose Up" annotation so
// goose applies it as is. Use it when a migration tool, not Migrate, owns the
// schema.
func MigrationsFS(table string, dialect sqldb.Dialect) (fs.FS, error) {
	if table == "" {
		table = DefaultTable
	}
	id, err := sqldb.ParseIdent(table)
	if err != nil {
		return nil, fmt.Errorf("processed: MigrationsFS table: %w", err)
	}
	ms, err := renderMigrations(dialect, id)
	if err != nil {
		return nil, err
	}
	return sqldb.MigrationsFS(ms), nil
}

func renderMigrations(dialect sqldb.Dialect, table sqldb.Ident) ([]Migration, error) {
	ms, err := sqldb.TableMigrations(migrationTemplates, "migrations", dialect, table)
	if err != nil {
		return nil, fmt.Errorf("processed: %w", err)
	}
	return ms, nil
}

// Migrate applies the store's migrations in version order and records each in
// the idempotency_migration table (component "processed:<table>"). It is safe
// to run from several instances at once (see sqldb.Migrate).
func (s *Store) Migrate(ctx context.Context, q sqldb.Querier) error {
	ms, err := s.pendingMigrations(ctx, q)
	if err != nil {
		return err
	}
	if err := sqldb.Migrate(ctx, q, s.dialect, "processed:"+s.table.String(), ms); err != nil {
		return fmt.Errorf("processed: %w", err)
	}
	return nil
}
