package processedstore

import (
	"context"
	"database/sql"
	"fmt"
	"time"

	"github.com/google/uuid"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// mysqlSQL is every MySQL/MariaDB statement of the store; %[1]s is the quoted
// table, placeholders are ?.
var mysqlSQL = dialectSQL{
	// The claim without INSERT IGNORE (which would also swallow other errors,
	// such as a too-long consumer): on a duplicate key the no-op update
	// changes nothing, so rows affected is 0 (go-sql-driver/mysql reports
	// changed rows unless clientFoundRows=true, which this store forbids), and
	// 1 for an insert. A concurrent uncommitted claim of the same key makes
	// InnoDB wait on its lock, as PostgreSQL does.
	claim: `INSERT INTO %[1]s (consumer, event_id, event_at) VALUES (?, ?, COALESCE(?, UTC_TIMESTAMP(6))) ON DUPLICATE KEY UPDATE consumer = consumer`,
	// The claim with the replay window (see the PostgreSQL text). The
	// third parameter is repeated: ? placeholders cannot be reused.
	window: `INSERT INTO %[1]s (consumer, event_id, event_at)
SELECT ?, ?, COALESCE(?, UTC_TIMESTAMP(6)) FROM DUAL
WHERE ? IS NULL OR ? BETWEEN UTC_TIMESTAMP(6) - INTERVAL %[2]d MICROSECOND AND UTC_TIMESTAMP(6) + INTERVAL %[3]d MICROSECOND
ON DUPLICATE KEY UPDATE consumer = consumer`,
	verdict: `SELECT EXISTS (SELECT 1 FROM %[1]s WHERE consumer = ? AND event_id = ?),
       ? < UTC_TIMESTAMP(6) - INTERVAL %[2]d MICROSECOND,
       DATE_FORMAT(UTC_TIMESTAMP(6), '%%Y-%%m-%%dT%%H:%%i:%%s.%%fZ')`,
	windowArgs: func(c, id, at any) []any { return []any{c, id, at, at, at} },
	eventAt:    func(t time.Time) any { return t.UTC().Format("2006-01-02 15:04:05.000000") },
	exists:     `SELECT EXISTS (SELECT 1 FROM %[1]s WHERE consumer = ? AND event_id = ?)`,
	// Bounded delete; UTC_TIMESTAMP(6) is the server clock in UTC, as stored.
	purgeBatch: `DELETE FROM %[1]s WHERE event_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND ORDER BY event_at LIMIT ?`,
	purgeArgs:  func(h time.Duration, limit int) []any { return []any{h.Microseconds(), limit} },
	// InnoDB has no per-transaction lock timeout: this sets the session's
	// (whole seconds, at least 1), which stays on the pooled connection.
	lockTimeout: func(d time.Duration) (string, []any) {
		s := int64(d / time.Second)
		if s < 1 {
			s = 1
		}
		return `SET SESSION innodb_lock_wait_timeout = ?`, []any{s}
	},
	// A named lock held by the purging session for one run, per database
	// and table (SHA1 keeps the name within GET_LOCK's 64 characters).
	tryLock: `SELECT GET_LOCK(SHA1(CONCAT('idempotency-purge:', DATABASE(), '.', ?)), 0)`,
	unlock:  `SELECT RELEASE_LOCK(SHA1(CONCAT('idempotency-purge:', DATABASE(), '.', ?)))`,
	eventID: func(id uuid.UUID) any { b := id; return b[:] },
}

// CheckChangedRows verifies, on MySQL, that db counts changed rows (the
// driver's default), not found rows (go-sql-driver/mysql's
// clientFoundRows=true): the claim tells a duplicate by rows affected 0,
// which found rows report as 1, a claim, so the effect would be applied
// again. Migrate checks its own connection; this checks the consumer's,
// which may have another DSN (or a schema made by a migration tool). It
// runs the claim of a key no consumer can have (the blank consumer name,
// the nil id) twice in a transaction it rolls back: nothing is stored.
// nil on the other dialects.
func (s *Store) CheckChangedRows(ctx context.Context, db *sql.DB) error {
	if s.dialect != sqldb.MySQL || db == nil {
		return nil
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("processed: check the changed-rows count on %s: %w", s.table, err)
	}
	defer func() { _ = tx.Rollback() }()
	query, args := s.ClaimQuery("", uuid.Nil)
	for i := 0; i < 2; i++ {
		res, err := tx.ExecContext(ctx, query, args...)
		if err != nil {
			return fmt.Errorf("processed: check the changed-rows count on %s: %w", s.table, err)
		}
		if n, err := res.RowsAffected(); err == nil && i == 1 && n != 0 {
			return sqldb.ErrMySQLFoundRows
		}
	}
	return nil
}
