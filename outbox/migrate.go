package outbox

import (
	"context"
	"embed"
	"fmt"
	"io/fs"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

//go:embed migrations
var migrationTemplates embed.FS

// migrations returns the outbox's migrations in version order, rendered for
// its tables and dialect (files migrations/<dialect>/NNNN_*.up.sql). Each one
// is idempotent (IF NOT EXISTS).
func (o *Outbox) migrations() ([]sqldb.Migration, error) {
	ms, err := sqldb.RenderMigrations(migrationTemplates, "migrations/"+o.dialect.String(), o.q.t)
	if err != nil {
		return nil, fmt.Errorf("outbox: %w", err)
	}
	return ms, nil
}

// MigrationsFS returns the outbox's migrations as an fs.FS of "<40000+N>_name.up.sql"
// files (golang-migrate's layout, with goose annotations; versions from
// sqldb.VersionBaseOutbox, disjoint from the other components', so goose's
// default shared version table applies every component), for a migration
// tool that owns the schema instead of Migrate. See sqldb.ComponentFS.
func (o *Outbox) MigrationsFS() (fs.FS, error) {
	ms, err := o.migrations()
	if err != nil {
		return nil, err
	}
	return sqldb.ComponentFS(ms, sqldb.VersionBaseOutbox), nil
}

// Migrate applies the migrations in version order and records each in the
// idempotency_migration table beside the outbox table (in its schema when
// Config.Table is qualified, component "outbox:<table>"), so that dropping
// and recreating that schema and migrating again recreates the tables; safe
// from several instances at once (sqldb.MigrateTable).
func (o *Outbox) Migrate(ctx context.Context) error {
	q := o.db.Querier()
	ms, err := o.migrations()
	if err != nil {
		return err
	}
	table, err := sqldb.ParseIdent(o.cfg.Table)
	if err != nil {
		return fmt.Errorf("outbox: %w", err)
	}
	if err := sqldb.MigrateTable(ctx, q, o.dialect, table, "outbox:"+o.cfg.Table, ms); err != nil {
		return fmt.Errorf("outbox: %w", err)
	}
	return nil
}
