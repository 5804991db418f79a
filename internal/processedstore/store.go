package processedstore

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/google/uuid"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// DefaultTable is the processed-event table used when Config.Table is empty.
const DefaultTable = "processed_event"

// Config configures a Store.
type Config struct {
	// Table is the processed-event table, "name" or "schema.name"; each part
	// must match [A-Za-z_][A-Za-z0-9_]{0,62}. It is validated and quoted once,
	// in NewStore. Defaults to DefaultTable.
	//
	// An unqualified name resolves through the connection's search_path at
	// each statement (PostgreSQL re-plans the prepared claim when
	// search_path changes), which is what a schema per tenant wants. A
	// handler that changes search_path for the session (SET, not SET LOCAL)
	// leaves it on the pooled connection, and the next claim there goes to
	// that schema's table (or fails, 42P01, where it has none): qualify the
	// name ("schema.name") or use SET LOCAL in handlers.
	Table string

	// Dialect is the SQL dialect. Defaults to sqldb.PostgreSQL.
	Dialect sqldb.Dialect

	// Horizon is the replay horizon: how long a processed row is kept, and
	// the age beyond which the claim refuses an event (ErrExpired). Both
	// are judged by one clock, the database's now() (on SQLite the process
	// clock, in microseconds), on one time, the
	// event's own (its UUIDv7 timestamp, RFC 9562 §5.7, else the occurred_at
	// the caller passes), stored in the row as event_at. The claim refuses
	// event_at < now() − Horizon and the purge deletes event_at < now() −
	// PurgerConfig.Horizon, which NewPurger requires to be ≥ this one
	// (PurgerConfig.Horizon defaults to it): a redelivery either finds its
	// row or is refused, whatever the producer's and the consumer's clocks
	// say. 0 (the default) refuses nothing, and NewPurger then refuses to
	// purge (a purged event would be claimed again). Set it to the
	// longest outbox replay window + the longest queue or dead-letter wait
	// + a margin for incidents.
	Horizon time.Duration

	// MaxFutureSkew bounds how far ahead of the database clock an event may
	// be dated: a claim of an event with event_at > now() + MaxFutureSkew is
	// refused (ErrFuture; the middleware poisons it and logs it at ERROR),
	// since its producer's clock is wrong; see ErrFuture for a database
	// clock stepped back. Only with Horizon > 0. Defaults to
	// DefaultMaxFutureSkew; it must be ≥ 0.
	MaxFutureSkew time.Duration

	// Narrowed says that Horizon is the narrower window AdoptHorizon
	// returned after a purge by a shorter horizon, and TableHorizon is
	// the horizon the table keeps (0: none): a refusal's text names both,
	// so that the window is not read as a misconfiguration.
	Narrowed     bool
	TableHorizon time.Duration

	// Layout is the table's layout: LayoutPlain (default) or
	// LayoutPartitioned (PostgreSQL only; see Layout).
	Layout Layout

	// PartitionSpan is the time span of one partition with
	// LayoutPartitioned: whole minutes, at least one. Defaults to
	// DefaultPartitionSpan (1 h). Rows stay up to one span longer than the
	// purge horizon (a partition goes when its whole span has expired).
	PartitionSpan time.Duration
}

// DefaultMaxFutureSkew is the default Config.MaxFutureSkew: how far ahead of
// the database clock an event's time may be before its claim is refused.
const DefaultMaxFutureSkew = 5 * time.Minute

func (c *Config) setDefaults() {
	if c.Table == "" {
		c.Table = DefaultTable
	}
	if c.MaxFutureSkew == 0 {
		c.MaxFutureSkew = DefaultMaxFutureSkew
	}
	if c.PartitionSpan == 0 {
		c.PartitionSpan = DefaultPartitionSpan
	}
}

// Validate reports the first invalid field of c, naming it.
func (c Config) Validate() error {
	if c.Table != "" {
		id, err := sqldb.ParseIdent(c.Table)
		if err != nil {
			return fmt.Errorf("processed: Config.Table: %w", err)
		}
		if c.Dialect == sqldb.SQLite && id.String() != id.Name() {
			return fmt.Errorf("processed: Config.Table %q: SQLite tables take no schema qualifier (an attached database cannot carry the index)", c.Table)
		}
	}
	if err := c.Dialect.Validate(); err != nil {
		return fmt.Errorf("processed: Config.Dialect: %w", err)
	}
	if c.Horizon < 0 {
		return fmt.Errorf("processed: Config.Horizon %s: must be ≥ 0", c.Horizon)
	}
	if c.MaxFutureSkew < 0 {
		return fmt.Errorf("processed: Config.MaxFutureSkew %s: must be ≥ 0", c.MaxFutureSkew)
	}
	return c.validateLayout()
}

// Store is the processed-event store of one table: it claims (consumer,
// event_id) pairs, answers whether one was processed, migrates its schema and
// purges rows older than a replay horizon. It holds no connection: every
// method takes the sqldb.Querier (transaction or pool) to run on, so the claim
// shares the transaction of the effect. A Store is safe for concurrent use.
type Store struct {
	table   sqldb.Ident
	dialect sqldb.Dialect
	sql     dialectSQL
	horizon time.Duration
	// horizonNote follows the horizon in a refusal's text: why it is
	// narrower than the table's (Config.Narrowed), else "".
	horizonNote string
	skew        time.Duration
	layout      Layout
	span        time.Duration
	other       *otherSQL // LayoutPartitioned: the side table of non-v7 ids
	// readLegacy: the tool queries read <table>_legacy too (ReadLegacy);
	// readV7: <table>_v7.
	readLegacy, readV7 bool
	now                func() time.Time // the process clock of SQLite statements; nil: time.Now (tests set it)

	claimSQL   string
	existsSQL  string
	purgeSQL   string
	verdictSQL string
	identity   identityStatements // payload verification (fingerprint.go)
	// lean is the pgx beginner's claim on the plain PostgreSQL layout
	// (postgresLeanClaim), by [UUIDv7 id][with identity]; hasLean: in use.
	lean    [2][2]string
	hasLean bool
	// leanNear: the same without the window's future arm
	// (ClaimParams.SQLNear), with a horizon only.
	leanNear [2][2]string
	guard    guardStatements // the commit guard (guard.go)
	// v7sql: the statements on <table>_v7 (v7.go), nil off the plain
	// PostgreSQL layout; v7On: UUIDv7 rows are claimed (for v7Consumer,
	// whose id is v7ID) and read there, set once by CheckLean.
	v7sql *v7SQL
	v7On  atomic.Bool
	// v7Both: <table>_v7 exists and the role may read it, but this store
	// does not claim there: its reads of UUIDv7 rows look in both tables.
	v7Both     atomic.Bool
	v7Consumer string
	v7ID       int32
}

// dialectSQL is one dialect's statements and argument encodings (one file per
// dialect: sql_postgres.go, sql_mysql.go, sql_sqlite.go).
type dialectSQL struct {
	// claim inserts (consumer, event_id, event_at); window is the same
	// statement refusing an event_at outside [now − horizon, now + skew]
	// (see NewStore for the
	// format arguments).
	claim, window, exists, purgeBatch string
	// verdict reads, after a claim that inserted nothing, whether the row
	// exists and whether event_at is older than now − horizon (%[2]d µs).
	verdict string
	// eventAt encodes an event time for the claim; nil (unknown) → now().
	eventAt func(time.Time) any
	// windowArgs lays out the window claim's arguments (nil: consumer,
	// event_id, event_at).
	windowArgs      func(consumer, eventID, eventAt any) []any
	purgeArgs       func(horizon time.Duration, limit int) []any
	lockTimeout     func(time.Duration) (string, []any) // nil: none
	tryLock, unlock string                              // one parameter, the table; "": in-process lock only
	eventID         func(uuid.UUID) any
	// processClock: the statements take the process clock as parameters
	// instead of reading a database clock (SQLite, in-process; see
	// sql_sqlite.go): the claims after event_at, the verdict after it,
	// the purge as its cutoff.
	processClock bool
}

func sqlFor(d sqldb.Dialect) dialectSQL {
	switch d {
	case sqldb.MySQL:
		return mysqlSQL
	case sqldb.SQLite:
		return sqliteSQL
	default:
		return postgresSQL
	}
}

// NewStore validates cfg (on a copy with defaults applied) and builds the SQL
// text once.
func NewStore(cfg Config) (*Store, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	table, _ := sqldb.ParseIdent(cfg.Table)
	q := table.Quoted(cfg.Dialect.QuoteChar())
	d := sqlFor(cfg.Dialect)
	s := &Store{
		table:       table,
		dialect:     cfg.Dialect,
		sql:         d,
		layout:      cfg.Layout,
		span:        cfg.PartitionSpan,
		horizon:     cfg.Horizon.Truncate(time.Microsecond),
		horizonNote: narrowedNote(cfg),
		skew:        cfg.MaxFutureSkew.Truncate(time.Microsecond),
		claimSQL:    fmt.Sprintf(d.claim, q),
		existsSQL:   fmt.Sprintf(d.exists, q),
		purgeSQL:    fmt.Sprintf(d.purgeBatch, q),
		identity:    newIdentityStatements(cfg.Dialect, q),
	}
	// %[2]d, %[3]d: horizon and skew in microseconds (SQLite takes its
	// bounds as parameters).
	window := func(text string) string {
		return fmt.Sprintf(text, q, s.horizon.Microseconds(), s.skew.Microseconds())
	}
	s.verdictSQL = window(d.verdict)
	if s.horizon > 0 {
		s.claimSQL = window(d.window)
	}
	if s.layout == LayoutPartitioned {
		s.initPartitioned()
		s.identity.storedOther = "SELECT event_name, fingerprint FROM " + s.sibling("other") + " WHERE consumer = $1 AND event_id = $2"
	}
	if s.dialect == sqldb.PostgreSQL && s.layout != LayoutPartitioned {
		for v7 := 0; v7 < 2; v7++ {
			for id := 0; id < 2; id++ {
				s.lean[v7][id] = postgresLeanClaim(q, v7 == 1, id == 1, true, s.horizon, s.skew)
				if s.horizon > 0 {
					s.leanNear[v7][id] = postgresLeanClaim(q, v7 == 1, id == 1, false, s.horizon, s.skew)
				}
			}
		}
		s.hasLean = true
		if len(s.table.Name()) <= v7MaxName {
			s.initV7()
		}
	}
	s.guard = newGuardStatements(s)
	if s.dialect == sqldb.PostgreSQL {
		three := []any{nil, nil, nil}
		s.identity.claim, _ = withIdentityColumns(s.claimSQL, three, "", nil)
		if s.other != nil {
			s.identity.claimOther, _ = withIdentityColumns(s.other.claim, three, "", nil)
		}
	}
	return s, nil
}

// Horizon is Config.Horizon (0: the claim refuses nothing).
func (s *Store) Horizon() time.Duration { return s.horizon }

// MaxFutureSkew is Config.MaxFutureSkew with its default applied.
func (s *Store) MaxFutureSkew() time.Duration { return s.skew }

// Table is the store's validated table identifier.
func (s *Store) Table() sqldb.Ident { return s.table }

// Dialect is the store's SQL dialect.
func (s *Store) Dialect() sqldb.Dialect { return s.dialect }

// ClaimQuery returns the claim statement and its arguments for (consumer,
// eventID) with no event time but the id's own (ClaimQueryAt with a zero
// time). Most callers want Claim.
func (s *Store) ClaimQuery(consumer string, eventID uuid.UUID) (string, []any) {
	return s.ClaimQueryAt(consumer, eventID, time.Time{})
}

// ClaimQueryAt returns the claim statement and its arguments for (consumer,
// eventID) dated at: rows affected 1 for a claim, 0 for a duplicate or (with
// Config.Horizon > 0) an event refused as expired or future, which Verdict
// tells apart. The event's time is its UUIDv7 timestamp when eventID is a
// UUIDv7 (at is then ignored), else at, else (at zero) unknown: the row is
// dated with the database clock and the event is never refused. It is
// exported for drivers that send it in a pipeline with BEGIN (see the
// middleware's pgx beginner); most callers want ClaimAt.
func (s *Store) ClaimQueryAt(consumer string, eventID uuid.UUID, at time.Time) (string, []any) {
	id, t := s.sql.eventID(eventID), s.eventAtArg(eventID, at)
	if s.claimsV7(consumer, eventID) {
		return s.v7sql.claim[0], []any{s.v7ID, id, t}
	}
	if s.routed(eventID) {
		return s.other.claim, []any{consumer, id, t}
	}
	if s.horizon > 0 && s.sql.windowArgs != nil {
		return s.claimSQL, s.sql.windowArgs(consumer, id, t)
	}
	if s.sql.processClock {
		return s.claimSQL, append([]any{consumer, id, t}, s.sqliteClock(s.horizon > 0)...)
	}
	return s.claimSQL, []any{consumer, id, t}
}

// EventTime is the time the store dates eventID's row with: the UUIDv7
// timestamp (milliseconds) for a UUIDv7, else at; ok=false when neither
// gives one (at zero).
func EventTime(eventID uuid.UUID, at time.Time) (time.Time, bool) {
	if eventID.Version() == 7 {
		sec, nsec := eventID.Time().UnixTime()
		return time.Unix(sec, nsec).UTC(), true
	}
	if at.IsZero() {
		return time.Time{}, false
	}
	return at.UTC(), true
}

func (s *Store) eventAtArg(eventID uuid.UUID, at time.Time) any {
	t, ok := EventTime(eventID, at)
	if !ok {
		return nil
	}
	return s.sql.eventAt(t)
}

// LockTimeoutQuery returns the statement that bounds lock waits to d in the
// current transaction (PostgreSQL: SET LOCAL lock_timeout = '<d>ms';
// MySQL: the session's innodb_lock_wait_timeout, whole seconds), or ok=false
// when the dialect has none (SQLite: the driver's busy_timeout applies).
func (s *Store) LockTimeoutQuery(d time.Duration) (query string, args []any, ok bool) {
	if s.sql.lockTimeout == nil {
		return "", nil, false
	}
	q, a := s.sql.lockTimeout(d)
	return q, a, true
}

// ErrNilEventID is returned by Claim for the nil UUID, which no producer may
// use (RFC 9562 §5.9): a nil id would make every such event one duplicate.
var ErrNilEventID = errors.New("processed: nil event_id")

// ErrEmptyConsumer is returned by Claim when consumer is "".
var ErrEmptyConsumer = errors.New("processed: empty consumer")

// Claim is ClaimAt with no event time but the id's own.
func (s *Store) Claim(ctx context.Context, q sqldb.Querier, consumer string, eventID uuid.UUID) (bool, error) {
	return s.ClaimAt(ctx, q, consumer, eventID, time.Time{})
}

// ClaimAt records (consumer, eventID) in q's transaction with one INSERT …
// ON CONFLICT DO NOTHING and reports whether this call inserted it. false
// with a nil error means the event was already processed by that consumer
// (or is being processed and committed while we waited on the primary key):
// the caller must not apply the effect. The row becomes visible to others,
// and final, only when q's transaction commits; a rollback releases the
// claim with the effects.
//
// With Config.Horizon > 0 the same statement refuses an event dated (see
// ClaimQueryAt) before now() − Horizon or after now() + MaxFutureSkew by the
// database clock: false and an error wrapping ErrExpired or ErrFuture
// (a *RefusedError), found by one more statement (Verdict) that runs only
// when nothing was inserted.
//
// Run it on a transaction. On a pool the claim commits by itself at once,
// which loses the guarantee (a failure after it would drop the event).
func (s *Store) ClaimAt(ctx context.Context, q sqldb.Querier, consumer string, eventID uuid.UUID, at time.Time) (bool, error) {
	ok, err := s.TryClaimAt(ctx, q, consumer, eventID, at)
	if err != nil || ok {
		return ok, err
	}
	return false, s.Verdict(ctx, q, consumer, eventID, at)
}

// TryClaimAt runs the claim statement alone (ClaimQueryAt): true when it
// inserted the row; false for a duplicate or a refused event, which Verdict
// tells apart.
func (s *Store) TryClaimAt(ctx context.Context, q sqldb.Querier, consumer string, eventID uuid.UUID, at time.Time) (bool, error) {
	if consumer == "" {
		return false, ErrEmptyConsumer
	}
	if eventID == uuid.Nil {
		return false, ErrNilEventID
	}
	query, args := s.ClaimQueryAt(consumer, eventID, at)
	n, err := q.Exec(ctx, query, args...)
	if err != nil {
		return false, fmt.Errorf("processed: claim %s/%s: %w", consumer, eventID, err)
	}
	return n == 1, nil
}

// ErrExpired: the claim refused an event dated before now() − Horizon by the
// database clock; its row may already be purged, so applying it could apply
// it twice. Permanent.
var ErrExpired = errors.New("processed: event older than the replay horizon")

// ErrFuture: the claim refused an event dated after now() +
// MaxFutureSkew by the database clock (its producer's clock is wrong).
// Permanent. The pgx beginner's claim over a direct connection leaves that
// bound to the database clock the connection last read (ClaimParams.SQLNear):
// a database clock stepped back since lets an event up to that step beyond
// it through.
var ErrFuture = errors.New("processed: event dated too far in the future")

// RefusedError is the error of a refused claim: it wraps ErrExpired or
// ErrFuture and carries the times the verdict was judged with.
type RefusedError struct {
	Reason   error     // ErrExpired or ErrFuture
	EventID  uuid.UUID // the refused event
	EventAt  time.Time // the event's time (ClaimQueryAt)
	Horizon  time.Duration
	MaxSkew  time.Duration
	Database time.Time // the database clock (now()) of the verdict
	// horizonNote: Store.horizonNote.
	horizonNote string
}

func (e *RefusedError) Error() string {
	return fmt.Sprintf("%v: event %s dated %s, database clock %s, horizon %s%s, max future skew %s",
		e.Reason, e.EventID, e.EventAt.UTC().Format(time.RFC3339Nano), e.Database.UTC().Format(time.RFC3339Nano), e.Horizon, e.horizonNote, e.MaxSkew)
}

// narrowedNote is what a refusal says after a horizon AdoptHorizon
// narrowed (cfg.Narrowed): why, and what the table keeps; "" otherwise.
func narrowedNote(cfg Config) string {
	switch {
	case !cfg.Narrowed:
		return ""
	case cfg.TableHorizon > 0:
		return " (the time since the table was purged by a shorter horizon, as of this consumer's start; the table keeps " +
			cfg.TableHorizon.String() + ": a consumer started once the purged rows are that old gets the whole horizon)"
	}
	return " (the time since the table was last purged, as of this consumer's start; the table keeps none now: " +
		"a consumer started later gets a longer window, never one that reaches before that purge)"
}

func (e *RefusedError) Unwrap() error { return e.Reason }

// Verdict explains a claim (TryClaimAt, or ClaimQueryAt's statement) that
// inserted nothing, on the same transaction: nil when the row exists (a
// duplicate), or a *RefusedError wrapping ErrExpired or ErrFuture. When the
// row does not exist the claim refused the event: it is expired when its
// time is older than now() − Horizon now, otherwise it was in the future
// (a purge only removes rows that are expired, so a row cannot have
// vanished in between otherwise). Without Horizon or an event time it
// returns nil at once, without a statement.
func (s *Store) Verdict(ctx context.Context, q sqldb.Querier, consumer string, eventID uuid.UUID, at time.Time) error {
	t, ok := EventTime(eventID, at)
	if s.horizon <= 0 || !ok {
		return nil
	}
	var exists, expired bool
	var clock string
	verdict := s.verdictSQL
	if s.routed(eventID) {
		verdict = s.other.verdict
	}
	if r := s.v7ReadOf(consumer, eventID); r != nil {
		verdict = r.verdict
	}
	args := []any{consumer, s.sql.eventID(eventID), s.sql.eventAt(t)}
	if s.sql.processClock {
		now := s.clock()
		args = append(args, sqldb.SQLiteTime(now.Add(-s.horizon)), sqldb.SQLiteTime(now))
	}
	err := q.QueryRow(ctx, verdict, args...).Scan(&exists, &expired, &clock)
	if s.FoldedV7(eventID, err) {
		return s.Verdict(ctx, q, consumer, eventID, at)
	}
	if err != nil {
		return fmt.Errorf("processed: claim verdict %s/%s: %w", consumer, eventID, err)
	}
	now, _ := time.Parse(time.RFC3339Nano, clock) // for the error text only
	if exists {
		return nil
	}
	e := &RefusedError{Reason: ErrFuture, EventID: eventID, EventAt: t, Horizon: s.horizon, MaxSkew: s.skew, Database: now, horizonNote: s.horizonNote}
	if expired {
		e.Reason = ErrExpired
	}
	return e
}

// Processed reports whether (consumer, eventID) has a committed row visible to q.
func (s *Store) Processed(ctx context.Context, q sqldb.Querier, consumer string, eventID uuid.UUID) (bool, error) {
	var ok bool
	exists := s.existsSQL
	if s.routed(eventID) {
		exists = s.other.exists
	}
	if r := s.v7ReadOf(consumer, eventID); r != nil {
		exists = r.exists
	}
	err := q.QueryRow(ctx, exists, consumer, s.sql.eventID(eventID)).Scan(&ok)
	if s.FoldedV7(eventID, err) {
		return s.Processed(ctx, q, consumer, eventID)
	}
	if err != nil {
		return false, fmt.Errorf("processed: lookup %s/%s: %w", consumer, eventID, err)
	}
	return ok, nil
}

// PurgeBatch deletes at most limit rows whose event_at is older than the
// database's now() minus horizon (on SQLite the process clock, in
// microseconds), in one statement (one short transaction when
// q is a pool), and returns how many it deleted. Rows locked by a concurrent
// transaction are skipped, never waited on. horizon is truncated to whole
// microseconds; limit must be > 0.
func (s *Store) PurgeBatch(ctx context.Context, q sqldb.Querier, horizon time.Duration, limit int) (int64, error) {
	if limit <= 0 {
		return 0, fmt.Errorf("processed: purge limit %d: must be > 0", limit)
	}
	if horizon < 0 {
		return 0, fmt.Errorf("processed: purge horizon %s: must be ≥ 0", horizon)
	}
	var n int64
	var err error
	var args []any
	if s.sql.processClock {
		args = []any{sqldb.SQLiteTime(s.clock().Add(-horizon.Truncate(time.Microsecond))), limit}
	} else {
		args = s.sql.purgeArgs(horizon, limit)
	}
	if s.layout == LayoutPartitioned {
		err = q.QueryRow(ctx, s.purgeSQL, args...).Scan(&n)
	} else {
		n, err = q.Exec(ctx, s.purgeSQL, args...)
	}
	if err != nil {
		return 0, fmt.Errorf("processed: purge: %w", err)
	}
	return n, nil
}
