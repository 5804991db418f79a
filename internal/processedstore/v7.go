package processedstore

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// The UUIDv7 claim table (migration 0008, PostgreSQL plain layout): a
// UUIDv7 event's claim row is (consumer id, event_id, fingerprint) in
// <table>_v7, the consumer id (integer) from <table>_consumer. Its time is
// its id (RFC 9562 §5.7), which orders the primary key, so the row needs
// no event_at, no event_name and no secondary index: 61.5k server
// instructions for the statement where the table's costs 82.3k
// (bench/RESULTS.md, floors).
//
// The claims of the consumer CheckLean registered insert there
// (ClaimParamsAt, ClaimQueryAt, ClaimIdentityQueryAt), once
// <table>_v7_ready exists (every row claimed before the migration copied
// by Migrate). Every other claim (another consumer name on this store, a
// store without CheckLean, a previous release) inserts into the table, and
// the migration's trigger writes each such UUIDv7 claim into <table>_v7
// too (registering its consumer name when needed), or, when the event is
// claimed there already, copies that row into the table and skips the
// claim (a duplicate whose verdict and identity read find the copy). A store in that mode reads UUIDv7 rows
// from <table>_v7 alone (Processed, Verdict, StoredIdentityQuery, the
// commit guard): every UUIDv7 claim of either path is there.

// v7MaxName is the longest table name with a UUIDv7 claim table: its
// siblings' names (<table>_v7_mirror, the longest) stay within
// PostgreSQL's 63 bytes. A longer name keeps every claim in the table.
const v7MaxName = 63 - len("_v7_mirror")

// v7SQL is the store's statements on <table>_v7.
type v7SQL struct {
	// claim[withIdentity], near[withIdentity]: $1 consumer id (integer),
	// $2 event id, $3 event time (timestamptz), with identity $4
	// fingerprint; near without the window's future arm.
	claim, near [2]string
	// byName are the reads for any consumer, found by its name ($1 text,
	// as in the table's statements); both, the same in the table or in
	// <table>_v7.
	byName, both v7Reads
	purge        string // $1 horizon µs, $2 limit
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
	exists := "EXISTS (SELECT 1 FROM " + v7 + " WHERE " + by + ")"
	return v7Reads{
		exists:  "SELECT " + exists,
		verdict: s.v7Verdict(exists),
		stored:  "SELECT NULL::text, fingerprint FROM " + v7 + " WHERE " + by,
		guard:   fmt.Sprintf(guardSQL, v7, by),
	}
}

// v7Verdict is the verdict (postgresSQL.verdict's columns) whose first
// column is exists.
func (s *Store) v7Verdict(exists string) string {
	return fmt.Sprintf(`SELECT %s,
       $3::timestamptz < statement_timestamp() - interval '%d microseconds',
       to_char(statement_timestamp() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')`, exists, s.horizon.Microseconds())
}

// v7Read returns the reads of <table>_v7 for consumer.
func (s *Store) v7Read(consumer string) *v7Reads {
	if consumer == s.v7Consumer {
		return &s.v7sql.own
	}
	return &s.v7sql.byName
}

// v7ReadOf returns the reads of consumer's row of eventID when they are
// not the table's: those of <table>_v7 in that mode, of both tables when
// the store does not claim there but may read it (v7Both); nil otherwise.
func (s *Store) v7ReadOf(consumer string, eventID uuid.UUID) *v7Reads {
	switch {
	case eventID.Version() != 7:
		return nil
	case s.v7On.Load():
		return s.v7Read(consumer)
	case s.v7Both.Load():
		return &s.v7sql.both
	}
	return nil
}

// initV7 builds the UUIDv7 table's statements (PostgreSQL plain layout).
func (s *Store) initV7() {
	v7, consumers := s.sibling("v7"), s.sibling("consumer")
	byName := "consumer = (SELECT c.id FROM " + consumers + " c WHERE c.name = $1) AND event_id = $2"
	t := s.table.Quoted('"')
	inBoth := "(EXISTS (SELECT 1 FROM " + t + " WHERE consumer = $1 AND event_id = $2) OR EXISTS (SELECT 1 FROM " + v7 + " WHERE " + byName + "))"
	st := &v7SQL{
		byName: s.v7ReadsBy("consumer = (SELECT c.id FROM " + consumers + " c WHERE c.name = $1)"),
		both: v7Reads{
			exists:  "SELECT " + inBoth,
			verdict: s.v7Verdict(inBoth),
			stored:  "(SELECT event_name, fingerprint FROM " + t + " WHERE consumer = $1 AND event_id = $2) UNION ALL (SELECT NULL::text, fingerprint FROM " + v7 + " WHERE " + byName + ") LIMIT 1",
		},
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
		st.claim[id] = leanInsert(v7, cols, sel, leanWindow(true, true, s.horizon, s.skew))
		if s.horizon > 0 {
			st.near[id] = leanInsert(v7, cols, sel, leanWindow(true, false, s.horizon, s.skew))
		}
	}
	s.v7sql = st
}

// inV7 reports whether eventID's row is read from <table>_v7.
func (s *Store) inV7(eventID uuid.UUID) bool {
	return eventID.Version() == 7 && s.v7On.Load()
}

// claimsV7 reports whether consumer's claim of eventID goes to
// <table>_v7: a UUIDv7 event of the consumer CheckLean registered.
func (s *Store) claimsV7(consumer string, eventID uuid.UUID) bool {
	return consumer == s.v7Consumer && s.inV7(eventID)
}

// FoldedV7 reports whether err, an error met for eventID, is a statement
// on <table>_v7 that found no such table (42P01, the message naming it:
// MigrateToPartitioned folded it into the legacy table), and then turns
// the UUIDv7 claim table off for good: this store's claims and reads go to
// the table again. The middleware calls it with an attempt's error (that
// attempt fails, the next claims in the table); the store's own reads
// call it and read again.
func (s *Store) FoldedV7(eventID uuid.UUID, err error) bool {
	var e *pgconn.PgError
	if err == nil || s.v7ReadOf("", eventID) == nil || !errors.As(err, &e) || e.Code != "42P01" ||
		!strings.Contains(e.Message, s.table.Name()+`_v7"`) {
		return false
	}
	s.v7On.Store(false)
	s.v7Both.Store(false)
	return true
}

// useV7 registers consumer in <table>_consumer when the table exists
// (migration 0008), so that no claim of it registers the name in its
// transaction (the trigger does for a name it does not know, and holds
// the name's first claims behind that one until it ends), and, when
// <table>_v7 is ready, turns the UUIDv7 claims and reads on for it. A
// table without migration 0008, or whose rows are not all copied yet,
// leaves them off: every claim then goes to the table, whose trigger
// (once created) keeps <table>_v7 complete. So does a role that may not
// read or write the new tables (42501): its claims go to the table, and
// the trigger (run as the tables' owner) copies them. Only a
// schema-qualified table (NewConsumer qualifies it) claims there.
func (s *Store) useV7(ctx context.Context, q sqldb.Querier, consumer string) error {
	if s.v7sql == nil || !s.hasLean {
		return nil
	}
	if exists, err := s.v7Exists(ctx, q); err != nil || !exists {
		return err
	}
	// Until this store claims there, its reads of UUIDv7 rows look in
	// <table>_v7 too, where other processes may claim, when the role may.
	var readable bool
	if err := q.QueryRow(ctx, `SELECT has_table_privilege($1, 'SELECT') AND has_table_privilege($2, 'SELECT')`,
		s.sibling("v7"), s.sibling("consumer")).Scan(&readable); err != nil {
		return fmt.Errorf("processed: read the privileges on %s: %w", s.sibling("v7"), err)
	}
	s.v7Both.Store(readable)
	if consumer == "" {
		return nil
	}
	id, err := s.registerV7(ctx, q, consumer)
	if err != nil || id == 0 || !s.table.Qualified() {
		return err
	}
	ready, err := s.v7Ready(ctx, q)
	if sqlState(err) == "42501" {
		return nil // the table's claim
	}
	if err != nil || !ready {
		return err
	}
	s.v7Consumer, s.v7ID = consumer, id
	s.v7sql.own = s.v7ReadsBy(fmt.Sprintf("consumer = CASE WHEN $1::text IS NOT NULL THEN %d END", id))
	s.v7On.Store(true)
	return nil
}

// sqlState is err's SQLSTATE, or "".
func sqlState(err error) string {
	var e *pgconn.PgError
	if errors.As(err, &e) {
		return e.Code
	}
	return ""
}

// registerV7 returns consumer's id in <table>_consumer, adding the name
// when it is not there (a sequence value is drawn only then); 0 when the
// role may not (42501).
func (s *Store) registerV7(ctx context.Context, q sqldb.Querier, consumer string) (int32, error) {
	consumers := s.sibling("consumer")
	var id int32
	err := q.QueryRow(ctx, `WITH i AS (
    INSERT INTO `+consumers+` (name) SELECT $1::text
    WHERE NOT EXISTS (SELECT 1 FROM `+consumers+` WHERE name = $1::text)
    ON CONFLICT (name) DO NOTHING RETURNING id)
SELECT id FROM i UNION ALL SELECT id FROM `+consumers+` WHERE name = $1::text`, consumer).Scan(&id)
	if errors.Is(err, sqldb.ErrNoRows) {
		// Added by another process after this statement's snapshot.
		err = q.QueryRow(ctx, "SELECT id FROM "+consumers+" WHERE name = $1", consumer).Scan(&id)
	}
	if sqlState(err) == "42501" {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("processed: register consumer %q in %s: %w", consumer, consumers, err)
	}
	return id, nil
}

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

// v7Purgeable reports whether <table>_v7 exists and whether this role may
// not purge it (its purge locks rows FOR UPDATE: SELECT and UPDATE, and
// DELETE on it, SELECT on <table>_consumer).
func (s *Store) v7Purgeable(ctx context.Context, q sqldb.Querier) (ok, denied bool, err error) {
	if ok, err = s.v7Exists(ctx, q); err != nil || !ok {
		return false, false, err
	}
	err = q.QueryRow(ctx, `SELECT has_table_privilege($1, 'SELECT') AND has_table_privilege($1, 'UPDATE') AND has_table_privilege($1, 'DELETE') AND has_table_privilege($2, 'SELECT')`,
		s.sibling("v7"), s.sibling("consumer")).Scan(&ok)
	if err != nil {
		return false, false, fmt.Errorf("processed: read the privileges on %s: %w", s.sibling("v7"), err)
	}
	return ok, !ok, nil
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

// fillV7 copies the UUIDv7 rows of the table into <table>_v7, then writes
// <table>_v7_ready. It registers every consumer name of the table in
// <table>_consumer first (a loose scan of its primary key), then copies in
// batches of v7CopyBatch along the table's primary key, each its own
// statement (no lock held between them). The trigger of migration 0008
// exists before it runs (Migrate applies it first; CREATE TRIGGER waited
// for the claims in flight), so every claim it does not see is in
// <table>_v7 already. Run again after it completed, it does nothing;
// interrupted, it starts over (the copy skips rows already there).
func (s *Store) fillV7(ctx context.Context, q sqldb.Querier) error {
	exists, err := s.v7Exists(ctx, q)
	if err != nil || !exists {
		return err
	}
	if ready, err := s.v7Ready(ctx, q); err != nil || ready {
		return err
	}
	t, v7, consumers := s.table.Quoted('"'), s.sibling("v7"), s.sibling("consumer")
	if _, err := q.Exec(ctx, `INSERT INTO `+consumers+` (name)
WITH RECURSIVE c(consumer) AS (
    SELECT min(consumer) FROM `+t+`
    UNION ALL
    SELECT (SELECT min(x.consumer) FROM `+t+` AS x WHERE x.consumer > c.consumer) FROM c WHERE c.consumer IS NOT NULL)
SELECT consumer FROM c WHERE consumer IS NOT NULL
    AND NOT EXISTS (SELECT 1 FROM `+consumers+` n WHERE n.name = c.consumer)
ON CONFLICT (name) DO NOTHING`); err != nil {
		return fmt.Errorf("processed: copy the consumer names of %s: %w", s.table, err)
	}
	copySQL := `WITH b AS (
    SELECT consumer, event_id, fingerprint FROM ` + t + `
    WHERE (consumer, event_id) > ($1, $2::uuid)
    ORDER BY consumer, event_id
    LIMIT ` + strconv.Itoa(v7CopyBatch) + `),
ins AS (
    INSERT INTO ` + v7 + ` (consumer, event_id, fingerprint)
    SELECT c.id, b.event_id, b.fingerprint FROM b JOIN ` + consumers + ` c ON c.name = b.consumer
    WHERE get_byte(uuid_send(b.event_id), 6) >> 4 = 7
    ON CONFLICT DO NOTHING)
SELECT consumer, event_id::text, (SELECT count(*) FROM b) FROM b ORDER BY consumer DESC, event_id DESC LIMIT 1`
	lastConsumer, lastID := "", uuid.Nil.String()
	for {
		var n int64
		err := q.QueryRow(ctx, copySQL, lastConsumer, lastID).Scan(&lastConsumer, &lastID, &n)
		if errors.Is(err, sqldb.ErrNoRows) {
			break
		}
		if err != nil {
			return fmt.Errorf("processed: copy the UUIDv7 rows of %s into %s: %w", s.table, v7, err)
		}
		if n < v7CopyBatch {
			break
		}
	}
	if _, err := q.Exec(ctx, "INSERT INTO "+s.sibling("v7_ready")+" (id, ready_us) VALUES (1, "+s.nowMicrosSQL()+") ON CONFLICT DO NOTHING"); err != nil {
		return fmt.Errorf("processed: mark %s ready: %w", v7, err)
	}
	return nil
}
