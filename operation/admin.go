package operation

import (
	"context"
	"database/sql"
	"fmt"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// DefaultListLimit bounds List when its limit is ≤ 0.
const DefaultListLimit = 100

// List returns up to limit records (DefaultListLimit when limit ≤ 0), in
// state when state != "" (every state otherwise), least recently updated
// first: the worklist of a person reconciling uncertain operations. It reads
// without any lock (a started record may be in flight or dead) and changes
// nothing.
func (r *Runner) List(ctx context.Context, state State, limit int) ([]Record, error) {
	if limit <= 0 {
		limit = DefaultListLimit
	}
	table := r.table.Quoted(r.dialect.QuoteChar())
	q := fmt.Sprintf(`SELECT %s FROM %s`, r.sql.columns, table)
	var args []any
	p1, p2 := "?", "?"
	if r.dialect == sqldb.PostgreSQL {
		p1, p2 = "$1", "$2"
	}
	if state != "" {
		q += ` WHERE state = ` + p1
		args = append(args, string(state))
	} else {
		p2 = p1
	}
	q += ` ORDER BY updated_at, ` + keyColumn(r.dialect) + ` LIMIT ` + p2
	args = append(args, limit)

	var out []Record
	scan := func(sc func(dest ...any) error) error {
		var s recordScan
		if err := sc(s.dest()...); err != nil {
			return err
		}
		out = append(out, s.record())
		return nil
	}
	var err error
	switch p := r.pool.(type) {
	case pgxConnPool:
		err = listPgx(ctx, p, q, args, scan)
	case stdConnPool:
		err = listStd(ctx, p.db, q, args, scan)
	default:
		err = fmt.Errorf("unsupported pool %T", r.pool)
	}
	if err != nil {
		return nil, fmt.Errorf("operation: list: %w", err)
	}
	return out, nil
}

// keyColumn is the key column, quoted where the dialect reserves the word.
func keyColumn(d sqldb.Dialect) string {
	switch d {
	case sqldb.MySQL:
		return "`key`"
	case sqldb.SQLite:
		return `"key"`
	}
	return "key"
}

func listPgx(ctx context.Context, p pgxConnPool, q string, args []any, scan func(func(...any) error) error) error {
	rows, err := p.p.Query(ctx, q, args...)
	if err != nil {
		return err
	}
	defer rows.Close()
	for rows.Next() {
		if err := scan(rows.Scan); err != nil {
			return err
		}
	}
	return rows.Err()
}

func listStd(ctx context.Context, db *sql.DB, q string, args []any, scan func(func(...any) error) error) error {
	rows, err := db.QueryContext(ctx, q, args...)
	if err != nil {
		return err
	}
	defer rows.Close()
	for rows.Next() {
		if err := scan(rows.Scan); err != nil {
			return err
		}
	}
	return rows.Err()
}

// WithNote returns v with note recorded as the record's error text when
// Resolve applies it (a VerdictFailed's reason is replaced by note): the
// place where a person's resolution says who decided and why, next to the
// updated_at and finished_at times the database sets. An empty note
// leaves v as it is.
func (v Verdict) WithNote(note string) Verdict {
	if note != "" {
		v.reason = note
	}
	return v
}
