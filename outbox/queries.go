package outbox

import (
	"fmt"

	"github.com/watermill-idempotency/idempotency/sqldb"
)

// queries is the SQL text of one outbox in one dialect. Statements with a
// variable number of ids are built per call (inIDs).
type queries struct {
	d         sqldb.Dialect
	t         tables
	insert    string
	stats     string
	countDead string
	lock      string // relay lock: a row (SQLite: an update) when this relay holds it
	claim     string // %d: batch size
	purge     string
	replay    string // %s: extra topic condition
}

func newQueries(d sqldb.Dialect, t tables) queries {
	p := func(i int) string { return placeholders(d, i, 1) }
	q := queries{d: d, t: t}
	q.insert = `INSERT INTO ` + t.Table + ` (event_id, topic, payload, metadata, created_at_us) VALUES (` + placeholders(d, 1, 5) + `)`
	q.stats = `SELECT count(*), min(created_at_us) FROM ` + t.Table
	q.countDead = `SELECT count(*) FROM ` + t.Dead
	switch d {
	case sqldb.SQLite:
		// SQLite has one writer: the UPDATE takes the database's write lock
		// (held to COMMIT), so relays on one file take turns.
		q.lock = `UPDATE ` + t.Lock + ` SET beat_us = ? WHERE name = 'relay'`
		q.claim = `SELECT id, event_id, topic, payload, metadata, attempts, first_fail_us FROM ` + t.Table +
			` WHERE next_try_us <= ? ORDER BY id LIMIT %d`
	default:
		q.lock = `SELECT name FROM ` + t.Lock + ` WHERE name = 'relay' FOR UPDATE SKIP LOCKED`
		q.claim = `SELECT id, event_id, topic, payload, metadata, attempts, first_fail_us FROM ` + t.Table +
			` WHERE next_try_us <= ` + p(1) + ` ORDER BY id LIMIT %d FOR UPDATE SKIP LOCKED`
	}
	q.purge = `DELETE FROM ` + t.Archive + ` WHERE relayed_at_us < ` + p(1)
	q.replay = `SELECT id, event_id, topic, payload, metadata, created_at_us FROM ` + t.Archive +
		` WHERE created_at_us >= ` + p(1) + ` AND created_at_us < ` + p(2) + `%s ORDER BY id`
	return q
}

// inIDs is " IN (…)" for n ids, placeholders from position from.
func (q queries) inIDs(from, n int) string {
	return ` IN (` + placeholders(q.d, from, n) + `)`
}

func (q queries) archive(n int) string {
	return `INSERT INTO ` + q.t.Archive + ` (id, event_id, topic, payload, metadata, created_at_us, relayed_at_us) SELECT id, event_id, topic, payload, metadata, created_at_us, ` +
		placeholders(q.d, 1, 1) + ` FROM ` + q.t.Table + ` WHERE id` + q.inIDs(2, n)
}

func (q queries) delete(n int) string {
	return `DELETE FROM ` + q.t.Table + ` WHERE id` + q.inIDs(1, n)
}

// deadLetter copies one row into the dead-letter table: args reason, now, id.
func (q queries) deadLetter() string {
	return `INSERT INTO ` + q.t.Dead + ` (id, event_id, topic, payload, metadata, created_at_us, attempts, reason, dead_at_us) SELECT id, event_id, topic, payload, metadata, created_at_us, attempts + 1, ` +
		placeholders(q.d, 1, 2) + ` FROM ` + q.t.Table + ` WHERE id = ` + placeholders(q.d, 3, 1)
}

// retry records a failed attempt: args attempts, next try, first failure,
// error, id.
func (q queries) retry() string {
	ph := func(i int) string { return placeholders(q.d, i, 1) }
	return fmt.Sprintf(`UPDATE %s SET attempts = %s, next_try_us = %s, first_fail_us = %s, last_error = %s WHERE id = %s`,
		q.t.Table, ph(1), ph(2), ph(3), ph(4), ph(5))
}
