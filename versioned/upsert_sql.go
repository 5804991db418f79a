package versioned

import (
	"fmt"
	"strings"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// This file holds all the SQL text of the versioned upsert, one function per
// dialect. Every dialect's statements have the same contract:
//
//   - parameters, in order: the key columns, the version, the value columns
//     (a dialect that must bind one twice says so with args);
//   - safe under concurrent writers of the same key, in the caller's
//     transaction;
//   - the stored row changes only when its version is NULL or strictly lower
//     than the incoming one;
//   - the result tells inserted, updated and stale apart (see upsertMode).

// upsertMode says how Apply reads the statements' result.
type upsertMode int

const (
	// modeReturning (PostgreSQL): query returns one row holding one boolean
	// ("inserted") when it wrote, no row when stale.
	modeReturning upsertMode = iota + 1
	// modeAffected (MySQL): query's rows affected are 1 for an insert, 2 for
	// an update and 0 when stale (ON DUPLICATE KEY UPDATE's convention).
	modeAffected
	// modeInsertThenUpdate (SQLite): query inserts if the key is absent
	// (rows affected 1: inserted); else update moves the row if its version
	// is older (rows affected 1: updated; 0: stale). Both take the same
	// arguments.
	modeInsertThenUpdate
)

// upsertStmt is the SQL of one Upsert.
type upsertStmt struct {
	mode   upsertMode
	query  string
	update string // modeInsertThenUpdate only
	// args orders the bound values; nil means key..., version, values...
	args func(key []any, version int64, values []any) []any
}

// upsertSQL builds the statements for d from validated identifiers.
func upsertSQL(d sqldb.Dialect, table sqldb.Ident, keys []sqldb.Ident, version sqldb.Ident, values []sqldb.Ident) (upsertStmt, error) {
	switch d {
	case sqldb.PostgreSQL:
		return upsertStmt{mode: modeReturning, query: upsertPostgres(table, keys, version, values)}, nil
	case sqldb.MySQL:
		return upsertMySQL(table, keys, version, values), nil
	case sqldb.SQLite:
		return upsertSQLite(table, keys, version, values), nil
	default:
		return upsertStmt{}, fmt.Errorf("unsupported dialect %s", d)
	}
}

// quoteAll quotes ids with q.
func quoteAll(ids []sqldb.Ident, q byte) []string {
	out := make([]string, len(ids))
	for i, id := range ids {
		out[i] = id.Quoted(q)
	}
	return out
}

// upsertPostgres:
//
//	INSERT INTO "t" AS cur ("k", "version", "v") VALUES ($1, $2, $3)
//	ON CONFLICT ("k") DO UPDATE SET "version" = EXCLUDED."version", "v" = EXCLUDED."v"
//	WHERE cur."version" IS NULL OR cur."version" < EXCLUDED."version"
//	RETURNING (cur.xmax = 0) AS inserted
//
// ON CONFLICT DO UPDATE locks the existing row (waiting for a concurrent writer
// to finish) and evaluates the WHERE clause against the latest committed
// version, so at READ COMMITTED concurrent upserts of one key serialise and the
// highest version wins; when the WHERE clause is false nothing is written and
// RETURNING yields no row. A freshly inserted tuple has xmax = 0; a tuple
// written by the DO UPDATE branch carries the updating transaction's id in
// xmax, which tells the two apart in the same round trip.
func upsertPostgres(table sqldb.Ident, keys []sqldb.Ident, version sqldb.Ident, values []sqldb.Ident) string {
	const q = '"'
	cols := quoteAll(keys, q)
	cols = append(cols, version.Quoted(q))
	cols = append(cols, quoteAll(values, q)...)
	params := make([]string, len(cols))
	for i := range cols {
		params[i] = fmt.Sprintf("$%d", i+1)
	}
	sets := make([]string, 0, 1+len(values))
	for _, c := range cols[len(keys):] {
		sets = append(sets, c+" = EXCLUDED."+c)
	}
	v := version.Quoted(q)

	var b strings.Builder
	b.WriteString("INSERT INTO " + table.Quoted(q) + " AS cur (" + strings.Join(cols, ", ") + ")")
	b.WriteString(" VALUES (" + strings.Join(params, ", ") + ")")
	b.WriteString(" ON CONFLICT (" + strings.Join(cols[:len(keys)], ", ") + ")")
	b.WriteString(" DO UPDATE SET " + strings.Join(sets, ", "))
	b.WriteString(" WHERE cur." + v + " IS NULL OR cur." + v + " < EXCLUDED." + v)
	b.WriteString(" RETURNING (cur.xmax = 0) AS inserted")
	return b.String()
}

// upsertMySQL (MySQL 8.0 and later, MariaDB 10.11 and later):
//
//	INSERT INTO `t` (`k`, `version`, `v`) VALUES (?, ?, ?)
//	ON DUPLICATE KEY UPDATE
//	  `v` = IF(`version` IS NULL OR `version` < ?, ?, `v`),
//	  `version` = IF(`version` IS NULL OR `version` < ?, ?, `version`)
//
// One statement, one round trip. MySQL has no WHERE on the update branch, so
// each column keeps its value unless the stored version is older; the
// version is assigned last because MySQL evaluates the assignments left to
// right and a column assigned earlier would show its new value to the later
// conditions (MariaDB's SIMULTANEOUS_ASSIGNMENT mode gives the same result).
// The incoming values are bound a second time rather than read back with
// VALUES(col), deprecated since MySQL 8.0.20, or a row alias (INSERT … AS
// new), which MariaDB does not have: the same text runs on both.
//
// The outcome is the statement's rows affected: 1 inserted, 2 updated, 0 when
// the row was left as it was (stale). That needs the driver's default
// "changed rows" count: a DSN with clientFoundRows=true reports 1 for an
// unchanged row, which would read as inserted. InnoDB locks the existing row
// for the update branch and evaluates the conditions on its latest committed
// version, whatever the isolation level, so concurrent writers of one key
// serialise and the highest version wins.
//
// ON DUPLICATE KEY UPDATE fires on a conflict with any unique index of the
// table, not only the one on the key columns, and a table with no unique
// index on them never conflicts (every Apply inserts): the table must have
// exactly one unique index, its primary key, on the key columns.
func upsertMySQL(table sqldb.Ident, keys []sqldb.Ident, version sqldb.Ident, values []sqldb.Ident) upsertStmt {
	const q = '`'
	cols := quoteAll(keys, q)
	cols = append(cols, version.Quoted(q))
	cols = append(cols, quoteAll(values, q)...)
	v := version.Quoted(q)
	older := "IF(" + v + " IS NULL OR " + v + " < ?, ?, "
	sets := make([]string, 0, 1+len(values))
	for _, c := range quoteAll(values, q) {
		sets = append(sets, c+" = "+older+c+")")
	}
	sets = append(sets, v+" = "+older+v+")")

	var b strings.Builder
	b.WriteString("INSERT INTO " + table.Quoted(q) + " (" + strings.Join(cols, ", ") + ")")
	b.WriteString(" VALUES (" + strings.TrimSuffix(strings.Repeat("?, ", len(cols)), ", ") + ")")
	b.WriteString(" ON DUPLICATE KEY UPDATE " + strings.Join(sets, ", "))
	return upsertStmt{
		mode:  modeAffected,
		query: b.String(),
		args: func(key []any, version int64, values []any) []any {
			args := make([]any, 0, len(key)+1+3*len(values)+2)
			args = append(args, key...)
			args = append(args, version)
			args = append(args, values...)
			for _, val := range values {
				args = append(args, version, val)
			}
			return append(args, version, version)
		},
	}
}

// upsertSQLite (SQLite 3.35 and later):
//
//	INSERT INTO "t" ("k", "version", "v") VALUES (?1, ?2, ?3) ON CONFLICT ("k") DO NOTHING
//	UPDATE "t" SET "version" = ?2, "v" = ?3 WHERE "k" = ?1 AND ("version" IS NULL OR "version" < ?2)
//
// Two statements, because SQLite's RETURNING shows only the row as written
// (no xmax, no old values) and its changes() counts an insert and an update
// alike, so no single statement tells inserted from updated. That costs no
// round trip (SQLite runs in the process) and no atomicity inside a
// transaction: SQLite has one writer at a time, and the first statement takes
// the database's write lock (at BEGIN IMMEDIATE already with the
// recommended DSN) until the transaction ends, so nothing moves the row
// between the two. (Outside a transaction, a row deleted between them would
// read as stale.) The conflict target names the key columns, so a table
// without a unique index on exactly them is an error, as on PostgreSQL.
// Numbered parameters let both statements take the same arguments.
func upsertSQLite(table sqldb.Ident, keys []sqldb.Ident, version sqldb.Ident, values []sqldb.Ident) upsertStmt {
	const q = '"'
	cols := quoteAll(keys, q)
	cols = append(cols, version.Quoted(q))
	cols = append(cols, quoteAll(values, q)...)
	params := make([]string, len(cols))
	for i := range cols {
		params[i] = fmt.Sprintf("?%d", i+1)
	}
	nk := len(keys)
	sets := make([]string, 0, 1+len(values))
	for i, c := range cols[nk:] {
		sets = append(sets, c+" = "+params[nk+i])
	}
	where := make([]string, 0, nk)
	for i, c := range cols[:nk] {
		where = append(where, c+" = "+params[i])
	}
	v, pv := version.Quoted(q), params[nk]
	t := table.Quoted(q)
	return upsertStmt{
		mode: modeInsertThenUpdate,
		query: "INSERT INTO " + t + " (" + strings.Join(cols, ", ") + ") VALUES (" + strings.Join(params, ", ") + ")" +
			" ON CONFLICT (" + strings.Join(cols[:nk], ", ") + ") DO NOTHING",
		update: "UPDATE " + t + " SET " + strings.Join(sets, ", ") +
			" WHERE " + strings.Join(where, " AND ") + " AND (" + v + " IS NULL OR " + v + " < " + pv + ")",
	}
}
