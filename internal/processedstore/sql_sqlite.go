package processedstore

import (
	"time"

	"github.com/google/uuid"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// sqliteSQL is every SQLite statement of the store; %[1]s is the quoted table.
//
// Times are sqldb.SQLiteTimeLayout text (UTC, microseconds, fixed width:
// text order is time order), and the clock is the process's (the database
// is in-process), passed as parameters (sqliteClock): SQLite's
// strftime('now') has millisecond resolution and read earlier than a Go
// clock read just before the statement.
var sqliteSQL = dialectSQL{
	// SQLite serialises writers: a concurrent claim waits (busy_timeout)
	// for the writer's COMMIT, then sees the row. ?4 is now.
	claim: `INSERT INTO %[1]s (consumer, event_id, event_at, processed_at) VALUES (?1, ?2, COALESCE(?3, ?4), ?4) ON CONFLICT DO NOTHING`,
	// The claim with the replay window (see the PostgreSQL text): ?3 is
	// the event's time, ?4 now, ?5 now − horizon, ?6 now + skew.
	window: `INSERT INTO %[1]s (consumer, event_id, event_at, processed_at)
SELECT ?1, ?2, COALESCE(?3, ?4), ?4
WHERE ?3 IS NULL OR ?3 BETWEEN ?5 AND ?6
ON CONFLICT DO NOTHING`,
	// ?4 is now − horizon, ?5 now.
	verdict: `SELECT EXISTS (SELECT 1 FROM %[1]s WHERE consumer = ?1 AND event_id = ?2), ?3 < ?4, ?5`,
	eventAt: func(t time.Time) any { return sqldb.SQLiteTime(t) },
	exists:  `SELECT EXISTS (SELECT 1 FROM %[1]s WHERE consumer = ? AND event_id = ?)`,
	// ?1 is the cutoff (now − horizon), ?2 the limit.
	purgeBatch: `DELETE FROM %[1]s WHERE (consumer, event_id) IN (
    SELECT consumer, event_id FROM %[1]s
    WHERE event_at < ?1
    ORDER BY event_at LIMIT ?2)`,
	processClock: true,
	// No lock timeout statement: the driver's busy_timeout bounds waits.
	eventID: func(id uuid.UUID) any { b := id; return b[:] },
}

// clock is the store's process clock (SQLite): time.Now unless a test set
// another.
func (s *Store) clock() time.Time {
	if s.now != nil {
		return s.now()
	}
	return time.Now()
}

// sqliteClock returns the process-clock arguments that follow (consumer,
// event_id, event_at) in the SQLite claim: now; with the window, also
// now − horizon and now + skew.
func (s *Store) sqliteClock(window bool) []any {
	now := s.clock()
	if !window {
		return []any{sqldb.SQLiteTime(now)}
	}
	return []any{sqldb.SQLiteTime(now), sqldb.SQLiteTime(now.Add(-s.horizon)), sqldb.SQLiteTime(now.Add(s.skew))}
}
