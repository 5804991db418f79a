package versioned

import (
	"fmt"
	"strings"

	"github.com/watermill-idempotency/idempotency/sqldb"
)

// This file holds all the SQL text of the versioned upsert, one function per
// dialect. Adding a dialect means adding a case to upsertSQL that produces a
// statement with the same contract:
//
//   - parameters, in order: the key columns, the version, the value columns;
//   - one statement, one round trip, safe under concurrent writers of the same key;
//   - the stored row changes only when its version is NULL or strictly lower than
//     the incoming one;
//   - it returns exactly one row holding one boolean ("inserted": true for a
//     new row, false for an updated one) when the row was written, and no row
//     when the incoming version was stale.

// upsertSQL builds the statement for d from validated identifiers.
func upsertSQL(d sqldb.Dialect, table sqldb.Ident, keys []sqldb.Ident, version sqldb.Ident, values []sqldb.Ident) (string, error) {
	switch d {
	case sqldb.PostgreSQL:
		return upsertPostgres(table, keys, version, values), nil
	default:
		return "", fmt.Errorf("unsupported dialect %s", d)
	}
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
	cols := make([]string, 0, len(keys)+1+len(values))
	for _, k := range keys {
		cols = append(cols, k.Quoted(q))
	}
	cols = append(cols, version.Quoted(q))
	for _, v := range values {
		cols = append(cols, v.Quoted(q))
	}
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
