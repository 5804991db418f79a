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
// their names ("NNNN_name.up.sql", the layout golang-migrate reads), each
// prefixed with a "-- +goose Up" annotation so goose applies it as is.
func MigrationsFS(ms []Migration) fs.FS {
	out := fstest.MapFS{}
	for _, m := range ms {
		out[m.Name] = &fstest.MapFile{Data: []byte("-- +goose Up\n" + m.SQL), Mode: 0o444}
	}
	return out
}

// Migrate applies ms in order on q and records each as (component, version)
// in the idempotency_migration table. Migrations must be idempotent (IF NOT
// EXISTS): Migrate is safe to run from several instances at once because
//   - on PostgreSQL each migration runs as one script in one implicit
//     transaction (the simple query protocol, which pgx and its stdlib use for
//     a statement without parameters) behind a transaction-scoped advisory
//     lock derived from component, so instances apply it one after another;
//   - on MySQL and SQLite each statement runs alone (DDL commits implicitly
//     there); CREATE … IF NOT EXISTS is atomic, so concurrent instances
//     converge.
func Migrate(ctx context.Context, q Querier, d Dialect, component string, ms []Migration) error {
	quoted := "'" + strings.ReplaceAll(component, "'", "''") + "'"
	for _, m := range ms {
		var err error
		switch d {
		case PostgreSQL:
			h := fnv.New64a()
			_, _ = h.Write([]byte("idempotency-migrate:" + component))
			script := strings.Join([]string{
				fmt.Sprintf("SELECT pg_advisory_xact_lock(%d)", int64(h.Sum64())),
				migrationsTable(d),
				m.SQL,
				fmt.Sprintf("INSERT INTO idempotency_migration (component, version) VALUES (%s, %d) ON CONFLICT DO NOTHING", quoted, m.Version),
			}, ";\n")
			_, err = q.Exec(ctx, script)
		default:
			stmts := append([]string{migrationsTable(d)}, SplitStatements(m.SQL)...)
			record := "INSERT INTO idempotency_migration (component, version) VALUES (%s, %d) ON CONFLICT DO NOTHING"
			if d == MySQL {
				record = "INSERT INTO idempotency_migration (component, version) VALUES (%s, %d) ON DUPLICATE KEY UPDATE version = version"
			}
			stmts = append(stmts, fmt.Sprintf(record, quoted, m.Version))
			for _, s := range stmts {
				if _, err = q.Exec(ctx, s); err != nil {
					break
				}
			}
		}
		if err != nil {
			return fmt.Errorf("migrate %s version %d (%s): %w", component, m.Version, m.Name, err)
		}
	}
	if d == MySQL && len(ms) > 0 {
		// A no-op upsert of the record just written: 0 rows affected with
		// the driver's default changed-rows count, 1 with clientFoundRows.
		n, err := q.Exec(ctx, "INSERT INTO idempotency_migration (component, version) VALUES (?, ?) ON DUPLICATE KEY UPDATE version = version",
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

// ErrMySQLFoundRows is returned by Migrate on MySQL when the connection
// counts found rows rather than changed rows (go-sql-driver/mysql's
// clientFoundRows=true). The library's MySQL claims and upserts read their
// outcome from rows affected: with found rows a duplicate claim would read as
// a new one and apply the effect again. Use the same DSN for Migrate as for
// the consumers, so that this check covers them.
var ErrMySQLFoundRows = errors.New("the MySQL connection reports found rows, not changed rows (remove clientFoundRows=true from the DSN)")

func migrationsTable(d Dialect) string {
	ts := "timestamptz NOT NULL DEFAULT now()"
	switch d {
	case MySQL:
		ts = "DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)"
	case SQLite:
		ts = "TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))"
	}
	return `CREATE TABLE IF NOT EXISTS idempotency_migration (
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
// schema-qualified name, {{.Prefix}} the bare name (for index names).
func TableMigrations(fsys fs.FS, root string, d Dialect, table Ident) ([]Migration, error) {
	data := struct{ Table, Prefix string }{Table: table.Quoted(d.QuoteChar()), Prefix: table.Name()}
	return RenderMigrations(fsys, path.Join(root, d.String()), data)
}
