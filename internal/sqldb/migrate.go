package sqldb

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"io/fs"
	"path"
	"sort"
	"strconv"
	"strings"
	"testing/fstest"
	"text/template"

	"github.com/watermill-idempotency/idempotency/internal/crashpoint"
)

// Migration is one versioned schema change, rendered for its table.
type Migration struct {
	// Version is the file's leading number (1, 2, …); versions only grow.
	Version int
	// Name is the file name, e.g. "0001_create_processed_event.up.sql".
	Name string
	// SQL is the rendered statement text: one or more statements, each
	// ending with ";" at the end of a line.
	SQL string
}

// RenderMigrations reads the "NNNN_name.up.sql" templates of dir in fsys and
// executes each (text/template) with data, in version order.
func RenderMigrations(fsys fs.FS, dir string, data any) ([]Migration, error) {
	entries, err := fs.ReadDir(fsys, dir)
	if err != nil {
		return nil, fmt.Errorf("migrations %s: %w", dir, err)
	}
	var out []Migration
	for _, e := range entries {
		name := e.Name()
		num, _, ok := strings.Cut(name, "_")
		if !ok || !strings.HasSuffix(name, ".up.sql") {
			continue
		}
		v, err := strconv.Atoi(num)
		if err != nil {
			return nil, fmt.Errorf("migration %s: bad version: %w", name, err)
		}
		raw, err := fs.ReadFile(fsys, path.Join(dir, name))
		if err != nil {
			return nil, err
		}
		tpl, err := template.New(name).Parse(string(raw))
		if err != nil {
			return nil, fmt.Errorf("migration %s: %w", name, err)
		}
		var buf bytes.Buffer
		if err := tpl.Execute(&buf, data); err != nil {
			return nil, fmt.Errorf("migration %s: %w", name, err)
		}
		out = append(out, Migration{Version: v, Name: name, SQL: buf.String()})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Version < out[j].Version })
	return out, nil
}

// MigrationsFS lays migrations out as an fs.FS of files at its root with
// their own versions (0001, 0002, …). Several components laid out this way
// collide in one version table (every one starts at 1): use ComponentFS.
func MigrationsFS(ms []Migration) fs.FS { return ComponentFS(ms, 0) }

// Version bases of the library's components in ComponentFS: a component's
// migration N is version base+N for goose and golang-migrate, so that the
// components' numbers are disjoint and one version table (goose's default
// goose_db_version, golang-migrate's schema_migrations) can hold them all.
const (
	VersionBaseProcessed = 10000
	VersionBaseOperation = 20000
	VersionBaseVersioned = 30000
	VersionBaseOutbox    = 40000
)

// ComponentFS lays migrations out as an fs.FS of files at its root named
// "<base+N>_<name>.up.sql" (the layout golang-migrate reads), each prefixed
// with a "-- +goose Up" annotation so goose applies it as is. base is the
// component's VersionBase constant.
//
// Applying several components with goose's defaults into one version table
// works in the bases' order (processed, operation, versioned, outbox) on a
// fresh database. A later release adding migration N+1 to a component whose
// base is below another's applied version is "out of order" for goose: use
// goose.WithAllowOutofOrder(true), or give each component its own version
// table (goose.WithTableName, golang-migrate's x-migrations-table), which
// golang-migrate needs anyway (it stores one version per table).
func ComponentFS(ms []Migration, base int) fs.FS {
	out := fstest.MapFS{}
	for _, m := range ms {
		name := m.Name
		if _, rest, ok := strings.Cut(m.Name, "_"); ok {
			name = fmt.Sprintf("%04d_%s", base+m.Version, rest)
		}
		out[name] = &fstest.MapFile{Data: []byte("-- +goose Up\n" + m.SQL), Mode: 0o444}
	}
	return out
}

// MigrationTable is the name of the table Migrate records applied versions
// in, next to the table they create.
const MigrationTable = "idempotency_migration"

// Migrate is MigrateTable with the bookkeeping table unqualified (the first
// schema of the search_path, or the connection's current database).
func Migrate(ctx context.Context, q Querier, d Dialect, component string, ms []Migration) error {
	return MigrateTable(ctx, q, d, Ident{}, component, ms)
}

// MigrateTable applies, in order, the migrations of ms that are not yet
// recorded for component, and records each as (component, version) in the
// idempotency_migration table of next's schema (next is the table the
// migrations create: "s.t" records in "s".idempotency_migration, an
// unqualified name in the unqualified table, which is where an unqualified
// table is created). A recorded version is never run again.
//
// Several instances at once:
//   - on PostgreSQL each migration runs as one script in one implicit
//     transaction (the simple query protocol, which pgx and its stdlib use for
//     a statement without parameters) behind a transaction-scoped advisory
//     lock derived from component: instances apply it one after another. Two
//     instances that both found it unrecorded both run it, so PostgreSQL
//     migrations must stay idempotent (IF NOT EXISTS);
//   - on MySQL and SQLite each statement runs alone (DDL commits implicitly
//     there). A statement refused because its change is already there
//     (alreadyApplied: a run killed before the version's record, another
//     instance) is passed over. When one fails otherwise, the record is
//     read again: if another instance recorded the version meanwhile, the
//     failure is ignored; otherwise it is returned (run Migrate again once
//     the other instance is done).
func MigrateTable(ctx context.Context, q Querier, d Dialect, next Ident, component string, ms []Migration) error {
	bk := MigrationTable
	if schema, _, ok := strings.Cut(next.String(), "."); ok {
		bk = schema + "." + MigrationTable
	}
	bkID, err := ParseIdent(bk)
	if err != nil {
		return fmt.Errorf("migrate %s: %w", component, err)
	}
	table := bkID.Quoted(d.QuoteChar())
	quoted := "'" + strings.ReplaceAll(component, "'", "''") + "'"
	create := migrationsTable(d, table)
	if d == PostgreSQL {
		// Concurrent CREATE TABLE IF NOT EXISTS can fail on PostgreSQL
		// (23505 on pg_type): serialise it behind a lock of its own.
		create = fmt.Sprintf("SELECT pg_advisory_xact_lock(%d);\n%s", lockKey("idempotency-migrate-table:"+bk), create)
	}
	if _, err := q.Exec(ctx, create); err != nil {
		return fmt.Errorf("migrate %s: create %s: %w", component, bk, err)
	}
	if !next.IsZero() {
		// The record is beside the table, but the table alone can be gone
		// (dropped by hand, a restored dump without it): its records then
		// describe nothing, and everything is applied again (the
		// migrations are idempotent).
		exists, err := tableExists(ctx, q, d, next)
		if err != nil {
			return fmt.Errorf("migrate %s: look up %s: %w", component, next, err)
		}
		if !exists {
			if _, err := q.Exec(ctx, fmt.Sprintf("DELETE FROM %s WHERE component = %s", table, quoted)); err != nil {
				return fmt.Errorf("migrate %s: forget the records of missing %s: %w", component, next, err)
			}
		}
	}
	applied := func(v int) (bool, error) {
		var ok bool
		err := q.QueryRow(ctx, fmt.Sprintf("SELECT EXISTS (SELECT 1 FROM %s WHERE component = %s AND version = %d)", table, quoted, v)).Scan(&ok)
		return ok, err
	}
	record := fmt.Sprintf("INSERT INTO %s (component, version) VALUES (%s, %%d) ON CONFLICT DO NOTHING", table, quoted)
	if d == MySQL {
		record = fmt.Sprintf("INSERT INTO %s (component, version) VALUES (%s, %%d) ON DUPLICATE KEY UPDATE version = version", table, quoted)
	}
	for _, m := range ms {
		done, err := applied(m.Version)
		if err != nil {
			return fmt.Errorf("migrate %s: read %s: %w", component, bk, err)
		}
		if done {
			continue
		}
		switch d {
		case PostgreSQL:
			script := strings.Join([]string{
				fmt.Sprintf("SELECT pg_advisory_xact_lock(%d)", lockKey("idempotency-migrate:"+component)),
				m.SQL,
				fmt.Sprintf(record, m.Version),
			}, ";\n")
			_, err = q.Exec(ctx, script)
		default:
			for _, s := range SplitStatements(m.SQL) {
				if _, err = q.Exec(ctx, s); err != nil {
					if alreadyApplied(d, err) {
						// A run killed after this statement and before
						// the version's record (DDL commits on its own
						// here), or another instance's.
						err = nil
						continue
					}
					if done, rerr := applied(m.Version); rerr == nil && done {
						err = nil // another instance applied it meanwhile
					}
					break
				}
				crashpoint.Reached(crashpoint.MigrationStatementApplied)
			}
			if err == nil {
				_, err = q.Exec(ctx, fmt.Sprintf(record, m.Version))
			}
		}
		if err != nil {
			return fmt.Errorf("migrate %s version %d (%s): %w", component, m.Version, m.Name, err)
		}
	}
	if d == MySQL && len(ms) > 0 {
		// A no-op upsert of the last record: 0 rows affected with the
		// driver's default changed-rows count, 1 with clientFoundRows.
		n, err := q.Exec(ctx, fmt.Sprintf("INSERT INTO %s (component, version) VALUES (?, ?) ON DUPLICATE KEY UPDATE version = version", table),
			component, ms[len(ms)-1].Version)
		switch {
		case err != nil:
			return fmt.Errorf("migrate %s: check changed rows: %w", component, err)
		case n != 0:
			return ErrMySQLFoundRows
		}
	}
	return nil
}

// alreadyApplied reports whether err is a DDL statement's refusal to do
// what is already done: MySQL 1060 (duplicate column), 1061 (duplicate key
// name), 1091 (nothing to drop) (MySQLErrorNumber); SQLite's "duplicate
// column name". On MySQL one ALTER TABLE is atomic, and the SQLite
// migrations run one change per statement, so the statement's change is
// whole.
func alreadyApplied(d Dialect, err error) bool {
	switch d {
	case MySQL:
		n, _ := MySQLErrorNumber(err)
		return n == "1060" || n == "1061" || n == "1091"
	case SQLite:
		return strings.Contains(err.Error(), "duplicate column name")
	}
	return false
}

// tableExists reports whether table exists (in its schema, or where an
// unqualified name resolves).
func tableExists(ctx context.Context, q Querier, d Dialect, table Ident) (bool, error) {
	lit := func(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }
	schema, _, qualified := strings.Cut(table.String(), ".")
	var query string
	switch d {
	case MySQL:
		db := "DATABASE()"
		if qualified {
			db = lit(schema)
		}
		query = fmt.Sprintf("SELECT EXISTS (SELECT 1 FROM information_schema.tables WHERE table_schema = %s AND table_name = %s)", db, lit(table.Name()))
	case SQLite:
		master := "sqlite_master"
		if qualified {
			master = `"` + schema + `".sqlite_master`
		}
		query = fmt.Sprintf("SELECT EXISTS (SELECT 1 FROM %s WHERE type = 'table' AND name = %s)", master, lit(table.Name()))
	default:
		query = fmt.Sprintf("SELECT to_regclass(%s) IS NOT NULL", lit(table.Quoted('"')))
	}
	var ok bool
	if err := q.QueryRow(ctx, query).Scan(&ok); err != nil {
		return false, err
	}
	return ok, nil
}

func lockKey(name string) int64 {
	h := fnv.New64a()
	_, _ = h.Write([]byte(name))
	return int64(h.Sum64())
}

// ErrMySQLFoundRows is returned by Migrate on MySQL when the connection
// counts found rows rather than changed rows (go-sql-driver/mysql's
// clientFoundRows=true). The library's MySQL claims and upserts read their
// outcome from rows affected: with found rows a duplicate claim would read as
// a new one and apply the effect again. middleware.NewConsumer checks its
// own DB the same way (processedstore.Store.CheckChangedRows), whatever DSN
// the migration ran on.
var ErrMySQLFoundRows = errors.New("the MySQL connection reports found rows, not changed rows (remove clientFoundRows=true from the DSN)")

func migrationsTable(d Dialect, table string) string {
	ts := "timestamptz NOT NULL DEFAULT now()"
	switch d {
	case MySQL:
		ts = "DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)"
	case SQLite:
		// SQLite's own clock (milliseconds) is enough here: applied_at
		// is a record for operators, nothing compares it.
		ts = "TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))"
	}
	return `CREATE TABLE IF NOT EXISTS ` + table + ` (
    component  varchar(255) NOT NULL,
    version    int          NOT NULL,
    applied_at ` + ts + `,
    PRIMARY KEY (component, version)
)`
}

// SplitStatements splits a migration into statements at lines ending with
// ";" (comments and blank lines dropped). Our migrations never put ";" at the
// end of a line inside a statement.
func SplitStatements(sql string) []string {
	var out []string
	var cur strings.Builder
	for _, line := range strings.Split(sql, "\n") {
		t := strings.TrimSpace(line)
		if t == "" || strings.HasPrefix(t, "--") {
			continue
		}
		cur.WriteString(line)
		cur.WriteString("\n")
		if strings.HasSuffix(t, ";") {
			s := strings.TrimSuffix(strings.TrimSpace(cur.String()), ";")
			out = append(out, s)
			cur.Reset()
		}
	}
	if s := strings.TrimSpace(cur.String()); s != "" {
		out = append(out, s)
	}
	return out
}

// TableMigrations renders the templates under root/<dialect> (for example
// "migrations/postgres") for one table: {{.Table}} is the quoted, possibly
// schema-qualified name, {{.Prefix}} the bare name (for index names),
// {{.IndexSchema}} the quoted schema followed by "." (or "" for an
// unqualified table), to qualify an index name in DROP INDEX.
func TableMigrations(fsys fs.FS, root string, d Dialect, table Ident) ([]Migration, error) {
	data := struct{ Table, Prefix, IndexSchema string }{Table: table.Quoted(d.QuoteChar()), Prefix: table.Name()}
	if schema, _, ok := strings.Cut(table.String(), "."); ok {
		q := string(d.QuoteChar())
		data.IndexSchema = q + schema + q + "."
	}
	return RenderMigrations(fsys, path.Join(root, d.String()), data)
}
