package versioned

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"path"
	"strings"
	"time"

	"github.com/watermill-idempotency/idempotency"

	"github.com/google/uuid"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// LatestStore keeps the latest recorded position of each family: the
// producer side advances it (LatestPublisher), the consumer side reads it
// (LatestFilter). Two implementations ship: *FamilyStore (PostgreSQL,
// MySQL/MariaDB or SQLite; the default) and *redislatest.Store (module versioned/redislatest). Implementations
// must be safe for concurrent use.
//
// The invariant every implementation keeps, and on which "never drop the
// latest message" rests: a record never moves backwards, and it only ever
// names a message that exists (was published, or committed into an outbox).
// Losing a record (expiry, restart, purge) is allowed: the filter then lets
// messages through.
type LatestStore interface {
	// Advance sets f's latest position to pos when pos is newer than the
	// recorded one (or none is recorded), atomically with respect to other
	// Advance calls, and reports whether it did. q is the transaction to
	// write in for a Transactional store; other stores ignore it.
	Advance(ctx context.Context, q sqldb.Querier, f Family, pos Position) (advanced bool, err error)

	// Latest returns f's latest recorded position; ok is false when none is
	// recorded. q is as for Advance.
	Latest(ctx context.Context, q sqldb.Querier, f Family) (pos Position, ok bool, err error)

	// Transactional reports whether Advance and Latest run on q, so that
	// they commit and roll back with the caller's transaction. For a store
	// that is not, the publisher records after the message is out (or after
	// the commit: LatestPublisherConfig.Deferred) and the filter tolerates
	// its errors by letting the message through.
	Transactional() bool
}

// Family store defaults (FamilyStoreConfig).
const (
	// DefaultLatestTable holds the latest position of each family.
	DefaultLatestTable = "family_latest"
	// DefaultAppliedTable holds each consumer's last applied position of each family.
	DefaultAppliedTable = "family_applied"
)

// FamilyStoreConfig configures a FamilyStore.
type FamilyStoreConfig struct {
	// LatestTable is the table of latest positions, "name" or "schema.name"
	// (each part [A-Za-z_][A-Za-z0-9_]{0,62}). Producers write it and
	// consumers read it, so both must reach the same table: the same
	// database, or see LatestFilterConfig.LatestDB. Defaults to
	// DefaultLatestTable.
	LatestTable string

	// AppliedTable is the table of each consumer's last applied positions,
	// in the consumer's database (written in its handler's transaction).
	// Defaults to DefaultAppliedTable.
	AppliedTable string

	// Dialect is the SQL dialect: idempotency.PostgreSQL, idempotency.MySQL (MySQL
	// 8.0+, MariaDB 10.11+; the DSN must keep clientFoundRows off, which
	// Migrate checks) or idempotency.SQLite. Defaults to idempotency.PostgreSQL.
	Dialect sqldb.Dialect
}

func (c *FamilyStoreConfig) setDefaults() {
	if c.LatestTable == "" {
		c.LatestTable = DefaultLatestTable
	}
	if c.AppliedTable == "" {
		c.AppliedTable = DefaultAppliedTable
	}
}

// Validate reports the first invalid field of c, naming it.
func (c FamilyStoreConfig) Validate() error {
	if c.LatestTable != "" {
		if _, err := sqldb.ParseIdent(c.LatestTable); err != nil {
			return fmt.Errorf("versioned: FamilyStoreConfig.LatestTable: %w", err)
		}
	}
	if c.AppliedTable != "" {
		if _, err := sqldb.ParseIdent(c.AppliedTable); err != nil {
			return fmt.Errorf("versioned: FamilyStoreConfig.AppliedTable: %w", err)
		}
	}
	if c.LatestTable != "" && c.LatestTable == c.AppliedTable {
		return fmt.Errorf("versioned: FamilyStoreConfig.AppliedTable %q: must differ from LatestTable", c.AppliedTable)
	}
	if err := c.Dialect.Validate(); err != nil {
		return fmt.Errorf("versioned: FamilyStoreConfig.Dialect: %w", err)
	}
	return nil
}

// FamilyStore is the SQL store of the latest-per-family filter: the latest
// table (a LatestStore, Transactional) and the applied table, on PostgreSQL,
// MySQL/MariaDB or SQLite. It holds no connection: every method takes the
// sqldb.Querier to run on, so records commit or roll back with the caller's
// transaction. Safe for concurrent use.
//
// What differs per dialect: the filter's verdict (check) is one statement on
// PostgreSQL (a data-modifying CTE) and two on MySQL and SQLite, a plain read
// of the latest table then the applied upsert, in the handler's transaction;
// the guarantees are the same (a stale read of the latest record only lets a
// message through to the applied check, which is the one that serialises).
// MySQL's upserts report through rows affected (clientFoundRows must be off);
// racing first records of one family can end in an InnoDB deadlock error
// (1213, transient: the producer's or handler's transaction is retried) when
// one of the racers rolls back; its purge waits for rows a writer holds
// instead of skipping them. SQLite's purge lock is per process.
type FamilyStore struct {
	latest, applied sqldb.Ident
	retired         sqldb.Ident // applied + "_retired" (latest_retire.go)
	dialect         sqldb.Dialect
	sql             familySQL
}

var _ LatestStore = (*FamilyStore)(nil)

// NewFamilyStore validates cfg (on a copy with defaults applied) and builds
// the SQL text once. It does not touch the database: run Migrate, or apply
// FamilyMigrationsFS with a migration tool.
func NewFamilyStore(cfg FamilyStoreConfig) (*FamilyStore, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	latest, _ := sqldb.ParseIdent(cfg.LatestTable)
	applied, _ := sqldb.ParseIdent(cfg.AppliedTable)
	retired, err := retiredTable(applied)
	if err != nil {
		return nil, fmt.Errorf("versioned: FamilyStoreConfig.AppliedTable: %w", err)
	}
	q, err := familySQLFor(cfg.Dialect, latest, applied, retired)
	if err != nil {
		return nil, fmt.Errorf("versioned: FamilyStoreConfig.Dialect: %w", err)
	}
	return &FamilyStore{latest: latest, applied: applied, retired: retired, dialect: cfg.Dialect, sql: q}, nil
}

// latestTable is the store's validated latest table.
func (s *FamilyStore) latestTable() sqldb.Ident { return s.latest }

// appliedTable is the store's validated applied table.
func (s *FamilyStore) appliedTable() sqldb.Ident { return s.applied }

// Transactional reports true: Advance and Latest run on the given Querier.
func (s *FamilyStore) Transactional() bool { return true }

// Advance moves f's latest record to pos when pos is newer, in one
// statement on q (the producer's transaction, so the record commits with the
// outbox row of the message), and reports whether it moved. Concurrent
// producers of one family serialise on the row lock until their
// transactions end; at READ COMMITTED the newest position wins whatever the
// commit order. Errors: ErrFamilyInvalid (wrapped) for an invalid f or a nil
// event id; database errors wrapped with %w.
func (s *FamilyStore) Advance(ctx context.Context, q sqldb.Querier, f Family, pos Position) (bool, error) {
	if err := checkArgs(f, pos); err != nil {
		return false, err
	}
	var seq *int64
	var at *time.Time
	if pos.HasSeq {
		seq = &pos.Seq
	} else {
		at = &pos.At
	}
	moved, err := s.upsert(ctx, q, s.sql.advance, s.sql.advanceArgs(f.Kind, f.ID, pos.key(), s.sql.eventID(pos.EventID), seq, at))
	if err != nil {
		return false, fmt.Errorf("versioned: advance latest of %s: %w", f, err)
	}
	return moved, nil
}

// Latest returns f's latest recorded position as visible to q; ok is false
// when none is.
func (s *FamilyStore) Latest(ctx context.Context, q sqldb.Querier, f Family) (Position, bool, error) {
	var key []byte
	err := q.QueryRow(ctx, s.sql.latest, f.Kind, f.ID).Scan(&key)
	switch {
	case errors.Is(err, sqldb.ErrNoRows):
		return Position{}, false, nil
	case err != nil:
		return Position{}, false, fmt.Errorf("versioned: latest of %s: %w", f, err)
	}
	var p Position
	if err := p.UnmarshalBinary(key); err != nil {
		return Position{}, false, fmt.Errorf("versioned: latest of %s: %w", f, err)
	}
	return p, true, nil
}

// recordApplied records, on q (the handler's transaction), that consumer
// applies the message at pos of family f, when pos is newer than the last
// one it applied; recorded is false (stale) when it is not. The row stays
// locked until q's transaction ends: a concurrent RecordApplied of the same
// consumer and family waits (bounded by the transaction's lock_timeout), then
// compares with what committed. LatestFilter calls it; call it directly
// only when not using the filter.
func (s *FamilyStore) recordApplied(ctx context.Context, q sqldb.Querier, consumer string, f Family, pos Position) (recorded bool, err error) {
	if consumer == "" {
		return false, errors.New("versioned: RecordApplied: empty consumer")
	}
	if err := checkArgs(f, pos); err != nil {
		return false, err
	}
	recorded, err = s.upsertApplied(ctx, q, consumer, f, pos)
	if err != nil {
		return false, fmt.Errorf("versioned: record applied %s of %s: %w", consumer, f, err)
	}
	return recorded, nil
}

func (s *FamilyStore) upsertApplied(ctx context.Context, q sqldb.Querier, consumer string, f Family, pos Position) (bool, error) {
	return s.upsert(ctx, q, s.sql.applied, s.sql.appliedArgs(consumer, f.Kind, f.ID, pos.key(), s.sql.eventID(pos.EventID)))
}

// upsert runs the advance or applied statement and reports whether it
// wrote: a returned row, or rows affected (MySQL: 1 inserted, 2 updated).
func (s *FamilyStore) upsert(ctx context.Context, q sqldb.Querier, query string, args []any) (bool, error) {
	if !s.sql.returning {
		n, err := q.Exec(ctx, query, args...)
		return n > 0, err
	}
	var one any
	err := q.QueryRow(ctx, query, args...).Scan(&one)
	if errors.Is(err, sqldb.ErrNoRows) {
		return false, nil
	}
	return err == nil, err
}

// verdict is what the filter decides for one message.
type verdict int

const (
	verdictHandle verdict = iota + 1
	verdictObsolete
	verdictStale
)

// check is the filter's verdict with the latest table read on q: obsolete
// (latest record newer, nothing written), stale (not newer than the
// consumer's last applied one) or handle (recorded). One round trip on
// PostgreSQL; on the other dialects the read of the latest table, then the
// applied upsert, in q's transaction.
func (s *FamilyStore) check(ctx context.Context, q sqldb.Querier, consumer string, f Family, pos Position) (verdict, error) {
	var obsolete, recorded bool
	var err error
	if s.sql.check != "" {
		err = q.QueryRow(ctx, s.sql.check, consumer, f.Kind, f.ID, pos.key(), s.sql.eventID(pos.EventID)).Scan(&obsolete, &recorded)
	} else if err = q.QueryRow(ctx, s.sql.newer, f.Kind, f.ID, pos.key(), consumer).Scan(&obsolete); err == nil && !obsolete {
		recorded, err = s.upsertApplied(ctx, q, consumer, f, pos)
	}
	switch {
	case err != nil:
		return 0, fmt.Errorf("versioned: filter %s of %s: %w", consumer, f, err)
	case obsolete:
		return verdictObsolete, nil
	case !recorded:
		return verdictStale, nil
	}
	return verdictHandle, nil
}

// purgeBatch deletes at most limit rows idle for longer than horizon (by the
// database clock: updated_at < now() - horizon) from the latest table, then,
// within what is left of limit, from the applied table, then from the
// retired table, and returns how many it deleted. A retired row was written
// after the latest record naming its message, so it goes after it: once
// idle, that latest record is gone or names a newer message. Each table's DELETE is one statement (one short transaction on
// a pool); rows locked by a writer are skipped. horizon is truncated to whole
// microseconds; limit must be > 0.
func (s *FamilyStore) purgeBatch(ctx context.Context, q sqldb.Querier, horizon time.Duration, limit int) (int64, error) {
	if limit <= 0 {
		return 0, fmt.Errorf("versioned: purge limit %d: must be > 0", limit)
	}
	if horizon < 0 {
		return 0, fmt.Errorf("versioned: purge horizon %s: must be ≥ 0", horizon)
	}
	n, err := q.Exec(ctx, s.sql.purgeLatest, s.sql.purgeArgs(horizon, int64(limit))...)
	if err != nil {
		return 0, fmt.Errorf("versioned: purge %s: %w", s.latest, err)
	}
	if n >= int64(limit) {
		return n, nil
	}
	m, err := q.Exec(ctx, s.sql.purgeApplied, s.sql.purgeArgs(horizon, int64(limit)-n)...)
	if err != nil {
		return n, fmt.Errorf("versioned: purge %s: %w", s.applied, err)
	}
	if n += m; n >= int64(limit) {
		return n, nil
	}
	r, err := q.Exec(ctx, s.sql.purgeRetired, s.sql.purgeArgs(horizon, int64(limit)-n)...)
	if err != nil {
		return n, fmt.Errorf("versioned: purge %s: %w", s.retired, err)
	}
	return n + r, nil
}

func checkArgs(f Family, pos Position) error {
	if err := f.Validate(); err != nil {
		return err
	}
	if pos.EventID == uuid.Nil {
		return fmt.Errorf("%w: nil event id", ErrFamilyInvalid)
	}
	return nil
}

// Migrations.

//go:embed migrations
var familyMigrationFiles embed.FS

// familyMigration is one versioned schema change of a FamilyStore, rendered
// for its tables (Version, Name "0001_create_family_tables.up.sql", SQL).
type familyMigration = sqldb.Migration

// migrations returns the store's migrations in version order, rendered for
// its tables. Each is idempotent (IF NOT EXISTS), so running one twice is safe.
func (s *FamilyStore) migrations() ([]familyMigration, error) {
	q := s.dialect.QuoteChar()
	// SQLite's CREATE INDEX takes the schema on the index's name and an
	// unqualified table: *Schema is the quoted schema and a dot (or ""),
	// *Bare the quoted table without its schema.
	schemaOf := func(id sqldb.Ident) string {
		if id.String() == id.Name() {
			return ""
		}
		schema, _, _ := strings.Cut(id.String(), ".")
		return string(q) + schema + string(q) + "."
	}
	bare := func(id sqldb.Ident) string { return string(q) + id.Name() + string(q) }
	data := struct {
		Latest, LatestName, Applied, AppliedName             string
		LatestSchema, LatestBare, AppliedSchema, AppliedBare string
		Retired                                              string
	}{
		Latest:        s.latest.Quoted(q),
		LatestName:    s.latest.Name(),
		Applied:       s.applied.Quoted(q),
		AppliedName:   s.applied.Name(),
		LatestSchema:  schemaOf(s.latest),
		LatestBare:    bare(s.latest),
		AppliedSchema: schemaOf(s.applied),
		AppliedBare:   bare(s.applied),
		Retired:       s.retired.Quoted(q),
	}
	ms, err := sqldb.RenderMigrations(familyMigrationFiles, path.Join("migrations", s.dialect.String()), data)
	if err != nil {
		return nil, fmt.Errorf("versioned: %w", err)
	}
	return ms, nil
}

// FamilyMigrationsFS returns the migrations for the given tables (defaults
// as in FamilyStoreConfig when "") as an fs.FS of files named
// "NNNN_name.up.sql" at its root, the layout golang-migrate reads; each file
// also starts with a "-- +goose Up" annotation for goose. Use it when a
// migration tool, not Migrate, owns the schema.
func FamilyMigrationsFS(latestTable, appliedTable string, dialect sqldb.Dialect) (fs.FS, error) {
	s, err := NewFamilyStore(FamilyStoreConfig{LatestTable: latestTable, AppliedTable: appliedTable, Dialect: dialect})
	if err != nil {
		return nil, err
	}
	ms, err := s.migrations()
	if err != nil {
		return nil, err
	}
	return sqldb.ComponentFS(ms, sqldb.VersionBaseVersioned), nil
}

// Migrate applies the store's migrations in version order and records each
// in the idempotency_migration table (component
// "versioned-family:<latest>,<applied>"), with sqldb.Migrate: on PostgreSQL
// each migration is one script in one implicit transaction behind a
// transaction-scoped advisory lock derived from the component; on MySQL and
// SQLite statement by statement, each idempotent (IF NOT EXISTS); either way
// it is safe to run from several instances at once. Run it on a pool or
// connection, not inside a transaction of yours. Both tables are created in
// q's database: where the latest table belongs to another service, the
// consumer's Migrate creates an unused one, which is harmless. On MySQL it
// then checks that q's DSN keeps clientFoundRows off (ErrMySQLFoundRows).
func (s *FamilyStore) Migrate(ctx context.Context, db idempotency.DB) error {
	h, err := sqldb.HandleOf(db)
	if err != nil {
		return fmt.Errorf("versioned: Migrate: %w", err)
	}
	q := h.Querier()
	ms, err := s.migrations()
	if err != nil {
		return err
	}
	component := "versioned-family:" + s.latest.String() + "," + s.applied.String()
	if err := sqldb.MigrateTable(ctx, q, s.dialect, s.applied, component, ms); err != nil {
		return fmt.Errorf("versioned: %w", err)
	}
	// The latest table may live in another schema than the applied one:
	// its own record beside it, so that losing that schema (or the table)
	// applies the (idempotent) migrations again. In one schema, the second
	// record sits next to the first and runs nothing more.
	if err := sqldb.MigrateTable(ctx, q, s.dialect, s.latest, component+":latest", ms); err != nil {
		return fmt.Errorf("versioned: %w", err)
	}
	if s.dialect != sqldb.PostgreSQL {
		return nil
	}
	for _, k := range []struct {
		table sqldb.Ident
		cols  []string
	}{{s.latest, []string{"family_kind", "family_id"}}, {s.applied, []string{"consumer", "family_kind", "family_id"}}} {
		ok, err := sqldb.HasUniqueKey(ctx, q, k.table.Quoted('"'), k.cols...)
		if err != nil {
			return fmt.Errorf("versioned: migrate: %w", err)
		}
		if !ok {
			return fmt.Errorf("%w: table %s, key %v", ErrNoFamilyKey, k.table, k.cols)
		}
	}
	return nil
}

// ErrNoFamilyKey is returned by FamilyStore.Migrate on PostgreSQL when the
// latest table has no unique index on exactly (family_kind, family_id), or
// the applied table none on exactly (consumer, family_kind, family_id):
// the store's upserts (ON CONFLICT on that key) would then insert a second
// row for one family. It happens when a user partitions a table by a column
// outside the key (range on updated_at, say: PostgreSQL requires the
// partition key in the primary key). Partition by hash or range on a key
// column instead.
var ErrNoFamilyKey = errors.New("versioned: no unique index on exactly the family key")

// ErrMySQLFoundRows is returned (wrapped) by FamilyStore.Migrate on MySQL when
// the connection counts found rows rather than changed rows
// (go-sql-driver/mysql's clientFoundRows=true): the MySQL upserts of this
// package (FamilyStore, Upsert) read their outcome from rows affected and
// would report a row left unchanged as written. It is sqldb.ErrMySQLFoundRows.
var ErrMySQLFoundRows = sqldb.ErrMySQLFoundRows
