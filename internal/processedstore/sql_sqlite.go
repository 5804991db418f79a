package processedstore

import (
	"fmt"
	"time"

	"github.com/google/uuid"
)

// sqliteSQL is every SQLite statement of the store; %[1]s is the quoted table.
var sqliteSQL = dialectSQL{
	// SQLite serialises writers: a concurrent claim waits (busy_timeout)
	// for the writer's COMMIT, then sees the row.
	claim: `INSERT INTO %[1]s (consumer, event_id, event_at) VALUES (?, ?, COALESCE(?, strftime('%%Y-%%m-%%dT%%H:%%M:%%fZ', 'now'))) ON CONFLICT DO NOTHING`,
	// The claim with the replay window (see the PostgreSQL text), on
	// ISO 8601 UTC text with milliseconds, which sorts like the instant.
	// ?3 is the event's time, reused.
	window: `INSERT INTO %[1]s (consumer, event_id, event_at)
SELECT ?1, ?2, COALESCE(?3, strftime('%%Y-%%m-%%dT%%H:%%M:%%fZ', 'now'))
WHERE ?3 IS NULL
   OR ?3 BETWEEN strftime('%%Y-%%m-%%dT%%H:%%M:%%fZ', 'now', '-%[4]s seconds') AND strftime('%%Y-%%m-%%dT%%H:%%M:%%fZ', 'now', '+%[5]s seconds')
ON CONFLICT DO NOTHING`,
	verdict: `SELECT EXISTS (SELECT 1 FROM %[1]s WHERE consumer = ?1 AND event_id = ?2),
       ?3 < strftime('%%Y-%%m-%%dT%%H:%%M:%%fZ', 'now', '-%[4]s seconds'),
       strftime('%%Y-%%m-%%dT%%H:%%M:%%fZ', 'now')`,
	eventAt: func(t time.Time) any { return t.UTC().Format("2006-01-02T15:04:05.000Z") },
	exists:  `SELECT EXISTS (SELECT 1 FROM %[1]s WHERE consumer = ? AND event_id = ?)`,
	purgeBatch: `DELETE FROM %[1]s WHERE (consumer, event_id) IN (
    SELECT consumer, event_id FROM %[1]s
    WHERE event_at < strftime('%%Y-%%m-%%dT%%H:%%M:%%fZ', 'now', ?)
    ORDER BY event_at LIMIT ?)`,
	purgeArgs: func(h time.Duration, limit int) []any {
		return []any{fmt.Sprintf("-%.3f seconds", h.Seconds()), limit}
	},
	// No lock timeout statement: the driver's busy_timeout bounds waits.
	eventID: func(id uuid.UUID) any { b := id; return b[:] },
}
