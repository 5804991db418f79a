package versioned_test

import (
	"context"
	"database/sql"
	"io/fs"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	_ "github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/versioned"
)

// familyDrivers runs fn once per target (testenv.TargetNames: PostgreSQL
// through pgx and database/sql, MariaDB, SQLite), each on a fresh database
// with the family tables; begin opens a transaction returning its Querier
// and its end (safe in any goroutine: errors are reported with t.Error).
func familyDrivers(t *testing.T, fn func(t *testing.T, db sqldb.Querier, s *versioned.FamilyStore, begin func() (sqldb.Querier, func(commit bool)))) {
	testenv.EachTarget(t, func(t *testing.T, tg testenv.Target) {
		s := migratedFamiliesOn(t, tg)
		fn(t, tg.DB, s, func() (sqldb.Querier, func(bool)) {
			tx, err := tg.BeginTx(context.Background())
			if err != nil {
				t.Error(err)
				return failingQuerier{err}, func(bool) {}
			}
			return tx, func(commit bool) {
				end := tx.Rollback
				if commit {
					end = tx.Commit
				}
				if err := end(); err != nil {
					t.Error(err)
				}
			}
		})
	})
}

// failingQuerier stands for a transaction that could not begin.
type failingQuerier struct{ err error }

func (f failingQuerier) Exec(context.Context, string, ...any) (int64, error) { return 0, f.err }
func (f failingQuerier) QueryRow(context.Context, string, ...any) sqldb.Row  { return failingRow(f) }

type failingRow struct{ err error }

func (f failingRow) Scan(...any) error { return f.err }

// migratedFamiliesOn is a FamilyStore of tg's dialect, migrated (twice:
// Migrate is idempotent).
func migratedFamiliesOn(t *testing.T, tg testenv.Target) *versioned.FamilyStore {
	t.Helper()
	s, err := versioned.NewFamilyStore(versioned.FamilyStoreConfig{Dialect: tg.Dialect})
	require.NoError(t, err)
	require.NoError(t, s.Migrate(context.Background(), tg.Handle()))
	require.NoError(t, s.Migrate(context.Background(), tg.Handle()))
	return s
}

func TestFamilyStoreContract(t *testing.T) {
	t.Parallel()
	familyDrivers(t, func(t *testing.T, db sqldb.Querier, s *versioned.FamilyStore, begin func() (sqldb.Querier, func(bool))) {
		ctx := context.Background()
		f := versioned.Family{Kind: "product.index", ID: "p-1"}
		at := time.Date(2024, 7, 1, 10, 0, 0, 0, time.UTC)
		// One nanosecond apart, event ids in the opposite order: rounding
		// to PostgreSQL's microseconds would make the older one win.
		older := versioned.TimePosition(at.Add(100*time.Nanosecond), uuid.MustParse(lfE6))
		newer := versioned.TimePosition(at.Add(101*time.Nanosecond), uuid.MustParse(lfE1))

		_, ok, err := s.Latest(ctx, db, f)
		require.NoError(t, err)
		require.False(t, ok)

		// Rolled back with the producer's transaction.
		tx, end := begin()
		moved, err := s.Advance(ctx, tx, f, newer)
		require.NoError(t, err)
		require.True(t, moved)
		end(false)
		_, ok, err = s.Latest(ctx, db, f)
		require.NoError(t, err)
		require.False(t, ok, "a rolled back record vanishes")

		for _, step := range []struct {
			pos  versioned.Position
			move bool
		}{{older, true}, {newer, true}, {newer, false}, {older, false}} {
			moved, err := s.Advance(ctx, db, f, step.pos)
			require.NoError(t, err)
			require.Equal(t, step.move, moved, step.pos.String())
		}
		got, ok, err := s.Latest(ctx, db, f)
		require.NoError(t, err)
		require.True(t, ok)
		require.Zero(t, got.Compare(newer))
		require.True(t, got.At.Equal(newer.At), "nanoseconds kept")

		// A numbered position supersedes the timestamped ones.
		numbered := versioned.SeqPosition(1, uuid.MustParse(lfE1))
		moved, err = s.Advance(ctx, db, f, numbered)
		require.NoError(t, err)
		require.True(t, moved)
		got, _, err = s.Latest(ctx, db, f)
		require.NoError(t, err)
		require.Equal(t, numbered, got)

		// Applied records: per consumer, strictly newer only.
		for _, step := range []struct {
			consumer string
			pos      versioned.Position
			recorded bool
		}{
			{"indexer", newer, true}, {"indexer", newer, false}, {"indexer", older, false},
			{"mailer", older, true}, {"indexer", numbered, true},
		} {
			ok, err := s.RecordApplied(ctx, db, step.consumer, f, step.pos)
			require.NoError(t, err)
			require.Equal(t, step.recorded, ok, "%s %s", step.consumer, step.pos)
		}

		// Families compare exactly: no case folding, no trailing-space
		// padding (VARBINARY on MySQL).
		for _, other := range []versioned.Family{{Kind: f.Kind, ID: "P-1"}, {Kind: f.Kind, ID: "p-1 "}} {
			_, ok, err := s.Latest(ctx, db, other)
			require.NoError(t, err)
			require.False(t, ok, "%q", other.ID)
			ok, err = s.RecordApplied(ctx, db, "indexer", other, older)
			require.NoError(t, err)
			require.True(t, ok, "%q has its own applied record", other.ID)
		}

		_, err = s.Advance(ctx, db, versioned.Family{Kind: "k"}, newer)
		require.ErrorIs(t, err, versioned.ErrFamilyInvalid)
		_, err = s.Advance(ctx, db, f, versioned.SeqPosition(1, uuid.Nil))
		require.ErrorIs(t, err, versioned.ErrFamilyInvalid)
		_, err = s.RecordApplied(ctx, db, "", f, newer)
		require.Error(t, err)
	})
}

// Concurrent producers of one family, each in its own transaction,
// committing in any order: the newest position wins.
func TestFamilyStoreConcurrentAdvance(t *testing.T) {
	t.Parallel()
	familyDrivers(t, func(t *testing.T, db sqldb.Querier, s *versioned.FamilyStore, begin func() (sqldb.Querier, func(bool))) {
		ctx := context.Background()
		f := versioned.Family{Kind: "product.index", ID: "p-1"}
		const n = 12
		positions := make([]versioned.Position, n)
		for i := range positions {
			positions[i] = versioned.SeqPosition(int64(i*7%n), uuid.Must(uuid.NewV7()))
		}
		newest := positions[0]
		for _, p := range positions {
			if p.After(newest) {
				newest = p
			}
		}
		var wg sync.WaitGroup
		for i, p := range positions {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					tx, end := begin()
					_, err := s.Advance(ctx, tx, f, p)
					if err != nil && mysqlTransient(err) {
						// InnoDB: racing first inserts of one key, one of
						// which rolls back, can deadlock (1213); the
						// producer's transaction is retried.
						end(false)
						continue
					}
					if err != nil {
						t.Error(err)
					}
					end(i%3 != 0 || p.Compare(newest) == 0) // some roll back, never the newest
					return
				}
			}()
		}
		wg.Wait()
		got, ok, err := s.Latest(ctx, db, f)
		require.NoError(t, err)
		require.True(t, ok)
		require.Equal(t, newest, got)
	})
}

func TestFamilyStoreMigrate(t *testing.T) {
	t.Parallel()
	testenv.EachTarget(t, func(t *testing.T, tg testenv.Target) {
		ctx := context.Background()
		// A schema-qualified latest table: the target's own schema or
		// database, "main" on SQLite.
		schema := tg.Database
		if tg.Dialect == sqldb.SQLite {
			schema = "main"
		}
		s, err := versioned.NewFamilyStore(versioned.FamilyStoreConfig{LatestTable: schema + ".latest", AppliedTable: "applied", Dialect: tg.Dialect})
		require.NoError(t, err)
		// Several instances at once (each its own handle on the database).
		var wg sync.WaitGroup
		errs := make(chan error, 4)
		for i := 0; i < 4; i++ {
			other := testenv.OpenTarget(t, tg.Name, tg.Database, 2)
			wg.Add(1)
			go func() {
				defer wg.Done()
				errs <- s.Migrate(ctx, other.Handle())
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			require.NoError(t, err)
		}
		require.NoError(t, s.Migrate(ctx, tg.Handle()))

		var tables, indexes, recorded int
		switch tg.Dialect {
		case sqldb.PostgreSQL:
			require.NoError(t, tg.DB.QueryRow(ctx, `SELECT count(*) FROM information_schema.tables WHERE table_schema = $1 AND table_name IN ('latest', 'applied')`, schema).Scan(&tables))
			// Catalog columns only: pg_indexes computes pg_get_indexdef
			// for every index of the cluster before the schema filter,
			// and fails (XX000, could not open relation) on an index
			// another test drops at that moment.
			require.NoError(t, tg.DB.QueryRow(ctx, `SELECT count(*) FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid
JOIN pg_namespace n ON n.oid = i.relnamespace JOIN pg_attribute a ON a.attrelid = x.indrelid AND a.attnum = x.indkey[0]
WHERE n.nspname = $1 AND x.indnkeyatts = 1 AND a.attname = 'updated_at'`, schema).Scan(&indexes))
		case sqldb.MySQL:
			require.NoError(t, tg.DB.QueryRow(ctx, `SELECT count(*) FROM information_schema.tables WHERE table_schema = ? AND table_name IN ('latest', 'applied')`, schema).Scan(&tables))
			require.NoError(t, tg.DB.QueryRow(ctx, `SELECT count(*) FROM information_schema.statistics WHERE table_schema = ? AND column_name = 'updated_at'`, schema).Scan(&indexes))
		default:
			require.NoError(t, tg.DB.QueryRow(ctx, `SELECT count(*) FROM sqlite_schema WHERE type = 'table' AND name IN ('latest', 'applied')`).Scan(&tables))
			require.NoError(t, tg.DB.QueryRow(ctx, `SELECT count(*) FROM sqlite_schema WHERE type = 'index' AND sql LIKE '%(updated_at)%'`).Scan(&indexes))
		}
		require.Equal(t, 2, tables)
		require.Equal(t, 2, indexes)
		require.NoError(t, tg.DB.QueryRow(ctx, tg.Rebind(`SELECT count(*) FROM idempotency_migration WHERE component = $1`),
			"versioned-family:"+schema+".latest,applied").Scan(&recorded))
		want := []string{"30001_create_family_tables.up.sql", "30002_family_retired.up.sql"}
		if tg.Dialect == sqldb.SQLite {
			want = append(want, "30003_microseconds.up.sql") // millisecond rows rewritten in µs
		}
		require.Equal(t, len(want), recorded)

		fsys, err := versioned.FamilyMigrationsFS("", "", tg.Dialect)
		require.NoError(t, err)
		names, err := fs.Glob(fsys, "*.up.sql")
		require.NoError(t, err)
		require.Equal(t, want, names)
		body, err := fs.ReadFile(fsys, names[0])
		require.NoError(t, err)
		require.Contains(t, string(body), "-- +goose Up\n")
		require.Contains(t, string(body), `CREATE TABLE IF NOT EXISTS `+tg.Quote("family_latest"))
		require.Contains(t, string(body), `CREATE TABLE IF NOT EXISTS `+tg.Quote("family_applied"))
	})
}

// The MySQL upserts read their outcome from rows affected: Migrate refuses
// a connection that counts found rows (clientFoundRows=true).
func TestFamilyStoreMigrateRefusesFoundRows(t *testing.T) {
	t.Parallel()
	database := testenv.MySQLDatabase(t)
	db, err := sql.Open("mysql", testenv.MySQLDatabaseDSN(database)+"&clientFoundRows=true")
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	s, err := versioned.NewFamilyStore(versioned.FamilyStoreConfig{Dialect: sqldb.MySQL})
	require.NoError(t, err)
	require.ErrorIs(t, s.Migrate(context.Background(), idempotency.SQL(db, idempotency.MySQL)), versioned.ErrMySQLFoundRows)
	good := testenv.OpenTarget(t, testenv.TargetMariaDB, database, 2)
	require.NoError(t, s.Migrate(context.Background(), good.Handle()))
}

func TestFamilyStoreConfigValidate(t *testing.T) {
	t.Parallel()
	for field, cfg := range map[string]versioned.FamilyStoreConfig{
		"LatestTable":              {LatestTable: `x"; DROP TABLE y; --`},
		"AppliedTable":             {AppliedTable: "a.b.c"},
		"AppliedTable must differ": {LatestTable: "t", AppliedTable: "t"},
		"Dialect":                  {Dialect: sqldb.Dialect(9)},
	} {
		_, err := versioned.NewFamilyStore(cfg)
		require.Error(t, err, field)
		require.Contains(t, err.Error(), "FamilyStoreConfig."+firstWord(field), field)
	}
	for _, d := range []sqldb.Dialect{sqldb.MySQL, sqldb.SQLite} {
		_, err := versioned.NewFamilyStore(versioned.FamilyStoreConfig{Dialect: d})
		require.NoError(t, err, d)
	}
	s, err := versioned.NewFamilyStore(versioned.FamilyStoreConfig{})
	require.NoError(t, err)
	require.Equal(t, versioned.DefaultLatestTable, s.LatestTable().String())
	require.Equal(t, versioned.DefaultAppliedTable, s.AppliedTable().String())
	require.True(t, s.Transactional())
}

func firstWord(s string) string {
	for i, r := range s {
		if r == ' ' {
			return s[:i]
		}
	}
	return s
}
