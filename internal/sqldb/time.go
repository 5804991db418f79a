package sqldb

import (
	"fmt"
	"time"
)

// Time is a sql.Scanner for a timestamp column of any supported dialect:
// a time.Time (pgx; MySQL/MariaDB with parseTime), or the text SQLite stores
// (ISO 8601 in UTC, "2006-01-02T15:04:05.000Z") or MySQL stores without
// parseTime ("2006-01-02 15:04:05.999999"). NULL scans as the zero time.
// The parsed time is in UTC. Scanning any other type, or text in no
// accepted layout, is an error.
type Time struct{ T time.Time }

// Scan implements sql.Scanner.
func (ts *Time) Scan(src any) error {
	var text string
	switch v := src.(type) {
	case nil:
		ts.T = time.Time{}
		return nil
	case time.Time:
		ts.T = v
		return nil
	case string:
		text = v
	case []byte:
		text = string(v)
	default:
		return fmt.Errorf("sqldb: time: unsupported type %T", src)
	}
	for _, layout := range []string{time.RFC3339Nano, "2006-01-02 15:04:05.999999999", "2006-01-02T15:04:05.999999999"} {
		if t, err := time.Parse(layout, text); err == nil {
			ts.T = t.UTC()
			return nil
		}
	}
	return fmt.Errorf("sqldb: time: cannot parse %q", text)
}

// SQLiteTimeLayout is how the library's SQLite columns store a time: ISO
// 8601 in UTC with microseconds, fixed width, so that text order is time
// order. Earlier versions stored milliseconds ("…05.123Z", which sorts
// after every microsecond text of the same millisecond); the components'
// SQLite migrations rewrite such rows to this layout ("…05.123000Z").
const SQLiteTimeLayout = "2006-01-02T15:04:05.000000Z"

// SQLiteTime formats t in SQLiteTimeLayout (UTC, truncated to the
// microsecond).
func SQLiteTime(t time.Time) string { return t.UTC().Format(SQLiteTimeLayout) }

// SQLiteNow is the SQLite clock of the library: the process clock (the
// database is in-process), read once per call, in SQLiteTimeLayout. Every
// SQLite statement that stores or compares a time takes it as a parameter:
// SQLite's own strftime/julianday('now') have millisecond resolution and
// read earlier than a Go clock read just before the statement (199 of 200
// reads), so bounds computed in Go missed rows.
func SQLiteNow() string { return SQLiteTime(time.Now()) }
