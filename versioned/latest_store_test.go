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

	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/sqldb"
	"github.com/watermill-idempotency/idempotency/versioned"
)

// familyDrivers runs fn once per driver, each on a fresh schema with the
// family tables; begin opens a transaction returning its Querier and its end.
func familyDrivers(t *testing.T, fn func(t *testing.T, db sqldb.Querier, s *versioned.FamilyStore, begin func() (sqldb.Querier, func(commit bool)))) {
	t.Run("pgx", func(t *testing.T) {
		t.Parallel()
		pool, _ := testenv.Pool(t)
		s := migratedFamilies(t, sqldb.Pgx(pool))
		fn(t, sqldb.Pgx(pool), s, func() (sqldb.Querier, func(bool)) {
			tx, err := pool.Begin(context.Background())
			require.NoError(t, err)
			return sqldb.Pgx(tx), func(commit bool) {
				if commit {
					require.NoError(t, tx.Commit(context.Background()))
				} else {
					require.NoError(t, tx.Rollback(context.Background()))
				}
			}
		})
	})
	t.Run("database/sql", func(t *testing.T) {
		t.Parallel()
		db, err := sql.Open("pgx", testenv.SchemaURL(testenv.Schema(t)))
		require.NoError(t, err)
		t.Cleanup(func() { _ = db.Close() })
		s := migratedFamilies(t, sqldb.Std(db))
		fn(t, sqldb.Std(db), s, func() (sqldb.Querier, func(bool)) {
			tx, err := db.Begin()
			require.NoError(t, err)
			return sqldb.Std(tx), func(commit bool) {
				if commit {
					require.NoError(t, tx.Commit())
				} else {
					require.NoError(t, tx.Rollback())
				}
			}
		})
	})
}

func migratedFamilies(t *testing.T, db sqldb.Querier) *versioned.FamilyStore {
	t.Helper()
	s, err := versioned.NewFamilyStore(versioned.FamilyStoreConfig{})
	require.NoError(t, err)
	require.NoError(t, s.Migrate(context.Background(), db))
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
				tx, end := begin()
				if _, err := s.Advance(ctx, tx, f, p); err != nil {
					t.Error(err)
				}
				end(i%3 != 0 || p.Compare(newest) == 0) // some roll back, never the newest
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
	pool, schema := testenv.Pool(t)
	ctx := context.Background()
	s, err := versioned.NewFamilyStore(versioned.FamilyStoreConfig{LatestTable: schema + ".latest", AppliedTable: "applied"})
	require.NoError(t, err)
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	for i := 0; i < 4; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs <- s.Migrate(ctx, sqldb.Pgx(testenv.PoolOn(t, schema, 2)))
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	require.NoError(t, s.Migrate(ctx, sqldb.Pgx(pool)))
	var tables, indexes, recorded int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM information_schema.tables WHERE table_schema = $1 AND table_name IN ('latest', 'applied')`, schema).Scan(&tables))
	require.Equal(t, 2, tables)
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM pg_indexes WHERE schemaname = $1 AND indexdef LIKE '%(updated_at)%'`, schema).Scan(&indexes))
	require.Equal(t, 2, indexes)
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM idempotency_migration WHERE component = $1`,
		"versioned-family:"+schema+".latest,applied").Scan(&recorded))
	require.Equal(t, 1, recorded)

	fsys, err := versioned.FamilyMigrationsFS("", "", sqldb.PostgreSQL)
	require.NoError(t, err)
	names, err := fs.Glob(fsys, "*.up.sql")
	require.NoError(t, err)
	require.Equal(t, []string{"0001_create_family_tables.up.sql"}, names)
	body, err := fs.ReadFile(fsys, names[0])
	require.NoError(t, err)
	require.Contains(t, string(body), "-- +goose Up\n")
	require.Contains(t, string(body), `CREATE TABLE IF NOT EXISTS "family_latest"`)
	require.Contains(t, string(body), `CREATE TABLE IF NOT EXISTS "family_applied"`)
}

func TestFamilyStoreConfigValidate(t *testing.T) {
	t.Parallel()
	for field, cfg := range map[string]versioned.FamilyStoreConfig{
		"LatestTable":              {LatestTable: `x"; DROP TABLE y; --`},
		"AppliedTable":             {AppliedTable: "a.b.c"},
		"AppliedTable must differ": {LatestTable: "t", AppliedTable: "t"},
		"Dialect":                  {Dialect: sqldb.Dialect(9)},
		"Dialect mysql":            {Dialect: sqldb.MySQL},
	} {
		_, err := versioned.NewFamilyStore(cfg)
		require.Error(t, err, field)
		require.Contains(t, err.Error(), "FamilyStoreConfig."+firstWord(field), field)
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
