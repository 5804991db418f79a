package processedstore

import (
	"context"
	"fmt"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// pendingMigrations returns the migrations Migrate runs. On PostgreSQL that
// is all of them: each is idempotent there (IF NOT EXISTS everywhere). On
// MySQL and SQLite, ALTER TABLE … ADD COLUMN has no portable IF NOT EXISTS
// (MySQL 8 has none, SQLite none), so a migration already recorded in the
// idempotency_migration table for the store's component is left out.
func (s *Store) pendingMigrations(ctx context.Context, q sqldb.Querier) ([]Migration, error) {
	ms, err := s.Migrations()
	if err != nil || s.dialect == sqldb.PostgreSQL {
		return ms, err
	}
	exists := "SELECT COUNT(*) FROM sqlite_schema WHERE type = 'table' AND name = 'idempotency_migration'"
	if s.dialect == sqldb.MySQL {
		exists = "SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name = 'idempotency_migration'"
	}
	var n int
	if err := q.QueryRow(ctx, exists).Scan(&n); err != nil {
		return nil, fmt.Errorf("processed: migrate: read the migration records: %w", err)
	}
	if n == 0 {
		return ms, nil
	}
	component := "processed:" + s.table.String()
	var pending []Migration
	for _, m := range ms {
		var done int
		err := q.QueryRow(ctx, "SELECT COUNT(*) FROM idempotency_migration WHERE component = ? AND version = ?", component, m.Version).Scan(&done)
		if err != nil {
			return nil, fmt.Errorf("processed: migrate: read the migration records: %w", err)
		}
		if done == 0 {
			pending = append(pending, m)
		}
	}
	return pending, nil
}
