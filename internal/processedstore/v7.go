package processedstore

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// The UUIDv7 claim table (migration 0008, PostgreSQL plain layout): a
// UUIDv7 event's claim row is (consumer id smallint, event_id uuid,
// fingerprint bytea) in <table>_v7, the consumer id from <table>_consumer.
// Its time is its id (RFC 9562 §5.7), which orders the primary key, so
// the row needs no event_at, no event_name and no secondary index: 61.5k
// server instructions for the statement where the table's costs 82.3k
// (bench/RESULTS.md, floors).
//
// Only the pgx beginner's claim (ClaimParamsAt) inserts there, for the
// consumer CheckLean resolved, once <table>_v7_ready exists (every row
// claimed before the migration copied by Migrate). Every other claim
// path keeps inserting into the table, and the migration's trigger
// writes each such UUIDv7 claim into <table>_v7 too, or, when the event
// is claimed there already, copies that row into the table and skips the
// claim (a duplicate whose verdict and identity read find the copy). A
// store in that mode reads UUIDv7 rows from <table>_v7 alone
// (Processed, Verdict, StoredIdentityQuery, the commit guard): every
// UUIDv7 claim of either path is there.

// v7SQL is the store's statements on <table>_v7.
type v7SQL struct {
	// claim[withIdentity], near[withIdentity]: $1 consumer id (smallint),
	// $2 event id, $3 event time (timestamptz), with identity $4
	// fingerprint; near without the window's future arm.
	claim, near [2]string
	// The reads take the consumer's name ($1 text) as the table's
	// statements do, and $2 the event id.
	exists, verdict, stored, guard string
	purge                          string // $1 horizon µs, $2 limit
	// own are the reads for the consumer useV7 resolved, its id written
	// into the text instead of the subquery that finds it (18k server
	// instructions on a redelivered duplicate's read); $1 is still typed
	// (text) but not compared: v7Read chooses them for that name only.
	own v7Reads
}

// v7Reads are the reads of <table>_v7 ($1 consumer name, $2 event id).
type v7Reads struct{ exists, verdict, stored, guard string }

// v7ReadsBy builds the reads with key, the condition on the consumer
// column.
func (s *Store) v7ReadsBy(key string) v7Reads {
	v7 := s.sibling("v7")
	by := key + " AND event_id = $2"
	return v7Reads{
		exists: "SELECT EXISTS (SELECT 1 FROM " + v7 + " WHERE " + by + ")",
		verdict: fmt.Sprintf(`SELECT EXISTS (SELECT 1 FROM %s WHERE %s),
       $3::timestamptz < statement_timestamp() - interval '%d microseconds',
       to_char(statement_timestamp() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')`, v7, by, s.horizon.Microseconds()),
		stored: "SELECT NULL::text, fingerprint FROM " + v7 + " WHERE " + by,
		guard:  "/* idempotency commit guard: fails unless this transaction made the claim */ SELECT 1 / count(*) FROM " + v7 + " WHERE " + by + " AND xmin = pg_current_xact_id_if_assigned()::xid",
	}
}

// v7Read returns the reads of <table>_v7 for consumer.
func (s *Store) v7Read(consumer string) *v7Reads {
	if consumer == s.v7Consumer {
		return &s.v7sql.own
	}
	r := &v7Reads{s.v7sql.exists, s.v7sql.verdict, s.v7sql.stored, s.v7sql.guard}
	return r
}

// errV7Table is the fallback sentinel: the UUIDv7 table is not in use.
var errV7Table = errors.New("processed: the UUIDv7 claim table is not ready")

// initV7 builds the UUIDv7 table's statements (PostgreSQL plain layout).
func (s *Store) initV7() {
	v7, consumers := s.sibling("v7"), s.sibling("consumer")
	r := s.v7ReadsBy("consumer = (SELECT c.id FROM " + consumers + " c WHERE c.name = $1)")
	st := &v7SQL{
		exists: r.exists, verdict: r.verdict, stored: r.stored, guard: r.guard,
		// Per consumer id (the few rows of <table>_consumer), a range of
		// the primary key below the smallest UUIDv7 of the cutoff's
		// millisecond: a row goes only when its id's millisecond is
		// before the cutoff's, which the claim refuses. At most $2 rows.
		purge: `DELETE FROM ` + v7 + ` WHERE (consumer, event_id) IN (
    SELECT x.consumer, x.event_id FROM ` + consumers + ` AS c
    CROSS JOIN LATERAL (
        SELECT t.consumer, t.event_id FROM ` + v7 + ` AS t
        WHERE t.consumer = c.id
          AND t.event_id < (lpad(to_hex(greatest(0, floor(extract(epoch FROM now() - ($1::bigint * interval '1 microsecond')) * 1000))::bigint), 12, '0') || '00000000000000000000')::uuid
        LIMIT $2
        FOR UPDATE SKIP LOCKED) AS x
    LIMIT $2)`,
	}
	for id := 0; id < 2; id++ {
		cols, sel := "consumer, event_id", "$1, $2"
		if id == 1 {
			cols, sel = cols+", fingerprint", sel+", $4"
		}
		where := "$3::timestamptz IS NULL OR true"
		near := ""
		if s.horizon > 0 {
			where = fmt.Sprintf("$3::timestamptz BETWEEN statement_timestamp() - interval '%d microseconds' AND statement_timestamp() + interval '%d microseconds'",
				s.horizon.Microseconds(), s.skew.Microseconds())
			near = fmt.Sprintf("$3::timestamptz >= statement_timestamp() - interval '%d microseconds'", s.horizon.Microseconds())
		}
		st.claim[id] = fmt.Sprintf("INSERT INTO %s (%s)\nSELECT %s%s%s)\nON CONFLICT DO NOTHING", v7, cols, sel, leanClaimWhere, where)
		if near != "" {
			st.near[id] = fmt.Sprintf("INSERT INTO %s (%s)\nSELECT %s%s%s)\nON CONFLICT DO NOTHING", v7, cols, sel, leanClaimWhere, near)
		}
	}
	s.v7sql = st
}

// inV7 reports whether eventID's row is read from <table>_v7.
func (s *Store) inV7(eventID uuid.UUID) bool {
	return eventID.Version() == 7 && s.v7On.Load()
}

// DisableV7 turns the UUIDv7 claim table off for good (the claims and
// reads go to the table again): the pgx beginner calls it when a claim
// there finds no such table (42P01), which MigrateToPartitioned folded
// into the legacy table.
func (s *Store) DisableV7() { s.v7On.Store(false) }

// undefinedV7 reports whether err is a missing relation (42P01) met by a
// statement on <table>_v7, and then turns it off (DisableV7).
func (s *Store) undefinedV7(eventID uuid.UUID, err error) bool {
	var e interface{ SQLState() string }
	if err == nil || !s.inV7(eventID) || !errors.As(err, &e) || e.SQLState() != "42P01" {
		return false
	}
	s.DisableV7()
	return true
}

// useV7 reads whether <table>_v7 is ready and, when it is, the id of
// consumer in <table>_consumer, and turns the UUIDv7 claims and reads on
// for it. A table without migration 0008, or whose rows are not all
// copied yet, leaves them off: every claim then goes to the table, whose
// trigger (once created) keeps <table>_v7 complete. A name not registered
// yet, or whose copy did not finish, is registered and its rows copied
// first (copyV7); when that copy cannot run (the barrier's lock not
// granted within v7BarrierTimeout) the claims stay off until the next
// start. Only a schema-qualified table (NewConsumer qualifies it) uses it.
func (s *Store) useV7(ctx context.Context, q sqldb.Querier, consumer string) error {
	if s.v7sql == nil || !s.hasLean || consumer == "" || !s.table.Qualified() {
		return nil
	}
	ready, err := s.v7Ready(ctx, q)
	if err != nil || !ready {
		return err
	}
	consumers := s.sibling("consumer")
	var (
		id     *int16
		copied bool
	)
	read := "SELECT id, copied FROM " + consumers + " WHERE name = $1"
	err = q.QueryRow(ctx, read, consumer).Scan(&id, &copied)
	if errors.Is(err, sqldb.ErrNoRows) {
		if _, err := q.Exec(ctx, "INSERT INTO "+consumers+" (name) VALUES ($1) ON CONFLICT (name) DO NOTHING", consumer); err != nil {
			return fmt.Errorf("processed: add consumer %q to %s: %w", consumer, consumers, err)
		}
		err = q.QueryRow(ctx, read, consumer).Scan(&id, &copied)
	}
	if err != nil {
		return fmt.Errorf("processed: read the id of consumer %q in %s: %w", consumer, consumers, err)
	}
	if !copied {
		// Claims the trigger did not copy (the name was not registered)
		// are copied now, once those in flight have ended.
		if err := s.copyV7(ctx, q, []int16{*id}); err != nil {
			if isLockTimeout(err) {
				return nil
			}
			return err
		}
	}
	s.v7Consumer, s.v7ID = consumer, *id
	s.v7sql.own = s.v7ReadsBy(fmt.Sprintf("consumer = CASE WHEN $1::text IS NOT NULL THEN %d::smallint END", *id))
	s.v7On.Store(true)
	return nil
}

// isLockTimeout: err is PostgreSQL's lock_timeout (55P03).
func isLockTimeout(err error) bool {
	var e interface{ SQLState() string }
	return errors.As(err, &e) && e.SQLState() == "55P03"
}

// v7BarrierTimeout bounds copyV7's wait for the claims in flight.
var v7BarrierTimeout = 30 * time.Second

// v7Ready reports whether <table>_v7_ready holds its row (false when the
// table does not exist).
func (s *Store) v7Ready(ctx context.Context, q sqldb.Querier) (bool, error) {
	ready7 := s.sibling("v7_ready")
	var exists, ready bool
	err := q.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, ready7).Scan(&exists)
	if err == nil && exists {
		err = q.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM "+ready7+")").Scan(&ready)
	}
	if err != nil {
		return false, fmt.Errorf("processed: read %s: %w", ready7, err)
	}
	return ready, nil
}

// v7Exists reports whether <table>_v7 exists (the purge's check).
func (s *Store) v7Exists(ctx context.Context, q sqldb.Querier) (bool, error) {
	if s.v7sql == nil {
		return false, nil
	}
	var ok bool
	if err := q.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, s.sibling("v7")).Scan(&ok); err != nil {
		return false, fmt.Errorf("processed: read %s: %w", s.sibling("v7"), err)
	}
	return ok, nil
}

// purgeV7Batch deletes at most limit rows of <table>_v7 whose id's time is
// before now() − horizon.
func (s *Store) purgeV7Batch(ctx context.Context, q sqldb.Querier, horizon time.Duration, limit int) (int64, error) {
	n, err := q.Exec(ctx, s.v7sql.purge, horizon.Truncate(time.Microsecond).Microseconds(), limit)
	if err != nil {
		return 0, fmt.Errorf("processed: purge %s: %w", s.sibling("v7"), err)
	}
	return n, nil
}

// v7CopyBatch is the size of one batch of fillV7.
const v7CopyBatch = 10000

// fillV7 copies the UUIDv7 rows of the table into <table>_v7: it
// registers every consumer name of the table in <table>_consumer, copies
// their rows (copyV7), then writes <table>_v7_ready. The trigger of
// migration 0008 exists before it runs (Migrate applies it first). Run
// again after it completed, it does nothing; interrupted, it starts over
// (the copy skips rows already there).
func (s *Store) fillV7(ctx context.Context, q sqldb.Querier) error {
	exists, err := s.v7Exists(ctx, q)
	if err != nil || !exists {
		return err
	}
	if ready, err := s.v7Ready(ctx, q); err != nil || ready {
		return err
	}
	t, consumers := s.table.Quoted('"'), s.sibling("consumer")
	// Every consumer name of the table, by a loose scan of its primary key.
	if _, err := q.Exec(ctx, `INSERT INTO `+consumers+` (name)
WITH RECURSIVE c(consumer) AS (
    SELECT min(consumer) FROM `+t+`
    UNION ALL
    SELECT (SELECT min(x.consumer) FROM `+t+` AS x WHERE x.consumer > c.consumer) FROM c WHERE c.consumer IS NOT NULL)
SELECT consumer FROM c WHERE consumer IS NOT NULL
ON CONFLICT (name) DO NOTHING`); err != nil {
		return fmt.Errorf("processed: copy the consumer names of %s: %w", s.table, err)
	}
	var ids []int16
	if err := q.QueryRow(ctx, "SELECT coalesce(array_agg(id), '{}') FROM "+consumers+" WHERE NOT copied").Scan(&ids); err != nil {
		return fmt.Errorf("processed: read %s: %w", consumers, err)
	}
	if len(ids) > 0 {
		if err := s.copyV7(ctx, q, ids); err != nil {
			return err
		}
	}
	if _, err := q.Exec(ctx, "INSERT INTO "+s.sibling("v7_ready")+" (id, ready_us) VALUES (1, "+s.nowMicrosSQL()+") ON CONFLICT DO NOTHING"); err != nil {
		return fmt.Errorf("processed: mark %s ready: %w", s.sibling("v7"), err)
	}
	return nil
}

// copyV7 copies the UUIDv7 rows of the consumers ids (registered in
// <table>_consumer) from the table into <table>_v7, then marks them
// copied. First a barrier: a transaction that takes the table's SHARE lock
// (waiting at most v7BarrierTimeout), which waits for the claims in
// flight, since one that began before a name was registered was not
// copied by the trigger, and is released at once. Then batches of
// v7CopyBatch rows along the table's primary key, each its own statement:
// a claim committed after a batch read its range is in <table>_v7
// already (the trigger, its name registered).
func (s *Store) copyV7(ctx context.Context, q sqldb.Querier, ids []int16) error {
	t, v7, consumers := s.table.Quoted('"'), s.sibling("v7"), s.sibling("consumer")
	// One query string: one implicit transaction, the lock released at
	// its end.
	if _, err := q.Exec(ctx, fmt.Sprintf("SET LOCAL lock_timeout = '%dms'; LOCK TABLE %s IN SHARE MODE", v7BarrierTimeout.Milliseconds(), t)); err != nil {
		return fmt.Errorf("processed: wait for the claims in flight on %s: %w", s.table, err)
	}
	copySQL := `WITH b AS (
    SELECT x.consumer, x.event_id, x.fingerprint, c.id FROM ` + consumers + ` c
    CROSS JOIN LATERAL (
        SELECT consumer, event_id, fingerprint FROM ` + t + ` t
        WHERE t.consumer = c.name AND t.event_id > $2::uuid
        ORDER BY event_id
        LIMIT ` + fmt.Sprint(v7CopyBatch) + `) x
    WHERE c.id = $1),
ins AS (
    INSERT INTO ` + v7 + ` (consumer, event_id, fingerprint)
    SELECT b.id, b.event_id, b.fingerprint FROM b
    WHERE get_byte(uuid_send(b.event_id), 6) >> 4 = 7
    ON CONFLICT DO NOTHING)
SELECT coalesce(max(event_id::text), ''), count(*) FROM b`
	for _, id := range ids {
		last := uuid.Nil.String()
		for {
			var n int64
			var max string
			if err := q.QueryRow(ctx, copySQL, id, last).Scan(&max, &n); err != nil {
				return fmt.Errorf("processed: copy the UUIDv7 rows of %s into %s: %w", s.table, v7, err)
			}
			if n < v7CopyBatch {
				break
			}
			last = max
		}
		if _, err := q.Exec(ctx, "UPDATE "+consumers+" SET copied = true WHERE id = $1", id); err != nil {
			return fmt.Errorf("processed: mark consumer %d copied: %w", id, err)
		}
	}
	return nil
}
