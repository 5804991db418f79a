package outbox

import (
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// queries is the SQL text of one outbox in one dialect. Statements with a
// variable number of ids are built per call (inIDs).
//
// Every time the outbox stores or compares (created_at_us, next_try_us,
// first_fail_us, dead_at_us, relayed_at_us, the oldest row's age) is the
// database server's clock in microseconds since the Unix epoch (dbNow),
// never a process's: producers and relays in several processes, with clocks
// that disagree, compare one clock. dbNow reads it in UTC whatever the
// session's time zone (PostgreSQL TimeZone, MySQL time_zone).
type queries struct {
	d         sqldb.Dialect
	t         tables
	now       string // dbNow: the database's clock, µs since the epoch
	insert    string
	stats     string
	countDead string
	lease     string // takes or renews the relay lease: args owner, lease (µs), owner; 1 row when held; beat_us = its expiry
	release   string // gives the lease up: arg owner
	unclaim   string // %s: inIDs; a Parallel relay's claimed rows due again
	pressure  string // back-pressure: args backoff (µs), error, id; attempts unchanged
	claim     string // %s: exclusions (holdBack), %d: batch size
	peek      string // claim's candidates without locks (ids, topics); %s, %d as claim
	lockIDs   string // %s: inIDs; locks the candidates, skipping those locked
	waiting   string // rows waiting for a retry, oldest first
	inFlight  string // %s: inIDs; arg 1 the lease (µs): a Parallel relay's claimed rows, hidden from the others
	rehide    string // as inFlight, for rows whose hiding still holds
	purge     string
	replay    string // %s: extra topic condition
}

// dbNow returns d's expression for the database clock in µs since the
// epoch, independent of the session time zone:
//   - PostgreSQL: extract(epoch from statement_timestamp()) (timestamptz:
//     an absolute instant; TimeZone only changes how it prints). STABLE, so
//     "next_try_us <= dbNow" can use the index; clock_timestamp() is
//     VOLATILE and made every claim scan the whole table (measured: 715
//     instead of thousands of msg/s with 100k rows pending);
//   - MySQL/MariaDB: microseconds from 1970-01-01 00:00:00 to
//     UTC_TIMESTAMP(6) (UNIX_TIMESTAMP(NOW(6)) would read NOW in the
//     session time_zone and is ambiguous in a DST fall-back hour);
//   - SQLite: the process clock (the database is in-process), in
//     microseconds: a marker that at replaces, for each statement, with
//     time.Now() as an integer literal. SQLite's own julianday('now') has
//     millisecond resolution: it read earlier than a Go clock read just
//     before the write (199 of 200 reads), and time-range bounds computed
//     in Go missed rows.
func dbNow(d sqldb.Dialect) string {
	switch d {
	case sqldb.MySQL:
		return `TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))`
	case sqldb.SQLite:
		return sqliteNow
	default:
		return `(extract(epoch from statement_timestamp()) * 1000000)::bigint`
	}
}

func newQueries(d sqldb.Dialect, t tables) queries {
	p := func(i int) string { return placeholders(d, i, 1) }
	now := dbNow(d)
	q := queries{d: d, t: t, now: now}
	q.insert = `INSERT INTO ` + t.Table + ` (event_id, topic, payload, metadata, created_at_us) VALUES (` + placeholders(d, 1, 4) + `, ` + now + `)`
	q.stats = `SELECT count(*), ` + now + ` - min(created_at_us) FROM ` + t.Table
	q.countDead = `SELECT count(*) FROM ` + t.Dead
	// The lease: taken when free (owner ''), expired (beat_us, the expiry
	// its holder set, has passed) or already ours; one UPDATE, so two
	// relays racing for it serialise on the row and the second finds it
	// taken.
	q.lease = `UPDATE ` + t.Lock + ` SET owner = ` + p(1) + `, beat_us = ` + now + ` + ` + p(2) + ` WHERE name = 'relay' AND (owner = ` + p(3) +
		` OR owner = '' OR beat_us < ` + now + `)`
	q.release = `UPDATE ` + t.Lock + ` SET owner = '', beat_us = 0 WHERE name = 'relay' AND owner = ` + p(1)
	q.unclaim = `UPDATE ` + t.Table + ` SET next_try_us = 0 WHERE id%s`
	q.pressure = `UPDATE ` + t.Table + ` SET next_try_us = ` + now + ` + ` + p(1) + `, last_error = ` + p(2) + ` WHERE id = ` + p(3)
	switch d {
	case sqldb.SQLite:
		q.claim = `SELECT id, event_id, topic, payload, metadata, attempts FROM ` + t.Table +
			` WHERE next_try_us <= ` + now + `%s ORDER BY id LIMIT %d`
	default:
		q.claim = `SELECT id, event_id, topic, payload, metadata, attempts FROM ` + t.Table +
			` WHERE next_try_us <= ` + now + `%s ORDER BY id LIMIT %d FOR UPDATE SKIP LOCKED`
	}
	q.peek = `SELECT id, topic FROM ` + t.Table + ` WHERE next_try_us <= ` + now + `%s ORDER BY id LIMIT %d`
	q.lockIDs = `SELECT id, event_id, topic, payload, metadata, attempts FROM ` + t.Table + ` WHERE id%s ORDER BY id FOR UPDATE SKIP LOCKED`
	q.waiting = `SELECT id, topic FROM ` + t.Table + ` WHERE next_try_us > ` + now + ` ORDER BY id`
	q.inFlight = `UPDATE ` + t.Table + ` SET next_try_us = ` + now + ` + ` + p(1) + ` WHERE id%s`
	q.rehide = `UPDATE ` + t.Table + ` SET next_try_us = ` + now + ` + ` + p(1) + ` WHERE next_try_us > ` + now + ` AND id%s`
	// At most $2 rows a statement (archivePurgeBatch): an unbounded DELETE
	// of a large backlog outlasted the step's deadline on every try and
	// never removed a row.
	if d == sqldb.MySQL { // no LIMIT in an IN subquery
		q.purge = `DELETE FROM ` + t.Archive + ` WHERE relayed_at_us < ` + now + ` - ` + p(1) + ` ORDER BY relayed_at_us LIMIT ` + p(2)
	} else {
		q.purge = `DELETE FROM ` + t.Archive + ` WHERE id IN (SELECT id FROM ` + t.Archive + ` WHERE relayed_at_us < ` + now + ` - ` + p(1) + ` LIMIT ` + p(2) + `)`
	}
	q.replay = `SELECT id, event_id, topic, payload, metadata, created_at_us FROM ` + t.Archive +
		` WHERE created_at_us >= ` + p(1) + ` AND created_at_us < ` + p(2) + `%s ORDER BY id`
	return q
}

// sqliteNow marks the database clock in SQLite statements; at replaces it.
// An unknown column name, so that a statement run without at fails.
const sqliteNow = "idem_outbox_now_us"

// at returns query ready to run: on SQLite with the clock marker replaced
// by the process clock's microseconds since the epoch (one reading per
// statement, as PostgreSQL's statement_timestamp()); unchanged otherwise.
func (q queries) at(query string) string {
	if q.d != sqldb.SQLite {
		return query
	}
	return strings.ReplaceAll(query, sqliteNow, strconv.FormatInt(time.Now().UnixMicro(), 10))
}

// inIDs is " IN (…)" for n ids, placeholders from position from.
func (q queries) inIDs(from, n int) string {
	return ` IN (` + placeholders(q.d, from, n) + `)`
}

func (q queries) archive(n int) string {
	return `INSERT INTO ` + q.t.Archive + ` (id, event_id, topic, payload, metadata, created_at_us, relayed_at_us) SELECT id, event_id, topic, payload, metadata, created_at_us, ` +
		q.now + ` FROM ` + q.t.Table + ` WHERE id` + q.inIDs(1, n)
}

func (q queries) delete(n int) string {
	return `DELETE FROM ` + q.t.Table + ` WHERE id` + q.inIDs(1, n)
}

// deadLetter copies one row into the dead-letter table: args attempts,
// reason, id.
func (q queries) deadLetter() string {
	return `INSERT INTO ` + q.t.Dead + ` (id, event_id, topic, payload, metadata, created_at_us, attempts, reason, dead_at_us) SELECT id, event_id, topic, payload, metadata, created_at_us, ` +
		placeholders(q.d, 1, 2) + `, ` + q.now + ` FROM ` + q.t.Table + ` WHERE id = ` + placeholders(q.d, 3, 1)
}

// topicIn is "topic IN (…)" over n placeholders from position from, for
// the filters of Redrive and Replay. On MySQL the topic is compared as
// bytes (BINARY), as in holdBack: the column's collation matched "Orders"
// and "orders " for "orders", routing keys the operator did not select.
func topicIn(d sqldb.Dialect, from, n int) string {
	col := `topic`
	if d == sqldb.MySQL {
		col = `BINARY topic`
	}
	return col + ` IN (` + placeholders(d, from, n) + `)`
}

// holdBack is the claim's exclusion of the rows behind a waiting row of
// each topic, placeholders from position from: topic, head id per topic.
// On MySQL the topic is compared as bytes (BINARY): the column's default
// collation (utf8mb4_general_ci) ignores case and trailing spaces, so a
// waiting row of "Orders" held back "orders", another routing key.
func (q queries) holdBack(from, n int) string {
	eq := ` AND NOT (topic = %s AND id > %s)`
	if q.d == sqldb.MySQL {
		eq = ` AND NOT (topic = BINARY %s AND id > %s)`
	}
	var b strings.Builder
	for i := 0; i < n; i++ {
		fmt.Fprintf(&b, eq, placeholders(q.d, from+2*i, 1), placeholders(q.d, from+2*i+1, 1))
	}
	return b.String()
}

// retry records a failed attempt: args attempts, backoff (µs), error, id.
// The next try is the database's now + backoff; first_fail_us keeps the
// first failure's time.
func (q queries) retry() string {
	ph := func(i int) string { return placeholders(q.d, i, 1) }
	return fmt.Sprintf(`UPDATE %s SET attempts = %s, next_try_us = %s + %s, first_fail_us = CASE WHEN first_fail_us = 0 THEN %s ELSE first_fail_us END, last_error = %s WHERE id = %s`,
		q.t.Table, ph(1), q.now, ph(2), q.now, ph(3), ph(4))
}
