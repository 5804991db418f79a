package processedstore

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"strings"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

//go:embed migrations
var migrationTemplates embed.FS

// Migration is one versioned schema change of the store, rendered for its table.
type Migration = sqldb.Migration

// Migrations returns the store's migrations in version order, rendered for its
// table and dialect. Each one is idempotent (IF NOT EXISTS).
func (s *Store) Migrations() ([]Migration, error) {
	if s.layout == LayoutPartitioned {
		return partitionedMigrations(s.table)
	}
	return renderMigrations(s.dialect, s.table)
}

// partitionedMigrations renders LayoutPartitioned's migrations (PostgreSQL).
func partitionedMigrations(table sqldb.Ident) ([]Migration, error) {
	data := struct{ Table, Prefix, Schema, Q string }{Table: table.Quoted('"'), Prefix: table.Name(), Q: `"`}
	if schema, _, ok := strings.Cut(table.String(), "."); ok {
		data.Schema = `"` + schema + `".`
	}
	ms, err := sqldb.RenderMigrations(migrationTemplates, "migrations/postgres_partitioned", data)
	if err != nil {
		return nil, fmt.Errorf("processed: %w", err)
	}
	return ms, nil
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
	return sqldb.ComponentFS(ms, sqldb.VersionBaseProcessed), nil
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
//
// With LayoutPartitioned it refuses a table that exists and is not
// partitioned (ErrPlainTable: convert it with MigrateToPartitioned), and it
// creates the partitions of the current and next spans, so that claims
// made before the Purger's first run land in time partitions.
func (s *Store) Migrate(ctx context.Context, q sqldb.Querier) error {
	if s.layout == LayoutPartitioned {
		return s.migratePartitioned(ctx, q)
	}
	ms, err := s.pendingMigrations(ctx, q)
	if err != nil {
		return err
	}
	if err := sqldb.MigrateTable(ctx, q, s.dialect, s.table, "processed:"+s.table.String(), ms); err != nil {
		return fmt.Errorf("processed: %w", err)
	}
	if s.dialect == sqldb.PostgreSQL {
		if err := s.checkGlobalKey(ctx, q); err != nil {
			return err
		}
		return s.fillV7(ctx, q)
	}
	return nil
}

// ErrNoGlobalKey is returned by Migrate on PostgreSQL when no unique index
// of the table is exactly (consumer, event_id): the claim's ON CONFLICT DO
// NOTHING then lets one event be claimed twice. It happens when a user
// partitions the table by a column outside the key (range on event_at, say:
// PostgreSQL requires the partition key in the primary key, which then
// stops being unique per event). Partition by hash or range on event_id or
// consumer, or use LayoutPartitioned (range on event_id by time).
var ErrNoGlobalKey = errors.New("processed: no unique index on exactly (consumer, event_id): one event could be claimed twice")

func (s *Store) checkGlobalKey(ctx context.Context, q sqldb.Querier) error {
	ok, err := sqldb.HasUniqueKey(ctx, q, s.table.Quoted('"'), "consumer", "event_id")
	if err != nil {
		return fmt.Errorf("processed: migrate: %w", err)
	}
	if !ok {
		return fmt.Errorf("%w: table %s", ErrNoGlobalKey, s.table)
	}
	return nil
}

func (s *Store) migratePartitioned(ctx context.Context, q sqldb.Querier) error {
	var kind string
	if err := q.QueryRow(ctx, `SELECT coalesce((SELECT relkind::text FROM pg_class WHERE oid = to_regclass($1)), '')`, s.table.Quoted('"')).Scan(&kind); err != nil {
		return fmt.Errorf("processed: migrate: read %s: %w", s.table, err)
	}
	if kind != "" && kind != "p" {
		return fmt.Errorf("%w: %s", ErrPlainTable, s.table)
	}
	ms, err := s.Migrations()
	if err != nil {
		return err
	}
	if err := sqldb.MigrateTable(ctx, q, s.dialect, s.table, "processed-partitioned:"+s.table.String(), ms); err != nil {
		return fmt.Errorf("processed: %w", err)
	}
	rep, err := s.maintain(ctx, q, 0, "")
	if err != nil {
		return err
	}
	if len(rep.Skipped) > 0 {
		return fmt.Errorf("processed: migrate: create the first partitions: %w", errors.Join(rep.Skipped...))
	}
	return nil
}
