package processed

import (
	"fmt"
	"time"

	"github.com/google/uuid"
)

// sqliteSQL is every SQLite statement of the store; %[1]s is the quoted table.
var sqliteSQL = dialectSQL{
	// SQLite serialises writers: a concurrent claim waits (busy_timeout)
	// for the writer's COMMIT, then sees the row.
	claim:  `INSERT INTO %[1]s (consumer, event_id) VALUES (?, ?) ON CONFLICT DO NOTHING`,
	exists: `SELECT EXISTS (SELECT 1 FROM %[1]s WHERE consumer = ? AND event_id = ?)`,
	purgeBatch: `DELETE FROM %[1]s WHERE (consumer, event_id) IN (
    SELECT consumer, event_id FROM %[1]s
    WHERE processed_at < strftime('%%Y-%%m-%%dT%%H:%%M:%%fZ', 'now', ?)
    ORDER BY processed_at LIMIT ?)`,
	purgeArgs: func(h time.Duration, limit int) []any {
		return []any{fmt.Sprintf("-%.3f seconds", h.Seconds()), limit}
	},
	// No lock timeout statement: the driver's busy_timeout bounds waits.
	eventID: func(id uuid.UUID) any { b := id; return b[:] },
}
