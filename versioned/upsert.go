package versioned

import (
	"context"
	"database/sql/driver"
	"errors"
	"fmt"
	"reflect"

	"github.com/watermill-idempotency/idempotency"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// UpsertConfig describes the table an Upsert writes. Identifiers are validated
// with sqldb.ParseIdent (letters, digits and underscores, at most 63 bytes) and
// quoted, so they are case-sensitive on PostgreSQL: give them as it stores
// them (lower case for names created without quotes). Anything else is
// refused, never escaped.
type UpsertConfig struct {
	// Table is the state-copy table, "table" or "schema.table". Required.
	// An unqualified name resolves through the session's search_path.
	Table string

	// KeyColumns identify the row (for example the customer id). Required, at
	// least one. They are the ON CONFLICT target, so the table must have a
	// primary key or unique constraint on exactly these columns; PostgreSQL
	// reports SQLSTATE 42P10 on the first Apply otherwise, SQLite an error
	// too (NewUpsert does not touch the database). MySQL cannot check it:
	// ON DUPLICATE KEY UPDATE reacts to a conflict on any unique index, and
	// without one on these columns every Apply inserts a row. There, the
	// table's only unique index must be its primary key on these columns.
	KeyColumns []string

	// VersionColumn holds the producer's version of the row, a bigint
	// (INTEGER on SQLite; nullable: a NULL stored version is older than any
	// version). Required.
	VersionColumn string

	// ValueColumns are the other columns written on insert and on update, in
	// the order Apply takes their values. Optional (zero columns is a valid
	// "latest version seen" table). Columns of the table not listed here keep
	// their defaults on insert and are left untouched on update.
	ValueColumns []string

	// Dialect selects the SQL text: idempotency.PostgreSQL, idempotency.MySQL (MySQL
	// 8.0+, MariaDB 10.11+; its DSN must not set clientFoundRows=true, see
	// Apply) or idempotency.SQLite. Defaults to idempotency.PostgreSQL (the zero value).
	Dialect sqldb.Dialect
}

// parsedUpsert is an UpsertConfig whose identifiers passed validation.
type parsedUpsert struct {
	table   sqldb.Ident
	keys    []sqldb.Ident
	version sqldb.Ident
	values  []sqldb.Ident
}

// Validate reports every problem of the configuration, each prefixed with the
// field it concerns, e.g. `versioned: UpsertConfig.KeyColumns[1]: identifier
// "id;--" ...`. Several problems are joined with errors.Join. It does not
// connect to the database.
func (c UpsertConfig) Validate() error {
	_, err := c.parse()
	return err
}

// parse validates c and returns its identifiers; Validate and NewUpsert share
// it so what is validated is exactly what is quoted into the SQL.
func (c UpsertConfig) parse() (parsedUpsert, error) {
	var (
		p    parsedUpsert
		errs []error
		seen = map[string]string{} // column name → field that first named it
	)
	fail := func(field, format string, args ...any) {
		errs = append(errs, fmt.Errorf("versioned: UpsertConfig.%s: %s", field, fmt.Sprintf(format, args...)))
	}
	column := func(field, name string) sqldb.Ident {
		id, err := sqldb.ParseIdent(name)
		switch {
		case err != nil:
			fail(field, "%v", err)
			return sqldb.Ident{}
		case id.String() != id.Name():
			fail(field, "column %q: a column name has no schema or table part", name)
			return sqldb.Ident{}
		}
		if first, dup := seen[name]; dup {
			fail(field, "column %q is already %s", name, first)
			return sqldb.Ident{}
		}
		seen[name] = field
		return id
	}

	if err := c.Dialect.Validate(); err != nil {
		fail("Dialect", "%v", err)
	}
	if c.Table == "" {
		fail("Table", "required")
	} else if id, err := sqldb.ParseIdent(c.Table); err != nil {
		fail("Table", "%v", err)
	} else {
		p.table = id
	}
	if len(c.KeyColumns) == 0 {
		fail("KeyColumns", "at least one column required")
	}
	for i, name := range c.KeyColumns {
		p.keys = append(p.keys, column(fmt.Sprintf("KeyColumns[%d]", i), name))
	}
	if c.VersionColumn == "" {
		fail("VersionColumn", "required")
	} else {
		p.version = column("VersionColumn", c.VersionColumn)
	}
	for i, name := range c.ValueColumns {
		p.values = append(p.values, column(fmt.Sprintf("ValueColumns[%d]", i), name))
	}
	return p, errors.Join(errs...)
}

// Outcome is what Apply did to the row. The zero value is none of the named
// outcomes; Apply returns it together with an error.
type Outcome int

const (
	// Inserted: no row existed for the key; it was created.
	Inserted Outcome = iota + 1
	// Updated: the stored version was NULL or lower; the row was overwritten.
	Updated
	// Stale: the stored version was equal or higher; nothing was written.
	// This is not an error: the event is superseded and can be acknowledged
	// (and recorded as processed) like an applied one.
	Stale
)

// String returns "inserted", "updated" or "stale" (suitable as a log field or
// metric label), and "Outcome(n)" for any other value.
func (o Outcome) String() string {
	switch o {
	case Inserted:
		return "inserted"
	case Updated:
		return "updated"
	case Stale:
		return "stale"
	default:
		return fmt.Sprintf("Outcome(%d)", int(o))
	}
}

// Applied reports whether the row was written (Inserted or Updated). Handlers
// use it to decide on side effects that must follow only the newest state.
func (o Outcome) Applied() bool { return o == Inserted || o == Updated }

// permanentArgError is the type of the package's argument sentinels. Its
// Permanent method is what the idempotency middleware (and any caller using
// errors.As with an interface{ Permanent() bool } target) checks to route a
// message to the poison topic instead of retrying it: retrying the same event
// cannot fix its arguments.
type permanentArgError struct{ msg string }

func (e *permanentArgError) Error() string { return e.msg }

// Permanent reports true: the error comes from the event itself.
func (e *permanentArgError) Permanent() bool { return true }

var (
	// ErrVersionMissing is returned (wrapped) by Apply when the incoming
	// version is nil: the event carried no version, or a null one. Nothing is
	// written. The error is permanent: it satisfies
	// errors.As(err, &p) for p of type interface{ Permanent() bool }, and
	// p.Permanent() is true.
	ErrVersionMissing error = &permanentArgError{"versioned: version missing"}

	// ErrArgCount is returned (wrapped) by Apply when the number of key or
	// value arguments differs from the configured columns. Permanent, like
	// ErrVersionMissing.
	ErrArgCount error = &permanentArgError{"versioned: wrong number of arguments"}

	// ErrKeyMissing is returned (wrapped) by Apply when a key argument would
	// be bound as NULL: nil, a nil pointer, slice or map, a driver.Valuer
	// whose value is nil, or a pointer to one of these. A NULL key would
	// never conflict with a unique constraint and would add a row per event.
	// Permanent, like ErrVersionMissing.
	ErrKeyMissing error = &permanentArgError{"versioned: key value missing"}
)

// Upsert writes a versioned state copy: a row that only moves forward. Build
// one with NewUpsert, once (typically at service start), and share it: it
// holds only the SQL text and is safe for concurrent use.
type Upsert struct {
	table     string   // as configured, for error messages
	keyCols   []string // as configured, for error messages
	valueCols []string
	stmt      upsertStmt
}

// NewUpsert validates cfg (see UpsertConfig.Validate) and builds the SQL text
// once. It does not connect to the database.
func NewUpsert(cfg UpsertConfig) (*Upsert, error) {
	p, err := cfg.parse()
	if err != nil {
		return nil, err
	}
	stmt, err := upsertSQL(cfg.Dialect, p.table, p.keys, p.version, p.values)
	if err != nil {
		return nil, fmt.Errorf("versioned: UpsertConfig.Dialect: %w", err)
	}
	return &Upsert{
		table:     cfg.Table,
		keyCols:   append([]string(nil), cfg.KeyColumns...),
		valueCols: append([]string(nil), cfg.ValueColumns...),
		stmt:      stmt,
	}, nil
}

// Apply writes the row identified by key at the given version, in one
// statement (two on SQLite, see below), through q, which should run on the
// caller's transaction (the one that also holds the processed-event claim):
// idempotency.PgxTx(tx) or idempotency.SQLTx(tx).
//
// key holds one value per KeyColumns entry and values one per ValueColumns
// entry, in configuration order; all are bound as parameters. The row is
// inserted when absent, overwritten when its stored version is NULL or strictly
// lower than version, and left alone otherwise (Stale, nil error: an equal
// version never overwrites, so a redelivered or repeated event changes
// nothing). Concurrent Apply calls on one key serialise on the row lock; at
// READ COMMITTED the highest version wins whatever the commit order, and at
// REPEATABLE READ or SERIALIZABLE the loser gets a serialization failure
// (SQLSTATE 40001, retryable) instead of a wrong result.
//
// Per dialect (UpsertConfig.Dialect):
//   - PostgreSQL: INSERT … ON CONFLICT DO UPDATE … WHERE … RETURNING, one
//     round trip; inserted and updated told apart by xmax.
//   - MySQL / MariaDB: INSERT … ON DUPLICATE KEY UPDATE with IF() per
//     column, one round trip; the outcome is the rows affected (1 inserted,
//     2 updated, 0 stale), so the DSN must not set clientFoundRows=true.
//     InnoDB's update branch reads the latest committed row at any isolation
//     level: the highest version wins at REPEATABLE READ too. Two first
//     inserts of one key racing may end in a deadlock error (1213) for one of
//     them, which is transient (retry).
//   - SQLite: an INSERT … ON CONFLICT DO NOTHING, then, if the row existed,
//     an UPDATE guarded by the version: two statements in the process, made
//     atomic by SQLite's single writer (the transaction holds the write lock
//     from the first one on). Run it in a transaction.
//
// Errors:
//   - version nil: ErrVersionMissing, before any SQL; nothing is written.
//   - wrong number of key or value arguments: ErrArgCount, before any SQL.
//   - a key argument bound as NULL: ErrKeyMissing, before any SQL.
//   - database errors are wrapped with %w, so the driver's error stays
//     reachable with errors.As (*pgconn.PgError by its SQLSTATE Code,
//     *mysql.MySQLError by its Number, *sqlite.Error by its Code).
//
// The first three are permanent (they have a Permanent() bool method that
// returns true). On error the Outcome is zero; a failed statement leaves a
// PostgreSQL transaction aborted, to be rolled back by its owner.
func (u *Upsert) Apply(ctx context.Context, tx idempotency.Tx, key []any, version *int64, values []any) (Outcome, error) {
	q, err := sqldb.TxOf(tx)
	if err != nil {
		return 0, fmt.Errorf("versioned: upsert into %s: %w", u.table, err)
	}
	if len(key) != len(u.keyCols) {
		return 0, fmt.Errorf("%w: upsert into %s: got %d key values for KeyColumns %v", ErrArgCount, u.table, len(key), u.keyCols)
	}
	if len(values) != len(u.valueCols) {
		return 0, fmt.Errorf("%w: upsert into %s: got %d values for ValueColumns %v", ErrArgCount, u.table, len(values), u.valueCols)
	}
	for i, k := range key {
		if isNil(k) {
			return 0, fmt.Errorf("%w: upsert into %s: key column %s is nil", ErrKeyMissing, u.table, u.keyCols[i])
		}
	}
	if isNil(version) {
		return 0, fmt.Errorf("%w: upsert into %s", ErrVersionMissing, u.table)
	}

	var args []any
	if u.stmt.args != nil {
		args = u.stmt.args(key, *version, values)
	} else {
		args = make([]any, 0, len(key)+1+len(values))
		args = append(args, key...)
		args = append(args, *version)
		args = append(args, values...)
	}
	out, err := u.run(ctx, q, args)
	if err != nil {
		return 0, fmt.Errorf("versioned: upsert into %s: %w", u.table, err)
	}
	return out, nil
}

// run executes the dialect's statements and reads their outcome.
func (u *Upsert) run(ctx context.Context, q sqldb.Querier, args []any) (Outcome, error) {
	switch u.stmt.mode {
	case modeAffected:
		n, err := q.Exec(ctx, u.stmt.query, args...)
		switch {
		case err != nil:
			return 0, err
		case n == 1:
			return Inserted, nil
		case n == 2:
			return Updated, nil
		case n == 0:
			return Stale, nil
		}
		return 0, fmt.Errorf("%d rows affected, want 0, 1 or 2 (is clientFoundRows off?)", n)
	case modeInsertThenUpdate:
		n, err := q.Exec(ctx, u.stmt.query, args...)
		switch {
		case err != nil:
			return 0, err
		case n == 1:
			return Inserted, nil
		}
		if n, err = q.Exec(ctx, u.stmt.update, args...); err != nil {
			return 0, err
		}
		if n == 1 {
			return Updated, nil
		}
		return Stale, nil
	default:
		var inserted bool
		err := q.QueryRow(ctx, u.stmt.query, args...).Scan(&inserted)
		switch {
		case errors.Is(err, sqldb.ErrNoRows):
			return Stale, nil
		case err != nil:
			return 0, err
		case inserted:
			return Inserted, nil
		default:
			return Updated, nil
		}
	}
}

// isNil reports whether v would be bound as SQL NULL: nil, a nil pointer,
// slice, map or interface, a driver.Valuer whose Value is nil
// (sql.NullString{}, pgtype.Text{}) or fails, or a pointer to any of these
// (the drivers dereference pointers all the way down: a **string holding a
// nil *string is bound as NULL).
func isNil(v any) bool {
	for depth := 0; ; depth++ {
		if v == nil {
			return true
		}
		rv := reflect.ValueOf(v)
		switch rv.Kind() {
		case reflect.Pointer, reflect.Slice, reflect.Map, reflect.Interface:
			if rv.IsNil() {
				return true
			}
		}
		if vl, ok := v.(driver.Valuer); ok {
			dv, err := vl.Value()
			return err != nil || dv == nil
		}
		if rv.Kind() != reflect.Pointer || depth == maxKeyDepth {
			return false
		}
		v = rv.Elem().Interface()
	}
}

// maxKeyDepth bounds isNil's walk through pointers (a pointer type may
// point to itself).
const maxKeyDepth = 32
