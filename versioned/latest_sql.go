package versioned

import (
	"fmt"

	"github.com/watermill-idempotency/idempotency/sqldb"
)

// This file holds all the SQL text of the family store, for PostgreSQL (the
// only dialect so far). %[1]s is the quoted latest table, %[2]s the quoted
// applied table. Another dialect adds a case to familySQLFor with statements
// of the same contract (parameters, one round trip, result shape).

// familySQL is the family store's statement set for one pair of tables.
type familySQL struct {
	advance, latest, applied, check string
	purgeLatest, purgeApplied       string
}

func familySQLFor(d sqldb.Dialect, latest, applied sqldb.Ident) (familySQL, error) {
	switch d {
	case sqldb.PostgreSQL:
		l, a := latest.Quoted(d.QuoteChar()), applied.Quoted(d.QuoteChar())
		return familySQL{
			advance:      fmt.Sprintf(pgFamilyAdvance, l),
			latest:       fmt.Sprintf(pgFamilyLatest, l),
			applied:      fmt.Sprintf(pgFamilyApplied, a),
			check:        fmt.Sprintf(pgFamilyCheck, l, a),
			purgeLatest:  fmt.Sprintf(pgFamilyPurge, l),
			purgeApplied: fmt.Sprintf(pgFamilyPurge, a),
		}, nil
	default:
		return familySQL{}, fmt.Errorf("unsupported dialect %s", d)
	}
}

const (
	// pgFamilyAdvance moves a family's latest record forward: parameters
	// kind, id, order_key, event_id, seq (NULL when none), occurred_at (NULL
	// for numbered positions). ON CONFLICT DO UPDATE locks the existing row
	// (waiting for a concurrent producer's transaction) and evaluates the
	// WHERE clause on the latest committed row, so at READ COMMITTED the
	// newest position wins whatever the commit order. One row (true) when
	// the record moved, none when the stored position is equal or newer.
	pgFamilyAdvance = `INSERT INTO %[1]s AS cur (family_kind, family_id, order_key, event_id, seq, occurred_at)
VALUES ($1, $2, $3, $4, $5, $6)
ON CONFLICT (family_kind, family_id) DO UPDATE
SET order_key = EXCLUDED.order_key, event_id = EXCLUDED.event_id, seq = EXCLUDED.seq,
    occurred_at = EXCLUDED.occurred_at, updated_at = now()
WHERE cur.order_key < EXCLUDED.order_key
RETURNING true`

	// pgFamilyLatest reads a family's latest record: parameters kind, id.
	pgFamilyLatest = `SELECT order_key FROM %[1]s WHERE family_kind = $1 AND family_id = $2`

	// pgFamilyApplied records that a consumer lets a message through:
	// parameters consumer, kind, id, order_key, event_id. One row when the
	// position is newer than the consumer's last one (recorded), none when
	// equal or older (stale). The row lock is held until the handler's
	// transaction ends, so one consumer's handlers of one family run one at
	// a time.
	pgFamilyApplied = `INSERT INTO %[1]s AS cur (consumer, family_kind, family_id, order_key, event_id)
VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (consumer, family_kind, family_id) DO UPDATE
SET order_key = EXCLUDED.order_key, event_id = EXCLUDED.event_id, updated_at = now()
WHERE cur.order_key < EXCLUDED.order_key
RETURNING true`

	// pgFamilyCheck is the filter's verdict in one round trip when the
	// latest table is read in the handler's transaction: parameters as
	// pgFamilyApplied. It returns (obsolete, recorded): obsolete when the
	// latest record is newer than the message (then nothing is written);
	// otherwise the applied upsert runs and recorded says whether it wrote
	// (false: stale). A data-modifying CTE runs exactly once whether or not
	// the outer query reads it; the casts give the parameters their types,
	// which INSERT … SELECT would not infer.
	pgFamilyCheck = `WITH latest AS (
    SELECT EXISTS (SELECT 1 FROM %[1]s
                   WHERE family_kind = $2::text AND family_id = $3::text AND order_key > $4::bytea) AS obsolete
), recorded AS (
    INSERT INTO %[2]s AS cur (consumer, family_kind, family_id, order_key, event_id)
    SELECT $1::text, $2::text, $3::text, $4::bytea, $5::uuid FROM latest WHERE NOT latest.obsolete
    ON CONFLICT (consumer, family_kind, family_id) DO UPDATE
    SET order_key = EXCLUDED.order_key, event_id = EXCLUDED.event_id, updated_at = now()
    WHERE cur.order_key < EXCLUDED.order_key
    RETURNING true
)
SELECT latest.obsolete, EXISTS (SELECT 1 FROM recorded) FROM latest`

	// pgFamilyPurge deletes at most $2 rows idle for longer than $1
	// microseconds by the database clock (now() is the transaction's start
	// on the server: neither the process's nor the session's time zone
	// enters the cutoff). Rows locked by a writer are skipped, not waited on.
	pgFamilyPurge = `DELETE FROM %[1]s WHERE ctid = ANY (ARRAY(
    SELECT ctid FROM %[1]s
    WHERE updated_at < now() - ($1::bigint * interval '1 microsecond')
    LIMIT $2
    FOR UPDATE SKIP LOCKED))`

	// pgFamilyTryLock / pgFamilyUnlock: the purger's session-level advisory
	// lock, held for one whole run, so one purger works at a time.
	pgFamilyTryLock = `SELECT pg_try_advisory_lock($1)`
	pgFamilyUnlock  = `SELECT pg_advisory_unlock($1)`
)
