package processed

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"

	"github.com/watermill-idempotency/idempotency/sqldb"
)

// DefaultTable is the processed-event table used when Config.Table is empty.
const DefaultTable = "processed_event"

// Config configures a Store.
type Config struct {
	// Table is the processed-event table, "name" or "schema.name"; each part
	// must match [A-Za-z_][A-Za-z0-9_]{0,62}. It is validated and quoted once,
	// in NewStore. Defaults to DefaultTable.
	Table string

	// Dialect is the SQL dialect. Defaults to sqldb.PostgreSQL.
	Dialect sqldb.Dialect
}

func (c *Config) setDefaults() {
	if c.Table == "" {
		c.Table = DefaultTable
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
	return nil
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

	claimSQL  string
	existsSQL string
	purgeSQL  string
	identity  identityStatements // payload verification (fingerprint.go)
}

// dialectSQL is one dialect's statements and argument encodings (one file per
// dialect: sql_postgres.go, sql_mysql.go, sql_sqlite.go).
type dialectSQL struct {
	claim, exists, purgeBatch string
	purgeArgs                 func(horizon time.Duration, limit int) []any
	lockTimeout               func(time.Duration) (string, []any) // nil: none
	tryLock, unlock           string                              // one parameter, the table; "": in-process lock only
	eventID                   func(uuid.UUID) any
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
	return &Store{
		table:     table,
		dialect:   cfg.Dialect,
		sql:       d,
		claimSQL:  fmt.Sprintf(d.claim, q),
		existsSQL: fmt.Sprintf(d.exists, q),
		purgeSQL:  fmt.Sprintf(d.purgeBatch, q),
		identity:  newIdentityStatements(cfg.Dialect, q),
	}, nil
}

// Table is the store's validated table identifier.
func (s *Store) Table() sqldb.Ident { return s.table }

// Dialect is the store's SQL dialect.
func (s *Store) Dialect() sqldb.Dialect { return s.dialect }

// ClaimQuery returns the claim statement and its arguments for (consumer,
// eventID): rows affected 1 for a claim and 0 for a duplicate. It is exported
// for drivers that send it in a pipeline with BEGIN (see the middleware's pgx
// beginner); most callers want Claim.
func (s *Store) ClaimQuery(consumer string, eventID uuid.UUID) (string, []any) {
	return s.claimSQL, []any{consumer, s.sql.eventID(eventID)}
}

// LockTimeoutQuery returns the statement that bounds lock waits to d in the
// current transaction (PostgreSQL: set_config('lock_timeout', …, true);
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

// Claim records (consumer, eventID) in q's transaction with one INSERT … ON
// CONFLICT DO NOTHING and reports whether this call inserted it. false means
// the event was already processed by that consumer (or is being processed and
// committed while we waited on the primary key): the caller must not apply
// the effect. The row becomes visible to others, and final, only when q's
// transaction commits; a rollback releases the claim with the effects.
//
// Run it on a transaction. On a pool the claim commits by itself at once,
// which loses the guarantee (a failure after it would drop the event).
func (s *Store) Claim(ctx context.Context, q sqldb.Querier, consumer string, eventID uuid.UUID) (bool, error) {
	if consumer == "" {
		return false, ErrEmptyConsumer
	}
	if eventID == uuid.Nil {
		return false, ErrNilEventID
	}
	n, err := q.Exec(ctx, s.claimSQL, consumer, s.sql.eventID(eventID))
	if err != nil {
		return false, fmt.Errorf("processed: claim %s/%s: %w", consumer, eventID, err)
	}
	return n == 1, nil
}

// Processed reports whether (consumer, eventID) has a committed row visible to q.
func (s *Store) Processed(ctx context.Context, q sqldb.Querier, consumer string, eventID uuid.UUID) (bool, error) {
	var ok bool
	if err := q.QueryRow(ctx, s.existsSQL, consumer, s.sql.eventID(eventID)).Scan(&ok); err != nil {
		return false, fmt.Errorf("processed: lookup %s/%s: %w", consumer, eventID, err)
	}
	return ok, nil
}

// PurgeBatch deletes at most limit rows whose processed_at is older than the
// database's now() minus horizon, in one statement (one short transaction when
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
	n, err := q.Exec(ctx, s.purgeSQL, s.sql.purgeArgs(horizon, limit)...)
	if err != nil {
		return 0, fmt.Errorf("processed: purge: %w", err)
	}
	return n, nil
}
