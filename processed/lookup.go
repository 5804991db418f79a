package processed

import (
	"fmt"

	"github.com/google/uuid"

	"github.com/watermill-idempotency/idempotency/sqldb"
)

// LookupQuery returns a read-only query of the rows of eventID, one row
// (consumer, processed_at) per consumer that processed it, oldest first; with
// consumer != "" only that consumer's row. It is for tools that need more
// than Processed's yes/no (the operators' command): run it with the
// driver's multi-row query (database/sql QueryContext, pgx Query).
// processed_at scans as a time.Time on PostgreSQL and MySQL (parseTime=true,
// UTC) and as ISO 8601 UTC text on SQLite.
func (s *Store) LookupQuery(eventID uuid.UUID, consumer string) (string, []any) {
	q := s.table.Quoted(s.dialect.QuoteChar())
	p1, p2 := "?", "?"
	if s.dialect == sqldb.PostgreSQL {
		p1, p2 = "$1", "$2"
	}
	sql := fmt.Sprintf(`SELECT consumer, processed_at FROM %s WHERE event_id = %s`, q, p1)
	args := []any{s.sql.eventID(eventID)}
	if consumer != "" {
		sql += fmt.Sprintf(` AND consumer = %s`, p2)
		args = append(args, consumer)
	}
	return sql + ` ORDER BY processed_at, consumer`, args
}
