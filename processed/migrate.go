package processed

import (
	"bytes"
	"context"
	"embed"
	"fmt"
	"hash/fnv"
	"io/fs"
	"path"
	"sort"
	"strconv"
	"strings"
	"testing/fstest"
	"text/template"

	"github.com/watermill-idempotency/idempotency/sqldb"
)

//go:embed migrations
var migrationTemplates embed.FS

// Migration is one versioned schema change of the store, rendered for its table.
type Migration struct {
	// Version is the file's leading number (1, 2, …); versions only grow.
	Version int
	// Name is the file name, e.g. "0001_create_processed_event.up.sql".
	Name string
	// SQL is the statement text, rendered for the store's table.
	SQL string
}

// Migrations returns the store's migrations in version order, rendered for its
// table. Each one is idempotent (IF NOT EXISTS), so running one twice is safe.
func (s *Store) Migrations() ([]Migration, error) {
	return renderMigrations(s.dialect, s.table)
}

// MigrationsFS returns the migrations for table (DefaultTable when empty) as an
// fs.FS of files named "NNNN_name.up.sql" at its root, the layout
// golang-migrate reads; each file also carries a "-- +goose Up" annotation so
// goose can apply it as is. Use it when a migration tool, not Migrate, owns the
// schema.
func MigrationsFS(table string, dialect sqldb.Dialect) (fs.FS, error) {
	if table == "" {
		table = DefaultTable
	}
	id, err := sqldb.ParseIdent(table)
	if err != nil {
		return nil, fmt.Errorf("processed: MigrationsFS table: %w", err)
	}
	ms, err := renderMigrations(dialect, id)
	if err != nil {
		return nil, err
	}
	out := fstest.MapFS{}
	for _, m := range ms {
		out[m.Name] = &fstest.MapFile{Data: []byte("-- +goose Up\n" + m.SQL), Mode: 0o444}
	}
	return out, nil
}

func renderMigrations(dialect sqldb.Dialect, table sqldb.Ident) ([]Migration, error) {
	dir := path.Join("migrations", dialect.String())
	entries, err := fs.ReadDir(migrationTemplates, dir)
	if err != nil {
		return nil, fmt.Errorf("processed: no migrations for dialect %s: %w", dialect, err)
	}
	data := struct{ Table, Prefix string }{
		Table:  table.Quoted(dialect.QuoteChar()),
		Prefix: table.Name(),
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
			return nil, fmt.Errorf("processed: migration %s: bad version: %w", name, err)
		}
		raw, err := migrationTemplates.ReadFile(path.Join(dir, name))
		if err != nil {
			return nil, err
		}
		tpl, err := template.New(name).Parse(string(raw))
		if err != nil {
			return nil, fmt.Errorf("processed: migration %s: %w", name, err)
		}
		var buf bytes.Buffer
		if err := tpl.Execute(&buf, data); err != nil {
			return nil, fmt.Errorf("processed: migration %s: %w", name, err)
		}
		out = append(out, Migration{Version: v, Name: name, SQL: buf.String()})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Version < out[j].Version })
	return out, nil
}

// Migrate applies the store's migrations in version order and records each in
// the idempotency_migration table (component "processed:<table>"). It is safe to run
// from several instances at once: each migration runs as one script, in one
// implicit transaction (PostgreSQL's simple query protocol, which pgx and its
// stdlib use for a statement without parameters), behind a transaction-scoped
// advisory lock derived from the table name; the migrations are idempotent,
// so an instance that waited on the lock re-runs a no-op.
func (s *Store) Migrate(ctx context.Context, q sqldb.Querier) error {
	return migrate(ctx, q, "processed:"+s.table.String(), s.Migrations)
}

func migrate(ctx context.Context, q sqldb.Querier, component string, list func() ([]Migration, error)) error {
	ms, err := list()
	if err != nil {
		return err
	}
	h := fnv.New64a()
	_, _ = h.Write([]byte("idempotency-migrate:" + component))
	lock := fmt.Sprintf(pgMigrationLock, int64(h.Sum64()))
	for _, m := range ms {
		script := strings.Join([]string{
			lock,
			pgMigrationsTable,
			m.SQL,
			fmt.Sprintf("INSERT INTO idempotency_migration (component, version) VALUES ('%s', %d) ON CONFLICT DO NOTHING",
				strings.ReplaceAll(component, "'", "''"), m.Version),
		}, ";\n")
		if _, err := q.Exec(ctx, script); err != nil {
			return fmt.Errorf("processed: migrate %s version %d (%s): %w", component, m.Version, m.Name, err)
		}
	}
	return nil
}
